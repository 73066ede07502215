"""The layers' pieces that the recurrent mixers share (flash-linear-attention keeps them in
fla/modules): the per-head norms of their outputs, the short causal convolution with its cached
window, and the initialisation of their decay parameters.

Norms over the last axis (a head's channels, or Mamba-2's whole inner width), in float32:
  rms_norm(x)              = x / sqrt(mean(x^2) + eps) * g                   (RMSNorm; g optional)
  gated_rms_norm(x, z)     = rms_norm(x) * silu(z)     fla's FusedRMSNormGated: Gated DeltaNet,
                                                       GLA (arXiv:2412.06464, 2312.06635), and
                                                       RetNet's swish gate (arXiv:2307.08621)
                           = rms_norm(x * silu(z))     Mamba-2's (norm_before_gate=False,
                                                       arXiv:2405.21060)
  group_norm(x)            = (x - mean(x)) / sqrt(var(x) + eps) * g + b      (GroupNorm, one group
                                                       per head: RWKV-6 and RWKV-7)
eps is NORM_EPSILON (fla's RMSNorm, Mamba-2's) unless a mixer passes its own (RetNet 1e-6, RWKV
64e-5); each mixer's docstring names its own.

The short convolution (Mamba, arXiv:2312.00752; fla's ShortConvolution): a causal depthwise
convolution of width W over the tokens, y_t = sum_i kernel_i x_{t - W + 1 + i} (+ bias), whose
decode state is the last W - 1 inputs; packed documents see no input of an earlier document.

Decay parameters: A = -exp(A_log) per head with A ~ U[low, high] (Mamba-2: U[1, 16], fla's
Gated DeltaNet: U[0, 16]), and the time step's bias dt_bias = softplus^-1(dt0) with
dt0 ~ logU[1e-3, 1e-1] floored at 1e-4 (Mamba, section 3.6).
"""

import math

import jax
import jax.numpy as jnp

from research.model import nn

NORM_EPSILON = 1e-5  # fla's RMSNorm / FusedRMSNormGated, Mamba-2's RMSNormGated
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


def rms_norm(x, scale=None, *, eps=NORM_EPSILON):
  """x / sqrt(mean(x^2) + eps) over the last axis, times `scale` if given (no casting: float32
  in, float32 out)."""
  normalized = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)
  return normalized if scale is None else normalized * scale


def gated_rms_norm(x, gate, scale=None, *, eps=NORM_EPSILON, norm_before_gate=True,
                   dtype=jnp.float32):
  """RMSNorm(x) * scale * silu(gate) (norm_before_gate, fla's FusedRMSNormGated), the norm in
  float32 and cast to `dtype`, in which the gate is activated and multiplied (RetNet's gate
  runs in the compute dtype); or RMSNorm(x * silu(gate)) * scale (Mamba-2's RMSNormGated with
  norm_before_gate=False), all in float32. Over the last axis."""
  if not norm_before_gate:
    gated = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return rms_norm(gated, scale, eps=eps)
  normalized = rms_norm(x.astype(jnp.float32), scale, eps=eps).astype(dtype)
  return normalized * jax.nn.silu(gate.astype(dtype))


def group_norm(x, scale, bias, *, eps):
  """(x - mean) / sqrt(variance + eps) * scale + bias over the last axis: GroupNorm with one
  group per head when the last axis is a head's channels."""
  mean = x.mean(-1, keepdims=True)
  variance = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(variance + eps) * scale + bias


def a_log_init(key, shape, low, high):
  """log A, A ~ U[low, high] (A = -exp(A_log) is the decay rate), float32; kept off 0 so that
  the log is finite when low is 0."""
  a = jax.random.uniform(key, shape, jnp.float32, low, high)
  return jnp.log(jnp.maximum(a, jnp.finfo(jnp.float32).tiny))


def dt_bias_init(key, shape, dtype=jnp.float32):
  """softplus^-1(dt0), dt0 ~ logU[DT_MIN, DT_MAX] floored at DT_FLOOR (Mamba, section 3.6)."""
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.maximum(jnp.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)), DT_FLOOR)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def conv1d_default_init(width):
  """PyTorch's Conv1d default for a depthwise kernel (fan-in = width): U(-1/sqrt(W), 1/sqrt(W)),
  its weight and bias alike (fla's ShortConvolution, Hyena's short filter)."""
  bound = 1.0 / math.sqrt(width)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


def _channels(channels):
  return tuple(channels) if isinstance(channels, (tuple, list)) else (channels,)


def short_conv_kernel(rngs, width, channels, channel_axes, init=None):
  """The kernel [W, *channels] of a short convolution, logical axes ("conv", *channel_axes), a
  weight (weight decay): drawn from `init`, by default PyTorch's Conv1d default
  (conv1d_default_init)."""
  shape = (width, *_channels(channels))
  init = conv1d_default_init(width) if init is None else init
  return nn.param(init(rngs.params(), shape), ("conv", *channel_axes), weight_decay=True)


def short_conv_bias(channels, channel_axes, *, rngs=None, width=None):
  """The bias [*channels] of a short convolution (no weight decay): zeros (Mamba's), or with
  `rngs` drawn as PyTorch's Conv1d default for `width` taps (Hyena's)."""
  shape = _channels(channels)
  values = (jnp.zeros(shape) if rngs is None
            else conv1d_default_init(width)(rngs.params(), shape))
  return nn.param(values, tuple(channel_axes), weight_decay=False)


def causal_depthwise_conv(x_BxTxF, window_BxWxF, kernel_WxF, bias_F=None, segments_BxT=None):
  """Causal depthwise convolution of x [B, T, ...channels] (tap W - 1 on the token itself) after
  the cached window [B, W - 1, ...] of the previous inputs (which belong to the first token's
  segment); inputs of other segments count as 0. Returns the output and the window for the next
  call: the last W - 1 inputs, those of other segments than the last token's zeroed, so that
  the window belongs to the last token's segment (a document that starts among the last W - 1
  tokens and goes on in the next call sees nothing of the one before it)."""
  full = jnp.concatenate([window_BxWxF.astype(x_BxTxF.dtype), x_BxTxF], axis=1)
  kernel = kernel_WxF.astype(x_BxTxF.dtype)
  t, w = x_BxTxF.shape[1], kernel_WxF.shape[0]
  taps = [full[:, i:i + t] for i in range(w)]
  if segments_BxT is not None:
    segments = jnp.pad(segments_BxT, [(0, 0), (w - 1, 0)], mode="edge")
    channels = (1,) * (x_BxTxF.ndim - 2)
    taps = [tap * (segments[:, i:i + t] == segments_BxT).reshape(*segments_BxT.shape, *channels)
            for i, tap in enumerate(taps)]
  # Parameters broadcast to the full shape: the gradient then sums over every token axis at
  # once (XLA:CPU sums slowly over an axis that follows a kept batch axis of size 1).
  y = sum(tap * jnp.broadcast_to(kernel[i], tap.shape) for i, tap in enumerate(taps))
  if bias_F is not None:
    y = y + jnp.broadcast_to(bias_F.astype(y.dtype), y.shape)
  window = full[:, t:]
  if segments_BxT is not None:
    last = (segments[:, t:] == segments_BxT[:, -1:]).reshape(*window.shape[:2], *channels)
    window = window * last.astype(window.dtype)
  return y, window


def decode_window(window, documents=None):
  """(a short convolution's cached window, the new tokens' segment ids or None) for
  `causal_depthwise_conv` in a decode call: with `documents` (masks.DecodeDocuments) the window
  emptied in the rows whose first new token starts a document."""
  if documents is None:
    return window, None
  return documents.restarted(window, jnp.zeros_like(window)), documents.segments_BxT
