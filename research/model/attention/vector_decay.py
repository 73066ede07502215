"""Linear attention whose state decays per key channel, in one chunked form: RWKV-6 and GLA.

Per head, a matrix state S [H, E] (keys x values) with a data-dependent decay w_t in (0, 1]^H:
  S_t = diag(w_t) S_{t-1} + k_t v_t^T
  RWKV-6 (bonus u):  o_t = q_t^T (S_{t-1} + diag(u) k_t v_t^T)     (arXiv:2404.05892)
  GLA (no bonus):    o_t = q_t^T S_t                                 (arXiv:2312.06635)
Within a chunk of C tokens, with G_t = sum_{m <= t} log w_m the inclusive cumulative log decay
since the chunk's start, Q_t the query's exponent (P_t = G_{t-1} for RWKV-6, G_t for GLA) and
S_0 the state there:
  o_t = (q_t e^{Q_t}) S_0 + sum_{s in pairs(t)} (sum_c q_tc k_sc e^{Q_tc - G_sc}) v_s
        [+ (q_t u k_t) v_t for RWKV-6]
  S_C = e^{G_C} S_0 + sum_s (k_s e^{G_C - G_s})^T v_s
with pairs(t) = s < t for RWKV-6 and s <= t for GLA. Only the last line is sequential: a scan
over chunks carries S. Numerical safety: every exponent is <= 0, so nothing overflows however
strong the decay (RWKV-6's w_t = exp(-exp(.)) reaches e^-1000 and below); products too small for
float32 underflow to 0, as their exact values would. The pairs (t, s) are never factored as
e^{Q_t} e^{-G_s} relative to the chunk's start (e^{-G_s} overflows once the decay within a chunk
passes e^-88). Instead, as flash-linear-attention's chunk_rwkv6 and chunk_gla (secondary
chunking), the chunk is cut into sub-chunks of c tokens: for s in an earlier sub-chunk than t,
e^{Q_t - G_s} = e^{Q_t - R} e^{R - G_s} with R = G just before t's sub-chunk (both factors
<= 1), so those scores are one matmul per sub-chunk against the chunk's keys; within a sub-chunk
each pair's factor is computed on its own ([c, c, H] per sub-chunk). Memory is
O(L c H + L C / c H) per head, never [L, L]. Precision: a factor's exponent is a difference of
two cumulative sums within one chunk, exact to float32 rounding of their size (about 6e-8 |G|:
3e-5 at a cumulative log decay of -500 within a chunk).

Packed documents: the state restarts at each segment start (the scores keep to the segment, the
carried state reaches only its own segment's tokens); a state passed in belongs to the first
token's segment.
"""

import jax
import jax.numpy as jnp

from research.model.attention import chunked
from research.model.attention import masks


def head_chunk_segments(segments_BxL, batch, padded, chunk):
  """masks.all_chunk_segments of `segments_BxL` (None: one document per row) with a heads axis
  after the chunk axis, for the [B, Z, N, C, F] layout of the per-channel decay forms (this one
  and kda's): same [B, Z, 1, C, C], sees_state and adds [B, Z, 1, C, 1], keeps_state
  [B, Z, 1, 1]."""
  same, sees_state, keeps_state, adds = masks.all_chunk_segments(segments_BxL, padded, chunk,
                                                                 batch)
  return (same[:, :, None], sees_state[:, :, None, :, None], keeps_state[:, :, None, None],
          adds[:, :, None, :, None])


def sub_chunk_length(chunk, sub_chunk_size):
  """The largest divisor of `chunk` that is at most sub_chunk_size."""
  return max(c for c in range(1, min(chunk, sub_chunk_size) + 1) if chunk % c == 0)


def chunked_vector_decay(q, k, v, log_decay, state, *, bonus=None, chunk_size=32,
                         sub_chunk_size=8, segments=None):
  """The recurrence of the module docstring in the chunked form, from `state`: RWKV-6's with
  `bonus` u [N, H], GLA's (the current token inside the state) without.

  q, k, log_decay (log w <= 0) [B, L, N, H], v [B, L, N, E], state [B, N, H, E]; segments
  [B, L] (packed documents, non-decreasing) restart the state at each segment start. Chunks of
  min(chunk_size, L) tokens, cut into sub-chunks of the largest divisor of that which is at most
  sub_chunk_size. Returns (o [B, L, N, E], final state), float32.
  """
  b, length, n, h = q.shape
  chunk = min(chunk_size, length)
  sub = sub_chunk_length(chunk, sub_chunk_size)
  num_sub = chunk // sub
  num_chunks = chunked.num_chunks(length, chunk)
  padded = num_chunks * chunk

  def to_sub_chunks(x):  # [..., C, F] -> [..., P, c, F] for P sub-chunks of c tokens
    return chunked.split_chunks(x, sub, axis=-2)

  # [B, L, N, F] -> [B, Z, N, C, F] for Z chunks of C tokens. Zero padding (log w = 0, k = 0)
  # leaves the state as it is.
  q, k, v, log_decay = (jnp.moveaxis(chunked.split_chunks(x.astype(jnp.float32), chunk), 2, 3)
                        for x in (q, k, v, log_decay))
  same, sees_state, keeps_state, adds = head_chunk_segments(segments, b, padded, chunk)

  inclusive = jnp.cumsum(log_decay, axis=-2)  # G [B, Z, N, C, H]
  exclusive = jnp.pad(inclusive[..., :-1, :], [(0, 0)] * 3 + [(1, 0), (0, 0)])  # G_{t-1}
  query_exponent = exclusive if bonus is not None else inclusive  # Q_t

  # s in an earlier sub-chunk than t: through R, G just before t's sub-chunk.
  reference_BxZxNxPxH = exclusive[..., ::sub, :]
  q_from_reference = to_sub_chunks(q) * jnp.exp(
      to_sub_chunks(query_exponent) - reference_BxZxNxPxH[..., None, :])
  earlier_PxC = jnp.arange(chunk)[None, :] < sub * jnp.arange(num_sub)[:, None]
  k_to_reference = k[..., None, :, :] * jnp.exp(jnp.where(
      earlier_PxC[..., None], reference_BxZxNxPxH[..., None, :] - inclusive[..., None, :, :],
      -jnp.inf))  # [B, Z, N, P, C, H]
  across = jnp.einsum("bznpih,bznpsh->bznpis", q_from_reference, k_to_reference)
  # s and t in one sub-chunk: each pair's factor; on the diagonal u (RWKV-6) or 1 (GLA).
  row, column = jnp.arange(sub)[:, None], jnp.arange(sub)[None, :]
  pairs = column < row if bonus is not None else column <= row
  pair_exponents = (to_sub_chunks(query_exponent)[..., :, None, :]
                    - to_sub_chunks(inclusive)[..., None, :, :])
  pair_factors = jnp.exp(jnp.where(pairs[..., None], pair_exponents, -jnp.inf))
  if bonus is not None:
    pair_factors = pair_factors + jnp.eye(sub)[..., None] * bonus[:, None, None, None, :]
  within = jnp.einsum("bznpih,bznpish,bznpsh->bznpis", to_sub_chunks(q), pair_factors,
                      to_sub_chunks(k))  # [B, Z, N, P, c, c]
  within = jnp.einsum("bznpis,pq->bznpiqs", within, jnp.eye(num_sub)).reshape(
      b, num_chunks, n, chunk, chunk)
  scores = jnp.where(same, across.reshape(b, num_chunks, n, chunk, chunk) + within, 0.0)

  from_start = jnp.exp(query_exponent) * sees_state
  to_end = jnp.exp(inclusive[..., -1:, :] - inclusive) * adds
  chunk_decay_BxZxNxH = jnp.exp(inclusive[..., -1, :]) * keeps_state
  chunk_kv = jnp.einsum("bznch,bznce->bznhe", k * to_end, v)

  def step(state_BxNxHxE, decay_and_kv):
    decay_BxNxH, kv_BxNxHxE = decay_and_kv
    return decay_BxNxH[..., None] * state_BxNxHxE + kv_BxNxHxE, state_BxNxHxE

  to_scan = lambda x: jnp.moveaxis(x, 1, 0)
  state, starts = jax.lax.scan(step, state.astype(jnp.float32),
                               (to_scan(chunk_decay_BxZxNxH), to_scan(chunk_kv)))
  out = (jnp.einsum("bznch,bznhe->bznce", q * from_start, jnp.moveaxis(starts, 0, 1))
         + jnp.einsum("bzncs,bznse->bznce", scores, v))
  return chunked.merge_chunks(jnp.moveaxis(out, 3, 2), length), state
