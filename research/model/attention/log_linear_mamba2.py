"""Log-linear Mamba-2: Mamba-2 with log-linear attention (Guo et al., arXiv:2506.04761).

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/log_linear_mamba2.py
(LogLinearMamba2, hmamba_chunk_scan_combined), fla/ops/log_linear_attn/naive.py
(naive_log_linear_attn, construct_level_mask) and chunk.py (chunk_log_linear_attn), with the
defaults of fla/models/log_linear_mamba2/configuration_log_linear_mamba2.py (Mamba2Config's).

The layer is Mamba-2's (research/model/attention/mamba2.py) with one more projection:
  z, x, B, C, dt, dl = in_proj(u)               (x: [heads, head_dim P]; B, C: [N]; dl: [heads, M])
  x, B, C = silu(causal_depthwise_conv(x, B, C))   (width 4, one kernel per channel, a bias)
  dt = softplus(dt + dt_bias),  A = -exp(A_log),  a_t = dt_t A      (one log decay per head)
  lambda_t^l = softplus(L[h, l] * dl_t[h, l])    (a weight per token, head and level l < M)
  y_t = sum_{s <= t} lambda_t^{level(t, s)} exp(a_{s+1} + ... + a_t) (C_t . B_s) dt_s x_s + D x_t
  out = out_proj(RMSNorm(y * silu(z)))           (gated RMSNorm over the inner width, eps 1e-5)
Mamba-2 is the case lambda = 1. The level of key s for query t (positions p within the document,
from 0) is 0 for s = t and otherwise bit_length(p_t XOR p_s) >= 1: one plus the highest bit in
which the two positions differ. For a query at p, the keys of level l >= 1 are the 2^(l-1)
positions just below p' = p with its low l - 1 bits cleared, [p' - 2^(l-1), p'), present where
bit l - 1 of p is set: the Fenwick-tree partition of the prefix [0, p) into O(log p) blocks, the
nearest the smallest (fla's construct_level_mask writes the same sets with modular arithmetic;
the tests check that the two agree). So, per head,
  y_t = sum_l lambda_t^l S_t^(l) C_t + D x_t,
  S_t^(l) = sum_{s: level(t, s) = l} exp(a_{s+1} + ... + a_t) (dt x)_s B_s^T      ([P, N]),
one state per set bit of p_t, each a Mamba-2 state [P, N] over its block. M = num_levels
(fla's 15, from its MAX_SEQUENCE_LENGTH 16384) weights per token; keys at a level >= M get
weight 0, as in fla's chunk kernel (its naive form would index past L).

The recurrence (the decode state). With S^(l) the states of the keys before position p, at the
levels they have for a query at p (bit_length(p XOR p_s)), stepping over token t at position p:
  S^(l) <- exp(a_t) S^(l);  y_t = lambda^0 (C_t . B_t) dt x_t + sum_{l>=1} lambda^l S^(l) C_t
then the keys move on to p + 1: with m = bit_length((p + 1) XOR p), every state of level < m
and the new key merge into level m and the levels above keep theirs (the Fenwick carry). In
general, keys at level l relative to p have level max(l, bit_length(p' XOR p)) relative to any
p' > p: the merge of a whole chunk is that map, a 0/1 matrix over the levels.

The chunked form (pure JAX, no alignment needed): chunks of C tokens from the call's first
token, any C; levels come from the positions, so a call may start at any position (decode), and
packed documents each count from 0.
  intra-chunk:  y_i = sum_{j <= i, one segment} lambda_i^{level(i, j)} exp(cum_i - cum_j)
                (C_i . B_j) dt_j x_j       (a [C, C] matmul per chunk and head; the level mask
                is gathered from lambda by a one-hot over the M levels)
  from state:   y_i += exp(cum_i) sum_{l >= 1} lambda_i^{max(l, m_i)} S_z^(l) C_i,
                m_i = bit_length(p_i XOR p_z)       (S_z: the states entering chunk z, at p_z)
  next states:  S_{z+1}^(l) = exp(cum_C) sum_{l'} [l == max(l', m_z)] S_z^(l')
                              + sum_j [level(p_{z+1}, p_j) = l] exp(cum_C - cum_j) (dt x)_j B_j^T
with m_z = bit_length(p_{z+1} XOR p_z); only the last line is sequential (a scan over chunks of
the [V, H, P, N] states). Time O(T C (N + M + P) + T V P N) per head, V = O(log T) state
levels; memory O(T C) plus V states per chunk. fla's kernel adds each (aligned) chunk's keys at
one level; here they are spread over the levels by a one-hot, which doubles the state work.
Packed documents: a segment start restarts the states (they reach only their segment's tokens,
as in mamba2.chunked_ssd) and the convolution windows; each document's positions start at 0
(fla's chunk kernel with cu_seqlens does the same).

The decode cache: the three convolution windows and the states [B, V, H, P, N] (float32) of
levels 1..V, V = min(num_levels - 1, bit_length(max_length - 1)): levels above V never occur
below max_length (keys of higher levels are dropped if decoding goes past max_length). So the
cache grows with the logarithm of the context, V * H * P * N * 4 bytes per row and layer plus
the windows; from 2^(num_levels - 1) = 16384 tokens on it stays at num_levels - 1 = 14 states,
since higher levels have weight 0. `cache_bytes_per_token` is None (it does not grow linearly);
`cache_bytes` reads the size off init_cache at each context. Decoding runs the chunked form on
any number of new tokens from the cache, at the positions base.decode_positions gives.

Deliberate differences from fla:
* fla's decode state (LogLinearAttentionState) holds chunk-level states (kv_0.. in its kernel:
  levels above its fixed 64-token chunk) plus the raw q, k, v, g and lambda of the last partial
  chunk and the offset; here the states are per level at token granularity (the same outputs),
  so chunks need no alignment, any chunk size works, and the cache holds no tokens. fla's layer
  decodes one token per call; here any number.
* Positions are the token indices within each document, computed from the segment ids (the
  positions passed to __call__ are not used: order comes from the recurrence); fla's layer has
  no packed documents (seq_idx raises), its op counts each cu_seqlens sequence from 0, as here.
* Projections (fla's in_proj split into z, x, B, C, dt and dl projections, a permutation of the
  same weights, no biases as fla's use_bias=False) and convolution kernels are initialised as
  the lab's Mamba-2 (LeCun normal), not fla's normal(0.02) (nor its rescaling of out_proj by
  depth, rescale_prenorm_residual); A_log = log(1..heads), D = 1,
  L = 1, dt_bias = softplus^-1(dt0) with dt0 ~ logU[1e-3, 1e-1] floored at 1e-4, conv biases 0
  are fla's (LogLinearMamba2PreTrainedModel._init_weights). No weight decay on A_log, dt_bias,
  D, L and the norm's scale (fla's _no_weight_decay).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import mamba2
from research.model.attention import masks
from research.model.attention import modules

HIGHEST = jax.lax.Precision.HIGHEST


def bit_length(x):
  """The number of bits of non-negative int32 x (0 for 0), elementwise."""
  return 32 - jax.lax.clz(x.astype(jnp.int32))


def level(query_position, key_position):
  """The level of a key at key_position for a query at query_position (same document, key not
  after the query): 0 for the token itself, else bit_length(p_query XOR p_key)."""
  return bit_length(jnp.bitwise_xor(query_position, key_position))


def state_levels(num_levels, given_levels, length):
  """State levels the chunked form carries: those of the cache (given_levels), or enough for
  positions below `length` (a call from an empty cache), at most num_levels - 1 (higher levels
  have weight 0)."""
  return min(num_levels - 1, max(given_levels, (length - 1).bit_length()))


def _one_hot(index, size):
  return (index[..., None] == jnp.arange(size)).astype(jnp.float32)


def chunked_log_linear(q, k, v, log_decay, level_scales, states, positions, *, chunk_size=64,
                       segments=None):
  """Log-linear attention with a scalar decay per head (the module docstring), in chunks.

  q, k [b, L, N] (Mamba-2's C and B, shared by the heads); v [b, L, H, P] (dt x); log_decay
  [b, L, H] (a = dt A <= 0); level_scales [b, L, H, M] (lambda, levels 0..M-1); states
  [b, V0, H, P, N], the states of levels 1..V0 of the keys before the first token, relative to
  its position; positions [b, L] int (within each document, consecutive in a document); segments
  [b, L] (packed documents, non-decreasing) restart the states at each segment start (the states
  passed in belong to the first token's segment). Levels up to state_levels(M, V0, L) are
  carried: positions must stay below 2^that (or keys of higher levels are dropped).
  Returns (y [b, L, H, P], the states after the last token, relative to its position + 1,
  [b, V0, H, P, N]), float32.
  """
  b, length, heads, p = v.shape
  m = level_scales.shape[-1]
  given = states.shape[1]
  levels = state_levels(m, given, length)
  chunk = min(chunk_size, length)
  num_chunks = chunked.num_chunks(length, chunk)
  padded = num_chunks * chunk
  same_BxZxCxC, sees_BxZxC, keeps_BxZ, adds_BxZxC = masks.all_chunk_segments(
      segments, padded, chunk, b)

  split = lambda t: chunked.split_chunks(t.astype(jnp.float32), chunk)  # zero padding: no-ops
  q_BxZxCxN, k_BxZxCxN = split(q), split(k)
  v_BxZxHxCxP = split(v).swapaxes(2, 3)
  lambda_BxZxCxHxM = split(level_scales)
  # Padding repeats the last position, so a chunk's next position is its last real one + 1.
  pos_BxZxC = chunked.split_chunks(positions.astype(jnp.int32), chunk, mode="edge")
  # The cumulative log decay within each chunk, as a matmul with a triangular matrix (as
  # mamba2.chunked_ssd: XLA:CPU's cumsum is slow), in full float32 precision.
  inclusive_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.float32))
  cum_BxZxHxC = jnp.einsum("bzch,lc->bzhl", split(log_decay), inclusive_CxC, precision=HIGHEST)

  # Within each chunk: the [C, C] scores, weighted by lambda of the query at the pair's level.
  level_BxZxCxC = level(pos_BxZxC[..., :, None], pos_BxZxC[..., None, :])
  weight_BxZxHxCxC = jnp.einsum("bzihm,bzijm->bzhij", lambda_BxZxCxHxM,
                                _one_hot(level_BxZxCxC, m))
  # exp only of the pairs kept (the others at 0 before and after it): a masked pair's
  # cum_i - cum_j is >= 0 and overflows exp under strong decays, and where(kept, exp(x), 0)
  # would pass 0 * inf to the backward pass.
  kept = same_BxZxCxC[:, :, None]
  exponent = jnp.where(kept, cum_BxZxHxC[..., :, None] - cum_BxZxHxC[..., None, :], 0.0)
  decay_BxZxHxCxC = jnp.where(kept, jnp.exp(exponent), 0.0)
  qk_BxZxCxC = jnp.einsum("bzin,bzjn->bzij", q_BxZxCxN, k_BxZxCxN)
  scores = qk_BxZxCxC[:, :, None] * decay_BxZxHxCxC * weight_BxZxHxCxC
  y_BxZxHxCxP = jnp.einsum("bzhij,bzhjp->bzhip", scores, v_BxZxHxCxP)

  # What each chunk hands on: its keys (of its last segment) at their levels relative to the
  # next chunk's first position, and the merge of the states it received.
  levels_V = jnp.arange(1, levels + 1)
  first_BxZ, next_BxZ = pos_BxZxC[..., 0], pos_BxZxC[..., -1] + 1
  crossed_BxZ = level(next_BxZ, first_BxZ)
  merge_BxZxVxV = (levels_V[:, None] == jnp.maximum(levels_V[None, :],
                                                    crossed_BxZ[..., None, None]))
  key_onehot_BxZxCxV = (_one_hot(level(next_BxZ[..., None], pos_BxZxC) - 1, levels)
                        * adds_BxZxC[..., None])
  to_end_BxZxHxC = jnp.exp(cum_BxZxHxC[..., -1:] - cum_BxZxHxC)
  keys_BxZxCxVxN = key_onehot_BxZxCxV[..., None] * k_BxZxCxN[..., None, :]
  added_BxZxVxHxPxN = jnp.einsum("bzhcp,bzcvn->bzvhpn",
                                 v_BxZxHxCxP * to_end_BxZxHxC[..., None], keys_BxZxCxVxN)
  chunk_decay_BxZxH = jnp.exp(cum_BxZxHxC[..., -1]) * keeps_BxZ[..., None]

  def step(states_BxVxHxPxN, inputs):
    merge_BxVxV, decay_BxH, added_BxVxHxPxN = inputs
    merged = jnp.einsum("bvw,bwhpn->bvhpn", merge_BxVxV.astype(jnp.float32), states_BxVxHxPxN)
    return decay_BxH[:, None, :, None, None] * merged + added_BxVxHxPxN, states_BxVxHxPxN

  h0 = jnp.pad(states.astype(jnp.float32)[:, :levels],
               [(0, 0), (0, levels - min(given, levels))] + [(0, 0)] * 3)
  final, entering = jax.lax.scan(step, h0, tuple(
      jnp.moveaxis(t, 1, 0) for t in (merge_BxZxVxV, chunk_decay_BxZxH, added_BxZxVxHxPxN)))
  entering_BxZxVxHxPxN = jnp.moveaxis(entering, 0, 1)

  # From the states entering each chunk: a key of level l there has level max(l, m_i) for
  # query i, m_i = bit_length(p_i XOR p_first).
  reach_BxZxC = level(pos_BxZxC, first_BxZ[..., None])
  read_BxZxCxV = jnp.maximum(levels_V, reach_BxZxC[..., None])
  read_weight = jnp.einsum("bzchm,bzcvm->bzhcv", lambda_BxZxCxHxM, _one_hot(read_BxZxCxV, m))
  read_weight *= (jnp.exp(cum_BxZxHxC) * sees_BxZxC[:, :, None])[..., None]
  read_BxZxHxCxVxP = jnp.einsum("bzcn,bzvhpn->bzhcvp", q_BxZxCxN, entering_BxZxVxHxPxN)
  y_BxZxHxCxP += jnp.einsum("bzhcv,bzhcvp->bzhcp", read_weight, read_BxZxHxCxVxP)

  y = chunked.merge_chunks(y_BxZxHxCxP.swapaxes(2, 3), length)
  final = jnp.pad(final[:, :given], [(0, 0), (0, given - min(given, levels))] + [(0, 0)] * 3)
  return y, final


class LogLinearMamba2(chunked.ChunkedRecurrentMixer):
  """The layer (module docstring). Its `_mix` also takes the tokens' positions, which decide the
  levels, so `__call__` (positions from the segment ids) and `decode` (base.decode_positions)
  are its own; a document start restarts the cache with zeros of the cache's own levels (the
  number of levels depends on init_cache's max_length)."""

  hyperparameters = {"state_size": 128, "head_dim": 64, "expand": 2, "conv_width": 4,
                     "chunk_size": 64,
                     "num_levels": 15}  # lambda's levels 0..14: fla's, for 16384 tokens
  test_settings = {"chunk_size": 8, "state_size": 8, "head_dim": 16}

  @classmethod
  def validate(cls, settings, model_config):
    mamba2.check_settings("log_linear_mamba2", settings, model_config, cls.hyperparameters)
    if settings.num_levels > 31:
      raise ValueError(f"model.log_linear_mamba2.num_levels={settings.num_levels} is more than "
                       f"int32 positions have levels; valid: 1..31 (fla's 15: 16384 tokens)")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d = model_config.d_model
    e = settings.expand * d
    p, n = int(settings.head_dim), int(settings.state_size)
    self.d_inner, self.head_dim, self.num_heads, self.state_size = e, p, e // p, n
    self.num_levels = m = int(settings.num_levels)
    self.conv_width = w = int(settings.conv_width)
    self.chunk_size = int(settings.chunk_size)
    self.dtype = dtype = nn.compute_dtype(model_config)
    h = self.num_heads

    def projection(width, axis):
      return nn.dense("...D,DF->...F", (d, width), ("embed", axis), rngs=rngs, dtype=dtype)

    # fla's in_proj [z, x, B, C, dt, dl] as one projection each (Mamba2's layout).
    self.z_proj, self.x_proj = projection(e, "mlp"), projection(e, "mlp")
    self.B_proj, self.C_proj = projection(n, "state"), projection(n, "state")
    self.dt_proj = projection(h, "heads")
    self.level_proj = nn.dense("...D,DHM->...HM", (d, h, m), ("embed", "heads", "state"),
                               rngs=rngs, dtype=dtype,
                               init=nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)))
    conv_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=1)
    streams = (("x", e, "mlp"), ("B", n, "state"), ("C", n, "state"))
    self.conv_kernels = nnx.Dict({
        name: modules.short_conv_kernel(rngs, w, width, (axis,), init=conv_init)
        for name, width, axis in streams})
    self.conv_biases = nnx.Dict({name: modules.short_conv_bias(width, (axis,))
                                 for name, width, axis in streams})
    # Decay rates, time steps, level scales and gains, not weights: no weight decay.
    self.dt_bias = nn.param(modules.dt_bias_init(rngs.params(), (h,)), ("heads",),
                            weight_decay=False)
    self.A_log = nn.param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)), ("heads",),
                          weight_decay=False)
    self.L = nn.param(jnp.ones((h, m)), ("heads", "state"), weight_decay=False)
    self.D = nn.param(jnp.ones((h,)), ("heads",), weight_decay=False)
    self.norm_scale = nn.param(jnp.ones((e,)), ("mlp",), weight_decay=False)
    self.out_proj = nn.dense("...E,ED->...D", (e, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def cache_levels(self, max_length):
    """State levels of a cache for positions below max_length (module docstring)."""
    return min(self.num_levels - 1, (max(int(max_length), 1) - 1).bit_length())

  def _mix(self, u_BxTxD, cache, positions_BxT, segments_BxT=None):
    b, t, _ = u_BxTxD.shape
    u_TxD, streams, windows, x_TxHxP, dt_TxH = mamba2.layer_inputs(self, u_BxTxD, cache["conv"],
                                                                   segments_BxT)
    log_decay_TxH = dt_TxH * jnp.broadcast_to(-jnp.exp(self.A_log[...]), dt_TxH.shape)
    dl_TxHxM = self.level_proj(u_TxD).astype(jnp.float32)
    lambda_TxHxM = jax.nn.softplus(jnp.broadcast_to(self.L[...], dl_TxHxM.shape) * dl_TxHxM)
    y, states = chunked_log_linear(
        streams["C"], streams["B"], (x_TxHxP * dt_TxH[..., None]).reshape(b, t, -1, self.head_dim),
        log_decay_TxH.reshape(b, t, -1), lambda_TxHxM.reshape(b, t, *lambda_TxHxM.shape[1:]),
        cache["levels"], jnp.broadcast_to(positions_BxT, (b, t)), chunk_size=self.chunk_size,
        segments=segments_BxT)
    out = mamba2.layer_output(self, y, u_TxD, x_TxHxP, u_BxTxD.shape)
    return out, {"conv": windows, "levels": states}

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    del positions_BxL  # the levels come from the token indices within each document
    b, length = x_BxLxD.shape[:2]
    positions = masks.indices_in_documents(length, segments_BxL)
    return self._mix(x_BxLxD, self.init_cache(b, 0), positions, segments_BxL)[0]

  def decode(self, x_BxTxD, cache, index, documents=None):
    _, positions_BxT, segments_BxT = base.decode_positions(index, x_BxTxD.shape[1], documents)
    if documents is not None:  # an empty cache of this cache's levels where a document starts
      cache = documents.restarted(cache, jax.tree.map(jnp.zeros_like, cache))
    return self._mix(x_BxTxD, cache, positions_BxT, segments_BxT)

  def init_cache(self, batch_size, max_length):
    window = lambda width: jnp.zeros((batch_size, self.conv_width - 1, width), self.dtype)
    n = self.state_size
    return {"conv": {"x": window(self.d_inner), "B": window(n), "C": window(n)},
            "levels": jnp.zeros((batch_size, self.cache_levels(max_length), self.num_heads,
                                 self.head_dim, n), jnp.float32)}

  def mixing_flops_per_token(self, context_length):
    e, h, p, n, m = self.d_inner, self.num_heads, self.head_dim, self.state_size, self.num_levels
    c = min(self.chunk_size, context_length)
    v = state_levels(m, 0, context_length)
    # Within a chunk, over (C + 1) / 2 keys on average: C . B (shared by the heads), the decay,
    # lambda at the pair's level (a one-hot over M levels) and scores @ x; across chunks, per
    # state level: C^T S and its weight, the keys' contribution to the next states, and the
    # merge of the states once per chunk; lambda's softplus; the convolutions (x, B, C); skip,
    # gate and norm.
    intra = (c + 1) / 2 * (2 * n + h * (2 + 2 * m + 2 * p))
    inter = h * v * (2 * p * n + 2 * p + 2 * p * n + 2 * v * p * n / c)
    return intra + inter + 3 * h * m + 2 * self.conv_width * (e + 2 * n) + 10 * e
