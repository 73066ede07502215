"""Length-aware score changes (core.ScoreMod.query_scale, core.QueryContext) and SSMax
(research/model/positions/ssmax.py, arXiv:2501.19399) against the equations written out:
softmax_j((s_h log n_i) z_ij) with n_i the keys query i sees, counted element by element under
windows, sinks, packed documents and a block-sparse pattern; on both CPU backends, forward and
gradients (to q, k, v and s). Decoding from both caches equals the forward pass through the
conformance suite, which runs every scheme with mha and with a window and sinks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model.attention import core
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _document_index, _normal, _visible

LENGTH, HEADS, KV_HEADS, DIM = 37, 4, 2, 8


def _ssmax_scale(s_N, context):
  return s_N[None, :, None] * jnp.log(context.keys_seen.astype(jnp.float32))[:, None, :]


def _naive(q, k, v, s_N, visible_BxTxS):
  """The equation, every count from the element-by-element mask: z = q k / sqrt(H), logits
  (s_h log n_i) z_ij with n_i = sum_j visible_ij."""
  n_BxT = visible_BxTxS.sum(-1)
  b, t, heads, h = q.shape
  kv = k.shape[2]
  k = jnp.repeat(k, heads // kv, axis=2)
  v = jnp.repeat(v, heads // kv, axis=2)
  z = jnp.einsum("btnh,bsnh->bnts", q, k) / h ** 0.5
  logits = s_N[None, :, None, None] * jnp.log(n_BxT.astype(jnp.float32))[:, None, :, None] * z
  logits = jnp.where(visible_BxTxS[:, None], logits, -jnp.inf)
  return jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.parametrize("window,sinks,packed", [(0, 0, False), (6, 2, False), (6, 2, True),
                                                 (0, 0, True)])
def test_query_context_counts_the_visible_keys_and_the_index_in_the_document(window, sinks,
                                                                            packed):
  segments = SEGMENTS_37 if packed else jnp.zeros((2, LENGTH), jnp.int32)
  context = core.query_context(core.MaskSpec(window=window, sinks=sinks), LENGTH,
                               segments if packed else None)
  visible = _visible(segments, window, sinks)
  np.testing.assert_array_equal(np.broadcast_to(context.keys_seen, (2, LENGTH)),
                                visible.sum(-1))
  np.testing.assert_array_equal(np.broadcast_to(context.document_index, (2, LENGTH)),
                                [_document_index(np.asarray(row)) for row in segments])


def test_a_block_sparse_pattern_is_counted_key_by_key():
  keep = lambda i, j: (j % 4 == 0) | (i - j < 3)  # noqa: E731
  mask = core.MaskSpec(keep=keep)
  assert mask.keys_seen(jnp.arange(LENGTH)[None]) is None  # no closed form
  counted = core.query_context(mask, LENGTH, SEGMENTS_37, block=8).keys_seen
  expected = [[sum(bool(keep(i, j)) and SEGMENTS_37[r, i] == SEGMENTS_37[r, j]
                   for j in range(i + 1)) for i in range(LENGTH)] for r in range(2)]
  np.testing.assert_array_equal(counted, expected)


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
@pytest.mark.parametrize("window,sinks,packed", [(0, 0, False), (6, 2, True)])
def test_a_query_scale_equals_the_equation_with_gradients(backend, window, sinks, packed):
  q = _normal(0, (2, LENGTH, HEADS, DIM))
  k, v = _normal(1, (2, LENGTH, KV_HEADS, DIM)), _normal(2, (2, LENGTH, KV_HEADS, DIM))
  s_N = jnp.asarray([0.43, 0.2, 1.0, 0.7])
  segments = SEGMENTS_37 if packed else None
  visible = jnp.asarray(_visible(SEGMENTS_37 if packed else jnp.zeros((2, LENGTH), jnp.int32),
                                 window, sinks))
  d_out = _normal(3, q.shape)

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v, s_N)
    return out, pullback(d_out)

  fast = jax.jit(lambda: vjp(lambda q, k, v, s: core.attend(
      q, k, v, score_mod=core.ScoreMod(query_scale=_ssmax_scale), score_params=s,
      mask=core.MaskSpec(window=window, sinks=sinks), segments_BxT=segments, backend=backend,
      block_size=8)))()
  naive = jax.jit(lambda: vjp(lambda q, k, v, s: _naive(q, k, v, s, visible)))()
  for g, w in zip(jax.tree.leaves(fast), jax.tree.leaves(naive)):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


def test_the_scale_comes_after_the_bias_and_before_modify():
  """((z + bias) * scale) then modify: the order the ScoreMod docstring gives, on both
  backends and in the materialised reference."""
  q, k, v = (_normal(i, (1, 16, 2, DIM)) for i in range(3))
  score_mod = core.ScoreMod(bias=lambda p, qi, ki: -0.1 * (qi[:, None, :, None]
                                                           - ki[:, None, None, :]),
                            query_scale=lambda p, c: 2.0 + 0 * c.keys_seen[:, None, :],
                            modify=lambda s, p, qi, ki: s - 1.0 * (s > 3.0))
  z = jnp.einsum("btnh,bsnh->bnts", q, k) / DIM ** 0.5
  position = jnp.arange(16)
  logits = (z - 0.1 * (position[:, None] - position[None, :])) * 2.0
  logits = logits - 1.0 * (logits > 3.0)
  causal = position[:, None] >= position[None, :]
  expected = jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(jnp.where(causal, logits, -jnp.inf)),
                        v)
  for backend in ("xla", "blockwise"):
    out = core.attend(q, k, v, score_mod=score_mod, backend=backend, block_size=8)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_ssmax_in_mha_is_the_paper_s_equation_on_rope():
  """The scheme inside the model: the layer's output == softmax((s log n) q k / sqrt(H)) v with q
  and k rotated by RoPE and n = i + 1, s per head at its initial 0.43; a window of 5 with 2 sinks
  counts min(i + 1, 5) + min(2, max(0, i - 4)) keys."""
  for window, sinks in ((0, 0), (5, 2)):
    config = tiny_model_config(attention="mha", position="ssmax",
                               softmax=dict(window=window, sinks=sinks, sink_positions="original"))
    block = research.build_model(config, rngs=nnx.Rngs(0)).blocks[0].mixer
    x = _normal(5, (2, 19, config.d_model))
    positions_1xT = jnp.arange(19)[None]
    q = block.position.queries(block.query(x), positions_1xT)
    k = block.position.keys(block.key(x), positions_1xT)
    np.testing.assert_allclose(block.position.s[...], 0.43)
    visible = jnp.asarray(_visible(jnp.zeros((2, 19), jnp.int32), window, sinks))
    expected = block.out(_naive(q, k, block.value(x), block.position.s[...], visible))
    np.testing.assert_allclose(block(x, positions_1xT), expected, atol=2e-5, rtol=2e-5)


def test_ssmax_refuses_a_non_positive_s_and_the_fused_kernels():
  with pytest.raises(ValueError, match="model.ssmax.s_init must be > 0"):
    research.build_model(tiny_model_config(position="ssmax", ssmax=dict(s_init=0.0)),
                         rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="attention_backend 'pallas' cannot run"):
    research.build_model(tiny_model_config(position="ssmax", attention_backend="pallas"),
                         rngs=nnx.Rngs(0))
