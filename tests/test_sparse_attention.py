"""The `sparse` mixer (research/model/attention/sparse.py) against references written from the
authors' code (openai/sparse_attention@c53f3bd, attention.py: get_attn_mask, get_blocksparse_obj,
get_callback, attention_impl) and the papers' definitions: the patterns element by element, the
mixer's outputs and gradients (the input and every parameter) against naive float32 attention
with that mask (fixed: xla and blockwise, with and without packed documents; strided and
local_global: blockwise, packed); the tiles the blockwise schedule visits; decode == forward for
local_global's rolling cache (the conformance suite runs test_settings' fixed pattern: its
causality, gradients, decode, packed documents and sharding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model import attention
from research.model.attention import masks
from research.model.attention import sparse
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _document_index, _mixer, _normal

LENGTH, BLOCK = 37, 4
# Sizes in tokens at tiles of 4: the local_global sizes are not multiples of the tile.
# The sizes a pattern does not read stay at their defaults (validate refuses others).
SETTINGS = {name: {**sparse.SparseAttention.hyperparameters, **fields} for name, fields in [
    ("strided", dict(pattern="strided", stride=8, block_size=BLOCK)),
    ("fixed", dict(pattern="fixed", stride=8, summary=4, block_size=BLOCK)),
    ("local_global", dict(pattern="local_global", window=6, global_tokens=3, block_size=BLOCK))]}


# The patterns, written independently of research/model/attention/sparse.py and masks.py.

def _authors_strided(n, stride):
  """get_attn_mask's "local" (a band of `stride` keys) or its "strided" mask, the union."""
  ones = np.ones((n, n), bool)
  local = np.tril(ones) & np.triu(ones, -(min(n - 1, stride - 1)))
  q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
  strided = (q >= k) & (np.mod(q - k, stride) == 0)
  return local | strided


def _authors_fixed(n, stride, summary, block):
  """get_blocksparse_obj's "fixed" layout (num_verts = 1, vertsize = summary / block) at block
  granularity, expanded to tokens with get_callback's causal diagonal tiles."""
  blocks, per_stride, vertsize = n // block, stride // block, summary // block
  last_blocks = np.arange(per_stride - 1, -1, -1).reshape(-1, vertsize)[0]
  layout = np.zeros((blocks, blocks), bool)
  for column in last_blocks:
    layout[:, column::per_stride] = True
  for row in range(blocks):
    start = (row // per_stride) * per_stride
    layout[row, start:start + per_stride] = True
    layout[row, row + 1:] = False
  tokens = np.kron(layout, np.ones((block, block), bool)).astype(bool)
  return tokens & np.tril(np.ones((n, n), bool))


def _paper_fixed(n, stride, summary):
  """Section 4.3: A1 = {j : floor(j / l) = floor(i / l)}, A2 = {j : j mod l in l - c..l - 1}."""
  mask = np.zeros((n, n), bool)
  for i in range(n):
    for j in range(i + 1):
      mask[i, j] = j // stride == i // stride or j % stride >= stride - summary
  return mask


def _local_global(n, window, global_tokens):
  """A causal window of the last W keys plus the first G tokens that every query sees."""
  mask = np.zeros((n, n), bool)
  for i in range(n):
    for j in range(i + 1):
      mask[i, j] = i - j < window or j < global_tokens
  return mask


def _reference_pattern(name, n):
  s = SETTINGS[name]
  if name == "strided":
    return _authors_strided(n, s["stride"])
  if name == "fixed":
    return _paper_fixed(n, s["stride"], s["summary"])
  return _local_global(n, s["window"], s["global_tokens"])


def _settings(**fields):
  config = tiny_model_config(attention="sparse", sparse=fields)
  return attention.REGISTRY.settings("sparse", config), config


@pytest.mark.parametrize("n,stride,summary,block", [(48, 8, 4, 4), (64, 16, 8, 8),
                                                    (96, 32, 16, 8)])
def test_patterns_equal_the_authors_and_papers_definitions(n, stride, summary, block):
  index = np.arange(n)
  fixed = sparse.Fixed(stride, summary).mask().visible(index, index)
  np.testing.assert_array_equal(fixed, _authors_fixed(n, stride, summary, block))
  np.testing.assert_array_equal(fixed, _paper_fixed(n, stride, summary))
  strided = sparse.Strided(stride).mask().visible(index, index)
  np.testing.assert_array_equal(strided, _authors_strided(n, stride))
  local_global = sparse.LocalGlobal(stride, summary).mask().visible(index, index)
  np.testing.assert_array_equal(local_global, _local_global(n, stride, summary))
  for pattern in (sparse.Fixed(stride, summary), sparse.Strided(stride),
                  sparse.LocalGlobal(stride, summary)):  # the FLOP count's keys per query
    np.testing.assert_array_equal(pattern.keys(index),
                                  np.asarray(pattern.mask().visible(index, index)).sum(1))
    assert pattern.keys(index).sum() < n * (n + 1) // 2  # sparse at this length


def _tile_count(pattern, num_blocks, block):
  """Tiles with a kept pair, by the closed forms of sparse.py's docstring (no documents)."""
  total = 0
  for row in range(num_blocks):
    if isinstance(pattern, sparse.Fixed):
      s, v = pattern.stride // block, pattern.summary // block
      total += row % s + 1 + (row // s) * v
    elif isinstance(pattern, sparse.Strided):
      s = pattern.stride // block
      total += min(row + 1, s + 1) + max(0, row // s - 1)
    else:
      w, g = pattern.window // block, -(-pattern.global_tokens // block)
      total += min(row + 1, w + 1) + int(np.clip(row - w, 0, g))
  return total


@pytest.mark.parametrize("pattern", [sparse.Fixed(256, 64), sparse.Fixed(128, 32),
                                     sparse.Strided(256), sparse.Strided(128),
                                     sparse.LocalGlobal(256, 32), sparse.LocalGlobal(96, 64)])
def test_blockwise_schedule_visits_only_the_tiles_of_the_pattern(pattern):
  """The schedule (forward and backward tables) is exactly the tiles holding a kept pair, their
  number is the closed form of the docstring, and the visited share of the causal tiles falls
  with the share of the causal pairs that are kept."""
  length, block = 2048, 32
  num_blocks = length // block
  spec = pattern.mask()
  index = np.arange(length)
  element = np.asarray(spec.visible(index, index))
  needed = element.reshape(num_blocks, block, num_blocks, block).any(axis=(1, 3))
  (key_counts, key_table), (query_counts, query_table) = spec.schedule(num_blocks, block)
  forward = np.zeros_like(needed)
  backward = np.zeros_like(needed)
  for b in range(num_blocks):
    forward[b, key_table[b, :key_counts[b]]] = True
    backward[query_table[b, :query_counts[b]], b] = True
  np.testing.assert_array_equal(forward, needed)
  np.testing.assert_array_equal(backward, needed)
  visited, causal = sparse.tile_density(spec, length, block)
  assert visited == int(key_counts.sum()) == _tile_count(pattern, num_blocks, block)
  assert causal == num_blocks * (num_blocks + 1) // 2
  pairs = element.sum() / (length * (length + 1) / 2)
  if isinstance(pattern, sparse.Strided):  # a diagonal in the strided tiles: 1 / block used
    s = pattern.stride // block
    assert pairs + 0.05 < visited / causal <= 2 * (s + 1) / num_blocks + 1 / s
  else:  # whole tiles but for the diagonal and the window's ends
    assert pairs <= visited / causal <= pairs + 2 / num_blocks
  if isinstance(pattern, sparse.Fixed):
    s, v = pattern.stride // block, pattern.summary // block
    assert visited / causal == pytest.approx((s + 1 + v * (num_blocks / s - 1))
                                             / (num_blocks + 1))
  assert visited / causal < 0.5


def _naive(mixer, x_BxLxD, positions_BxL, allowed_BxLxL):
  """attention_impl of the authors' code written out in float32 around the mixer's projections:
  w = q k^T / sqrt(d) + the scheme's bias, w mask - 1e9 (1 - mask), softmax, w v; K/V repeated
  to the query heads."""
  q = mixer.position.queries(mixer.query(x_BxLxD), positions_BxL)
  k = mixer.position.keys(mixer.key(x_BxLxD), positions_BxL)
  group = mixer.num_heads // mixer.num_kv_heads
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(mixer.value(x_BxLxD), group, axis=2)
  w = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  w = w + mixer.position.bias(positions_BxL, positions_BxL)
  mask = allowed_BxLxL[:, None].astype(jnp.float32)
  w = jax.nn.softmax(w * mask - 1e9 * (1 - mask), axis=-1)
  return mixer.out(jnp.einsum("bnts,bsnh->btnh", w, v))


def _allowed(name, segments):
  """[B, L, L]: the pattern of each token's index within its document, within the document."""
  pattern = _reference_pattern(name, LENGTH)
  out = np.zeros((segments.shape[0], LENGTH, LENGTH), bool)
  for row, segments_row in enumerate(segments):
    d = np.asarray(_document_index(list(segments_row)))
    same = segments_row[:, None] == segments_row[None, :]
    out[row] = pattern[d[:, None], d[None, :]] & same
  return out


@pytest.mark.parametrize("name,packed,backends", [
    ("fixed", False, ("xla", "blockwise")), ("fixed", True, ("xla", "blockwise")),
    ("strided", True, ("blockwise",)), ("local_global", True, ("blockwise",))])
def test_mixer_equals_naive_attention_with_the_pattern_and_its_gradients(name, packed, backends):
  """Outputs and the gradients w.r.t. the input and every parameter (projections and KERPLE's
  bias parameters) against the naive reference; packed: SEGMENTS_37 with positions restarting
  per document, the pattern per document (fixed: the score-bias path). Strided and local_global
  take the same path packed or not (their mask spec, with the segments when given), so they run
  packed only; xla materialises any mask spec alike, so it runs with fixed alone, blockwise with
  every pattern (its schedule)."""
  segments = np.asarray(SEGMENTS_37) if packed else np.zeros((2, LENGTH), np.int32)
  positions = (masks.positions_in_documents(jnp.asarray(segments)) if packed
               else jnp.arange(LENGTH)[None])
  allowed = jnp.asarray(_allowed(name, segments))
  x = _normal(0, (2, LENGTH, 32))
  cotangent = _normal(9, x.shape)

  def outputs_and_gradients(mixer, forward):
    graphdef, params = nnx.split(mixer)
    out, pullback = jax.vjp(lambda p, x: forward(nnx.merge(graphdef, p), x), params, x)
    return out, pullback(cotangent)

  seg = jnp.asarray(segments) if packed else None
  want = None
  for backend in backends:
    mixer = _mixer("sparse", sparse=SETTINGS[name], position="kerple",
                   attention_backend=backend)
    got = jax.jit(lambda: outputs_and_gradients(
        mixer, lambda m, x: m(x, positions, seg)))()
    if want is None:
      want = jax.jit(lambda: outputs_and_gradients(
          mixer, lambda m, x: _naive(m, x, positions, allowed)))()
      params = jax.tree.leaves(nnx.state(mixer, nnx.Param))
      assert len(jax.tree.leaves(want[1])) == len(params) + 1  # every parameter, and x
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  # The pattern mattered: it leaves out causal pairs within the documents.
  assert bool((_allowed_causal(segments) & ~np.asarray(allowed)).any())
  if packed and name == "fixed":  # attention_weights of the score-bias path: 0 outside
    weights = jax.jit(mixer.attention_weights)(x, positions, seg)
    assert not bool(jnp.where(allowed[:, None], 0.0, weights).any())


def _allowed_causal(segments):
  same = segments[:, :, None] == segments[:, None, :]
  return same & np.tril(np.ones((LENGTH, LENGTH), bool))


def test_local_global_prefill_in_chunks_then_decode_equals_the_forward():
  """The conformance suite decodes the test_settings' fixed pattern (a keep(i, j) on the full
  cache, as strided); local_global's rolling cache of G + W = 3 + 6 slots here: a prompt of 7,
  then one token at a time past the cache's wrap, against the forward, with RoPE."""
  length = 19
  mixer = _mixer("sparse", sparse=SETTINGS["local_global"], position="rope",
                 attention_backend="xla")
  graphdef, state = nnx.split(mixer)
  x = _normal(1, (2, length, 32))
  want = mixer(x, jnp.arange(length)[None])
  step = jax.jit(lambda state, x, cache, index: nnx.merge(graphdef, state).decode(x, cache,
                                                                                   index))
  cache = mixer.init_cache(2, length)
  assert cache["key"].shape[1] == 3 + 6
  outputs = []
  for start, end in [(0, 7)] + [(t, t + 1) for t in range(7, length)]:
    y, cache = step(state, x[:, start:end], cache, start)
    outputs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fields,message", [
    (dict(pattern="butterfly"), "valid: 'strided', 'fixed', 'local_global'"),
    (dict(SETTINGS["strided"], stride=12, block_size=8), "stride=12 must be a multiple of"),
    (dict(SETTINGS["fixed"], stride=16, summary=4, block_size=8), "valid: 8, 16"),
    (dict(SETTINGS["fixed"], stride=16, summary=24, block_size=8), "at most model.sparse.stride"),
    (dict(SETTINGS["local_global"], window=0), "window must be >= 1"),
    (dict(SETTINGS["local_global"], window=4, global_tokens=5), "must be in 0..4"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(SETTINGS["local_global"], stride=16), "stride=16 is read only by the 'strided' and "
                                                 "'fixed' pattern"),
    (dict(SETTINGS["fixed"], window=64), "window=64 is read only by the 'local_global'"),
])
def test_validate_names_what_is_valid(fields, message):
  settings, config = _settings(**fields)
  with pytest.raises(ValueError, match=message):
    sparse.SparseAttention.validate(settings, config)


def test_defaults_and_test_settings_validate():
  for fields in [{}, dict(sparse.SparseAttention.hyperparameters),
                 *SETTINGS.values()]:
    settings, config = _settings(**fields)
    sparse.SparseAttention.validate(settings, config)
