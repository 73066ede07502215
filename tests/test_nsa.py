"""NSA (research/model/attention/nsa.py) against a float32 port of the authors' reference,
fla-org/native-sparse-attention@bd67af5 native_sparse_attention/ops/naive.py
`naive_nsa_with_compression` (mean-pooled blocks, compressed attention over the complete ones,
top-n blocks by the group-summed probabilities with the own block at 1.0, one softmax over the
selected keys, a sliding window, three gates), run per document as cu_seqlens' sequences, with
the layer of native_sparse_attention/modeling_nsa.py around it (RoPE on q and k, sigmoid gates
from one projection, output projection): outputs and gradients w.r.t. the input and every
parameter, on both backends, packed documents included, and decoding from the cache. The
conformance suite covers causality, decode == forward in chunks, packed rows == each document
alone and sharding."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from research.model.attention import nsa
from tests.conftest import tiny_model_config
from tests.test_kernels import _mixer, _normal, _outputs_and_gradients

BLOCK, SELECTED, WINDOW = 4, 3, 5  # the own block and 2 earlier ones: later queries drop blocks
LENGTH = 22
# Two rows of documents of 13 (three whole blocks and one token) and 9 tokens.
FIRST = 13
SEGMENTS = np.array([[0] * FIRST + [1] * (LENGTH - FIRST)] * 2, np.int32)
SETTINGS = dict(block_size=BLOCK, num_selected=SELECTED, window=WINDOW, tile_size=3)


def _naive_compression(q, k, v, g_cmp, block_counts, block_size, scale):
  """naive_nsa_compression for one sequence: (block indices [T, K, S], o_cmp [T, N, H])."""
  t, n, kv = q.shape[0], q.shape[1], k.shape[1]
  group = n // kv
  num_block = math.ceil(t / block_size)
  pad = [(0, num_block * block_size - t), (0, 0), (0, 0)]
  k_cmp, v_cmp = (jnp.pad(x, pad).reshape(num_block, block_size, kv, -1).mean(1) for x in (k, v))
  s = min(block_counts, num_block)
  k_cmp, v_cmp = (jnp.repeat(x, group, axis=1) for x in (k_cmp, v_cmp))
  causal_mask = (jnp.arange(t) - block_size + 1)[:, None] // block_size < jnp.arange(num_block)
  empty_mask = causal_mask.all(-1, keepdims=True)
  local_mask = jnp.arange(t)[:, None] // block_size == jnp.arange(num_block)[None, :]
  attn = jnp.einsum("qhd,khd->hqk", q * scale, k_cmp)
  attn = jnp.where(causal_mask & ~empty_mask, -jnp.inf, attn)
  attn = jnp.where(empty_mask, 0.0, jax.nn.softmax(attn, axis=-1))
  o_cmp = jnp.einsum("hqk,khd->qhd", attn, v_cmp) * g_cmp[..., None]
  select = jnp.where(local_mask, 1.0, attn).reshape(kv, group, t, num_block).sum(1)
  indices = jax.lax.top_k(jax.lax.stop_gradient(select), s)[1]  # [K, T, S]
  indices = jnp.where(indices > (jnp.arange(t) // block_size)[:, None], -1, indices)
  return indices.transpose(1, 0, 2), o_cmp


def _naive_sparse(q, k, v, g_slc, g_swa, block_indices, block_size, window_size, scale):
  """naive_nsa for one sequence, every query at once: the selected blocks' keys gathered as
  theirs (index * block_size + 0..block_size - 1, masked where < 0 or past the query)."""
  t, n, kv = q.shape[0], q.shape[1], k.shape[1]
  k, v, block_indices = (jnp.repeat(x, n // kv, axis=1) for x in (k, v, block_indices))
  index = (block_indices[..., None] * block_size + jnp.arange(block_size)).reshape(t, n, -1)
  gather = lambda x: x[jnp.clip(index, 0, t - 1), jnp.arange(n)[None, :, None]]  # noqa: E731
  logits = jnp.einsum("qhd,qhsd->qhs", q * scale, gather(k))
  dropped = (index < 0) | (index > jnp.arange(t)[:, None, None])
  attn = jax.nn.softmax(jnp.where(dropped, -jnp.inf, logits), axis=-1)
  o = jnp.einsum("qhs,qhsd->qhd", attn, gather(v)) * g_slc[..., None]
  if window_size > 0:
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    outside = (j > i) | (j < i - window_size + 1)
    logits = jnp.einsum("qhd,khd->hqk", q * scale, k)
    attn = jax.nn.softmax(jnp.where(outside, -jnp.inf, logits), axis=-1)
    o = o + jnp.einsum("hqk,khd->qhd", attn, v) * g_swa[..., None]
  return o


def _naive_nsa_mixer(mixer, x_BxLxD, segments_L):
  """modeling_nsa.NativeSparseAttention.forward with naive_nsa_with_compression, float32, each
  document a sequence of its own (positions restarting there); the rows share their documents
  (segments_L), each row is one batch entry of naive_nsa_with_compression."""
  length = x_BxLxD.shape[1]
  cuts = [0] + [t for t in range(1, length) if segments_L[t] != segments_L[t - 1]] + [length]
  scale = mixer.head_dim ** -0.5

  def document(x_LxD):
    x = x_LxD[None]
    positions = jnp.arange(x.shape[1])[None]
    q = mixer.position.queries(mixer.query(x), positions)[0]
    k = mixer.position.keys(mixer.key(x), positions)[0]
    v = mixer.value(x)[0]
    g_cmp, g_slc, g_swa = (jax.nn.sigmoid(mixer.gate(x)[0])[..., i] for i in range(3))
    indices, o_cmp = _naive_compression(q, k, v, g_cmp, mixer.num_selected, mixer.block, scale)
    return _naive_sparse(q, k, v, g_slc, g_swa, indices, mixer.block, mixer.window,
                         scale) + o_cmp

  return mixer.out(jnp.concatenate([jax.vmap(document)(x_BxLxD[:, start:end])
                                    for start, end in zip(cuts[:-1], cuts[1:])], axis=1))


@functools.lru_cache(maxsize=1)
def _reference():
  """(x, the reference's outputs and gradients w.r.t. x and the parameters) of the mixer's
  parameters (the same for every backend: built from the same seeds) on packed rows."""
  mixer = _mixer("nsa", position="rope", attention_backend="xla", nsa=SETTINGS)
  x = _normal(0, (2, LENGTH, 32))
  return x, jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: _naive_nsa_mixer(m, x, SEGMENTS[0]), mixer, x))(x)


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_mixer_equals_the_naive_reference_with_gradients_in_packed_documents(backend):
  """GQA (4 query heads on 2 key/value heads), RoPE, blocks of 4, 3 selected, a window of 5,
  packed rows: outputs and gradients w.r.t. x and every parameter (the gate's included)."""
  mixer = _mixer("nsa", position="rope", attention_backend=backend, nsa=SETTINGS)
  assert (mixer.num_heads, mixer.num_kv_heads) == (4, 2)
  x, want = _reference()
  positions = jnp.concatenate([jnp.arange(FIRST), jnp.arange(LENGTH - FIRST)])[None]
  got = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: m(x, positions, jnp.asarray(SEGMENTS)), mixer, x))(x)
  gate_gradient = got[1][0]["gate"]["kernel"][...]  # [D, N, 3]: every branch's gate is used
  assert float(jnp.abs(gate_gradient).max(axis=(0, 1)).min()) > 0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=backend)


def test_selection_drops_blocks_and_decoding_equals_the_reference():
  """The last query of the first document (13 tokens) picks 3 of its 4 blocks; its tokens one
  at a time through the cache give the reference's outputs (a prompt into an empty cache runs
  the sequence path, tested above; prefill in chunks: the conformance suite)."""
  mixer = _mixer("nsa", position="rope", attention_backend="xla", nsa=SETTINGS)
  x, (want, _) = _reference()
  x, want = x[:, :FIRST], want[:, :FIRST]
  positions = jnp.arange(FIRST)[None]
  q = mixer.position.queries(mixer.query(x), positions)[0]
  k = mixer.position.keys(mixer.key(x), positions)[0]
  indices, _ = _naive_compression(q, k, k, jnp.ones(q.shape[:2]), SELECTED, BLOCK,
                                  mixer.head_dim ** -0.5)
  assert int((indices[-1] >= 0).sum(-1).max()) == SELECTED < math.ceil(FIRST / BLOCK)

  @jax.jit
  def decode(x):
    def step(cache, t):
      y, cache = mixer.decode(jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1), cache, t)
      return cache, y[:, 0]

    return jax.lax.scan(step, mixer.init_cache(2, FIRST), jnp.arange(FIRST))[1].swapaxes(0, 1)

  np.testing.assert_allclose(decode(x), want, atol=1e-4, rtol=1e-4)


def test_validate_names_what_is_valid():
  config = tiny_model_config(attention="nsa")
  settings = ml_collections.ConfigDict(dict(nsa.NativeSparseAttention.hyperparameters))
  nsa.NativeSparseAttention.validate(settings, config)
  with pytest.raises(ValueError, match="num_selected must be an integer >= 1"):
    nsa.NativeSparseAttention.validate(ml_collections.ConfigDict(dict(settings, num_selected=0)),
                                       config)
  with pytest.raises(ValueError, match="window must be >= 1"):
    nsa.NativeSparseAttention.validate(ml_collections.ConfigDict(dict(settings, window=-1)),
                                       config)
  config.attention_backend = "cudnn"
  with pytest.raises(ValueError, match="valid: auto, xla, blockwise"):
    nsa.NativeSparseAttention.validate(settings, config)
