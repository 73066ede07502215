"""Fast paths against their naive float32 references (research.model.attention.reference)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from research.model import attention, positions
from research.model.attention import fox
from research.model.attention import reference
from research.model.attention import core
from research.model.attention.gated_deltanet import (chunked_gated_delta_rule, invert_unit_lower,
                                               l2_normalize)
from research.model.attention.linear import FEATURE_MAPS, chunked_linear_attention
from research.model.attention.mamba2 import chunked_ssd
from research.model.attention.retention import chunked_retention
from research.model.attention.rwkv6 import chunked_rwkv6
from research.model.attention.ssm import SCANS, chunked_selective_scan
from tests.conftest import tiny_model_config


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def blockwise_attention(q, k, v, inputs=None, bias_fn=None, params=(), *, block_size,
                        window=0, sinks=0, segments_BxT=None):
  """The core's blockwise backend with an additive bias function."""
  return core.attend(q, k, v, inputs=inputs, score_params=params, backend="blockwise",
                     score_mod=None if bias_fn is None else core.ScoreMod(bias=bias_fn),
                     block_size=block_size, mask=core.MaskSpec(window=window, sinks=sinks),
                     segments_BxT=segments_BxT)


def _bias_function(name, heads):
  """The bias of scheme `name` as (bias_fn(params, q_positions, k_positions), params)."""
  scheme = attention.position_scheme(
      tiny_model_config(position=name, num_heads=heads, d_model=8 * heads,
                        t5=dict(num_buckets=8, max_distance=16), fire=dict(init_threshold=6.0)),
      rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(scheme)
  return (lambda p, q_positions, k_positions:
          nnx.merge(graphdef, p).bias(q_positions, k_positions)), params


BIAS_SCHEMES = [n for n, cls in positions.REGISTRY.items() if positions.BIAS in cls.hooks()]


@pytest.mark.parametrize("length,heads,kv_heads,scheme,shared_positions", [
    (37, 4, 2, "alibi", True),  # GQA, length not a multiple of the block
    (32, 4, 4, "none", True),  # MHA, whole blocks, no bias
    (20, 4, 1, "alibi", False),  # MQA, a position row per sequence
] + [(37, 4, 2, name, name == "t5") for name in BIAS_SCHEMES if name != "alibi"])
def test_blockwise_equals_xla_forward_and_gradients_including_the_bias_parameters(
    length, heads, kv_heads, scheme, shared_positions):
  """The same bias function per tile as materialised: outputs, dq, dk, dv and d(bias params)."""
  q = _normal(0, (2, length, heads, 8))
  k, v = _normal(1, (2, length, kv_heads, 8)), _normal(2, (2, length, kv_heads, 8))
  positions_BxT = jnp.arange(length)[None] * 2 + 1  # any increasing positions
  if not shared_positions:
    positions_BxT = jnp.stack([positions_BxT[0], positions_BxT[0] + 5])
  bias_fn, params = _bias_function(scheme, heads)
  d_out = _normal(3, q.shape)

  def xla(q, k, v, params):
    bias = bias_fn(params, positions_BxT, positions_BxT)
    if bias is not None:
      bias = jnp.broadcast_to(bias, (2,) + bias.shape[1:])
    return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True,
                                        implementation="xla")

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v, params)
    return out, pullback(d_out)

  fast = jax.jit(lambda: vjp(lambda *a: blockwise_attention(
      *a[:3], positions_BxT, bias_fn, a[3], block_size=8)))()
  naive = jax.jit(lambda: vjp(xla))()
  got, want = jax.tree.leaves(fast), jax.tree.leaves(naive)
  assert len(got) == len(want) and (scheme in ("none", "alibi") or len(got) > 4)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("window,sinks,packed", [(0, 0, False), (6, 2, True)])
def test_xla_backend_equals_the_naive_reference(window, sinks, packed):
  """The core's xla backend (the mask and bias it builds, then jax.nn.dot_product_attention)
  against the reference with the mask built element by element; GQA, an ALiBi bias."""
  length = 13
  q = _normal(0, (2, length, 4, 8))
  k, v = _normal(1, (2, length, 2, 8)), _normal(2, (2, length, 2, 8))
  segments = jnp.array([[0] * 5 + [1] * 8, [0] * 2 + [1] * 11]) if packed else None
  bias_fn, params = _bias_function("alibi", 4)
  positions_BxT = jnp.arange(length)[None]
  got = core.attend(q, k, v, inputs=positions_BxT, score_params=params, backend="xla",
                    score_mod=core.ScoreMod(bias=bias_fn), segments_BxT=segments,
                    mask=core.MaskSpec(window=window, sinks=sinks))
  visible = _visible(jnp.zeros((2, length), jnp.int32) if segments is None else segments,
                     window, sinks)
  want = reference.softmax_attention(q, k, v, bias_fn(params, positions_BxT, positions_BxT),
                                     mask_BxTxS=jnp.asarray(visible))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_blockwise_keeps_no_length_squared_residual():
  """The VJP's residuals are O(length): q, k, v, out and the row log-sum-exp."""
  length, heads = 64, 2
  q = k = v = jnp.ones((1, length, heads, 4))
  _, pullback = jax.vjp(lambda q: blockwise_attention(q, k, v, block_size=8), q)
  sizes = [x.size for x in jax.tree.leaves(pullback)]
  assert max(sizes) <= length * heads * 4, sizes


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("use_rope", [False, True])
def test_chunked_linear_equals_materialised_cumsum(feature_map, use_rope):
  b, length, n, h = 2, 21, 2, 8
  q, k, v = (_normal(i, (b, length, n, h)) for i in range(3))
  state = (jnp.zeros((b, n, h, h)), jnp.zeros((b, n, h)))
  rope = attention.position_scheme(tiny_model_config(d_model=16, num_heads=2), rngs=nnx.Rngs(0))
  rotate = (lambda x: rope.rotate(x, jnp.arange(length)[None])) if use_rope else None
  got, (s, z) = jax.jit(lambda q, k, v: chunked_linear_attention(
      q, k, v, state, feature_map=feature_map, chunk_size=8, transform_q=rotate,
      transform_k=rotate))(q, k, v)
  phi = FEATURE_MAPS[feature_map]
  phi_q, phi_k = phi(q), phi(k)
  rotated = (rotate(phi_q), rotate(phi_k)) if use_rope else (None, None)
  want = reference.linear_attention(phi_q, phi_k, v, *rotated)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(z, phi_k.sum(1), rtol=1e-5)


def test_linear_attention_survives_bfloat16_inputs_with_negative_features():
  """The elu+1 trap: in bf16, elu(-8) + 1 cancels to exactly 0; the feature map here does not."""
  b, length, n, h = 1, 16, 1, 4
  x = jnp.full((b, length, n, h), -8.0, jnp.bfloat16)
  assert bool((jax.nn.elu(x) + 1 == 0).all())  # the naive bf16 form collapses
  v = _normal(0, (b, length, n, h)).astype(jnp.bfloat16)
  out, _ = chunked_linear_attention(x, x, v, (jnp.zeros((b, n, h, h)), jnp.zeros((b, n, h))),
                                    chunk_size=8)
  phi = FEATURE_MAPS["elu"](x.astype(jnp.float32))
  assert bool((phi > 0).all())
  want = reference.linear_attention(phi, phi, v.astype(jnp.float32))
  np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(out).max()) > 0.1


def _ssm_inputs(b=2, length=29, e=6, n=4):
  x = _normal(0, (b, length, e))
  delta = jax.nn.softplus(_normal(1, (b, length, e)))
  A = -jnp.exp(jnp.log(jnp.tile(jnp.arange(1.0, n + 1), (e, 1))))
  B, C = _normal(2, (b, length, n)), _normal(3, (b, length, n))
  h0 = _normal(4, (b, e, n))
  return x, delta, A, B, C, h0


@pytest.mark.parametrize("scan", sorted(SCANS))
def test_chunked_scan_equals_sequential_scan_with_gradients(scan):
  inputs = _ssm_inputs()

  def loss(f):
    return lambda *a: (lambda y, h: (y ** 2).sum() + h.sum())(*f(*a))

  chunked = lambda *a: chunked_selective_scan(*a, chunk_size=8, scan=scan)
  got = jax.jit(chunked)(*inputs)
  want = jax.jit(reference.sequential_selective_scan)(*inputs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  got_grads = jax.jit(jax.grad(loss(chunked), argnums=(0, 1, 2, 3, 4, 5)))(*inputs)
  want_grads = jax.jit(jax.grad(loss(reference.sequential_selective_scan),
                                argnums=(0, 1, 2, 3, 4, 5)))(*inputs)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-3, rtol=1e-3)


def test_associative_reference_equals_sequential_reference():
  inputs = _ssm_inputs()
  for g, w in zip(reference.associative_selective_scan(*inputs),
                  reference.sequential_selective_scan(*inputs)):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def _document_index(segments_row):
  """Index of each token within its document, by a loop (independent of
  research.model.attention.masks)."""
  index, count = [], 0
  for t, segment in enumerate(segments_row):
    count = 0 if t and segment != segments_row[t - 1] else count + (t > 0)
    index.append(count)
  return index


def _visible(segments_BxT, window, sinks):
  """The mask by its definition, element by element."""
  segments = np.asarray(segments_BxT)
  b, t = segments.shape
  mask = np.zeros((b, t, t), bool)
  for row in range(b):
    inside = _document_index(segments[row])
    for i in range(t):
      for j in range(i + 1):
        near = not window or i - j < window or inside[j] < sinks
        mask[row, i, j] = near and segments[row, i] == segments[row, j]
  return mask


SEGMENTS_37 = jnp.array([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34])


@pytest.mark.parametrize("window,sinks,packed", [
    (5, 0, False), (11, 3, False), (0, 0, True), (6, 2, True), (20, 0, True)])
def test_blockwise_window_sinks_and_documents_equal_the_naive_reference(window, sinks, packed):
  """Outputs and gradients (q, k, v and the ALiBi bias parameters) against the reference with
  the mask built element by element; block 8, so whole tiles are skipped."""
  length, heads, kv_heads = 37, 4, 2
  q = _normal(0, (2, length, heads, 8))
  k, v = _normal(1, (2, length, kv_heads, 8)), _normal(2, (2, length, kv_heads, 8))
  segments = SEGMENTS_37 if packed else jnp.zeros((2, length), jnp.int32)
  positions_BxT = jnp.arange(length)[None]
  bias_fn, params = _bias_function("t5", heads)
  mask = jnp.asarray(_visible(segments, window, sinks))
  d_out = _normal(3, q.shape)

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v, params)
    return out, pullback(d_out)

  fast = jax.jit(lambda: vjp(lambda *a: blockwise_attention(
      *a[:3], positions_BxT, bias_fn, a[3], block_size=8, window=window, sinks=sinks,
      segments_BxT=segments if packed else None)))()
  naive = jax.jit(lambda: vjp(lambda q, k, v, p: reference.softmax_attention(
      q, k, v, bias_fn(p, positions_BxT, positions_BxT), mask_BxTxS=mask)))()
  for g, w in zip(jax.tree.leaves(fast), jax.tree.leaves(naive)):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("window,sinks,packed", [(0, 0, False), (6, 2, True)])
def test_blockwise_forget_bias_equals_xla_and_the_naive_reference(window, sinks, packed):
  """FoX's bias D[i, j] = c_i - c_j per tile from the cumulative log forget gates c, against
  xla (D materialised) and the reference that sums log f_l term by term: outputs and the
  gradients of q, k, v and log f (through the cumulative sum); a window and sinks skip whole
  tiles, packed documents leave cross-document pairs to the mask."""
  length, heads, kv_heads = 37, 4, 2
  q = _normal(0, (2, length, heads, 8))
  k, v = _normal(1, (2, length, kv_heads, 8)), _normal(2, (2, length, kv_heads, 8))
  log_forget = jax.nn.log_sigmoid(_normal(4, (2, length, heads), 2.0) + 1.0)
  segments = SEGMENTS_37 if packed else jnp.zeros((2, length), jnp.int32)
  mask = jnp.asarray(_visible(segments, window, sinks))
  positions_BxT = jnp.arange(length)[None]
  d_out = _normal(3, q.shape)

  def blockwise(q, k, v, log_forget):
    c = jnp.cumsum(log_forget, axis=1)
    return blockwise_attention(q, k, v, (positions_BxT, c),
                               lambda p, q_in, k_in: fox.forget_bias(q_in[1], k_in[1]), (),
                               block_size=8, window=window, sinks=sinks,
                               segments_BxT=segments if packed else None)

  def xla(q, k, v, log_forget):
    c = jnp.cumsum(log_forget, axis=1)
    return jax.nn.dot_product_attention(q, k, v, bias=fox.forget_bias(c, c), mask=mask[:, None],
                                        implementation="xla")

  def naive(q, k, v, log_forget):
    return reference.softmax_attention(q, k, v, reference.forget_bias(log_forget),
                                       mask_BxTxS=mask)

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v, log_forget)
    return out, pullback(d_out)

  got = jax.tree.leaves(jax.jit(lambda: vjp(blockwise))())
  assert len(got) == 5 and float(jnp.abs(got[-1]).max()) > 1e-3  # d log f reached the gates
  for want in (jax.jit(lambda: vjp(xla))(), jax.jit(lambda: vjp(naive))()):
    for g, w in zip(got, jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def _per_document(fn, segments_BxT, *arrays):
  """fn applied to each document of each row alone ([1, length_d, ...] slices), concatenated."""
  rows = []
  for row, segment_row in enumerate(np.asarray(segments_BxT)):
    parts = [fn(*(a[row:row + 1, segment_row == s] for a in arrays))
             for s in np.unique(segment_row)]
    rows.append(jnp.concatenate(parts, axis=1))
  return jnp.concatenate(rows, axis=0)


def test_chunked_linear_attention_restarts_at_document_starts():
  b, length, n, h = 2, 37, 2, 8
  q, k, v = (FEATURE_MAPS["elu"](_normal(i, (b, length, n, h))) for i in range(3))
  state = (jnp.zeros((b, n, h, h)), jnp.zeros((b, n, h)))
  got, _ = chunked_linear_attention(q, k, v, state, feature_map="relu", chunk_size=8,
                                    segments=SEGMENTS_37)  # relu is the identity on q, k > 0
  want = _per_document(reference.linear_attention, SEGMENTS_37, q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  unpacked, _ = chunked_linear_attention(q, k, v, state, feature_map="relu", chunk_size=8)
  assert float(jnp.abs(unpacked[:, 10:] - got[:, 10:]).max()) > 1e-3  # the segments mattered


def test_chunked_retention_equals_the_recurrence_from_a_state_and_per_document():
  b, length, n, h = 2, 37, 3, 4
  q, k, v = (_normal(i, (b, length, n, h)) for i in range(3))
  gamma = 1.0 - 2.0 ** (-1.0 - np.arange(n))  # fast decays: every chunk boundary matters
  state = _normal(5, (b, n, h, h))
  got, got_state = chunked_retention(q, k, v, gamma, state, chunk_size=8)
  want, want_state = reference.retention(q, k, v, gamma, state)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(got_state, want_state, atol=1e-4, rtol=1e-4)
  zeros = jnp.zeros((1, n, h, h))
  packed, _ = chunked_retention(q, k, v, gamma, jnp.concatenate([zeros, zeros]), chunk_size=8, segments=SEGMENTS_37)
  alone = _per_document(lambda *a: reference.retention(*a, gamma, zeros)[0], SEGMENTS_37, q, k, v)
  np.testing.assert_allclose(packed, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mixer", ["linear", "retention"])
def test_state_passed_in_belongs_to_the_first_document_only(mixer):
  """Chunked form from the final state of a prefix P, on packed documents d0, d1, ...: d0 continues
  P (the reference runs [P; d0] from zero), every later document starts from zero."""
  b, n, h, prefix_length = 2, 2, 4, 5
  q, k, v = (jax.nn.softplus(_normal(i, (b, prefix_length + 37, n, h))) for i in range(3))
  gamma = 1.0 - 2.0 ** (-1.0 - np.arange(n))
  if mixer == "linear":
    zeros = (jnp.zeros((b, n, h, h)), jnp.zeros((b, n, h)))
    chunked = functools.partial(chunked_linear_attention, feature_map="relu", chunk_size=8)
    naive = reference.linear_attention
  else:
    zeros = jnp.zeros((b, n, h, h))
    chunked = functools.partial(chunked_retention, gamma_N=gamma, chunk_size=8)
    naive = lambda q, k, v: reference.retention(q, k, v, gamma, zeros[:1])[0]  # noqa: E731
  prefix, rest = ((x[:, :prefix_length] for x in (q, k, v)),
                  [x[:, prefix_length:] for x in (q, k, v)])
  chunked = jax.jit(chunked)
  _, state = chunked(*prefix, state=zeros)
  got, _ = chunked(*rest, state=state, segments=SEGMENTS_37)
  want = _per_document(naive, SEGMENTS_37, *rest)
  for row, first_length in enumerate((10, 3)):  # d0 of each row continues the prefix
    continued = naive(*(x[row:row + 1, :prefix_length + first_length] for x in (q, k, v)))
    want = want.at[row, :first_length].set(continued[0, prefix_length:])
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
  fresh, _ = chunked(*rest, state=zeros, segments=SEGMENTS_37)
  assert float(jnp.abs(fresh[:, :3] - got[:, :3]).max()) > 1e-3  # the state mattered


@pytest.mark.parametrize("block,window,sinks", [(4, 5, 0), (4, 5, 2), (8, 12, 9), (4, 16, 1)])
def test_blockwise_visits_exactly_the_tiles_that_hold_a_visible_key(block, window, sinks):
  """The schedule of MaskSpec (forward: key blocks per query block; backward: query blocks per
  key block) is exactly the (query block, key block) tiles with at least one visible pair: none
  is missed, none computed in vain."""
  length = 64
  num_blocks = length // block
  index = np.arange(length)
  spec = core.MaskSpec(window=window, sinks=sinks)
  element = np.asarray(spec.visible(index, index))
  needed = {(i, j) for i in range(num_blocks) for j in range(num_blocks)
            if element[i * block:(i + 1) * block, j * block:(j + 1) * block].any()}
  (key_counts, key_table), (query_counts, query_table) = spec.schedule(num_blocks, block)
  forward = {(i, int(j)) for i in range(num_blocks) for j in key_table[i, :key_counts[i]]}
  backward = {(int(i), j) for j in range(num_blocks) for i in query_table[j, :query_counts[j]]}
  assert forward == needed and backward == needed
  assert len(needed) < num_blocks * (num_blocks + 1) // 2  # the window skipped some tiles


@pytest.mark.parametrize("packed", [False, True])
def test_block_sparse_pattern_skips_tiles_and_equals_the_naive_reference(packed):
  """A block-sparse `keep(i, j)` (block 4, stride 8: key blocks between the recent ones and the
  strided ones hold no kept key) shortens the schedule, and blockwise == xla == the naive
  reference with the mask built element by element: outputs and gradients, with a bias."""
  length, heads, kv_heads, block = 37, 4, 2, 4
  spec = core.MaskSpec(keep=lambda i, j: (i - j < 4) | ((i - j) % 16 == 0))
  num_blocks = -(-length // block)
  assert int(spec.schedule(num_blocks, block)[0][0].sum()) < num_blocks * (num_blocks + 1) // 2
  q = _normal(0, (2, length, heads, 8))
  k, v = _normal(1, (2, length, kv_heads, 8)), _normal(2, (2, length, kv_heads, 8))
  segments = SEGMENTS_37 if packed else None
  bias_fn, params = _bias_function("alibi", heads)
  index = np.arange(length)
  element = (index[None, :] <= index[:, None]) & np.asarray(spec.keep(index[:, None],
                                                                      index[None, :]))
  same = np.ones((2, length, length), bool) if segments is None else (
      np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None, :])
  d_out = _normal(3, q.shape)

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(d_out)

  def attend(backend):
    return lambda q, k, v: core.attend(q, k, v, score_mod=core.ScoreMod(bias=bias_fn),
                                       score_params=params, mask=spec, segments_BxT=segments,
                                       backend=backend, block_size=block)

  naive = jax.jit(lambda: vjp(lambda q, k, v: reference.softmax_attention(
      q, k, v, bias_fn(params, index[None], index[None]),
      mask_BxTxS=jnp.asarray(element[None] & same))))()
  for backend in ("blockwise", "xla"):
    got = jax.jit(lambda: vjp(attend(backend)))()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(naive)):
      np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


def test_a_block_sparse_pattern_must_keep_each_querys_own_key():
  with pytest.raises(ValueError, match="must keep each query's own key"):
    core.MaskSpec(keep=lambda i, j: (i - j) % 2 == 1).schedule(4, 4)


def test_values_wider_than_keys_and_a_score_modify_equal_the_naive_reference():
  """V = 2 H (as differential attention's values), and a non-additive score function (a soft
  cap, tanh(s / 5) * 5, as Gemma 2's) that sees per-token float inputs: blockwise == xla ==
  the naive reference, outputs and the gradients of q, k, v and the inputs."""
  length, heads, kv_heads = 21, 4, 2
  q = _normal(0, (2, length, heads, 8))
  k, v = _normal(1, (2, length, kv_heads, 8)), _normal(2, (2, length, kv_heads, 16))
  gate = _normal(4, (2, length, heads))
  d_out = _normal(3, (2, length, heads, 16))
  score_mod = core.ScoreMod(
      bias=lambda p, q_in, k_in: q_in.transpose(0, 2, 1)[:, :, :, None] * 0.1
      - k_in.transpose(0, 2, 1)[:, :, None, :] * 0.1,
      modify=lambda s, p, q_in, k_in: 5.0 * jnp.tanh(s / 5.0))

  def naive(q, k, v, gate):
    g = heads // kv_heads
    logits = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, g, axis=2)) * 8 ** -0.5
    logits = logits + 0.1 * (gate.transpose(0, 2, 1)[:, :, :, None]
                             - gate.transpose(0, 2, 1)[:, :, None, :])
    logits = 5.0 * jnp.tanh(logits / 5.0)
    causal = jnp.tril(jnp.ones((length, length), bool))
    p = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(v, g, axis=2))

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v, gate)
    return out, pullback(d_out)

  want = jax.jit(lambda: vjp(naive))()
  for backend in ("blockwise", "xla"):
    got = jax.jit(lambda: vjp(lambda q, k, v, g: core.attend(
        q, k, v, score_mod=score_mod, inputs=g, backend=backend, block_size=8)))()
    assert got[0].shape == (2, length, heads, 16)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  with pytest.raises(ValueError, match="'cudnn' takes an additive bias only"):
    core.attend(q, k, v, score_mod=score_mod, inputs=gate, backend="cudnn")


@pytest.mark.parametrize("scan", sorted(SCANS))
def test_chunked_scan_resets_at_document_starts(scan):
  x, delta, A, B, C, _ = _ssm_inputs(length=37)
  h0 = jnp.zeros((1, x.shape[-1], A.shape[-1]))
  resets = jnp.asarray(np.diff(np.asarray(SEGMENTS_37), axis=1, prepend=0) != 0)

  def chunked(x, delta, A, B, C):
    return chunked_selective_scan(x, delta, A, B, C, jnp.concatenate([h0, h0]), chunk_size=8,
                                  scan=scan, resets=resets)[0]

  def per_document(x, delta, A, B, C):
    return _per_document(
        lambda x, d, b, c: reference.sequential_selective_scan(x, d, A, b, c, h0)[0],
        SEGMENTS_37, x, delta, B, C)

  inputs = (x, delta, A, B, C)
  np.testing.assert_allclose(chunked(*inputs), per_document(*inputs), atol=1e-4, rtol=1e-4)
  if scan != "sequential":  # autodiff; the hand-written backward is the sequential scan's
    return
  squares = lambda f: lambda *a: (f(*a) ** 2).sum()
  got = jax.jit(jax.grad(squares(chunked), argnums=range(5)))(*inputs)
  want = jax.jit(jax.grad(squares(per_document), argnums=range(5)))(*inputs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-3, rtol=1e-3)


def _mixer(name, **overrides):
  """The registered mixer `name` alone, built from the tiny test config with `overrides`."""
  config = tiny_model_config(attention=name, **overrides)
  return attention.REGISTRY[name](attention.REGISTRY.settings(name, config), config,
                                  attention.position_scheme(config, rngs=nnx.Rngs(1)),
                                  rngs=nnx.Rngs(0))


def _outputs_and_gradients(forward, mixer, x):
  """forward(mixer, x) and the gradients of <forward, cotangent> w.r.t. x and the parameters."""
  graphdef, params = nnx.split(mixer)
  cotangent = _normal(9, x.shape)
  out, pullback = jax.vjp(lambda p, x: forward(nnx.merge(graphdef, p), x), params, x)
  return out, pullback(cotangent)


def _naive_retention_mixer(mixer, x_BxLxD):
  """MSR(X) = (swish(X W_G) * RMSNorm_per_head(retention)) W_O, the retention one token at a time."""
  positions_1xL = jnp.arange(x_BxLxD.shape[1])[None]
  h = mixer.head_dim
  q = mixer.position.queries(mixer.query(x_BxLxD), positions_1xL)
  k = mixer.position.keys(mixer.key(x_BxLxD) / np.sqrt(h), positions_1xL)
  state = jnp.zeros((x_BxLxD.shape[0], mixer.num_heads, h, h))
  o, _ = reference.retention(q, k, mixer.value(x_BxLxD), mixer.gamma, state)
  normalised = o / jnp.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-6)
  return mixer.out(jax.nn.silu(mixer.gate(x_BxLxD)) * normalised)


def _assert_mixer_equals_naive(mixer, naive):
  """The mixer's forward and gradients (w.r.t. x and every parameter) equal `naive`'s."""
  x = _normal(0, (2, 21, 32))
  got = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: m(x, jnp.arange(21)[None]), mixer, x))(x)
  want = jax.jit(lambda x: _outputs_and_gradients(naive, mixer, x))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_retention_mixer_equals_the_token_by_token_reference_with_gradients():
  _assert_mixer_equals_naive(_mixer("retention", position="xpos", retention=dict(chunk_size=8)),
                             _naive_retention_mixer)


def test_retention_output_of_a_slow_decay_head_does_not_grow_with_context():
  """Head 3 decays with gamma = 1 - 2^-8: its retention sums ~256 tokens and grows with the
  context; after the per-head norm the mixer's output stays the size it has at the start."""
  mixer = _mixer("retention", position="none")
  length = 512
  x = _normal(0, (1, 1, 32)) + _normal(1, (1, length, 32), 0.3)  # a shared direction plus noise
  q, k, v = (f(x) for f in (mixer.query, mixer.key, mixer.value))
  raw, _ = chunked_retention(q, k / np.sqrt(mixer.head_dim), v, mixer.gamma,
                             mixer.init_cache(1, 0))
  rms = lambda y: float(jnp.sqrt(jnp.mean(y ** 2)))
  assert rms(raw[:, -64:, 3]) > 10 * rms(raw[:, :8, 3])  # what the norm has to undo
  out = mixer(x, jnp.arange(length)[None])
  assert 0.5 < rms(out[:, -64:]) / rms(out[:, :8]) < 2


def _ssd_inputs(b=2, length=37, heads=3, p=4, n=5):
  x = _normal(0, (b, length, heads, p))
  B, C = _normal(1, (b, length, n)), _normal(2, (b, length, n))
  dt = jax.nn.softplus(_normal(3, (b, length, heads)) - 1.0)
  A = -jnp.exp(_normal(4, (heads,)))
  return x, dt, A, B, C, _normal(5, (b, heads, p, n))


def test_chunked_ssd_equals_the_recurrence_with_gradients_from_a_state_and_per_document():
  inputs = _ssd_inputs()

  def loss(f):
    return lambda *a: (lambda y, h: (y ** 2).sum() + h.sum())(*f(*a))

  chunked = lambda *a: chunked_ssd(*a, chunk_size=8)
  for g, w in zip(jax.jit(chunked)(*inputs), reference.ssd_recurrence(*inputs)):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  got = jax.jit(jax.grad(loss(chunked), argnums=tuple(range(6))))(*inputs)
  want = jax.jit(jax.grad(loss(reference.ssd_recurrence), argnums=tuple(range(6))))(*inputs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-3, rtol=1e-3)
  x, dt, A, B, C, h0 = inputs
  zeros = jnp.zeros_like(h0[:1])
  packed, _ = chunked_ssd(x, dt, A, B, C, jnp.zeros_like(h0), chunk_size=8, segments=SEGMENTS_37)
  alone = _per_document(lambda x, dt, B, C: reference.ssd_recurrence(x, dt, A, B, C, zeros)[0],
                        SEGMENTS_37, x, dt, B, C)
  np.testing.assert_allclose(packed, alone, atol=1e-4, rtol=1e-4)


def _naive_mamba2_mixer(mixer, u_BxLxD):
  """Mamba-2 with the convolution written out and the SSM one token at a time."""
  b, length, _ = u_BxLxD.shape
  w = mixer.conv_width

  def conv(name, proj):
    padded = jnp.pad(proj(u_BxLxD), [(0, 0), (w - 1, 0), (0, 0)])
    kernel = mixer.conv_kernels[name][...]
    out = sum(kernel[i] * padded[:, i:i + length] for i in range(w))
    return jax.nn.silu(out + mixer.conv_biases[name][...])

  x = conv("x", mixer.x_proj).reshape(b, length, mixer.num_heads, mixer.head_dim)
  dt = jax.nn.softplus(mixer.dt_proj(u_BxLxD) + mixer.dt_bias[...])
  h0 = jnp.zeros((b, mixer.num_heads, mixer.head_dim, mixer.state_size))
  y, _ = reference.ssd_recurrence(x, dt, -jnp.exp(mixer.A_log[...]), conv("B", mixer.B_proj),
                                  conv("C", mixer.C_proj), h0)
  y = (y + mixer.D[...][:, None] * x).reshape(b, length, -1) * jax.nn.silu(mixer.z_proj(u_BxLxD))
  y = y / jnp.sqrt((y ** 2).mean(-1, keepdims=True) + 1e-5) * mixer.norm_scale[...]
  return mixer.out_proj(y)


def test_mamba2_mixer_equals_the_token_by_token_reference_with_gradients():
  _assert_mixer_equals_naive(_mixer("mamba2", position="none"), _naive_mamba2_mixer)


def _recurrence_per_document(recurrence, *inputs_and_state):
  """recurrence(*inputs, state) -> (out, state) on each document of SEGMENTS_37 alone: a row's
  first document from that row's state, the others from 0; the final state is the last
  document's."""
  *inputs, state = inputs_and_state
  outputs, states = [], []
  for row, segment_row in enumerate(np.asarray(SEGMENTS_37)):
    parts, row_state = [], state[row:row + 1]
    for i, segment in enumerate(np.unique(segment_row)):
      out, row_state = recurrence(*(a[row:row + 1, segment_row == segment] for a in inputs),
                                  row_state if i == 0 else jnp.zeros_like(row_state))
      parts.append(out)
    outputs.append(jnp.concatenate(parts, axis=1))
    states.append(row_state)
  return jnp.concatenate(outputs), jnp.concatenate(states)


def _assert_same_outputs_and_input_gradients(fast, naive, inputs, cotangents):
  """fast(*inputs) == naive(*inputs), and so are their pullbacks of `cotangents`."""

  def vjp(f):
    out, pullback = jax.vjp(f, *inputs)
    return out, pullback(cotangents)

  for got, expected in zip(jax.tree.leaves(jax.jit(lambda: vjp(fast))()),
                           jax.tree.leaves(jax.jit(lambda: vjp(naive))()), strict=True):
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_gated_delta_rule_equals_the_recurrence_with_gradients(packed):
  """The WY chunked form against the token-by-token recurrence: outputs, final state and the
  gradients of q, k, v, the log decays, beta and the initial state; length 37 in chunks of 8,
  from a state; packed documents (SEGMENTS_37) each alone."""
  b, length, n, h, e = 2, 37, 2, 4, 6
  inputs = (l2_normalize(_normal(0, (b, length, n, h))) * h ** -0.5,
            l2_normalize(_normal(1, (b, length, n, h))),
            _normal(2, (b, length, n, e)),
            -jax.nn.softplus(_normal(3, (b, length, n), 2.0)),  # decays from ~1 to ~e^-6
            jax.nn.sigmoid(_normal(4, (b, length, n), 2.0)),
            _normal(5, (b, n, h, e)))
  segments = SEGMENTS_37 if packed else None
  naive = (functools.partial(_recurrence_per_document, reference.gated_delta_rule) if packed
           else reference.gated_delta_rule)
  _assert_same_outputs_and_input_gradients(
      lambda *a: chunked_gated_delta_rule(*a, chunk_size=8, segments=segments), naive, inputs,
      (_normal(6, (b, length, n, e)), _normal(7, (b, n, h, e))))


def test_invert_unit_lower_by_doubling():
  for size in (1, 5, 8):  # padded to a power of two, or not
    m = jnp.tril(_normal(size, (3, size, size)), -1) + jnp.eye(size)
    np.testing.assert_allclose(invert_unit_lower(m), np.linalg.inv(np.asarray(m)), atol=1e-4)


def test_chunked_rwkv6_equals_the_recurrence_with_gradients():
  """The chunked form (chunks of 8 in sub-chunks of 4; length 37, so the last chunk is padded)
  against the token-by-token recurrence: outputs, final state and the gradients of r, k, v, the
  log decays, u and the initial state, on packed documents (SEGMENTS_37: resets inside chunks)
  whose first continues the state. Some channels decay by up to ~e^-100 per token, so e^-G
  relative to a chunk's start would overflow float32."""
  b, length, n, h, e = 2, 37, 2, 4, 6
  log_decay = -jnp.exp(_normal(3, (b, length, n, h), 1.5))
  assert float(jnp.cumsum(log_decay[:, :8], axis=1).min()) < -88
  inputs = (_normal(0, (b, length, n, h)), _normal(1, (b, length, n, h)),
            _normal(2, (b, length, n, e)), log_decay, _normal(4, (n, h)),
            _normal(5, (b, n, h, e)))

  def naive(r, k, v, log_decay, bonus, state):
    recurrence = lambda *a: reference.rwkv6_recurrence(*a[:4], bonus, a[4])  # noqa: E731
    return _recurrence_per_document(recurrence, r, k, v, log_decay, state)

  _assert_same_outputs_and_input_gradients(
      lambda *a: chunked_rwkv6(*a, chunk_size=8, sub_chunk_size=4, segments=SEGMENTS_37), naive,
      inputs, (_normal(6, (b, length, n, e)), _normal(7, (b, n, h, e))))


def _naive_rwkv6_mixer(mixer, x_BxLxD):
  """RWKV_Tmix_x060's forward written out, the recurrence one token at a time."""
  b, length, d = x_BxLxD.shape
  n, h = mixer.num_heads, mixer.head_dim
  dx = jnp.pad(x_BxLxD, [(0, 0), (1, 0), (0, 0)])[:, :-1] - x_BxLxD
  down = mixer.mix_down[...].reshape(d, -1)
  lora = jnp.tanh((x_BxLxD + dx * mixer.mix["x"][...]) @ down).reshape(b, length, 5, -1)
  xw, xk, xv, xr, xg = (x_BxLxD + dx * (mixer.mix[name][...] + lora[:, :, i] @ mixer.mix_up[i])
                        for i, name in enumerate("wkvrg"))
  w = mixer.decay[...].reshape(d) + jnp.tanh(xw @ mixer.decay_down[...]) @ mixer.decay_up[
      ...].reshape(-1, d)
  o, _ = reference.rwkv6_recurrence(mixer.receptance(xr), mixer.key(xk), mixer.value(xv),
                                    -jnp.exp(w).reshape(b, length, n, h), mixer.bonus[...],
                                    jnp.zeros((b, n, h, h)))
  o = (o - o.mean(-1, keepdims=True)) / jnp.sqrt(o.var(-1, keepdims=True) + 64e-5)
  o = o * mixer.norm_scale[...] + mixer.norm_bias[...]
  return mixer.out(o * jax.nn.silu(mixer.gate(xg)))


def test_rwkv6_mixer_equals_the_token_by_token_reference():
  """The forward only: the chunked form's gradients are the test above's."""
  mixer = _mixer("rwkv6", position="none", rwkv6=dict(mix_lora_rank=4, decay_lora_rank=8))
  # The low-rank maps start at 0 (the reference's initialisation): give them values.
  mixer.mix_down[...] = _normal(10, mixer.mix_down.shape, 0.3)
  mixer.decay_down[...] = _normal(11, mixer.decay_down.shape, 0.3)
  x = _normal(0, (2, 21, 32))
  got = jax.jit(lambda x: mixer(x, None))(x)
  np.testing.assert_allclose(got, jax.jit(functools.partial(_naive_rwkv6_mixer, mixer))(x),
                             atol=1e-4, rtol=1e-4)
