"""Kimi Delta Attention: the gated delta rule with a per-channel decay (Kimi Team, Kimi Linear,
arXiv:2510.26692).

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/kda.py (KimiDeltaAttention at its
defaults: expand_v = 1, head_dim 128 = hidden_size / num_heads, num_v_heads = num_heads, short
convolutions of width 4 without bias, allow_neg_eigval False, safe_gate False, lower_bound None,
norm_eps 1e-5), fla/ops/kda/naive.py (naive_recurrent_kda, naive_chunk_kda), fla/ops/kda/gate.py
(naive_kda_gate, naive_kda_lowerbound_gate) and fla/ops/kda/chunk.py (chunk_kda with
use_qk_l2norm_in_kernel, use_gate_in_kernel and use_beta_sigmoid_in_kernel, as the layer calls it).

Per head, a matrix state S [H, E] (keys x values, fla's [K, V] orientation) that decays per key
channel before the delta-rule update:
  S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t
  log alpha_t = g_t = -exp(A_log) softplus(W_f2 W_f1 x_t + dt_bias)       (per channel, <= 0)
  beta_t = sigmoid(W_b x_t)                              (2 sigmoid(.) with allow_neg_eigval)
q, k, v come from linear projections and short causal depthwise convolutions (width 4, no bias)
with SiLU; q and k are L2-normalised per head (x / sqrt(|x|^2 + 1e-6), fla's l2norm inside the
kernel) and q is scaled by H^-1/2. The decay's projection is low rank (d_model -> E -> N H, no
biases); A_log is per head, dt_bias per head and channel [N, H]. The output is normalised per
head and gated by a sigmoid, RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g) (fla's FusedRMSNormGated
with activation "sigmoid"; the gate also low rank, d_model -> E -> N E, with a bias on the second
projection), before the output projection. Key head dim H = head_dim (0: d_model / num_heads,
fla's 128 = 2048 / 16), value head dim E = expand_v H.

Initialisation as fla's: A_log = log U[1, 16] per head (0 with safe_gate), dt_bias =
softplus^-1(dt0), dt0 ~ logU[1e-3, 1e-1] floored at 1e-4 (modules.dt_bias_init, the same
distribution), the gate's bias 0, the norm's gain 1; none of them takes weight decay. The
projections are the lab's (LeCun normal, fan-in the input width) and the convolutions PyTorch's
Conv1d default U[-W^-1/2, W^-1/2] (modules.short_conv_kernel), as the lab's other delta-rule
mixers, not fla's model-level normal(0.02) re-initialisation (KDAForCausalLM._init_weights).

Options exposed (fla's names): allow_neg_eigval; lower_bound (fla's None is 0 here), which
replaces the gate by g_t = lower_bound sigmoid(exp(A_log) (W_f2 W_f1 x_t + dt_bias)), in
[lower_bound, 0) (fla's naive_kda_lowerbound_gate with A_log given, as the layer always gives
it); safe_gate, which in fla picks a faster Triton kernel for such a bounded gate and
initialises A_log to 0: only the initialisation (and its validation, lower_bound in [-5, 0))
applies here. Not exposed: num_v_heads > num_heads (grouped value attention), use_short_conv
False, and fla's mode (chunk and fused_recurrent compute the same function).

The chunked form. Inside a chunk of C tokens, with G_i = g_1 + ... + g_i [H] the cumulative log
decay since the chunk's start and S_0 the state there, the state after token i is
  S_i = diag(e^{G_i}) S_0 + sum_{j <= i} diag(e^{G_i - G_j}) k_j u_j^T,
with u_j = beta_j (v_j - k_j^T diag(alpha_j) S_{j-1}) the delta-rule corrections. They solve one
unit lower triangular system (the UT transform, as naive_chunk_kda):
  (I + A) U = diag(beta) V - diag(beta) (K * e^G) S_0,
  A_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}  (j < i),
so U = U' - W S_0 with [U', W] = (I + A)^-1 [diag(beta) V, diag(beta) (K * e^G)] (the
inverse by blockwise doubling, gated_deltanet.invert_unit_lower). Then
  O = (Q * e^G) S_0 + P U,   P_ij = sum_c q_ic k_jc e^{G_ic - G_jc}  (j <= i),
  S_C = diag(e^{G_C}) S_0 + (K * e^{G_C - G})^T U.
Only the last line is sequential: a scan over chunks carries S.

Numerical safety: the per-channel pair factors e^{G_ic - G_jc} of P and A are never factored as
e^{G_i} e^{-G_j} relative to the chunk's start (e^{-G_j} overflows once a channel decays past
e^-88 within the chunk: A = 16 with dt0 = 0.1 at init does in 55 tokens, a trained gate sooner).
As in vector_decay.py and fla's chunk_kda_fwd_intra (sub-chunks of 16 referenced to their first
token), the chunk is cut into sub-chunks of c tokens: for j in an earlier sub-chunk than i,
e^{G_i - G_j} = e^{G_i - R} e^{R - G_j} with R the cumulative decay just before i's sub-chunk
(both factors <= 1), one matmul per sub-chunk against the chunk's keys; within a sub-chunk each
pair's factor is computed on its own ([c, c, H] per sub-chunk). Every exponent is <= 0; products
too small for float32 underflow to 0, as their exact values would. Memory is
O(L (C + C / c H + c H)) per head, never [L, L]. Float32 throughout; the triangular inverse in
full float32 matmuls (no TF32 on GPUs), the other matmuls at JAX's default precision.

Packed documents: the state and the convolution windows restart at each segment start (pairs
across segments are masked; the carried state reaches only its own segment's tokens); a state
passed in belongs to the first token's segment. The decode state is the three convolution windows
and S; decoding runs the same chunked form on any number of new tokens (chunked.py).
"""


import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import gated_deltanet
from research.model.attention import modules
from research.model.attention import vector_decay

NORM_EPSILON = 1e-5  # fla's KimiDeltaAttention default (KDAConfig passes its norm_eps, 1e-6)
A_INIT_RANGE = (1.0, 16.0)
SAFE_GATE_BOUND = -5.0  # fla's safe range of lower_bound with safe_gate: [-5, 0)
# A kernel [R, N, F] read as R inputs to N * F outputs (lecun_normal's default would take N * R
# as the fan-in).
UP_INIT = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))


def decayed_pair_scores(a, b, log_decay, sub_chunk):
  """P_ij = sum_c a_ic b_jc e^{G_ic - G_jc} for j <= i (0 above the diagonal) in each chunk, with
  G the inclusive cumulative sum of log_decay (<= 0) along the chunk; a, b and log_decay
  [..., C, H], C a multiple of sub_chunk. Through sub-chunks, every exponent <= 0 (module
  docstring). Returns [..., C, C]."""
  c, h = b.shape[-2:]
  num_sub = c // sub_chunk
  inclusive = jnp.cumsum(log_decay, axis=-2)  # G [..., C, H]
  exclusive = jnp.concatenate([jnp.zeros_like(inclusive[..., :1, :]), inclusive[..., :-1, :]],
                              axis=-2)

  def to_sub_chunks(x):  # [..., C, H] -> [..., P, c, H]
    return x.reshape(*x.shape[:-2], num_sub, sub_chunk, h)

  reference = to_sub_chunks(exclusive)[..., 0, :]  # R, G just before each sub-chunk [..., P, H]
  # j in an earlier sub-chunk than i: e^{G_i - R} e^{R - G_j}.
  a_from_reference = to_sub_chunks(a) * jnp.exp(to_sub_chunks(inclusive) - reference[..., None, :])
  earlier_PxC = jnp.arange(c)[None, :] < sub_chunk * jnp.arange(num_sub)[:, None]
  b_to_reference = b[..., None, :, :] * jnp.exp(jnp.where(
      earlier_PxC[..., None], reference[..., :, None, :] - inclusive[..., None, :, :],
      -jnp.inf))  # [..., P, C, H]
  across = jnp.einsum("...pih,...psh->...pis", a_from_reference, b_to_reference)
  # i and j in one sub-chunk: each pair's factor, j <= i.
  pairs = jnp.tril(jnp.ones((sub_chunk, sub_chunk), bool))
  g_sub = to_sub_chunks(inclusive)
  factors = jnp.exp(jnp.where(pairs[..., None], g_sub[..., :, None, :] - g_sub[..., None, :, :],
                              -jnp.inf))  # [..., P, c, c, H]
  within = jnp.einsum("...pih,...pish,...psh->...pis", to_sub_chunks(a), factors,
                      to_sub_chunks(b))  # [..., P, c, c]
  within = jnp.einsum("...pis,pq->...piqs", within, jnp.eye(num_sub, dtype=within.dtype))
  return across.reshape(*across.shape[:-3], c, c) + within.reshape(*within.shape[:-4], c, c)


def chunked_kda(q, k, v, log_decay, beta, state, *, chunk_size=64, sub_chunk_size=16,
                segments=None):
  """KDA's recurrence (module docstring) in the chunkwise form, from `state`.

  q, k, log_decay g (<= 0) [B, L, N, H] (q scaled, q and k L2-normalised by the caller),
  v [B, L, N, E], beta [B, L, N], state [B, N, H, E]; segments [B, L] (packed documents,
  non-decreasing) restart the state at each segment start. Chunks of min(chunk_size, L) tokens
  in sub-chunks of the largest divisor of that which is at most sub_chunk_size. Returns
  (o [B, L, N, E], final state), float32.
  """
  b, length, n, _ = q.shape
  e = v.shape[-1]
  chunk = min(chunk_size, length)
  sub = vector_decay.sub_chunk_length(chunk, sub_chunk_size)

  def to_chunks(x):  # [B, L, N, ...] -> [B, Z, N, C, ...]; zero padding leaves the state as is
    return jnp.moveaxis(chunked.split_chunks(x.astype(jnp.float32), chunk), 2, 3)

  q, k, v, log_decay, beta = map(to_chunks, (q, k, v, log_decay, beta))
  padded = q.shape[1] * chunk
  same, sees_state, keeps_state, adds = vector_decay.head_chunk_segments(segments, b, padded,
                                                                         chunk)

  # Queries and keys apart: stacked, the gradient at B = 1, H >= 32 met the YNNPACK bug of
  # research/xla_workarounds.py (a segmentation fault without its flag; fine with it).
  qk_scores, kk_scores = (jnp.where(same, decayed_pair_scores(a, k, log_decay, sub), 0.0)
                          for a in (q, k))  # [B, Z, N, C, C]
  inclusive = jnp.cumsum(log_decay, axis=-2)  # G [B, Z, N, C, H]
  from_start = jnp.exp(inclusive) * sees_state
  to_end = jnp.exp(inclusive[..., -1:, :] - inclusive) * adds
  chunk_decay = jnp.exp(inclusive[..., -1, :]) * keeps_state  # [B, Z, N, H]

  eye = jnp.eye(chunk, dtype=bool)
  system = jnp.where(eye, 1.0, beta[..., :, None] * kk_scores)  # I + A, unit lower
  drives = jnp.concatenate([beta[..., None] * v, beta[..., None] * k * from_start], axis=-1)
  solved = jnp.einsum("bzncs,bznsf->bzncf", gated_deltanet.invert_unit_lower(system), drives)
  free_u, w = solved[..., :e], solved[..., e:]  # U = U' - W S_0
  k_to_end = k * to_end

  def step(state_BxNxHxE, chunk_inputs):
    free_u, w, k_to_end, chunk_decay = chunk_inputs
    u = free_u - jnp.einsum("bnch,bnhe->bnce", w, state_BxNxHxE)
    new_state = (chunk_decay[..., None] * state_BxNxHxE
                 + jnp.einsum("bnch,bnce->bnhe", k_to_end, u))
    return new_state, (state_BxNxHxE, u)

  to_scan = lambda x: jnp.moveaxis(x, 1, 0)
  state, (starts, u) = jax.lax.scan(
      step, state.astype(jnp.float32), tuple(map(to_scan, (free_u, w, k_to_end, chunk_decay))))
  starts, u = jnp.moveaxis(starts, 0, 1), jnp.moveaxis(u, 0, 1)
  out = (jnp.einsum("bznch,bznhe->bznce", q * from_start, starts)
         + jnp.einsum("bzncs,bznse->bznce", qk_scores, u))
  return chunked.merge_chunks(jnp.moveaxis(out, 2, 3), length), state


def kda_gate(f_BxTxNxH, A_log_N, dt_bias_NxH, lower_bound=0.0):
  """The per-channel log decay g <= 0 from the decay projection f (fla's gate.py):
  -exp(A_log) softplus(f + dt_bias) (naive_kda_gate), or with lower_bound < 0,
  lower_bound sigmoid(exp(A_log) (f + dt_bias)) (naive_kda_lowerbound_gate)."""
  f = f_BxTxNxH.astype(jnp.float32) + dt_bias_NxH
  a = jnp.exp(A_log_N)[:, None]
  if lower_bound:
    return lower_bound * jax.nn.sigmoid(a * f)
  return -a * jax.nn.softplus(f)


class KimiDeltaAttention(chunked.ChunkedRecurrentMixer):
  """Kimi Delta Attention (this module's docstring)."""

  hyperparameters = {"head_dim": 0,  # key head dim; 0: d_model / num_heads (fla's 128)
                     "expand_v": 1.0,  # value head dim = expand_v * head_dim
                     "conv_width": 4,
                     "chunk_size": 64,  # tokens per chunk (fla's chunk_kda: 64)
                     "sub_chunk_size": 16,  # tokens per sub-chunk (fla's intra-chunk blocks: 16)
                     "allow_neg_eigval": False,  # beta in (0, 2) (arXiv:2411.12537)
                     "lower_bound": 0.0,  # < 0: the bounded gate; 0: fla's None (softplus gate)
                     "safe_gate": False}  # fla's: A_log starts at 0; needs lower_bound in [-5, 0)
  test_settings = {"chunk_size": 8, "sub_chunk_size": 4}

  @classmethod
  def key_head_dim(cls, settings, model_config):
    return int(settings.head_dim) or model_config.d_model // model_config.num_heads

  @classmethod
  def validate(cls, settings, model_config):
    for field in ("conv_width", "chunk_size", "sub_chunk_size"):
      if settings[field] < 1:
        raise ValueError(f"model.kda.{field} must be >= 1, got {settings[field]}")
    gated_deltanet.check_head_dims("kda", settings, cls.key_head_dim(settings, model_config),
                                   "d_model / num_heads")
    if settings.lower_bound > 0:
      raise ValueError(f"model.kda.lower_bound must be < 0 (the bounded gate) or 0 (fla's None: "
                       f"the softplus gate); got {settings.lower_bound}")
    if settings.safe_gate and not SAFE_GATE_BOUND <= settings.lower_bound < 0:
      raise ValueError(f"model.kda.safe_gate needs lower_bound in [{SAFE_GATE_BOUND:g}, 0) "
                       f"(fla recommends -5); got lower_bound={settings.lower_bound}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d, n = model_config.d_model, model_config.num_heads
    h = self.key_head_dim(settings, model_config)
    e = round(h * settings.expand_v)
    self.num_heads, self.head_dim, self.value_dim = n, h, e
    self.conv_width = int(settings.conv_width)
    self.chunk_size = int(settings.chunk_size)
    self.sub_chunk_size = int(settings.sub_chunk_size)
    self.beta_scale = 2.0 if settings.allow_neg_eigval else 1.0
    self.lower_bound = float(settings.lower_bound)
    self.dtype = dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype)
    self.key = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype)
    self.value = base.head_projection(d, n, e, "heads", rngs=rngs, dtype=dtype)
    # fla's f_proj and g_proj: rank E (head_v_dim) bottlenecks; the gate's second one biased.
    self.decay_down = nn.dense("BLD,DR->BLR", (d, e), ("embed", "ssm_proj"), rngs=rngs,
                               dtype=dtype)
    self.decay_up = nn.dense("BLR,RNH->BLNH", (e, n, h), ("ssm_proj", "heads", "head_dim"),
                             rngs=rngs, dtype=dtype, init=UP_INIT)
    self.beta_proj = nn.dense("BLD,DN->BLN", (d, n), ("embed", "heads"), rngs=rngs, dtype=dtype)
    self.gate_down = nn.dense("BLD,DR->BLR", (d, e), ("embed", "ssm_proj"), rngs=rngs,
                              dtype=dtype)
    self.gate_up = nn.dense("BLR,RNE->BLNE", (e, n, e), ("ssm_proj", "heads", "head_dim"),
                            rngs=rngs, dtype=dtype, init=UP_INIT, bias_shape=(n, e),
                            bias_axes=("heads", "head_dim"))
    # Depthwise kernels, U[-1/sqrt(W), 1/sqrt(W)] as PyTorch's Conv1d (fla's ShortConvolution).
    self.q_conv, self.k_conv, self.v_conv = (
        modules.short_conv_kernel(rngs, self.conv_width, (n, width), ("heads", "head_dim"))
        for width in (h, h, e))
    # Decay rates and the norm's gain are not weights: no weight decay.
    if settings.safe_gate:
      a_log = jnp.zeros((n,), jnp.float32)
    else:
      a_log = modules.a_log_init(rngs.params(), (n,), *A_INIT_RANGE)
    self.A_log = nn.param(a_log, ("heads",), weight_decay=False)
    self.dt_bias = nn.param(modules.dt_bias_init(rngs.params(), (n, h)), ("heads", "head_dim"),
                            weight_decay=False)
    self.norm_scale = nn.param(jnp.ones((e,)), ("head_dim",), weight_decay=False)
    self.out = base.output_projection(n, e, d, rngs=rngs, dtype=dtype)

  def _mix(self, x_BxTxD, cache, segments_BxT=None):
    windows, convolved = [], []
    for project, kernel, window in zip((self.query, self.key, self.value),
                                       (self.q_conv, self.k_conv, self.v_conv), cache["conv"]):
      y, window = modules.causal_depthwise_conv(project(x_BxTxD), window, kernel[...],
                                                 segments_BxT=segments_BxT)
      convolved.append(jax.nn.silu(y).astype(jnp.float32))
      windows.append(window)
    q_BxTxNxH, k_BxTxNxH, v_BxTxNxE = convolved
    q_BxTxNxH = gated_deltanet.l2_normalize(q_BxTxNxH) * self.head_dim ** -0.5
    k_BxTxNxH = gated_deltanet.l2_normalize(k_BxTxNxH)
    log_decay_BxTxNxH = kda_gate(self.decay_up(self.decay_down(x_BxTxD)), self.A_log[...],
                                 self.dt_bias[...], self.lower_bound)
    beta_BxTxN = self.beta_scale * jax.nn.sigmoid(self.beta_proj(x_BxTxD).astype(jnp.float32))
    o_BxTxNxE, state = chunked_kda(
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxE, log_decay_BxTxNxH, beta_BxTxN, cache["state"],
        chunk_size=self.chunk_size, sub_chunk_size=self.sub_chunk_size, segments=segments_BxT)
    gate_BxTxNxE = self.gate_up(self.gate_down(x_BxTxD)).astype(jnp.float32)
    o_BxTxNxE = (modules.rms_norm(o_BxTxNxE, self.norm_scale[...], eps=NORM_EPSILON)
                 * jax.nn.sigmoid(gate_BxTxNxE))  # FusedRMSNormGated, activation sigmoid
    return self.out(o_BxTxNxE.astype(self.dtype)), {"conv": tuple(windows), "state": state}

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    n, h, e, w = self.num_heads, self.head_dim, self.value_dim, self.conv_width - 1
    return {"conv": tuple(jnp.zeros((batch_size, w, n, width), self.dtype)
                          for width in (h, h, e)),
            "state": jnp.zeros((batch_size, n, h, e), jnp.float32)}

  def mixing_flops_per_token(self, context_length):
    n, h, e = self.num_heads, self.head_dim, self.value_dim
    c = min(self.chunk_size, context_length)
    sub = vector_decay.sub_chunk_length(c, self.sub_chunk_size)
    # Per head, within a chunk over (C + 1) / 2 earlier tokens on average: the decayed q.k and
    # k.k scores, the triangular solve for [U', W] and scores @ U; the per-pair decay factors of
    # a sub-chunk; across chunks W S_0, Q S_0 and the state update; the three convolutions; the
    # gate, norm and output gate.
    within = 2 * (c + 1) / 2 * (2 * h + (h + e) + e) + 6 * sub * h
    across = 3 * 2 * h * e
    return n * (within + across + 2 * self.conv_width * (2 * h + e) + 6 * h + 8 * e)
