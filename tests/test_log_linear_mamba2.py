"""Log-linear Mamba-2 (research/model/attention/log_linear_mamba2.py) against references written
from the authors' code (flash-linear-attention@bc3b101): fla/ops/log_linear_attn/naive.py's
matrix form (construct_level_mask, naive_log_linear_attn), a token-by-token fp32 recurrence of
the same sums over Fenwick-tree states, and fla/layers/log_linear_mamba2.py's forward pass:
outputs and gradients w.r.t. every input and parameter. The conformance suite covers causality,
decode in pieces, packed documents (also decoded) and sharding as for every mixer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model.attention import log_linear_mamba2 as llm
from tests.test_kernels import (SEGMENTS_37, _assert_mixer_equals_naive,
                                _assert_same_outputs_and_input_gradients, _mixer, _normal,
                                _recurrence_per_document)


def _fla_level_mask(level, length):
  """fla's construct_level_mask as a 0/1 [T, T] matrix (query i, key j): the diagonal at level 0;
  at level l >= 1 the keys j with i % 2^l >= 2^(l-1) and
  i - i % 2^(l-1) - 2^(l-1) <= j < i - i % 2^(l-1)."""
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  if level == 0:
    return (i == j).astype(np.float32)
  half = 1 << (level - 1)
  floor = i - i % half
  return ((i % (1 << level) >= half) & (j + half >= floor) & (j < floor)).astype(np.float32)


def _fla_naive(q, k, v, g, level_scales):
  """fla's naive_log_linear_attn for one document from position 0: H = sum_l exp(segsum(g))
  * mask_l * lambda[query, l] over levels 0..ceil(log2 T), o = (H * (q k^T)) v; q, k [b, T, N]
  (shared by the heads), v [b, T, H, P], g [b, T, H], level_scales [b, T, H, M]. Levels >= M
  weigh 0 (fla's chunk kernel; its naive form needs M > ceil(log2 T))."""
  length = q.shape[1]
  cum = jnp.cumsum(g, axis=1)  # [b, T, H]
  tril = np.tril(np.ones((length, length), bool))
  decay = jnp.exp(jnp.where(tril[None, :, :, None], cum[:, :, None] - cum[:, None], -jnp.inf))
  weights = jnp.zeros_like(decay)  # [b, i, j, H]
  for lev in range(int(np.ceil(np.log2(length))) + 1):
    if lev < level_scales.shape[-1]:
      weights += _fla_level_mask(lev, length)[None, :, :, None] * level_scales[:, :, None, :, lev]
  scores = decay * weights * jnp.einsum("bin,bjn->bij", q, k)[..., None]
  return jnp.einsum("bijh,bjhp->bihp", scores, v)


def _recurrence(q, k, v, g, level_scales, states, positions):
  """One token at a time over the Fenwick states of levels 1..M-1 (levels >= M weigh 0): decay,
  read y_t = lambda^0 (q_t . k_t) v_t + sum_l lambda^l S^(l) q_t, then move to p_t + 1: levels up
  to m = 1 + (trailing ones of p_t) and the new key merge into level m. states [b, V0, H, P, N]
  relative to the first position; returns (y, the states after the last token, V0 levels)."""
  b, length, heads, p = v.shape
  n, m = q.shape[-1], level_scales.shape[-1]
  given, top = states.shape[1], m - 1
  kept = min(given, top)
  s = jnp.zeros((b, top, heads, p, n)).at[:, :kept].set(states[:, :kept])
  levels = jnp.arange(1, top + 1)

  def step(s, inputs):
    q_t, k_t, v_t, g_t, lam_t, p_t = inputs
    s = jnp.exp(g_t)[:, None, :, None, None] * s
    y = (lam_t[..., 0, None] * jnp.sum(q_t * k_t, -1)[:, None, None] * v_t
         + jnp.einsum("bhl,blhpn,bn->bhp", lam_t[..., 1:], s, q_t))
    lowest = (p_t + 1) & -(p_t + 1)  # 2^(m - 1)
    m_t = jnp.round(jnp.log2(lowest.astype(jnp.float32))).astype(jnp.int32) + 1
    merged = (jnp.einsum("bl,blhpn->bhpn", (levels <= m_t[:, None]).astype(jnp.float32), s)
              + jnp.einsum("bhp,bn->bhpn", v_t, k_t))
    keep = (levels > m_t[:, None])[..., None, None, None]
    at_m = (levels == m_t[:, None])[..., None, None, None]
    return jnp.where(keep, s, 0.0) + at_m * merged[:, None], y

  s, y = jax.lax.scan(step, s, tuple(t.swapaxes(0, 1) for t in
                                     (q, k, v, g, level_scales, positions)))
  final = jnp.zeros_like(states).at[:, :kept].set(s[:, :kept])
  return y.swapaxes(0, 1), final


def _op_inputs(b=2, length=37, heads=2, p=3, n=4, m=8):
  q, k = _normal(0, (b, length, n)), _normal(1, (b, length, n))
  v = _normal(2, (b, length, heads, p))
  g = -jax.nn.softplus(_normal(3, (b, length, heads)) - 1.0)  # decays ~e^-0.05 .. e^-3
  level_scales = jax.nn.softplus(_normal(4, (b, length, heads, m)))
  return q, k, v, g, level_scales


def test_fla_level_masks_are_the_xor_levels_and_partition_the_prefix():
  """construct_level_mask at levels 0..7 over 128 positions: key j is at exactly one level for
  each query i >= j, bit_length(i XOR j) (0 on the diagonal), and at none for j > i."""
  length = 128
  masks = np.stack([_fla_level_mask(lev, length) for lev in range(8)])
  np.testing.assert_array_equal(masks.sum(0), np.tril(np.ones((length, length))))
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  levels = np.asarray(llm.level(jnp.asarray(i), jnp.asarray(j)))
  np.testing.assert_array_equal(np.argmax(masks, 0)[i >= j], levels[i >= j])


def test_recurrence_equals_fla_naive_matrix_form():
  """The token-by-token recurrence from position 0 and zero states == fla's naive form, with
  every level used (37 tokens: levels 0..6 of M = 8) and with M = 4 (levels 4..6 weigh 0)."""
  q, k, v, g, level_scales = _op_inputs()
  for m in (8, 4):
    lam = level_scales[..., :m]
    states = jnp.zeros((2, m - 1, 2, 3, 4))
    positions = jnp.broadcast_to(jnp.arange(37), (2, 37))
    y, _ = jax.jit(_recurrence)(q, k, v, g, lam, states, positions)
    np.testing.assert_allclose(y, _fla_naive(q, k, v, g, lam), atol=1e-5, rtol=1e-5)


def _document_positions(segments_BxL, start_B):
  """Positions within each document, the first document of each row going on from start_B."""
  segments = np.asarray(segments_BxL)
  index = np.arange(segments.shape[1])
  positions = []
  for row, start in zip(segments, start_B):
    first = np.array([np.argmax(row == s) for s in row])
    positions.append(np.where(row == row[0], start + index, index - first))
  return jnp.asarray(np.stack(positions), jnp.int32)


def _fenwick_states(start_B, levels, heads=2, p=3, n=4):
  """Random states of the levels 1..`levels` that a prefix of start_B tokens fills: those of the
  set bits of start_B."""
  bits = (np.asarray(start_B)[:, None] >> np.arange(levels)) & 1
  return _normal(5, (len(start_B), levels, heads, p, n)) * bits[:, :, None, None, None]


@pytest.mark.parametrize("num_levels,packed,chunk_size", [(8, True, 8), (5, False, 6)])
def test_chunked_equals_the_recurrence_with_gradients(num_levels, packed, chunk_size):
  """The chunked form == the recurrence, outputs, final states and the gradients of q, k, v, the
  log decays, lambda and the initial states: 37 tokens in chunks of 8 or 6 (neither divides
  it), from states at positions 5 and 13 (chunks unaligned to the levels); packed documents
  (SEGMENTS_37) each alone; with M = 5 positions reach 49, past 2^(M-1) = 16, so keys of levels
  5 and 6 are dropped (weight 0)."""
  start = np.array([5, 13])
  q, k, v, g, level_scales = _op_inputs(m=num_levels)
  states = _fenwick_states(start, 6)
  segments = SEGMENTS_37 if packed else None
  positions = _document_positions(SEGMENTS_37 if packed else np.zeros((2, 37), np.int32), start)
  assert int(positions.max()) == (33 if packed else 49)

  def naive(*inputs):
    if not packed:
      return _recurrence(*inputs, positions)
    *arrays, state = inputs
    return _recurrence_per_document(lambda *a: _recurrence(*a[:5], a[6], a[5]),
                                    *arrays, positions, state)

  _assert_same_outputs_and_input_gradients(
      lambda *a: llm.chunked_log_linear(*a, positions, chunk_size=chunk_size, segments=segments),
      naive, (q, k, v, g, level_scales, states),
      (_normal(6, v.shape), _normal(7, states.shape)))


def test_chunked_form_in_pieces_equals_one_pass():
  """Running 37 tokens as pieces of 13, 1 and 23 (each from the previous one's states, at the
  positions that follow) gives one pass's outputs and states: a call may start anywhere."""
  q, k, v, g, level_scales = _op_inputs()
  positions = jnp.broadcast_to(jnp.arange(37), (2, 37))
  states = jnp.zeros((2, 6, 2, 3, 4))
  run = functools.partial(llm.chunked_log_linear, chunk_size=4)
  whole, final = run(q, k, v, g, level_scales, states, positions)
  pieces, s = [], states
  for lo, hi in ((0, 13), (13, 14), (14, 37)):
    y, s = run(*(t[:, lo:hi] for t in (q, k, v, g, level_scales)), s, positions[:, lo:hi])
    pieces.append(y)
  np.testing.assert_allclose(jnp.concatenate(pieces, 1), whole, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(s, final, atol=1e-5, rtol=1e-5)


def _naive_log_linear_mamba2(mixer, u_BxLxD):
  """fla's LogLinearMamba2 forward: the projections, the convolution written out with SiLU,
  dt = softplus(dt + dt_bias), A = -exp(A_log), lambda = softplus(L * dl), fla's naive
  log-linear attention with q = C, k = B, v = x dt, g = A dt; + D x; RMSNorm(y * silu(z))."""
  b, length, _ = u_BxLxD.shape
  w = mixer.conv_width

  def conv(name, proj):
    padded = jnp.pad(proj(u_BxLxD), [(0, 0), (w - 1, 0), (0, 0)])
    kernel = mixer.conv_kernels[name][...]
    return jax.nn.silu(sum(kernel[i] * padded[:, i:i + length] for i in range(w))
                       + mixer.conv_biases[name][...])

  x = conv("x", mixer.x_proj).reshape(b, length, mixer.num_heads, mixer.head_dim)
  dt = jax.nn.softplus(mixer.dt_proj(u_BxLxD) + mixer.dt_bias[...])
  lam = jax.nn.softplus(mixer.L[...] * mixer.level_proj(u_BxLxD))
  y = _fla_naive(conv("C", mixer.C_proj), conv("B", mixer.B_proj), x * dt[..., None],
                 -jnp.exp(mixer.A_log[...]) * dt, lam)
  y = (y + mixer.D[...][:, None] * x).reshape(b, length, -1) * jax.nn.silu(mixer.z_proj(u_BxLxD))
  y = y / jnp.sqrt((y ** 2).mean(-1, keepdims=True) + 1e-5) * mixer.norm_scale[...]
  return mixer.out_proj(y)


def test_mixer_equals_fla_s_layer_with_gradients():
  """The mixer (chunks of 4 over 21 tokens: levels 0..5 inside and across chunks) == fla's
  layer with its naive op, outputs and gradients w.r.t. the input and every parameter; L and D
  are given values off their init of 1 so that their gradients are told apart."""
  mixer = _mixer("log_linear_mamba2", position="none", log_linear_mamba2=dict(chunk_size=4))
  mixer.L[...] = 1.0 + 0.5 * _normal(10, mixer.L.shape)
  mixer.D[...] = 1.0 + 0.5 * _normal(11, mixer.D.shape)
  _assert_mixer_equals_naive(mixer, _naive_log_linear_mamba2)


def test_defaults_and_init_are_fla_s_and_the_cache_grows_with_log_context():
  """fla's defaults (state 128, head dim 64, expand 2, conv 4, chunk 64, 15 levels) and init:
  A_log = log(1..heads), L = 1, D = 1, softplus(dt_bias) in [1e-3, 1e-1], conv biases 0. The
  cache holds bit_length(max_length - 1) states up to 14 (levels of 16384 tokens), so its bytes
  grow with the log of the context and stop growing there; none grow per token."""
  cls = llm.LogLinearMamba2
  assert cls.hyperparameters == {"state_size": 128, "head_dim": 64, "expand": 2,
                                 "conv_width": 4, "chunk_size": 64, "num_levels": 15}
  mixer = _mixer("log_linear_mamba2", position="none")
  h = mixer.num_heads
  np.testing.assert_allclose(mixer.A_log[...], np.log(np.arange(1, h + 1)), rtol=1e-6)
  np.testing.assert_array_equal(mixer.L[...], np.ones((h, 15)))
  np.testing.assert_array_equal(mixer.D[...], np.ones(h))
  dt = np.asarray(jax.nn.softplus(mixer.dt_bias[...]))
  assert ((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-1 * (1 + 1e-5))).all()
  assert all(float(jnp.abs(bias[...]).max()) == 0 for bias in mixer.conv_biases.values())
  assert mixer.level_proj.kernel.shape == (32, h, 15)
  assert [mixer.cache_levels(n) for n in (0, 1, 2, 19, 16384, 16385, 10 ** 6)] == [
      0, 0, 1, 5, 14, 14, 14]
  per_state = 4 * h * mixer.head_dim * mixer.state_size
  grown = mixer.cache_bytes(1, 1024) - mixer.cache_bytes(1, 512)
  assert grown == per_state  # one more level per doubling
  assert mixer.cache_bytes(1, 2 ** 20) == mixer.cache_bytes(1, 16384)
  assert cls.cache_bytes_per_token(None) is None and cls.recurrent
