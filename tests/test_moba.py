"""MoBA (research/model/attention/moba.py) against a float32 port of the authors' reference,
MoonshotAI/MoBA@61e456b moba/moba_naive.py `moba_attn_varlen_naive` (per sequence of cu_seqlens:
block-mean gates, the own block at +inf and later blocks at -inf, top-k, one masked softmax),
with key/value heads repeated to the query heads as their moba/wrapper.py `moba_layer` does:
outputs and gradients w.r.t. q, k, v (both backends, packed documents, lengths that are and are
not multiples of the block), and w.r.t. the input and every parameter of the mixer. The
conformance suite covers decode == forward (prefill in chunks), packed rows == each document
alone, causality and sharding."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from research.model.attention import core
from research.model.attention import moba
from tests.conftest import tiny_model_config
from tests.test_kernels import _mixer, _normal, _outputs_and_gradients

CHUNK, TOPK = 4, 3  # two past blocks besides the own one: with 5 past blocks, 3 are left out


def _naive_moba_sequence(q_SxNxH, k_SxNxH, v_SxNxH, chunk, topk):
  """One sequence (one cu_seqlens interval) of moba_attn_varlen_naive, float32."""
  n = q_SxNxH.shape[0]
  num_block = math.ceil(n / chunk)
  q, k, v = (x.astype(jnp.float32) for x in (q_SxNxH, k_SxNxH, v_SxNxH))
  key_gate_weight = jnp.stack([k[i * chunk:min(n, (i + 1) * chunk)].mean(0)
                               for i in range(num_block)])  # [blocks, N, H]
  gate = jnp.einsum("shd,nhd->hsn", q, key_gate_weight)  # [N, S, blocks]
  for i in range(num_block):
    gate = gate.at[:, :(i + 1) * chunk, i].set(-jnp.inf)  # not ended before the query
    gate = gate.at[:, i * chunk:(i + 1) * chunk, i].set(jnp.inf)  # the own block
  values, index = jax.lax.top_k(gate, min(topk, num_block))
  chosen = jax.nn.one_hot(index, num_block, dtype=bool).any(axis=-2)
  need_attend = (gate >= values.min(axis=-1)[..., None]) & chosen
  block_mask = jnp.repeat(need_attend, chunk, axis=-1)[:, :, :n] & jnp.tril(jnp.ones((n, n), bool))
  qk = jnp.einsum("xhd,yhd->hxy", q, k) + jnp.where(block_mask, 0.0, -jnp.inf)
  p = jax.nn.softmax(qk * q.shape[-1] ** -0.5, axis=-1)
  return jnp.einsum("hxy,yhd->xhd", p, v)


def _naive_moba(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segments, chunk=CHUNK, topk=TOPK):
  """Each row's documents as the sequences of cu_seqlens, key/value heads repeated."""
  group = q_BxLxNxH.shape[2] // k_BxLxKxH.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k_BxLxKxH, v_BxLxKxH))
  rows = []
  for b, segments_row in enumerate(np.asarray(segments)):
    starts = [0] + [t for t in range(1, len(segments_row))
                    if segments_row[t] != segments_row[t - 1]] + [len(segments_row)]
    rows.append(jnp.concatenate([_naive_moba_sequence(q_BxLxNxH[b, s:e], k[b, s:e], v[b, s:e],
                                                      chunk, topk)
                                 for s, e in zip(starts[:-1], starts[1:])]))
  return jnp.stack(rows)


def _moba_core(q, k, v, segments, backend, tile=3):
  """The mixer's attention given q, k, v: its routing, then the backend's form."""
  length = q.shape[1]
  layout = moba.blocks(length, CHUNK, segments)
  routed = moba.route(q, k, layout, CHUNK, TOPK)
  positions = jnp.arange(length)[None]
  if backend == "xla":
    score_mod = core.ScoreMod(modify=lambda logits, p, q_in, k_in: jnp.where(
        moba.visible_blocks(q_in, k_in), logits, moba.MASKED))
    return core.attend(q, k, v, score_mod=score_mod, segments_BxT=segments, backend="xla",
                       inputs=(positions, layout.group, layout.complete, routed))
  return moba.sparse_attention(q, k, v, layout, routed, positions, scale=q.shape[-1] ** -0.5,
                               bias_fn=None, chunk=CHUNK, tile=tile)


# Row 0: documents of 16 (four whole blocks), 7 and 3 tokens; row 1: one document of 26 (six whole
# blocks and a partial one).
LENGTH = 26
SEGMENTS = np.array([[0] * 16 + [1] * 7 + [2] * 3, [0] * LENGTH], np.int32)


def _vjp(f, inputs, cotangent):
  out, pullback = jax.vjp(f, *inputs)
  return out, pullback(cotangent)


def test_attention_equals_the_authors_naive_form_with_gradients():
  """GQA (4 query heads on 2 key/value heads), packed documents, both backends: outputs and the
  pullback of a random cotangent w.r.t. q, k and v."""
  b, n, kv, h = 2, 4, 2, 8
  q, k, v = (_normal(0, (b, LENGTH, n, h)), _normal(1, (b, LENGTH, kv, h)),
             _normal(2, (b, LENGTH, kv, h)))
  segments, cotangent = jnp.asarray(SEGMENTS), _normal(3, (b, LENGTH, n, h))
  routed = moba.route(q, k, moba.blocks(LENGTH, CHUNK, segments), CHUNK, TOPK)
  # The selection is sparse: the last query of row 1 sees 2 of its 5 past blocks, of row 0 2 of 3.
  assert [int((routed[row, t] >= 0).sum()) for row, t in ((1, -1), (0, 15))] == [n * 2] * 2
  want = jax.jit(lambda: _vjp(lambda *a: _naive_moba(*a, SEGMENTS), (q, k, v), cotangent))()
  full = core.attend(q, k, v, segments_BxT=segments, backend="xla")
  assert float(jnp.abs(full - want[0]).max()) > 1e-2  # MoBA is not full attention here
  for backend in ("xla", "blockwise"):
    got = jax.jit(lambda: _vjp(lambda *a: _moba_core(*a, segments, backend), (q, k, v),
                               cotangent))()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=backend)


def _naive_moba_mixer(mixer, x_BxLxD):
  """The mixer as the authors' model runs it: projections, the rotary scheme on q and k, then
  moba_attn_varlen_naive per row (one sequence each), then the output projection."""
  positions = jnp.arange(x_BxLxD.shape[1])[None]
  q = mixer.position.queries(mixer.query(x_BxLxD), positions)
  k = mixer.position.keys(mixer.key(x_BxLxD), positions)
  segments = np.zeros(x_BxLxD.shape[:2], np.int32)
  return mixer.out(_naive_moba(q, k, mixer.value(x_BxLxD), segments,
                               mixer.chunk_size, mixer.topk))


def test_mixer_equals_the_naive_reference_with_gradients():
  """21 tokens in blocks of 4 with RoPE, the blockwise form (the xla one equals it in the next
  test): outputs and gradients w.r.t. x and every parameter."""
  mixer = _mixer("moba", position="rope", attention_backend="blockwise",
                 moba=dict(chunk_size=CHUNK, topk=TOPK, block_size=3))
  assert mixer.num_kv_heads == mixer.num_heads == 4
  x = _normal(0, (2, 21, 32))
  want = jax.jit(lambda x: _outputs_and_gradients(_naive_moba_mixer, mixer, x))(x)
  got = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: m(x, jnp.arange(21)[None]), mixer, x))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_blockwise_equals_xla_with_a_bias_scheme_and_packed_documents():
  """T5's bias (a learned table: its gradient too) on the selected keys' logits, packed rows."""
  mixer = _mixer("moba", position="t5", attention_backend="xla",
                 moba=dict(chunk_size=CHUNK, topk=TOPK, block_size=3))
  x, segments = _normal(4, (2, LENGTH, 32)), jnp.asarray(SEGMENTS)
  positions = jnp.stack([jnp.concatenate([jnp.arange(16), jnp.arange(7), jnp.arange(3)]),
                         jnp.arange(LENGTH)])  # a row of positions per row: restarting at documents
  forward = lambda m, x: m(x, positions, segments)  # noqa: E731
  want = jax.jit(lambda x: _outputs_and_gradients(forward, mixer, x))(x)
  mixer.backend = "blockwise"
  got = jax.jit(lambda x: _outputs_and_gradients(forward, mixer, x))(x)
  table_gradient = got[1][0]["position"]["table"][...]
  assert float(jnp.abs(table_gradient).max()) > 0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_blockwise_form_keeps_no_length_squared_arrays():
  """The blockwise form's residuals (what its gradient keeps) are O(L (k + 2) C) per head, far
  below the L^2 of the materialised form: 256 tokens in blocks of 8, top-2."""
  length, heads, chunk = 256, 2, 8

  def pullback(q):
    layout = moba.blocks(length, chunk)
    routed = moba.route(q, q, layout, chunk, 2)
    return jax.vjp(lambda q: moba.sparse_attention(
        q, q, q, layout, routed, jnp.arange(length)[None], scale=0.5, bias_fn=None, chunk=chunk,
        tile=chunk), q)[1]

  residuals = jax.eval_shape(pullback, jax.ShapeDtypeStruct((1, length, heads, 4), jnp.float32))
  sizes = [math.prod(x.shape) for x in jax.tree.leaves(residuals)]
  assert max(sizes) <= length * heads * (2 + 2) * chunk < length * length, max(sizes)


def test_validate_names_what_is_valid():
  config = tiny_model_config(attention="moba")
  settings = ml_collections.ConfigDict(dict(moba.MoBA.hyperparameters))
  moba.MoBA.validate(settings, config)
  with pytest.raises(ValueError, match="topk must be an integer >= 1"):
    moba.MoBA.validate(ml_collections.ConfigDict(dict(settings, topk=0)), config)
  config.attention_backend = "cudnn"
  with pytest.raises(ValueError, match="valid: auto, xla, blockwise"):
    moba.MoBA.validate(settings, config)
