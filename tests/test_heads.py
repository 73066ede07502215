"""Head measures (research.analysis.heads) on hand-built attention patterns, and the softmax mixer's
attention probabilities against a naive reference from its parameters and against its own output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.analysis import heads
from research.model import transformer as model_lib
from research.model import positions
from research.model.attention import masks
from tests.conftest import tiny_model_config


def _mixer(**overrides):
  config = tiny_model_config(**overrides)
  return model_lib.build_model(config, rngs=nnx.Rngs(0)).blocks[0].mixer


def test_attention_weights_match_a_naive_reference_from_the_parameters():
  mixer = _mixer(attention="gqa", position="alibi")  # 4 query heads sharing 2 key/value heads
  x = jax.random.normal(jax.random.key(1), (2, 12, 32))
  weights = np.asarray(mixer.attention_weights(x, jnp.arange(12)[None]))

  wq, wk = np.asarray(mixer.query.kernel[...]), np.asarray(mixer.key.kernel[...])
  q = np.einsum("bld,dnh->bnlh", x, wq)
  k = np.repeat(np.einsum("bld,dkh->bklh", x, wk), 2, axis=1)  # query head n reads kv head n // 2
  distance = np.arange(12)[:, None] - np.arange(12)[None, :]
  logits = q @ k.swapaxes(-1, -2) / np.sqrt(8) - positions.alibi_slopes(4)[:, None, None] * distance
  logits = np.where(distance >= 0, logits, -np.inf)
  expected = np.exp(logits - logits.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)

  assert weights.shape == (2, 4, 12, 12)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(weights, expected, atol=1e-5)


@pytest.mark.parametrize("attention,position", [("gqa", "rope"), ("fox", "none")])
def test_attention_weights_reproduce_the_mixers_output_with_window_sinks_and_documents(
    attention, position):
  """The maps are what the mixer computes, data-dependent biases (FoX's forget gates) included."""
  mixer = _mixer(attention=attention, position=position, softmax=dict(window=4, sinks=1))
  x = jax.random.normal(jax.random.key(2), (1, 12, 32))
  segments = jnp.asarray([[0] * 5 + [1] * 7])
  positions_1xL = masks.positions_in_documents(segments)
  weights = mixer.attention_weights(x, positions_1xL, segments)
  values = jnp.repeat(mixer.value(x), mixer.num_heads // mixer.num_kv_heads, axis=2)
  np.testing.assert_allclose(mixer.out(jnp.einsum("bnts,bsnh->btnh", weights, values)),
                             mixer(x, positions_1xL, segments), atol=1e-5)
  np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
  assert float(weights[0, :, 6, 0].max()) == 0.0  # another document's sink
  assert float(weights[0, :, 11, 6:8].max()) == 0.0  # outside the window of 4
  assert float(weights[0, :, 11, 5].min()) > 0.0  # this document's sink


def test_model_attention_weights_are_per_layer_and_none_without_maps():
  config = tiny_model_config(num_layers=2, layer_pattern=("mamba", "mha"), position="none")
  model = model_lib.build_model(config, rngs=nnx.Rngs(0))
  weights = model.attention_weights(jnp.zeros((1, 6), jnp.int32))
  assert weights[0] is None and weights[1].shape == (1, 4, 6, 6)


def _pattern(period, target):
  """[1, 1, 2P, 2P] probabilities: each query's mass on key target(i) (a valid causal key)."""
  probs = np.zeros((1, 1, 2 * period, 2 * period))
  for i in range(2 * period):
    probs[0, 0, i, target(i)] = 1.0
  return probs


def test_induction_and_previous_token_scores_of_hand_built_patterns():
  period = 5
  induction = _pattern(period, lambda i: i - period + 1 if i >= period else 0)
  previous = _pattern(period, lambda i: max(i - 1, 0))
  causal = np.tril(np.ones((2 * period, 2 * period)))
  uniform = (causal / causal.sum(-1, keepdims=True))[None, None]
  assert heads.induction_score(induction, period) == pytest.approx([1.0])
  assert heads.induction_score(previous, period) == pytest.approx([0.0])
  assert heads.induction_score(uniform, period) == pytest.approx(
      [np.mean([1 / (i + 1) for i in range(period, 2 * period)])])
  assert heads.previous_token_score(previous) == pytest.approx([1.0])
  assert heads.previous_token_score(induction) == pytest.approx([1 / 9])  # only query 1's key 0

  tokens = heads.repeated_random_tokens(np.random.default_rng(0), 3, period, 256)
  assert tokens.shape == (3, 10) and (tokens[:, :5] == tokens[:, 5:]).all()
  assert all(len(set(row[:5])) == 5 for row in tokens)


def test_mass_by_distance_of_a_previous_token_head():
  mass = heads.mass_by_distance(_pattern(4, lambda i: max(i - 1, 0)))  # 8 tokens
  np.testing.assert_allclose(mass[0], [1 / 8, 7 / 8, 0, 0, 0, 0, 0, 0])
  buckets = heads.distance_buckets(7)
  assert buckets == [(0, 0), (1, 1), (2, 3), (4, 7)]
  np.testing.assert_allclose(heads.bucket_mass(mass, buckets)[0], [1 / 8, 7 / 8, 0, 0])
  assert heads.mean_distance(mass) == pytest.approx([7 / 8])


def test_icl_score_scales_olssons_token_positions_to_the_window():
  assert heads.icl_positions(512) == (range(40, 50), range(400, 500))
  assert heads.icl_positions(128) == (range(10, 12), range(100, 125))
  loss = np.linspace(3.0, 1.0, 128)
  score = heads.icl_score(loss)
  assert score["icl_score"] == pytest.approx(np.mean(loss[100:125]) - np.mean(loss[10:12]))
  assert score["icl_score"] < 0


def _masked_model(mask_LxN, zero_head=None):
  model = model_lib.build_model(tiny_model_config(attention="gqa", position="rope"),
                                rngs=nnx.Rngs(0))
  if zero_head is not None:
    out = model.blocks[0].mixer.out
    out.kernel[...] = out.kernel[...].at[zero_head].set(0.0)
  heads.mask_heads(model, jnp.asarray(mask_LxN, jnp.float32))
  return model


def test_a_head_mask_scales_each_heads_output_before_the_projection():
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
  unmasked = model_lib.build_model(tiny_model_config(attention="gqa", position="rope"),
                                   rngs=nnx.Rngs(0))
  assert (np.asarray(_masked_model(np.ones((1, 4)))(tokens)) == np.asarray(unmasked(tokens))).all()

  mixer = unmasked.blocks[0].mixer  # head 2's slice of the attention output zeroed, directly
  x = jax.random.normal(jax.random.key(3), (1, 8, 32))
  positions_1xL = jnp.arange(8)[None]
  heads_BxLxNxH = jnp.einsum("bnts,bsnh->btnh", mixer.attention_weights(x, positions_1xL),
                             jnp.repeat(mixer.value(x), 2, axis=2))
  direct = mixer.out(heads_BxLxNxH.at[:, :, 2].set(0.0))
  masked = _masked_model([[1.0, 1.0, 0.0, 1.0]]).blocks[0].mixer
  np.testing.assert_allclose(masked(x, positions_1xL), direct, atol=1e-5)


def test_a_head_whose_output_projection_is_zero_has_importance_zero():
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])

  def loss(mask):
    logits = _masked_model(mask, zero_head=1)(tokens)
    return -jax.nn.log_softmax(logits)[0, :-1, :].mean()

  grad = np.asarray(jax.grad(loss)(jnp.ones((1, 4))))
  assert grad[0, 1] == 0.0 and np.abs(grad[0, [0, 2, 3]]).min() > 0


def test_pruning_removes_the_least_important_and_never_a_layers_last_head():
  scores = np.asarray([[0.1, 0.9, 0.8, 0.7], [0.2, 0.3, 0.6, 0.5]])
  alive = np.asarray([[True, False, False, False], [True, True, True, True]])
  assert heads.heads_to_remove(scores, alive, 0.5) == [(1, 0), (1, 1)]  # not (0, 0): the last
  assert heads.heads_to_remove(scores, np.eye(2, 4, dtype=bool), 0.5) == []
  np.testing.assert_allclose(np.linalg.norm(heads.normalise_per_layer(scores), axis=1), 1.0)
  for fraction in (0.0, 1.0, -0.1):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
      heads.heads_to_remove(scores, alive, fraction)


def test_probe_hooks_reproduce_the_model_and_a_permuted_row_moves_only_its_position():
  config = tiny_model_config(attention="gqa", position="rope", softmax=dict(window=5, sinks=1))
  model = model_lib.build_model(config, rngs=nnx.Rngs(0))
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
  logits = np.asarray(model(tokens))
  np.testing.assert_allclose(model.probe(tokens, edit_attention={0: lambda p, mask: p},
                                         input_offset_BxLxD=jnp.zeros((1, 10, 32))),
                             logits, atol=1e-5)

  def permute_last_row(probs, mask):
    row = heads.permute_visible(probs[0, 1, -1], mask[0, 0, -1], jax.random.key(0))
    visible = np.asarray(mask[0, 0, -1])  # the window's last 5 keys and the sink
    assert visible.sum() == 6 and float(row[~visible].max()) == 0.0
    np.testing.assert_allclose(np.sort(row[visible]), np.sort(probs[0, 1, -1][visible]))
    assert not np.allclose(row, probs[0, 1, -1])
    return probs.at[0, 1, -1].set(row)

  moved = np.abs(np.asarray(model.probe(tokens, edit_attention={0: permute_last_row})
                            - logits)).max(axis=-1)[0]
  assert moved[:-1].max() < 1e-5 < moved[-1]
  assert heads.total_variation([0.5, 0.5, 0.0], [0.0, 0.5, 0.5]) == pytest.approx(0.5)


def test_kv_group_pruning_removes_whole_groups_and_never_a_layers_last():
  scores = np.asarray([[0.1, 0.2, 0.9, 0.8], [0.5, 0.1, 0.3, 0.4]])
  sizes = [2, 1]  # layer 0: 2 key/value heads of 2 query heads each; layer 1: MHA
  grouped = heads.group_scores(scores, sizes)
  np.testing.assert_allclose(grouped, [[0.3, 1.7, 0, 0], [0.5, 0.1, 0.3, 0.4]])
  groups = heads.groups_of_heads(np.ones((2, 4), bool), sizes)
  assert groups.tolist() == [[True, True, False, False], [True] * 4]
  removed = heads.heads_to_remove(grouped, groups, 0.5)  # 3 of the 6 groups
  assert removed == [(1, 1), (1, 2), (0, 0)]
  for layer, group in removed:
    groups[layer, group] = False
  assert heads.heads_of_groups(groups, sizes, 4).tolist() == [[False, False, True, True],
                                                              [True, False, False, True]]
  assert heads.heads_to_remove(grouped, np.asarray([[False, True, False, False],
                                                    [True, False, False, False]]), 0.5) == []
