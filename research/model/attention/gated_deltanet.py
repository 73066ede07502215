"""Gated DeltaNet: the gated delta rule (Yang, Kautz & Hatamizadeh, arXiv:2412.06464).

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/gated_deltanet.py (GatedDeltaNet)
and fla/ops/gated_delta_rule/naive.py; the family below, fla/layers/delta_net.py and
fla/layers/gated_deltaproduct.py.

Per head, with a matrix state S [H, E] (keys x values, the orientation of flash-linear-attention;
the paper writes its transpose):
  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t
  alpha_t = exp(g_t),  g_t = -exp(A_log) softplus(W_a x_t + dt_bias)   (Mamba-2's decay, < 1)
  beta_t = sigmoid(W_b x_t)                                            (the delta rule's step)
q, k, v come from linear projections and short causal depthwise convolutions (width 4) with SiLU;
q and k are L2-normalised per head and q is scaled by H^-0.5. The output is normalised per head
and gated, RMSNorm(o) * silu(W_g x) (fla's FusedRMSNormGated), before the output projection.
A_log = log(U[0, 16]) per head and dt_bias = softplus^-1(dt0), dt0 ~ logU[1e-3, 1e-1], as fla
initialises them; neither takes weight decay. The key head dim defaults to 3/4 of
d_model / num_heads and values are expand_v = 2 times wider, fla's sizing: about 6 d_model^2
parameters per layer, as Mamba's.

Training, evaluation and decoding run the chunkwise (WY) form. Inside a chunk of C tokens, with
G_i = g_1 + ... + g_i the cumulative log decay since the chunk's start and S_0 the state there,
the delta-rule corrections u_i (S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} k_j u_j^T) solve one
unit lower triangular system (the UT transform):
  (I + A) U = diag(beta) V - diag(beta e^G) K S_0,   A_ij = beta_i e^{G_i - G_j} k_i . k_j  (j < i)
so U = U' - W S_0 with [U', W] = (I + A)^-1 [diag(beta) V, diag(beta e^G) K]; the inverse of the
unit triangular I + A is built for all chunks at once by blockwise doubling (log2 C rounds of
matmuls, exact; LAPACK's triangular solve on CPU was slower and stalled at random). Then,
  O = diag(e^G) Q S_0 + (Q K^T * D) U,   D_ij = e^{G_i - G_j} (j <= i),
  S_C = e^{G_C} S_0 + (diag(e^{G_C - G}) K)^T U.
Only the last line is sequential: a scan over chunks carries S. Every decay factor is <= 1.
Packed documents: the state and the convolution window restart at each segment start (a masked
decay factor is 0, exactly as if alpha were 0 there); a state passed in belongs to the first
token's segment. The decode state is the three convolution windows and S; decoding runs the same
chunked form on any number of new tokens (prefill is one pass).

The family. The class below is flash-linear-attention's delta-rule layers with its attributes
choosing the member: DeltaNet (arXiv:2406.06484) has no forget gate (alpha_t = 1) and no output
gate; Gated DeltaProduct (arXiv:2502.10297) takes S steps per token, each with its own key,
value and beta, the decay on the first step and the query read after the last:
  S_{t,0} = alpha_t S_{t-1},  S_{t,j} = (I - beta_tj k_tj k_tj^T) S_{t,j-1} + beta_tj k_tj v_tj^T,
  S_t = S_{t,S},  o_t = S_t^T q_t,
which is the gated delta rule over the interleaved sequence of T * S steps (queries 0 on all
but each token's last step, log decays 0 on all but its first): the same chunked form runs it,
in chunks of chunk_size tokens. allow_neg_eigval doubles beta, so that the transition's
eigenvalue 1 - beta can be negative (arXiv:2411.12537; fla's allow_neg_eigval).
"""

import math

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import masks
from research.model.attention import modules

L2_EPSILON = 1e-6
A_INIT_RANGE = (0.0, 16.0)  # A ~ U[0, 16] per head (fla)
HIGHEST = jax.lax.Precision.HIGHEST


def l2_normalize(x):
  """x / ||x|| over the last axis (fla's l2norm: x * rsqrt(sum x^2 + 1e-6))."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPSILON)


def invert_unit_lower(m):
  """The inverse of unit lower triangular matrices m [..., C, C] by doubling, with matmuls only:
  the inverses X1, X2 of two diagonal blocks of size s give that of the block of size 2s,
  [[M11, 0], [M21, M22]]^-1 = [[X1, 0], [-X2 M21 X1, X2]]; C is padded to a power of two."""
  c = m.shape[-1]
  p = 1 << (c - 1).bit_length()
  batch = m.shape[:-2]
  m = jnp.pad(m, [(0, 0)] * len(batch) + [(0, p - c), (0, p - c)])
  inverse = jnp.ones((*batch, p, 1, 1), m.dtype)  # of the 1 x 1 diagonal blocks
  size = 1
  while size < p:
    blocks = m.reshape(*batch, p // size, size, p // size, size)
    below = jnp.diagonal(blocks[..., 1::2, :, 0::2, :], axis1=-4, axis2=-2)  # M21 of each pair
    below = jnp.moveaxis(below, -1, -3)
    first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
    # Full float32 matmuls (no TF32 on GPUs): the inverse feeds every output of the chunk.
    corner = -jnp.matmul(jnp.matmul(second, below, precision=HIGHEST), first, precision=HIGHEST)
    inverse = jnp.concatenate([jnp.concatenate([first, jnp.zeros_like(first)], axis=-1),
                               jnp.concatenate([corner, second], axis=-1)], axis=-2)
    size *= 2
  return inverse[..., 0, :c, :c]


def chunked_gated_delta_rule(q, k, v, log_decay, beta, state, *, chunk_size=64, segments=None):
  """The gated delta rule in the chunkwise WY form (module docstring), from `state`.

  q, k [B, L, N, H] (q scaled, both L2-normalised by the caller), v [B, L, N, E], log_decay
  g <= 0 and beta [B, L, N], state [B, N, H, E]; segments [B, L] (packed documents,
  non-decreasing) restart the state at each segment start. Returns (o [B, L, N, E], final
  state), float32.
  """
  b, length, n, h = q.shape
  e = v.shape[-1]
  chunk = min(chunk_size, length)
  padded = chunked.num_chunks(length, chunk) * chunk
  # [B, L, N, ...] -> [B, Z, N, C, ...] for Z chunks of C tokens. Zero padding (g = 0, beta = 0,
  # k = 0) leaves the state as it is.
  q, k, v, log_decay, beta = (
      jnp.moveaxis(chunked.split_chunks(x.astype(jnp.float32), chunk), 2, 3)
      for x in (q, k, v, log_decay, beta))
  same, sees_state, keeps_state, adds = masks.all_chunk_segments(segments, padded, chunk, b)
  same = same[:, :, None]
  sees_state, adds = (m[:, :, None] for m in (sees_state, adds))
  keeps_state = keeps_state[:, :, None]

  cumulative = jnp.cumsum(log_decay, axis=-1)  # G [B, Z, N, C]
  # D_ij = e^{G_i - G_j} for j <= i in one segment, else 0 (exp(-inf); never exp of a positive).
  within = jnp.exp(jnp.where(same, cumulative[..., :, None] - cumulative[..., None, :], -jnp.inf))
  from_start = jnp.exp(cumulative) * sees_state
  to_end = jnp.exp(cumulative[..., -1:] - cumulative) * adds
  chunk_decay = jnp.exp(cumulative[..., -1]) * keeps_state  # [B, Z, N]

  eye = jnp.eye(chunk, dtype=bool)
  kk = jnp.einsum("bznch,bznsh->bzncs", k, k)
  system = jnp.where(eye, 1.0, beta[..., :, None] * kk * within)  # I + A, unit lower
  drives = jnp.concatenate([beta[..., None] * v, (beta * from_start)[..., None] * k], axis=-1)
  solved = jnp.einsum("bzncs,bznsf->bzncf", invert_unit_lower(system), drives)
  free_u, w = solved[..., :e], solved[..., e:]  # U = U' - W S_0
  k_to_end = k * to_end[..., None]

  def step(state_BxNxHxE, chunk_inputs):
    free_u, w, k_to_end, chunk_decay = chunk_inputs
    u = free_u - jnp.einsum("bnch,bnhe->bnce", w, state_BxNxHxE)
    new_state = (chunk_decay[..., None, None] * state_BxNxHxE
                 + jnp.einsum("bnch,bnce->bnhe", k_to_end, u))
    return new_state, (state_BxNxHxE, u)

  to_scan = lambda x: jnp.moveaxis(x, 1, 0)
  state, (starts, u) = jax.lax.scan(
      step, state.astype(jnp.float32), tuple(map(to_scan, (free_u, w, k_to_end, chunk_decay))))
  starts, u = jnp.moveaxis(starts, 0, 1), jnp.moveaxis(u, 0, 1)
  scores = jnp.einsum("bznch,bznsh->bzncs", q, k) * within
  out = (jnp.einsum("bznch,bznhe->bznce", q * from_start[..., None], starts)
         + jnp.einsum("bzncs,bznse->bznce", scores, u))
  return chunked.merge_chunks(jnp.moveaxis(out, 3, 2), length), state


def check_head_dims(name, settings, key_head_dim, default):
  """model.<name>.head_dim (0: `default`, giving `key_head_dim`) and expand_v, the value head dim
  over the key head dim, of a delta-rule mixer: ValueError naming what is valid."""
  if settings.head_dim < 0:
    raise ValueError(f"model.{name}.head_dim must be >= 1, or 0 for {default}; got "
                     f"{settings.head_dim}")
  if key_head_dim < 1:
    raise ValueError(f"model.{name}.head_dim=0 gives {default} = {key_head_dim} < 1; set "
                     f"model.{name}.head_dim >= 1")
  e = key_head_dim * settings.expand_v
  if not (settings.expand_v > 0 and math.isclose(e, round(e))):
    raise ValueError(f"model.{name}.expand_v={settings.expand_v} gives a value head dim of "
                     f"head_dim * expand_v = {key_head_dim} * {settings.expand_v} = {e:g}; "
                     f"valid: expand_v > 0 with an integer product (e.g. 1 or 2)")


def interleave_steps(x_BxTxNxSx_, num_steps):
  """[B, T, N, S, ...] -> [B, T * S, N, ...]: the S steps of each token in turn."""
  b, t, n, s = x_BxTxNxSx_.shape[:4]
  assert s == num_steps
  return jnp.swapaxes(x_BxTxNxSx_, 2, 3).reshape(b, t * s, n, *x_BxTxNxSx_.shape[4:])


class GatedDeltaNet(chunked.ChunkedRecurrentMixer):
  """The delta-rule family of flash-linear-attention's layers (this module's docstring): the
  class attributes below select a member, so DeltaNet and Gated DeltaProduct are subclasses
  that set them (research/model/attention/deltanet.py, gated_deltaproduct.py)."""

  settings_name = "gated_deltanet"  # model.<settings_name>.* in messages
  hyperparameters = {"head_dim": 0,  # 0: key_head_fraction of d_model / num_heads
                     "expand_v": 2.0,  # value head dim = expand_v * head_dim
                     "conv_width": 4,
                     "chunk_size": 64,  # tokens per chunk
                     "allow_neg_eigval": False}  # beta in (0, 2) (arXiv:2411.12537)
  test_settings = {"chunk_size": 8}
  key_head_fraction = 0.75  # fla's head_dim 256 at hidden_size 2048 and 6 heads
  forget_gate = True  # alpha_t = exp(g_t); without it alpha_t = 1 (DeltaNet)
  output_gate = True  # RMSNorm(o) * silu(W_g x); without it RMSNorm(o) (fla's use_gate=False)

  @classmethod
  def key_head_dim(cls, settings, model_config):
    """model.<name>.head_dim, or with 0 key_head_fraction of d_model / num_heads."""
    return int(settings.head_dim) or int(
        cls.key_head_fraction * model_config.d_model) // model_config.num_heads

  @classmethod
  def householder_steps(cls, settings):
    """Delta-rule steps per token (Gated DeltaProduct's num_householder; 1 here)."""
    return int(settings.get("num_householder", 1))

  @classmethod
  def validate(cls, settings, model_config):
    name = cls.settings_name
    for field in ("conv_width", "chunk_size") + (
        ("num_householder",) if "num_householder" in settings else ()):
      if settings[field] < 1:
        raise ValueError(f"model.{name}.{field} must be >= 1, got {settings[field]}")
    check_head_dims(name, settings, cls.key_head_dim(settings, model_config),
                    f"{cls.key_head_fraction:g} of d_model / num_heads")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d, n = model_config.d_model, model_config.num_heads
    h = self.key_head_dim(settings, model_config)
    e = round(h * settings.expand_v)
    steps = self.householder_steps(settings)
    self.num_heads, self.head_dim, self.value_dim, self.num_steps = n, h, e, steps
    self.conv_width = int(settings.conv_width)
    self.chunk_size = int(settings.chunk_size)
    self.beta_scale = 2.0 if settings.allow_neg_eigval else 1.0
    # A member may expose its gates as settings (fla's use_forget_gate / use_output_gate).
    self.forget_gate = bool(settings.get("use_forget_gate", self.forget_gate))
    self.output_gate = bool(settings.get("use_output_gate", self.output_gate))
    self.dtype = dtype = nn.compute_dtype(model_config)
    # Keys, values and betas of every step of a token come from one projection each, head-major
    # (fla's '(n h d)' with the step outermost is only a permutation of the same weights). The
    # parameters are created in one order for every member, so a seed gives one initialisation.
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype)
    self.key = base.head_projection(d, n, steps * h, "heads", rngs=rngs, dtype=dtype)
    self.value = base.head_projection(d, n, steps * e, "heads", rngs=rngs, dtype=dtype)
    if self.output_gate:
      self.gate = base.head_projection(d, n, e, "heads", rngs=rngs, dtype=dtype)
    if self.forget_gate:
      self.decay_proj = nn.dense("BLD,DN->BLN", (d, n), ("embed", "heads"), rngs=rngs,
                                 dtype=dtype)
    self.beta_proj = nn.dense("BLD,DN->BLN", (d, n * steps), ("embed", "heads"), rngs=rngs,
                              dtype=dtype)
    # Depthwise kernels, U[-1/sqrt(W), 1/sqrt(W)] as PyTorch's Conv1d (fla's ShortConvolution).
    self.q_conv, self.k_conv, self.v_conv = (
        modules.short_conv_kernel(rngs, self.conv_width, (n, width), ("heads", "head_dim"))
        for width in (h, steps * h, steps * e))
    if self.forget_gate:  # decay rates and the norm's gain are not weights: no weight decay
      self.A_log = nn.param(modules.a_log_init(rngs.params(), (n,), *A_INIT_RANGE), ("heads",),
                            weight_decay=False)
      self.dt_bias = nn.param(modules.dt_bias_init(rngs.params(), (n,)), ("heads",),
                              weight_decay=False)
    self.norm_scale = nn.param(jnp.ones((e,)), ("head_dim",), weight_decay=False)
    self.out = base.output_projection(n, e, d, rngs=rngs, dtype=dtype)

  def _mix(self, x_BxTxD, cache, segments_BxT=None):
    b, t = x_BxTxD.shape[:2]
    n, h, e, steps = self.num_heads, self.head_dim, self.value_dim, self.num_steps
    windows, convolved = [], []
    for project, kernel, window in zip((self.query, self.key, self.value),
                                       (self.q_conv, self.k_conv, self.v_conv), cache["conv"]):
      y, window = modules.causal_depthwise_conv(project(x_BxTxD), window, kernel[...],
                                                 segments_BxT=segments_BxT)
      convolved.append(jax.nn.silu(y).astype(jnp.float32))
      windows.append(window)
    q_BxTxNxH, k_BxTxNxSH, v_BxTxNxSE = convolved
    q_BxTxNxH = l2_normalize(q_BxTxNxH) * h ** -0.5
    k_BxTxNxSxH = l2_normalize(k_BxTxNxSH.reshape(b, t, n, steps, h))
    beta_BxTxNxS = self.beta_scale * jax.nn.sigmoid(
        self.beta_proj(x_BxTxD).astype(jnp.float32)).reshape(b, t, n, steps)
    if self.forget_gate:
      log_decay_BxTxN = -jnp.exp(self.A_log[...]) * jax.nn.softplus(
          self.decay_proj(x_BxTxD).astype(jnp.float32) + self.dt_bias[...])
    else:
      log_decay_BxTxN = jnp.zeros((b, t, n), jnp.float32)
    # Each token's steps in turn: the decay on its first step, the query read after its last.
    first, last = (jnp.arange(steps) == 0), (jnp.arange(steps) == steps - 1)
    o, state = chunked_gated_delta_rule(
        interleave_steps(q_BxTxNxH[:, :, :, None] * last[:, None], steps),
        interleave_steps(k_BxTxNxSxH, steps),
        interleave_steps(v_BxTxNxSE.reshape(b, t, n, steps, e), steps),
        interleave_steps(log_decay_BxTxN[..., None] * first, steps),
        interleave_steps(beta_BxTxNxS, steps), cache["state"],
        chunk_size=self.chunk_size * steps,
        segments=None if segments_BxT is None else jnp.repeat(segments_BxT, steps, axis=1))
    o_BxTxNxE = o.reshape(b, t, steps, n, e)[:, :, -1]
    if self.output_gate:  # RMSNorm(o) * silu(W_g x)
      o_BxTxNxE = modules.gated_rms_norm(o_BxTxNxE, self.gate(x_BxTxD), self.norm_scale[...])
    else:
      o_BxTxNxE = modules.rms_norm(o_BxTxNxE, self.norm_scale[...])
    return self.out(o_BxTxNxE.astype(self.dtype)), {"conv": tuple(windows), "state": state}

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    n, h, e, w, s = (self.num_heads, self.head_dim, self.value_dim, self.conv_width - 1,
                     self.num_steps)
    return {"conv": tuple(jnp.zeros((batch_size, w, n, width), self.dtype)
                          for width in (h, s * h, s * e)),
            "state": jnp.zeros((batch_size, n, h, e), jnp.float32)}

  def mixing_flops_per_token(self, context_length):
    n, h, e, s = self.num_heads, self.head_dim, self.value_dim, self.num_steps
    c = min(self.chunk_size, context_length) * s  # delta-rule steps per chunk
    # Per step, within a chunk over (C + 1) / 2 earlier steps on average: k k^T and q k^T, the
    # triangular solve for [U', W], and scores @ U; across chunks W S_0, Q S_0 and the state
    # update; the three convolutions once per token.
    within = 2 * (c + 1) / 2 * (2 * h + (h + e) + e)
    across = 3 * 2 * h * e
    return s * n * (within + across) + 2 * self.conv_width * n * (h + s * (h + e))
