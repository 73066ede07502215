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

The chunked SSD ("state space duality") form computes the scan as matmuls (the "minimal SSD"
algorithm of the paper, section 7). With a_t = dt_t A and, within a chunk, cum_l = a_1 + ... + a_l:
  intra-chunk:  y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s     (a masked [C, C]
                attention-like matmul whose mask is the segment-sum decay)
  chunk state:  S = sum_s exp(cum_C - cum_s) dt_s x_s B_s^T      (the chunk's own part, from 0)
  next state:   h = exp(cum_C) h_prev + S
  from state:   y_l += exp(cum_l) h_prev C_l
The intra-chunk outputs and chunk states of all chunks are batched matmuls over (batch and
chunk, head); only the [H, P, N] state is scanned over chunks, and the from-state outputs are
again one batched matmul. Memory grows as [length, C] per head plus one [H, P, N] state per
chunk, never [length, length] or [length, P, N]. Retention is the special case of a constant
decay and per-head B, C (research/model/attention/retention.py). Decoding runs the same form from
the cached conv windows and SSM state on any number of new tokens (prefill is one pass). On CPU,
per-token work runs on [batch * length, ...] and parameters are broadcast to the activations'
full shape (see layer_inputs): XLA:CPU is slow to sum over tokens behind a batch axis of size 1.
Packed documents: the state restarts at a segment start (the intra-chunk mask keeps to the
segment, the carried state reaches only its own segment's tokens) and the convolution sees no
input of an earlier segment, as Mamba does here.
"""


import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import masks
from research.model.attention import modules

A_INIT_RANGE = (1.0, 16.0)  # A ~ U[1, 16] per head


def _intra_chunk(xdt_KxHxCxP, cum_KxHxC, same_KxCxC, B_KxCxN, C_KxCxN):
  """y_l = sum_{s <= l, same segment} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s for every chunk
  at once: a masked [C, C] attention-like matmul per chunk and head -> [K, H, C, P]."""
  # exp(cum_l - cum_s) for s <= l in the same segment; masked before exp, so no overflow.
  exponents_KxHxCxC = cum_KxHxC[..., :, None] - cum_KxHxC[..., None, :]
  decay_KxHxCxC = jnp.exp(jnp.where(same_KxCxC[:, None], exponents_KxHxCxC, -jnp.inf))
  scores_KxHxCxC = jnp.einsum("kln,ksn->kls", C_KxCxN, B_KxCxN)[:, None] * decay_KxHxCxC
  return jnp.einsum("khls,khsp->khlp", scores_KxHxCxC, xdt_KxHxCxP)


def _chunk_states(xdt_KxHxCxP, to_end_KxHxC, B_KxCxN):
  """Each chunk's own contribution to the state at its end, from a zero state:
  sum_s exp(cum_C - cum_s) dt_s x_s B_s^T over the chunk's last segment -> [K, H, P, N]."""
  return jnp.einsum("khcp,kcn->khpn", xdt_KxHxCxP * to_end_KxHxC[..., None], B_KxCxN)


def chunked_ssd(x, dt, A, B, C, h0, *, chunk_size=64, segments=None):
  """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t from h0, in chunks of chunk_size.

  x: [b, L, H, P]; dt: [b, L, H] (> 0); A: [H] (< 0); B, C: [b, L, N]; h0: [b, H, P, N].
  segments [b, L] (packed documents, non-decreasing) restart h at each segment start; h0
  belongs to the first token's segment. The D x skip term is the caller's.
  Returns (y [b, L, H, P], h_L).
  """
  b, length, heads, p = x.shape
  chunk = min(chunk_size, length)
  num_chunks = chunked.num_chunks(length, chunk)
  padded = num_chunks * chunk

  def to_chunks(t):  # [b, L, ...] -> [K = b * chunks, C, ...]; dt = 0 padding keeps the state
    t = chunked.split_chunks(t, chunk)
    return t.reshape(b * num_chunks, *t.shape[2:])

  same, sees_state, keeps_state, adds = (
      m.reshape(b * num_chunks, *m.shape[2:])
      for m in masks.all_chunk_segments(segments, padded, chunk, b))
  # Heads before tokens: every matmul below is batched over (batch and chunk, head). dt_t x_t
  # on [b L, H, P] and A broadcast to dt's shape: their gradients then sum without a batch axis
  # of size 1 in front, which XLA:CPU sums slowly.
  xdt = x.reshape(b * length, heads, p) * dt.reshape(b * length, heads, 1)
  xdt_KxHxCxP = to_chunks(xdt.reshape(x.shape)).swapaxes(1, 2)
  B_KxCxN, C_KxCxN = to_chunks(B), to_chunks(C)
  # The cumulative sum as a matmul with a triangular matrix: XLA:CPU's cumsum (reduce-window)
  # fuses into the decay below as a slow, unvectorised loop. Full float32 precision: the sums
  # are exponentiated (no TF32 / bf16 passes on accelerators).
  inclusive_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.float32))
  log_decay = dt * jnp.broadcast_to(A, dt.shape)
  cum_KxHxC = jnp.einsum("kch,lc->khl", to_chunks(log_decay), inclusive_CxC,
                         precision=jax.lax.Precision.HIGHEST)
  y_KxHxCxP = _intra_chunk(xdt_KxHxCxP, cum_KxHxC, same, B_KxCxN, C_KxCxN)
  to_end_KxHxC = jnp.exp(cum_KxHxC[..., -1:] - cum_KxHxC) * adds[:, None]
  chunk_decay_KxH = jnp.exp(cum_KxHxC[..., -1]) * keeps_state[:, None]
  states_KxHxPxN = _chunk_states(xdt_KxHxCxP, to_end_KxHxC, B_KxCxN)
  per_row = lambda t: t.reshape(b, num_chunks, *t.shape[1:])
  starts, h = base.states_entering_chunks(h0, per_row(chunk_decay_KxH)[..., None, None],
                                          per_row(states_KxHxPxN), axis=1)
  from_state_KxHxCxP = jnp.einsum("kln,khpn->khlp", C_KxCxN * sees_state[..., None],
                                  starts.reshape(states_KxHxPxN.shape))
  y_KxHxCxP += jnp.exp(cum_KxHxC)[..., None] * from_state_KxHxCxP
  y = y_KxHxCxP.reshape(b, num_chunks, heads, chunk, p).swapaxes(2, 3)
  return chunked.merge_chunks(y, length), h


def gated_rms_norm(y_TxE, z_TxE, scale_E, eps=modules.NORM_EPSILON):
  """RMSNorm(y * silu(z)) * scale over the inner width, in float32 (modules.gated_rms_norm,
  gating before the norm); the scale broadcast to the full shape (see layer_inputs)."""
  return modules.gated_rms_norm(y_TxE, z_TxE, jnp.broadcast_to(scale_E, y_TxE.shape), eps=eps,
                                norm_before_gate=False)


def check_settings(name, settings, model_config, fields):
  """model.<name>'s `fields` >= 1 and its head_dim dividing the inner width expand * d_model
  (Mamba-2's layer and the layers built on it): ValueError naming what is valid."""
  for field in fields:
    if settings[field] < 1:
      raise ValueError(f"model.{name}.{field} must be >= 1, got {settings[field]}")
  inner = settings.expand * model_config.d_model
  if inner % settings.head_dim:
    raise ValueError(
        f"model.{name}.head_dim={settings.head_dim} does not divide the inner width "
        f"expand * d_model = {inner}; valid head_dim: "
        f"{[p for p in range(1, inner + 1) if inner % p == 0]}")


def layer_inputs(layer, u_BxTxD, conv_cache, segments_BxT=None):
  """(u [b t, D], the convolved and SiLU-ed streams {x, B, C} [B, T, F] float32, the new
  convolution windows, x [b t, H, P], dt [b t, H]) of T tokens: the input side of Mamba-2's
  layer `layer`, which the layers built on it share (log_linear_mamba2). Per-token work runs on [b t, ...]
  (all rows' tokens on one axis, as nn.dense does for the projections) and parameters are
  broadcast to the full shape, for XLA:CPU: it is slow to sum over an axis behind a batch axis
  of size 1, which implicit broadcasting keeps."""
  b, t, d = u_BxTxD.shape
  u_TxD = u_BxTxD.reshape(b * t, d)
  streams, windows = {}, {}
  for name, proj in (("x", layer.x_proj), ("B", layer.B_proj), ("C", layer.C_proj)):
    y, windows[name] = modules.causal_depthwise_conv(
        proj(u_TxD).reshape(b, t, -1), conv_cache[name], layer.conv_kernels[name][...],
        layer.conv_biases[name][...], segments_BxT)
    streams[name] = jax.nn.silu(y).astype(jnp.float32)
  x_TxHxP = streams["x"].reshape(b * t, layer.num_heads, layer.head_dim)
  dt_TxH = layer.dt_proj(u_TxD).astype(jnp.float32)
  dt_TxH = jax.nn.softplus(dt_TxH + jnp.broadcast_to(layer.dt_bias[...], dt_TxH.shape))
  return u_TxD, streams, windows, x_TxHxP, dt_TxH


def layer_output(layer, y, u_TxD, x_TxHxP, shape_BxTxD):
  """out [B, T, D] of the SSM's y (x_TxHxP's shape): the D skip, the gated RMSNorm (gate, then
  norm, as Mamba-2's) and the output projection."""
  skip_TxHxP = jnp.broadcast_to(layer.D[...][:, None], x_TxHxP.shape) * x_TxHxP
  y_TxE = (y.reshape(x_TxHxP.shape) + skip_TxHxP).reshape(x_TxHxP.shape[0], layer.d_inner)
  y_TxE = gated_rms_norm(y_TxE, layer.z_proj(u_TxD), layer.norm_scale[...])
  return layer.out_proj(y_TxE.astype(layer.dtype)).reshape(shape_BxTxD)


class Mamba2(chunked.ChunkedRecurrentMixer):
  hyperparameters = {"state_size": 64, "head_dim": 64, "expand": 2, "conv_width": 4,
                     "chunk_size": 64}
  test_settings = {"chunk_size": 8, "state_size": 8, "head_dim": 16}

  @classmethod
  def validate(cls, settings, model_config):
    check_settings("mamba2", settings, model_config, cls.hyperparameters)

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d = model_config.d_model
    e = settings.expand * d
    p, n = int(settings.head_dim), int(settings.state_size)
    self.d_inner, self.head_dim, self.num_heads, self.state_size = e, p, e // p, n
    self.conv_width = w = int(settings.conv_width)
    self.chunk_size = int(settings.chunk_size)
    self.dtype = dtype = nn.compute_dtype(model_config)

    def projection(width, axis):
      return nn.dense("...D,DF->...F", (d, width), ("embed", axis), rngs=rngs, dtype=dtype)

    self.z_proj, self.x_proj = projection(e, "mlp"), projection(e, "mlp")
    self.B_proj, self.C_proj = projection(n, "state"), projection(n, "state")
    self.dt_proj = projection(self.num_heads, "heads")
    conv_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=1)
    streams = (("x", e, "mlp"), ("B", n, "state"), ("C", n, "state"))
    self.conv_kernels = nnx.Dict({
        name: modules.short_conv_kernel(rngs, w, width, (axis,), init=conv_init)
        for name, width, axis in streams})
    self.conv_biases = nnx.Dict({name: modules.short_conv_bias(width, (axis,))
                                 for name, width, axis in streams})
    # Decay rates, time steps and gains, not weights: no weight decay.
    h = self.num_heads
    self.dt_bias = nn.param(modules.dt_bias_init(rngs.params(), (h,)), ("heads",),
                            weight_decay=False)
    self.A_log = nn.param(modules.a_log_init(rngs.params(), (h,), *A_INIT_RANGE), ("heads",),
                          weight_decay=False)
    self.D = nn.param(jnp.ones((h,)), ("heads",), weight_decay=False)
    self.norm_scale = nn.param(jnp.ones((e,)), ("mlp",), weight_decay=False)
    self.out_proj = nn.dense("...E,ED->...D", (e, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def _mix(self, u_BxTxD, cache, segments_BxT=None):
    b, t, _ = u_BxTxD.shape
    u_TxD, streams, windows, x_TxHxP, dt_TxH = layer_inputs(self, u_BxTxD, cache["conv"],
                                                            segments_BxT)
    y, h = chunked_ssd(x_TxHxP.reshape(b, t, *x_TxHxP.shape[1:]), dt_TxH.reshape(b, t, -1),
                       -jnp.exp(self.A_log[...]), streams["B"], streams["C"], cache["ssm"],
                       chunk_size=self.chunk_size, segments=segments_BxT)
    return layer_output(self, y, u_TxD, x_TxHxP, u_BxTxD.shape), {"conv": windows, "ssm": h}

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    window = lambda width: jnp.zeros((batch_size, self.conv_width - 1, width), self.dtype)
    n = self.state_size
    return {"conv": {"x": window(self.d_inner), "B": window(n), "C": window(n)},
            "ssm": jnp.zeros((batch_size, self.num_heads, self.head_dim, n), jnp.float32)}

  def mixing_flops_per_token(self, context_length):
    e, h, p, n = self.d_inner, self.num_heads, self.head_dim, self.state_size
    c = min(self.chunk_size, context_length)
    # Within a chunk, over (C + 1) / 2 keys on average: C . B (shared by the heads), the decay
    # and scores @ x; across chunks: h C and the state update; the convolutions (x, B, C); skip,
    # gate and norm.
    intra = (c + 1) / 2 * (2 * n + 2 * h + 2 * h * p)
    inter = 2 * 2 * h * p * n
    return intra + inter + 2 * self.conv_width * (e + 2 * n) + 10 * e
