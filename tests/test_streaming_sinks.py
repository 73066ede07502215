"""Attention sinks at StreamingLLM's cache positions (model.softmax.sink_positions).

StreamingLLM (mit-han-lab/streaming-llm@2e5042606d69933d88fbf909bd77907456b9b4dd, pos_shift:
`llama_pos_shift_attention_forward` with `StartRecentKVCache`) caches keys before the rotation and,
at every step, rotates the cached keys at their slots 0..n-1 (sinks first, then the recent tokens
in order) and the query at the slot it is appended to, so no distance reaches sinks + window. With
`sink_positions = "cache"` (the default) the lab computes the same thing in every path:

  (i)   decoding one token at a time through the rolling cache == a float64 port of the authors'
        eval loop (examples/eval_long_ppl.py: one token per call, evict after it);
  (ii)  the sequence path (xla, blockwise) == decoding; blockwise == xla == an element-by-element
        reference, forward and backward, with packed documents;
  (iii) `sink_positions = "original"` keeps every token at its own position: the numbers of the
        code before the setting (the naive reference of that definition);
  (iv)  with "cache" no query-sink distance exceeds sinks + window - 1 (ALiBi's bias read back
        from the attention weights), and an output depends on the cached tokens alone, not on
        how many tokens were evicted before them.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention
from research.model.attention import core, masks
from research.model.attention import streaming
from research.model.attention.streaming import SINK_POSITIONS
from research.model.positions import alibi_slopes
from tests.conftest import tiny_model_config

BATCH = 2
SINKS, WINDOW = 2, 5  # StreamingLLM's start_size = SINKS, recent_size = WINDOW - 1 (the lab's
                      # window counts the query's own key)


def _config(position, backend="xla", mode="cache", window=WINDOW, sinks=SINKS, attention="gqa"):
  return tiny_model_config(attention=attention, position=position, attention_backend=backend,
                           softmax=dict(window=window, sinks=sinks, sink_positions=mode))


@functools.cache
def _mixer(position, backend="xla", mode="cache", window=WINDOW, sinks=SINKS):
  """(graphdef, state) of the first layer's mixer (gqa: 4 query heads, 2 key/value heads, head
  dim 8, block 8)."""
  mixer = research.build_model(_config(position, backend, mode, window, sinks),
                               rngs=nnx.Rngs(0)).blocks[0].mixer
  return nnx.split(mixer)


def _x(length, seed=0):
  return jax.random.normal(jax.random.key(seed), (BATCH, length, 32), jnp.float32)


@functools.cache
def _functions(position, backend="xla", mode="cache", window=WINDOW, sinks=SINKS):
  """Jitted (sequence path, one decode call, attention weights) of the mixer."""
  graphdef, state = _mixer(position, backend, mode, window, sinks)

  def forward(x, segments=None):
    mixer = nnx.merge(graphdef, state)
    positions = jnp.arange(x.shape[1])[None] if segments is None else (
        masks.positions_in_documents(segments))
    return mixer(x, positions, segments)

  def decode(x, cache, index):
    return nnx.merge(graphdef, state).decode(x, cache, index)

  def weights(x):
    return nnx.merge(graphdef, state).attention_weights(x, jnp.arange(x.shape[1])[None])

  return jax.jit(forward), jax.jit(decode), jax.jit(weights)


def _decode(position, x, chunks=(), backend="xla", mode="cache", window=WINDOW, sinks=SINKS):
  """Outputs of the mixer decoding x [B, L, D] from an empty rolling cache: prefill chunks of the
  given lengths, then one token at a time."""
  graphdef, state = _mixer(position, backend, mode, window, sinks)
  _, decode, _ = _functions(position, backend, mode, window, sinks)
  cache = nnx.merge(graphdef, state).init_cache(BATCH, x.shape[1])
  outputs, index = [], 0
  for size in list(chunks) + [1] * (x.shape[1] - sum(chunks)):
    y, cache = decode(x[:, index:index + size], cache, jnp.int32(index))
    outputs.append(y)
    index += size
  return jnp.concatenate(outputs, axis=1)


# (i) StreamingLLM's own algorithm, ported to float64 numpy.


def _rotate(x_TxNxH, positions_T, base=10000.0):
  """RoPE at the given positions, the lab's pairing of channels (2i, 2i + 1); HF's rotate_half
  pairs (i, i + H/2), the same rotation up to a fixed permutation of a head's channels, which the
  projections absorb."""
  h = x_TxNxH.shape[-1]
  theta = base ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  angle = np.asarray(positions_T, np.float64)[:, None, None] * theta  # [T, 1, H/2]
  even, odd = x_TxNxH[..., 0::2], x_TxNxH[..., 1::2]
  out = np.empty_like(x_TxNxH)
  out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
  out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
  return out


def streaming_llm_pos_shift(q_TxNxH, k_TxKxH, v_TxKxH, start_size, recent_size):
  """StreamingLLM's decoding of one sequence, token by token (examples/eval_long_ppl.py with
  --enable_start_recent_kv_cache --enable_pos_shift), from the unrotated projections:

    llama_pos_shift_attention_forward: past_len = len(cache); the query is rotated at
      position_ids = arange(past_len, past_len + 1) (HF LlamaModel's default: the cache length);
      the new key is appended to the cache unrotated; all cached keys are rotated at
      arange(kv_seq_len), their slots; softmax(q k^T / sqrt(H)) v with repeat_kv.
    StartRecentKVCache.__call__ after each call: when the cache holds more than
      start_size + recent_size keys, keep the first start_size and the last recent_size.
  """
  t_len, n, h = q_TxNxH.shape
  group = n // k_TxKxH.shape[1]
  cache_k, cache_v = k_TxKxH[:0], v_TxKxH[:0]
  out = np.zeros((t_len, n, v_TxKxH.shape[-1]))
  for t in range(t_len):
    past_len = cache_k.shape[0]
    q = _rotate(q_TxNxH[t:t + 1], [past_len])[0]  # [N, H]
    cache_k = np.concatenate([cache_k, k_TxKxH[t:t + 1]])
    cache_v = np.concatenate([cache_v, v_TxKxH[t:t + 1]])
    keys = np.repeat(_rotate(cache_k, np.arange(cache_k.shape[0])), group, axis=1)  # [S, N, H]
    values = np.repeat(cache_v, group, axis=1)
    logits = np.einsum("nh,snh->ns", q, keys) / np.sqrt(h)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    out[t] = np.einsum("ns,snh->nh", p / p.sum(-1, keepdims=True), values)
    if cache_k.shape[0] > start_size + recent_size:
      keep = np.r_[0:start_size, cache_k.shape[0] - recent_size:cache_k.shape[0]]
      cache_k, cache_v = cache_k[keep], cache_v[keep]
  return out


def _projections(position, x, mode="cache"):
  """The mixer's unrotated queries, keys and values of x, float64, and its output projection."""
  graphdef, state = _mixer(position, "xla", mode)
  mixer = nnx.merge(graphdef, state)
  as64 = lambda a: np.asarray(a, np.float64)
  return as64(mixer.query(x)), as64(mixer.key(x)), as64(mixer.value(x)), mixer.out


@pytest.mark.parametrize("window,sinks", [(WINDOW, SINKS), (6, 4)])
def test_decoding_with_the_rolling_cache_is_streaming_llm_pos_shift(window, sinks):
  """RoPE, sink_positions = "cache": each decoded token's output == the authors' algorithm with
  start_size = sinks, recent_size = window - 1, long past the point where the cache is full."""
  length = 23
  x = _x(length, seed=1)
  got = _decode("rope", x, window=window, sinks=sinks)
  graphdef, state = _mixer("rope", "xla", "cache", window, sinks)
  mixer = nnx.merge(graphdef, state)
  q, k, v = (np.asarray(f(x), np.float64) for f in (mixer.query, mixer.key, mixer.value))
  ported = np.stack([streaming_llm_pos_shift(q[b], k[b], v[b], sinks, window - 1)
                     for b in range(BATCH)])
  expected = mixer.out(jnp.asarray(ported, jnp.float32))
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)


# (ii) The sequence path is the decode path; blockwise is xla.


# Each scheme on both backends and both sizes, each size once per backend (6 compiles, not 12).
@pytest.mark.parametrize("position,backend,length,window,sinks", [
    ("rope", "xla", 37, 11, 3), ("rope", "blockwise", 19, WINDOW, SINKS),
    ("alibi", "xla", 19, WINDOW, SINKS), ("alibi", "blockwise", 37, 11, 3),
    ("t5", "xla", 37, 11, 3), ("t5", "blockwise", 19, WINDOW, SINKS)])
def test_the_sequence_path_equals_decoding(position, backend, length, window, sinks):
  """forward(x) == prefill in two chunks then one token at a time, through the rolling cache (a
  chunk after one token holds sinks of its own later tokens); block 8, so the sink tiles, the
  window's tiles and the skipped ones all occur."""
  x = _x(length, seed=2)
  forward, _, _ = _functions(position, backend, "cache", window, sinks)
  expected = forward(x)
  for chunks in ((7, 6), (1, window + sinks + 3)):
    np.testing.assert_allclose(_decode(position, x, chunks, backend, "cache", window, sinks),
                               expected, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(_decode(position, x, (), backend, "cache", window, sinks),
                             expected, atol=2e-5, rtol=2e-5)
  if backend == "blockwise":
    xla, _, _ = _functions(position, "xla", "cache", window, sinks)
    np.testing.assert_allclose(expected, xla(x), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("position,backend", [("rope", "blockwise"), ("alibi", "xla")])
def test_packed_documents_see_their_own_sinks_at_their_cache_positions(position, backend):
  """A packed row gives each document what it gets alone (its sinks are its first tokens, its
  cache positions restart with it)."""
  segments = jnp.asarray(np.array([[0] * 12 + [1] * 14 + [2] * 3, [0] * 2 + [1] * 27], np.int32))
  x = _x(29, seed=3)
  forward, _, _ = _functions(position, backend)
  packed = forward(x, segments)
  for row in range(BATCH):
    for document in np.unique(np.asarray(segments[row])):
      where = np.nonzero(np.asarray(segments[row]) == document)[0]
      alone = forward(x[row:row + 1, where[0]:where[-1] + 1])
      np.testing.assert_allclose(packed[row:row + 1, where[0]:where[-1] + 1], alone,
                                 atol=2e-5, rtol=2e-5)


def _naive_sink_attention(q, q_sink, k, v, bias_fn, params, positions, cache_positions,
                          segments, window, sinks):
  """The definition element by element: pair (i, j) is visible when j <= i, in one document, and
  i - j < W or d(j) < S; a sink pair (i - j >= W, d(j) < S) takes q_sink_i and the bias at the
  query's cache position, every other pair q_i and the bias at its position."""
  b, t, n, h = q.shape
  seg = np.asarray(segments)
  visible = np.zeros((b, t, t), bool)
  sink_pair = np.zeros((b, t, t), bool)
  for r in range(b):
    d = [sum(seg[r, m] == seg[r, i] for m in range(i)) for i in range(t)]  # index in its document
    for i in range(t):
      for j in range(i + 1):
        if seg[r, i] != seg[r, j]:
          continue
        visible[r, i, j] = i - j < window or d[j] < sinks
        sink_pair[r, i, j] = i - j >= window and d[j] < sinks
  group = n // k.shape[2]
  kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, kk) * h ** -0.5
  sink_logits = jnp.einsum("btnh,bsnh->bnts", q_sink, kk) * h ** -0.5
  logits = logits + bias_fn(params, positions, positions)
  sink_logits = sink_logits + bias_fn(params, cache_positions, positions)
  logits = jnp.where(sink_pair[:, None], sink_logits, logits)
  logits = jnp.where(visible[:, None], logits, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), vv)


@pytest.mark.parametrize("packed,own_queries", [(False, True), (True, True), (True, False)])
def test_blockwise_equals_xla_and_the_naive_reference_forward_and_backward(packed, own_queries):
  """The core with sink queries: outputs and the gradients of q, the sink queries, k, v and the
  bias parameters (T5's table), blockwise (block 8) == xla == element by element; without
  queries of their own (a bias scheme) the sink pairs differ by their bias alone."""
  length, heads, kv_heads, window, sinks = 37, 4, 2, 6, 3
  normal = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  q, q_sink = normal(0, (2, length, heads, 8)), normal(4, (2, length, heads, 8))
  k, v = normal(1, (2, length, kv_heads, 8)), normal(2, (2, length, kv_heads, 8))
  segments = (jnp.array([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34]) if packed
              else jnp.zeros((2, length), jnp.int32))
  document_index = masks.positions_in_documents(segments)
  positions = document_index
  cache_positions = streaming.cache_positions(positions, document_index, window, sinks)
  scheme = attention.position_scheme(
      tiny_model_config(position="t5", num_heads=heads, d_model=8 * heads,
                        t5=dict(num_buckets=8, max_distance=16)), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(scheme)
  bias_fn = lambda p, qp, kp: nnx.merge(graphdef, p).bias(qp, kp)
  d_out = normal(3, q.shape)
  mask = core.MaskSpec(window=window, sinks=sinks)

  def vjp(f):
    out, pullback = jax.vjp(f, q, q_sink, k, v, params)
    return out, pullback(d_out)

  def fast(backend):
    return jax.jit(lambda: vjp(lambda q, qs, k, v, p: core.attend(
        q, k, v, score_mod=core.ScoreMod(bias=bias_fn), score_params=p, inputs=positions,
        mask=mask, segments_BxT=segments if packed else None, backend=backend, block_size=8,
        other_queries=core.OtherQueries(qs if own_queries else None, cache_positions))))()

  naive = jax.jit(lambda: vjp(lambda q, qs, k, v, p: _naive_sink_attention(
      q, qs if own_queries else q, k, v, bias_fn, p, positions, cache_positions, segments,
      window, sinks)))()
  blockwise, xla = fast("blockwise"), fast("xla")
  for got in (blockwise, xla):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(naive)):
      np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  # The sink queries got gradients of their own, or none.
  assert (float(jnp.abs(naive[1][1]).max()) > 1e-3) == own_queries


@pytest.mark.parametrize("window,sinks,block,packed", [(5, 2, 4, False), (5, 2, 4, True),
                                                       (7, 2, 4, False), (9, 1, 4, True),
                                                       (6, 0, 4, False)])
def test_the_mask_spec_plans_the_requeried_pairs_the_core_reads(window, sinks, block, packed):
  """The core knows the sink pairs only through the mask spec: its requeried pairs, where
  visible, are the pairs seen only through a sink (W or more back, a sink key), all within the
  leading `requeried_keys` and in a visited tile that `requeried_tiles` flags (blockwise
  computes the other queries' logits only there; an off-by-one in the tiles fails at W = 7)."""
  length = 24
  mask = masks.MaskSpec(window=window, sinks=sinks)
  index = np.arange(length)
  segments = (np.repeat(np.arange(3), [5, 11, 8])[None] if packed
              else np.zeros((1, length), np.int32))
  document_index = np.asarray(masks.positions_in_documents(jnp.asarray(segments)))
  seen = np.asarray(mask.allowed(index, index, segments, segments, document_index))[0, 0]
  pairs = np.asarray(mask.requeried_pairs(index, index, document_index))
  pairs = (pairs[0] if pairs.ndim == 3 else pairs) & seen  # across documents: masked anyway
  q, k = index[:, None], index[None, :]
  want = seen & (q - k >= window) & (document_index[0][None, :] < sinks)
  np.testing.assert_array_equal(pairs, want)
  assert mask.requeries == bool(want.any())
  assert not pairs[:, mask.requeried_keys(length, packed):].any()
  num_blocks = length // block
  tiles = mask.requeried_tiles(num_blocks, block, packed) & mask.tiles(num_blocks, block, packed)
  in_tiles = np.kron(tiles, np.ones((block, block), bool))
  assert not (pairs & ~in_tiles).any()


class _FarPairs(masks.MaskSpec):
  """Full causal attention whose pairs 3 or more apart are requeried: no sinks at all."""
  reads_key_documents = False
  requeries = True

  def requeried_pairs(self, q_index_T, k_index_S, k_document_index_BxS=None):
    q, k = q_index_T[:, None], k_index_S[None, :]
    return (k <= q) & (q - k >= 3)

  def requeried_keys(self, length, packed=False):
    return length

  def requeried_tiles(self, num_blocks, block, packed=False):
    i, j = np.arange(num_blocks)[:, None], np.arange(num_blocks)[None, :]
    return (j <= i) & ((i + 1) * block - 1 - j * block >= 3)


def test_the_core_requeries_whatever_pairs_the_mask_spec_names():
  """The core reads the requeried pairs from the mask spec alone: a spec without sinks that
  requeries every pair 3 or more apart gets those logits from the other queries, on xla and
  blockwise, forward and backward (against the formula written out)."""
  length, heads = 13, 2
  normal = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  q, q_other = normal(0, (1, length, heads, 8)), normal(1, (1, length, heads, 8))
  k, v = normal(2, (1, length, heads, 8)), normal(3, (1, length, heads, 8))
  d_out = normal(4, q.shape)
  mask = _FarPairs()

  def naive(q, q_other, k, v):
    index = jnp.arange(length)
    far = (index[:, None] - index[None, :] >= 3)[None, None]
    logits = jnp.where(far, jnp.einsum("bqnh,bknh->bnqk", q_other, k),
                       jnp.einsum("bqnh,bknh->bnqk", q, k)) * 8 ** -0.5
    causal = (index[None, :] <= index[:, None])[None, None]
    weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", weights, v)

  def vjp(f):
    out, pullback = jax.vjp(f, q, q_other, k, v)
    return out, pullback(d_out)

  want = vjp(naive)
  for backend in ("xla", "blockwise"):
    got = vjp(lambda q, qo, k, v: core.attend(
        q, k, v, mask=mask, backend=backend, block_size=4,
        other_queries=core.OtherQueries(qo, jnp.arange(length)[None])))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
  assert float(jnp.abs(want[1][1]).max()) > 1e-3  # the other queries matter


def test_the_model_trains_through_blockwise_with_sink_queries():
  """The gradients of a whole layer (sink queries from the same query projection at other
  positions) agree between blockwise and xla."""
  x = _x(37, seed=5)

  def grads(backend):
    graphdef, state = _mixer("rope", backend, "cache", 11, 3)

    def loss(state):
      mixer = nnx.merge(graphdef, state)
      return jnp.sum(jnp.sin(mixer(x, jnp.arange(37)[None])))

    return jax.jit(jax.grad(loss))(state)

  for g, w in zip(jax.tree.leaves(grads("blockwise")), jax.tree.leaves(grads("xla"))):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


# (iii) "original": every token at its own position, as before the setting.


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_original_positions_are_the_code_before_the_setting(backend):
  """sink_positions = "original": the sequence path and decoding == attention with every query
  and key rotated at its own position under the window + sinks mask (what the code computed
  before the setting existed); "cache" differs once a sink is outside the window."""
  length = 19
  x = _x(length, seed=6)
  q, k, v, out = _projections("rope", x, "original")
  positions = np.arange(length)
  q = np.stack([_rotate(q[b], positions) for b in range(BATCH)])
  k = np.stack([_rotate(k[b], positions) for b in range(BATCH)])
  i, j = positions[:, None], positions[None, :]
  visible = (j <= i) & ((i - j < WINDOW) | (j < SINKS))
  group = q.shape[2] // k.shape[2]
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, group, 2)) / np.sqrt(q.shape[-1])
  logits = np.where(visible, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  y = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), np.repeat(v, group, 2))
  expected = out(jnp.asarray(y, jnp.float32))
  forward, _, _ = _functions("rope", backend, "original")
  np.testing.assert_allclose(forward(x), expected, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(_decode("rope", x, (7,), backend, "original"), expected,
                             atol=2e-5, rtol=2e-5)
  cache, _, _ = _functions("rope", backend, "cache")
  differs = np.abs(np.asarray(cache(x)) - np.asarray(expected)).max(axis=(0, 2))
  assert differs[:SINKS + WINDOW].max() < 2e-5  # the cache is not full yet: the same positions
  assert differs[SINKS + WINDOW:].min() > 1e-4  # a token evicted: the sinks moved


def test_sink_positions_is_validated_and_defaults_to_cache():
  from research.model.attention.softmax import SoftmaxAttention  # noqa: PLC0415
  assert SoftmaxAttention.hyperparameters["sink_positions"] == "cache"
  assert SINK_POSITIONS == ("cache", "original")
  config = _config("rope", mode="slots")
  with pytest.raises(ValueError, match="sink_positions 'slots'.*'cache', 'original'"):
    research.build_model(config, rngs=nnx.Rngs(0))


# (iv) No distance reaches sinks + window.


@pytest.mark.parametrize("mode", SINK_POSITIONS)
def test_no_query_sink_distance_exceeds_sinks_plus_window(mode):
  """ALiBi with the queries zeroed: log p[i, i] - log p[i, j] = slope * (the distance the bias
  used). With "cache" a sink s is min(i, S + W - 1) - s away, never S + W or more; with
  "original", i - s."""
  length = 31
  graphdef, state = _mixer("alibi", "xla", mode)
  mixer = nnx.merge(graphdef, state)
  mixer.query.kernel.value = jnp.zeros_like(mixer.query.kernel.value)
  probs = np.asarray(mixer.attention_weights(_x(length, seed=7), jnp.arange(length)[None]),
                     np.float64)
  slopes = alibi_slopes(probs.shape[1]).astype(np.float64)
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  visible = (j <= i) & ((i - j < WINDOW) | (j < SINKS))
  with np.errstate(divide="ignore"):
    log_p = np.log(probs)
  diagonal = np.diagonal(log_p, axis1=-2, axis2=-1)[..., None]
  distance = (diagonal - log_p) / slopes[None, :, None, None]
  distance = np.where(visible, distance, np.nan)
  if mode == "cache":
    expected = np.where(i - j < WINDOW, i - j, np.minimum(i, SINKS + WINDOW - 1) - j)
    assert np.nanmax(distance) < SINKS + WINDOW - 1 + 1e-3
  else:
    expected = i - j
    assert np.nanmax(distance) > length - 2
  np.testing.assert_allclose(distance, np.broadcast_to(np.where(visible, expected, np.nan),
                                                       distance.shape), atol=2e-3)


@pytest.mark.parametrize("position", ["rope", "t5"])
def test_an_output_depends_on_the_cached_tokens_not_on_how_many_were_evicted(position):
  """The same sinks and the same last W tokens after 3 or after 40 evicted ones give the same
  output under "cache" (StreamingLLM: positions are slots), different ones under "original"."""
  sinks_x, filler, recent = _x(SINKS, 8), _x(40, 9), _x(WINDOW, 10)
  short = jnp.concatenate([sinks_x, filler[:, :3], recent], axis=1)
  long = jnp.concatenate([sinks_x, filler, recent], axis=1)
  for mode, same in (("cache", True), ("original", False)):
    forward, _, _ = _functions(position, "xla", mode)
    a, b = forward(short)[:, -1], forward(long)[:, -1]
    close = np.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert close == same, (mode, float(jnp.abs(a - b).max()))
    np.testing.assert_allclose(_decode(position, long, (), "xla", mode)[:, -1], b, atol=2e-5,
                               rtol=2e-5)


# Runs written before the setting keep their meaning.


def test_a_config_saved_before_the_setting_loads_with_original_positions():
  """A config.json without model.softmax.sink_positions was written by code that kept every
  token at its position: it loads as "original" (not today's default), and a new config must set
  "original" to continue it; a new run's config keeps "cache"."""
  from research import defaults  # noqa: PLC0415
  from research.runs import config_fields  # noqa: PLC0415
  saved = json.loads(defaults.get_config().to_json())  # as a config.json holds it
  saved["model"]["softmax"].update(window=128, sinks=4)
  del saved["model"]["softmax"]["sink_positions"], saved["version"]  # saved before either
  loaded = config_fields.merge_saved(saved, "an old config.json")
  assert loaded.model.softmax.sink_positions == "original"
  current = defaults.get_config()
  current.model.softmax.update(window=128, sinks=4)
  assert any("sink_positions" in d for d in config_fields.training_differences(saved, current))
  current.model.softmax.sink_positions = "original"
  assert config_fields.training_differences(saved, current) == []
  fresh = json.loads(defaults.get_config().to_json())
  assert config_fields.merge_saved(fresh, "new").model.softmax.sink_positions == "cache"
  # Without sinks the field changes nothing: an old run's absent field is today's default, and
  # the run continues under today's config.
  del fresh["model"]["softmax"]["sink_positions"], fresh["version"]
  assert config_fields.merge_saved(fresh, "old").model.softmax.sink_positions == "cache"
  assert config_fields.training_differences(fresh, defaults.get_config()) == []
