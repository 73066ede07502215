"""Position schemes against their defining equations (design.md section 5)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research import positions
from research.positions import RoPE, Sinusoidal, alibi_slopes


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
  bias = positions.ALiBi().bias(4, jnp.arange(5), jnp.arange(5))
  for h, slope in enumerate(alibi_slopes(4)):
    for i in range(5):
      for j in range(5):
        assert float(bias[h, i, j]) == pytest.approx(-slope * (i - j))


def test_sinusoidal_matches_its_formula():
  d, pos = 16, jnp.arange(50)
  pe = np.asarray(Sinusoidal().embedding(pos, d))
  for p in (0, 1, 7, 49):
    for i in range(d // 2):
      angle = p / 10000 ** (2 * i / d)
      assert pe[p, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
      assert pe[p, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


@pytest.mark.parametrize("scaling", ["none", "pi", "ntk", "yarn"])
def test_rope_score_depends_only_on_relative_position(scaling):
  rope = RoPE(scaling=scaling, factor=4.0, original_length=16)
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

  def score(m, n):
    return float(jnp.sum(rope.rotate(q, jnp.array([m])) * rope.rotate(k, jnp.array([n]))))

  for offset in (0, 3, 11):
    assert score(5 + offset, 2 + offset) == pytest.approx(score(5, 2), rel=1e-4, abs=1e-4)
  assert score(5, 2) != pytest.approx(score(9, 2), rel=1e-3)


def test_rope_rotates_pairs_by_position_times_theta():
  rope, d = RoPE(), 8
  x = jnp.zeros((1, 1, 1, d)).at[..., 2].set(1.0)  # the pair i = 1: (x[2], x[3]) = (1, 0)
  m = 3
  rotated = np.asarray(rope.rotate(x, jnp.array([m]))[0, 0, 0])
  theta = 10000 ** (-2 / d)
  np.testing.assert_allclose(rotated[2:4], [math.cos(m * theta), math.sin(m * theta)], atol=1e-6)
  np.testing.assert_allclose(rotated[[0, 1, 4, 5, 6, 7]], 0, atol=1e-6)


def test_rope_scalings_follow_their_definitions():
  d, s, base = 16, 4.0, 10000.0
  plain = RoPE().frequencies(d)
  np.testing.assert_allclose(plain, base ** (-np.arange(0, d, 2) / d), rtol=1e-6)
  # PI: positions m -> m / s.
  x = jax.random.normal(jax.random.key(0), (1, 3, 2, d))
  np.testing.assert_allclose(RoPE(scaling="pi", factor=s).rotate(x, jnp.array([4, 8, 12])),
                             RoPE().rotate(x, jnp.array([1, 2, 3])), atol=1e-5)
  # NTK-aware: base -> base * s^(d / (d - 2)).
  ntk = RoPE(scaling="ntk", factor=s).frequencies(d)
  np.testing.assert_allclose(ntk, (base * s ** (d / (d - 2))) ** (-np.arange(0, d, 2) / d),
                             rtol=1e-5)
  # YaRN: high frequencies (>= beta rotations in L_train) kept, low ones (< alpha) divided by s.
  yarn = RoPE(scaling="yarn", factor=s, original_length=64)
  theta = np.asarray(yarn.frequencies(d))
  rotations = 64 * np.asarray(plain) / (2 * math.pi)
  np.testing.assert_allclose(theta[rotations >= 32], np.asarray(plain)[rotations >= 32], rtol=1e-6)
  np.testing.assert_allclose(theta[rotations <= 1], np.asarray(plain)[rotations <= 1] / s,
                             rtol=1e-6)
  assert yarn.magnitude() == pytest.approx(0.1 * math.log(s) + 1)
  # rotate is a pure rotation under every scaling; the temperature lives in magnitude().
  x = jax.random.normal(jax.random.key(1), (1, 5, 2, d))
  np.testing.assert_allclose(jnp.linalg.norm(yarn.rotate(x, jnp.arange(5)), axis=-1),
                             jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_yarn_temperature_is_applied_once_in_softmax_attention():
  """q and k each carry sqrt(1/t) = 0.1 ln s + 1, so the logits carry 1/t."""
  from flax import nnx
  from research.attention import MHA
  from tests.conftest import tiny_model_config

  s = 4.0
  config = tiny_model_config()
  plain = MHA(config, RoPE(), rngs=nnx.Rngs(0))
  yarn = MHA(config, RoPE(scaling="yarn", factor=s, original_length=16), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 1, 32))
  position = jnp.array([0])  # no rotation at position 0: only the temperature acts
  (q_plain, k_plain, _), (q_yarn, k_yarn, _) = plain._project(x, position), yarn._project(x, position)
  logit = lambda q, k: float(jnp.sum(q * k))
  assert logit(q_yarn, k_yarn) / logit(q_plain, k_plain) == pytest.approx(
      (0.1 * math.log(s) + 1) ** 2, rel=1e-5)


def test_registry_names_and_kinds():
  kinds = {name: cls.kind for name, cls in positions.REGISTRY.items()}
  assert kinds == {"none": "none", "sinusoidal": "embed", "rope": "qk", "alibi": "bias"}
  with pytest.raises(ValueError, match="valid: alibi, none, rope, sinusoidal"):
    positions.REGISTRY.lookup("t5")
  with pytest.raises(ValueError, match="valid: none, pi, ntk, yarn"):
    RoPE(scaling="linear")
