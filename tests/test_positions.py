"""Position schemes against their defining equations and their authors' reference code."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention, positions
from research.model.positions import alibi_slopes, rope
from tests.conftest import tiny_model_config

D_MODEL, HEADS = 32, 2  # head_dim 16


def _scheme(name, **settings):
  """Scheme `name` for a d_model 32, 2-head model, with settings overriding its defaults."""
  config = tiny_model_config(d_model=D_MODEL, num_heads=HEADS, position=name,
                             **({positions.REGISTRY.settings_key(name): settings} if settings else {}))
  return attention.position_scheme(config, rngs=nnx.Rngs(0))


def _grid(n):
  return jnp.arange(n)[None]


def _paper_slopes(n):
  """ALiBi's slopes as the paper (arXiv:2108.12409) defines them: a geometric sequence with
  ratio and first term 2^(-8/n) for a power of two n; otherwise those of the closest smaller
  power of two p, then the even-indexed slopes of 2p, n - p of them."""
  if math.log2(n).is_integer():
    first = 2 ** (-8 / n)
    return [first * first ** i for i in range(n)]
  p = 2 ** math.floor(math.log2(n))
  return _paper_slopes(p) + _paper_slopes(2 * p)[0::2][: n - p]


@pytest.mark.parametrize("n", range(1, 65))
def test_alibi_slopes_match_the_paper(n):
  np.testing.assert_allclose(alibi_slopes(n), _paper_slopes(n), rtol=1e-6)


def test_alibi_slopes_for_twelve_heads_are_written_out():
  want = [2.0 ** -e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
  np.testing.assert_allclose(alibi_slopes(12), want, rtol=1e-6)
  np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -e for e in range(1, 9)], rtol=1e-6)


def test_alibi_bias_is_minus_slope_times_distance():
  bias = _scheme("alibi").bias(_grid(5), _grid(5))
  for h, slope in enumerate(alibi_slopes(HEADS)):
    for i in range(5):
      for j in range(5):
        assert float(bias[0, h, i, j]) == pytest.approx(-slope * (i - j))


def test_sinusoidal_matches_its_formula():
  d, pos = 16, _grid(50)
  pe = np.asarray(_scheme("sinusoidal").embedding(pos, d))[0]
  for p in (0, 1, 7, 49):
    for i in range(d // 2):
      angle = p / 10000 ** (2 * i / d)
      assert pe[p, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
      assert pe[p, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


@pytest.mark.parametrize("name", [n for n in positions.REGISTRY if positions.rotary(n)])
@pytest.mark.parametrize("scaling", positions.SCALINGS)
def test_rotary_score_depends_only_on_relative_position(name, scaling):
  scheme = _scheme(name, scaling=scaling, scaling_factor=4.0, original_length=16)
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  if scaling == "dynamic_ntk":  # adapts to the current length: hold the length fixed
    window = jnp.array([[0, 63]])
    def score(m, n):
      q_at = scheme.queries(jnp.concatenate([q, q], 1), window.at[0, 0].set(m))[:, :1]
      k_at = scheme.keys(jnp.concatenate([k, k], 1), window.at[0, 0].set(n))[:, :1]
      return float(jnp.sum(q_at * k_at))
  else:
    def score(m, n):
      return float(jnp.sum(scheme.queries(q, jnp.array([[m]])) * scheme.keys(k, jnp.array([[n]]))))
  for offset in (0, 3, 11):
    assert score(5 + offset, 2 + offset) == pytest.approx(score(5, 2), rel=1e-4, abs=1e-4)
  assert score(5, 2) != pytest.approx(score(9, 2), rel=1e-3)


def test_rope_rotates_pairs_by_position_times_theta():
  scheme, d = _scheme("rope"), 16
  x = jnp.zeros((1, 1, 1, d)).at[..., 2].set(1.0)  # the pair i = 1: (x[2], x[3]) = (1, 0)
  m = 3
  rotated = np.asarray(scheme.rotate(x, jnp.array([[m]]))[0, 0, 0])
  theta = 10000 ** (-2 / d)
  np.testing.assert_allclose(rotated[2:4], [math.cos(m * theta), math.sin(m * theta)], atol=1e-6)
  np.testing.assert_allclose(rotated[[0, 1] + list(range(4, d))], 0, atol=1e-6)


def _theta(d=16, base=10000.0):
  return base ** (-np.arange(0, d, 2) / d)


def test_pi_and_static_ntk_follow_their_definitions():
  d, s = 16, 4.0
  np.testing.assert_allclose(_scheme("rope").inverse_frequencies(), _theta(), rtol=1e-6)
  x = jax.random.normal(jax.random.key(0), (1, 3, 2, d))
  # PI: positions m -> m / s.
  np.testing.assert_allclose(_scheme("rope", scaling="pi", scaling_factor=s).rotate(x, jnp.array([[4, 8, 12]])),
                             _scheme("rope").rotate(x, jnp.array([[1, 2, 3]])), atol=1e-5)
  # Static NTK-aware: base -> base * s^(d / (d - 2)).
  np.testing.assert_allclose(_scheme("rope", scaling="static_ntk", scaling_factor=s).inverse_frequencies(),
                             _theta(base=10000 * s ** (d / (d - 2))), rtol=1e-5)


def test_dynamic_ntk_is_hf_dynamic_scaling_of_the_current_length():
  """base * (s n / L - (s - 1))^(d / (d - 2)), n = max(L, largest position + 1)."""
  d, s, L = 16, 2.0, 16
  scheme = _scheme("rope", scaling="dynamic_ntk", scaling_factor=s, original_length=L)
  np.testing.assert_allclose(scheme.inverse_frequencies(_grid(10)), _theta(), rtol=1e-6)  # n <= L
  n = 40
  want = _theta(base=10000 * (s * n / L - (s - 1)) ** (d / (d - 2)))
  np.testing.assert_allclose(scheme.inverse_frequencies(_grid(n)), want, rtol=1e-5)


def test_yarn_matches_its_reference_code_written_out_by_hand():
  """head_dim 16, base 10000, L = 16, s = 4. Correction dims d_r = 16 ln(16 / (2 pi r)) /
  (2 ln 10000): d_32 = -3.72 -> floor -> clamp to 0; d_1 = 0.812 -> ceil -> 1. The ramp over the
  pair index i is clip((i - 0) / (1 - 0), 0, 1) = [0, 1, 1, ...]: pair 0 keeps theta_0, every
  other pair is interpolated (theta_i / 4). A paper-style ramp in the rotation count would leave
  pair 1 (16 theta_1 / 2 pi = 0.80 rotations) partly extrapolated instead."""
  d, s = 16, 4.0
  assert rope.yarn_correction_range(d, 10000.0, 16) == (0, 1)
  scheme = _scheme("rope", scaling="yarn", scaling_factor=s, original_length=16)
  want = _theta() / s
  want[0] = _theta()[0]
  np.testing.assert_allclose(scheme.inverse_frequencies(), want, rtol=1e-6)
  # A longer original length: d_32 = 16 ln(4096 / (64 pi)) / (2 ln 1e4) = 2.65 -> 2,
  # d_1 = 16 ln(4096 / (2 pi)) / (2 ln 1e4) = 5.66 -> 6: ramp (i - 2) / 4 over i = 0..7.
  assert rope.yarn_correction_range(d, 10000.0, 4096) == (2, 6)
  scheme = _scheme("rope", scaling="yarn", scaling_factor=s, original_length=4096)
  ramp = np.clip((np.arange(8) - 2) / 4, 0, 1)
  np.testing.assert_allclose(scheme.inverse_frequencies(),
                             _theta() / s * ramp + _theta() * (1 - ramp), rtol=1e-6)
  # Temperature m = 0.1 ln s + 1 on cos and sin: the logits carry m^2; rotate stays a rotation.
  assert scheme.logit_scale() == pytest.approx((0.1 * math.log(s) + 1) ** 2)
  x = jax.random.normal(jax.random.key(1), (1, 5, 2, d))
  np.testing.assert_allclose(jnp.linalg.norm(scheme.rotate(x, _grid(5)), axis=-1),
                             jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_yarn_temperature_is_applied_once_in_softmax_attention():
  """softmax(m^2 (R_i q_i) . (R_j k_j) / sqrt(d)), R YaRN's rotation at its interpolated
  frequencies and m = 0.1 ln s + 1 (arXiv:2309.00071, eq. 22): the mixer's attention weights
  against that formula from its projections, so a temperature applied twice, or not at all,
  fails (m^2 = 1.30 at s = 4)."""
  s, length = 4.0, 9
  mixer = research.build_model(tiny_model_config(attention="mha", rope=dict(
      scaling="yarn", scaling_factor=s)), rngs=nnx.Rngs(0)).blocks[0].mixer
  x = jax.random.normal(jax.random.key(3), (1, length, 32))
  positions_1xL = 37 * jnp.arange(length)[None]
  q = mixer.position.rotate(mixer.query(x), positions_1xL)
  k = mixer.position.rotate(mixer.key(x), positions_1xL)
  logits = (0.1 * math.log(s) + 1) ** 2 * jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(8)
  expected = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((length, length), bool)), logits,
                                      -jnp.inf), axis=-1)
  np.testing.assert_allclose(mixer.attention_weights(x, positions_1xL), expected, atol=1e-5)
  np.testing.assert_allclose(mixer.position.logit_scale(), (0.1 * math.log(s) + 1) ** 2,
                             rtol=1e-6)


def test_partial_rope_rotates_only_the_highest_frequencies():
  scheme = _scheme("prope", fraction=0.75)  # int(0.75 * 16 // 2) = 6 of 8 pairs rotate
  theta = np.asarray(scheme.inverse_frequencies())
  np.testing.assert_allclose(theta[:6], _theta()[:6], rtol=1e-6)
  assert (theta[6:] == 0).all()
  x = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  moved = scheme.rotate(x, jnp.array([[100]]))
  np.testing.assert_allclose(moved[..., 12:], x[..., 12:], atol=1e-6)  # the last two pairs stay
  np.testing.assert_allclose(_scheme("prope", fraction=1.0).rotate(x, jnp.array([[7]])),
                             _scheme("rope").rotate(x, jnp.array([[7]])), atol=1e-6)


def test_xpos_is_rope_times_zeta_to_the_relative_distance():
  """q_n . k_m per pair = RoPE's pair score * zeta_i^((n - m) / 512), zeta_i = (i / 8 + .4) / 1.4."""
  scheme, ropes = _scheme("xpos"), _scheme("rope")
  zeta = (np.arange(8) / 8 + 0.4) / 1.4
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  n, m = 900, 100
  got = (scheme.queries(q, jnp.array([[n]])) * scheme.keys(k, jnp.array([[m]])))[0, 0, 0]
  plain = (ropes.queries(q, jnp.array([[n]])) * ropes.keys(k, jnp.array([[m]])))[0, 0, 0]
  np.testing.assert_allclose(got, plain * np.repeat(zeta ** ((n - m) / 512), 2), rtol=1e-4)


def _t5_bucket(n, buckets=32, max_distance=128):
  """T5's unidirectional bucket, written out: exact below 16, then log-spaced to 128."""
  if n < buckets // 2:
    return n
  value = buckets // 2 + int(math.log(n / (buckets // 2)) / math.log(max_distance / (buckets // 2))
                             * (buckets - buckets // 2))
  return min(value, buckets - 1)


def test_t5_buckets_and_bias_follow_the_definition():
  distances = jnp.arange(-3, 400)
  got = np.asarray(positions.t5.relative_bucket(distances, 32, 128))
  assert [int(x) for x in got] == [_t5_bucket(max(int(n), 0)) for n in distances]
  assert _t5_bucket(16) == 16 and _t5_bucket(127) == 31 and _t5_bucket(1000) == 31
  scheme = _scheme("t5")
  bias = scheme.bias(_grid(300), _grid(300))
  table = np.asarray(scheme.table[...])
  for i, j in [(5, 5), (20, 3), (299, 0), (150, 140)]:
    np.testing.assert_allclose(bias[0, :, i, j], table[_t5_bucket(i - j)], rtol=1e-6)


def test_kerple_log_bias_and_its_positivity_floor():
  scheme = _scheme("kerple")
  scheme.r1[...] = jnp.array([0.5, -3.0])  # the second is held at the floor 0.01
  scheme.r2[...] = jnp.array([2.0, 0.3])
  bias = scheme.bias(_grid(6), _grid(6))
  for i, j in [(5, 0), (3, 3), (4, 1)]:
    assert float(bias[0, 0, i, j]) == pytest.approx(-0.5 * math.log(1 + 2.0 * (i - j)), rel=1e-5)
    assert float(bias[0, 1, i, j]) == pytest.approx(-0.01 * math.log(1 + 0.3 * (i - j)), rel=1e-5)


def test_fire_bias_is_the_mlp_of_the_normalised_log_distance():
  scheme = _scheme("fire", init_threshold=4.0)
  p = {name: np.asarray(getattr(scheme, name)[...]) for name in
       ("hidden_kernel", "hidden_bias", "out_kernel", "out_bias", "c", "threshold_scale")}
  bias = np.asarray(scheme.bias(_grid(10), _grid(10)))
  psi = lambda x: math.log(abs(p["c"] * x) + 1)
  for i, j in [(9, 0), (2, 1), (7, 7), (3, 0)]:
    x = psi(i - j) / (psi(max(abs(p["threshold_scale"] * 4.0), i)) + 1e-6)
    want = np.maximum(x * p["hidden_kernel"] + p["hidden_bias"], 0) @ p["out_kernel"] + p["out_bias"]
    np.testing.assert_allclose(bias[0, :, i, j], want, rtol=1e-5, atol=1e-6)


def test_learned_positions_look_up_their_table_and_refuse_lengths_beyond_it():
  scheme = _scheme("learned", max_length=8)
  pe = scheme.embedding(jnp.array([[0, 7, 8]]), D_MODEL)
  np.testing.assert_allclose(pe[0, :2], scheme.table[...][jnp.array([0, 7])])
  assert bool(jnp.isnan(pe[0, 2]).all())  # past the table: NaN, never a silent reuse
  config = tiny_model_config(position="learned", learned=dict(max_length=64))
  with pytest.raises(ValueError, match=r"eval.lengths = 128 exceeds the 64 positions of the "
                                       r"'learned' table \(model.learned.max_length\)"):
    research.model.transformer.validate_lengths(config, 32, (32, 128))


def test_randomized_training_positions_are_sorted_distinct_and_seeded():
  model = research.build_model(tiny_model_config(randomize_max_length=50), rngs=nnx.Rngs(0))
  positions_BxL = np.asarray(model.training_positions(jax.random.key(3), 4, 16))
  assert positions_BxL.shape == (4, 16)
  for row in positions_BxL:
    assert (np.diff(row) > 0).all() and row.min() >= 0 and row.max() < 50
  assert len({tuple(row) for row in positions_BxL}) == 4  # each row its own draw
  np.testing.assert_array_equal(positions_BxL, model.training_positions(jax.random.key(3), 4, 16))
  plain = research.build_model(tiny_model_config(), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(plain.training_positions(jax.random.key(3), 4, 16),
                                np.arange(16)[None])


def test_hooks_are_read_off_the_overridden_methods():
  hooks = {name: set(cls.hooks()) for name, cls in positions.REGISTRY.items()}
  assert hooks["none"] == set() and hooks["sinusoidal"] == {"embed"}
  assert hooks["learned"] == {"embed"} and hooks["rope"] == hooks["xpos"] == {"qk"}
  assert hooks["alibi"] == hooks["t5"] == hooks["kerple"] == hooks["fire"] == {"bias"}
  assert hooks["cope"] == {"context"}


@pytest.mark.parametrize("settings,message", [
    (dict(t5=dict(num_buckets=0)), "model.t5.num_buckets must be >= 2"),
    (dict(t5=dict(max_distance=8)), "model.t5.max_distance must exceed num_buckets / 2 = 16"),
    (dict(fire=dict(hidden=0)), "model.fire.hidden must be >= 1"),
    (dict(learned=dict(max_length=-1)), "model.learned.max_length must be >= 1"),
    (dict(rope=dict(base=0.0)), "the rotary base must be > 1"),
    (dict(rope=dict(scaling="yarn2")),
     r"unknown rotary scaling 'yarn2' \(the scheme's scaling field, e.g. model.rope.scaling\) "
     r"\(did you mean 'yarn'\?\); valid: none, pi, static_ntk, dynamic_ntk, yarn"),
    (dict(prope=dict(fraction=1.5)), r"model.prope.fraction must be in \[0, 1\]"),
])
def test_bad_scheme_settings_name_what_is_valid(settings, message):
  position = next(iter(settings))
  with pytest.raises(ValueError, match=message):
    research.build_model(tiny_model_config(position=position, **settings), rngs=nnx.Rngs(0))


def test_unknown_scheme_field_is_refused():
  config = tiny_model_config(position="fire")
  config.fire.hiden = 3
  with pytest.raises(ValueError, match="unknown field.*model.fire.hiden.*valid: model.fire.hidden"):
    research.build_model(config, rngs=nnx.Rngs(0))


def test_registry_settings_keys_do_not_collide_and_reach_the_base_config():
  from configs import base
  attention_settings = research.model.attention.REGISTRY.default_settings()
  position_settings = positions.REGISTRY.default_settings()
  assert not set(attention_settings) & set(position_settings)
  model = base.get_config().model
  for key, defaults in {**attention_settings, **position_settings}.items():
    assert model[key].to_dict() == defaults, key
  assert model.num_heads == 4 and model.attention == "mha"  # no scalar field was overwritten
