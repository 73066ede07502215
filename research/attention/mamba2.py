"""Mamba-2, the state space duality (SSD) layer (Dao & Gu, arXiv:2405.21060).

  z, x, B, C, dt = in_proj(u)                          (x: [heads, head_dim P], B, C: [N])
  x, B, C = silu(causal_depthwise_conv(x, B, C))       (width 4, one kernel per channel)
  dt = softplus(dt + dt_bias),  A = -exp(A_log)        (one scalar decay per head)
  h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t     (per head, h: [P, N])
  out = out_proj(RMSNorm(y * silu(z)))                 (gated RMSNorm, eps 1e-5, learned scale)
as in the authors' Mamba2Simple (state-spaces/mamba): one group of B and C shared by all heads,
A_log from log U[1, 16], dt_bias = softplus^-1(dt0) with dt0 ~ logU[1e-3, 1e-1] floored at 1e-4,
D = 1, no projection biases, a conv bias; the norm multiplies y by the gate before normalising
(norm_before_gate=False) over the whole inner width. The number of heads is
expand * d_model / head_dim; model.num_heads is not used. Projections are initialised like the
lab's other dense layers (LeCun normal) rather than PyTorch's default uniform.

The chunked SSD ("state space duality") form computes the scan as matmuls. With
a_t = dt_t A and, within a chunk, cum_l = a_1 + ... + a_l:
  intra-chunk:  y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s     (a masked [C, C]
                attention-like matmul whose mask is the segment-sum decay)
  from state:   y_l += exp(cum_l) h_prev C_l
  next state:   h = exp(cum_C) h_prev + sum_s exp(cum_C - cum_s) dt_s x_s B_s^T
and a scan over chunks carries h (each chunk rematerialised in the backward pass), so memory
grows as [length, C] and never [length, length] or [length, P, N]. Retention is the special case
of a constant decay and per-head B, C (research/attention/retention.py). Decoding runs the same
form from the cached conv windows and SSM state on any number of new tokens (prefill is one
pass). Packed documents: the state restarts at a segment start (the intra-chunk mask keeps to the
segment, the carried state reaches only its own segment's tokens) and the convolution sees no
input of an earlier segment, as Mamba does here.
"""


import jax
import jax.numpy as jnp
from flax import nnx

from research import nn
from research.attention import base
from research.attention import masks
from research.attention.ssm import causal_depthwise_conv, dt_bias_init

A_INIT_RANGE = (1.0, 16.0)
NORM_EPSILON = 1e-5


def _ssd_chunk(carry, chunk):
  """One chunk of the SSD form. x is already multiplied by dt; padding has dt = 0 (decay 1,
  nothing added)."""
  h_BxHxPxN, carried_segment_B = carry
  segments_BxC, x_BxCxHxP, log_decay_BxCxH, B_BxCxN, C_BxCxN = chunk
  same, sees_state, keeps_state, adds = masks.chunk_segments(segments_BxC, carried_segment_B)
  cum_BxCxH = jnp.cumsum(log_decay_BxCxH, axis=1)
  cum_BxHxC = cum_BxCxH.transpose(0, 2, 1)
  # exp(cum_l - cum_s) for s <= l in the same segment; masked before exp, so no overflow.
  decay_BxHxCxC = jnp.exp(jnp.where(same, cum_BxHxC[..., :, None] - cum_BxHxC[..., None, :],
                                    -jnp.inf))
  scores_BxHxCxC = jnp.einsum("bln,bsn->bls", C_BxCxN, B_BxCxN)[:, None] * decay_BxHxCxC
  from_state_BxCxHxP = jnp.einsum("bln,bhpn->blhp", C_BxCxN * sees_state[..., 0], h_BxHxPxN)
  y_BxCxHxP = (jnp.einsum("bhls,bshp->blhp", scores_BxHxCxC, x_BxCxHxP)
               + jnp.exp(cum_BxCxH)[..., None] * from_state_BxCxHxP)
  to_end_BxCxH = jnp.exp(cum_BxCxH[:, -1:] - cum_BxCxH) * adds[..., 0]
  h_BxHxPxN = (jnp.exp(cum_BxCxH[:, -1])[:, :, None, None] * h_BxHxPxN * keeps_state
               + jnp.einsum("bsh,bshp,bsn->bhpn", to_end_BxCxH, x_BxCxHxP, B_BxCxN))
  return (h_BxHxPxN, segments_BxC[:, -1]), y_BxCxHxP


def chunked_ssd(x, dt, A, B, C, h0, *, chunk_size=64, segments=None):
  """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t from h0, in chunks of chunk_size.

  x: [b, L, H, P]; dt: [b, L, H] (> 0); A: [H] (< 0); B, C: [b, L, N]; h0: [b, H, P, N].
  segments [b, L] (packed documents, non-decreasing) restart h at each segment start; h0
  belongs to the first token's segment. The D x skip term is the caller's.
  Returns (y [b, L, H, P], h_L).
  """
  b, length, heads, p = x.shape
  chunk = min(chunk_size, length)
  padded = -(-length // chunk) * chunk
  num_chunks = padded // chunk

  def to_chunks(t):  # zero padding: dt = 0 leaves the state as it is
    t = jnp.pad(t, [(0, 0), (0, padded - length)] + [(0, 0)] * (t.ndim - 2))
    return t.reshape(b, num_chunks, chunk, *t.shape[2:]).swapaxes(0, 1)

  if segments is None:
    segments = jnp.zeros((b, length), jnp.int32)
  segments = jnp.pad(segments, [(0, 0), (0, padded - length)], mode="edge")
  chunks = (segments.reshape(b, num_chunks, chunk).swapaxes(0, 1), to_chunks(x * dt[..., None]),
            to_chunks(dt * A), to_chunks(B), to_chunks(C))
  (h, _), y = jax.lax.scan(jax.checkpoint(_ssd_chunk), (h0, segments[:, 0]), chunks)
  return y.swapaxes(0, 1).reshape(b, padded, heads, p)[:, :length], h


def _a_log_init(key, shape, dtype=jnp.float32):
  return jnp.log(jax.random.uniform(key, shape, dtype, *A_INIT_RANGE))


def gated_rms_norm(y_BxTxE, z_BxTxE, scale_E, eps=NORM_EPSILON):
  """RMSNorm(y * silu(z)) * scale over the inner width, in float32."""
  gated = y_BxTxE.astype(jnp.float32) * jax.nn.silu(z_BxTxE.astype(jnp.float32))
  return gated * jax.lax.rsqrt(jnp.mean(jnp.square(gated), -1, keepdims=True) + eps) * scale_E


class Mamba2(base.Mixer):
  hyperparameters = {"state_size": 64, "head_dim": 64, "expand": 2, "conv_width": 4,
                     "chunk_size": 64}
  recurrent = True

  @classmethod
  def validate(cls, settings, model_config):
    for field in cls.hyperparameters:
      if settings[field] < 1:
        raise ValueError(f"model.mamba2.{field} must be >= 1, got {settings[field]}")
    inner = settings.expand * model_config.d_model
    if inner % settings.head_dim:
      raise ValueError(
          f"model.mamba2.head_dim={settings.head_dim} does not divide the inner width "
          f"expand * d_model = {inner}; valid head_dim: "
          f"{[p for p in range(1, inner + 1) if inner % p == 0]}")

  def __init__(self, settings, model_config, position, *, rngs):
    del position  # order comes from the recurrence; the embedding hook is the model's
    d = model_config.d_model
    e = settings.expand * d
    p, n = int(settings.head_dim), int(settings.state_size)
    self.d_inner, self.head_dim, self.num_heads, self.state_size = e, p, e // p, n
    self.conv_width = w = int(settings.conv_width)
    self.chunk_size = int(settings.chunk_size)
    self.dtype = dtype = nn.compute_dtype(model_config)

    def projection(width, axis):
      return nn.dense("BLD,DF->BLF", (d, width), ("embed", axis), rngs=rngs, dtype=dtype)

    self.z_proj, self.x_proj = projection(e, "mlp"), projection(e, "mlp")
    self.B_proj, self.C_proj = projection(n, "state"), projection(n, "state")
    self.dt_proj = projection(self.num_heads, "heads")
    conv_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=1)
    self.conv_kernels = nnx.Dict({
        name: nn.param(conv_init(rngs.params(), (w, width)), ("conv", axis), weight_decay=True)
        for name, width, axis in (("x", e, "mlp"), ("B", n, "state"), ("C", n, "state"))})
    self.conv_biases = nnx.Dict({
        name: nn.param(jnp.zeros((width,)), (axis,), weight_decay=False)
        for name, width, axis in (("x", e, "mlp"), ("B", n, "state"), ("C", n, "state"))})
    # Decay rates, time steps and gains, not weights: no weight decay.
    h = self.num_heads
    self.dt_bias = nn.param(dt_bias_init(rngs.params(), (h,)), ("heads",), weight_decay=False)
    self.A_log = nn.param(_a_log_init(rngs.params(), (h,)), ("heads",), weight_decay=False)
    self.D = nn.param(jnp.ones((h,)), ("heads",), weight_decay=False)
    self.norm_scale = nn.param(jnp.ones((e,)), ("mlp",), weight_decay=False)
    self.out_proj = nn.dense("BLE,ED->BLD", (e, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def _mix(self, u_BxTxD, cache, segments_BxT=None):
    b, t, _ = u_BxTxD.shape
    streams, windows = {}, {}
    for name, proj in (("x", self.x_proj), ("B", self.B_proj), ("C", self.C_proj)):
      y, windows[name] = causal_depthwise_conv(
          proj(u_BxTxD), cache["conv"][name], self.conv_kernels[name][...],
          self.conv_biases[name][...], segments_BxT)
      streams[name] = jax.nn.silu(y).astype(jnp.float32)
    x_BxTxHxP = streams["x"].reshape(b, t, self.num_heads, self.head_dim)
    dt_BxTxH = jax.nn.softplus(self.dt_proj(u_BxTxD).astype(jnp.float32) + self.dt_bias[...])
    y, h = chunked_ssd(x_BxTxHxP, dt_BxTxH, -jnp.exp(self.A_log[...]), streams["B"],
                       streams["C"], cache["ssm"], chunk_size=self.chunk_size,
                       segments=segments_BxT)
    y = (y + self.D[...][:, None] * x_BxTxHxP).reshape(b, t, self.d_inner)
    y = gated_rms_norm(y, self.z_proj(u_BxTxD), self.norm_scale[...])
    return self.out_proj(y.astype(self.dtype)), {"conv": windows, "ssm": h}

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    del positions_BxL  # order comes from the recurrence
    return self._mix(x_BxLxD, self.init_cache(x_BxLxD.shape[0], 0), segments_BxL)[0]

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    window = lambda width: jnp.zeros((batch_size, self.conv_width - 1, width), self.dtype)
    n = self.state_size
    return {"conv": {"x": window(self.d_inner), "B": window(n), "C": window(n)},
            "ssm": jnp.zeros((batch_size, self.num_heads, self.head_dim, n), jnp.float32)}

  def decode(self, x_BxTxD, cache, index):
    del index
    return self._mix(x_BxTxD, cache)

  def mixing_flops_per_token(self, context_length):
    e, h, p, n = self.d_inner, self.num_heads, self.head_dim, self.state_size
    c = min(self.chunk_size, context_length)
    # Within a chunk, over (C + 1) / 2 keys on average: C . B (shared by the heads), the decay
    # and scores @ x; across chunks: h C and the state update; the convolutions (x, B, C); skip,
    # gate and norm.
    intra = (c + 1) / 2 * (2 * n + 2 * h + 2 * h * p)
    inter = 2 * 2 * h * p * n
    return intra + inter + 2 * self.conv_width * (e + 2 * n) + 10 * e
