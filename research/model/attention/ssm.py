"""Mamba selective state-space mixer (Gu & Dao, arXiv:2312.00752).

  x, z = in_proj(u);  x = silu(causal_depthwise_conv(x))            (width 4)
  dt, B, C = x_proj(x);  delta = softplus(dt_proj(dt))               (dt_proj bias = softplus^-1(dt0),
                                                                      dt0 ~ logU[1e-3, 1e-1])
  A = -exp(A_log),  A_log = log(1..N)
  h_t = exp(delta_t A) * h_{t-1} + delta_t B_t x_t,   y_t = C_t h_t + D x_t
  out = out_proj(y * silu(z))
The scan runs in chunks: inside a chunk an associative scan (accelerators) or a token-by-token
scan (CPU; model.mamba.scan), across chunks the carried state;
each chunk is rematerialised in the backward pass, so memory grows with length as
[batch, length, d_inner] plus one [batch, d_inner, N] state per chunk, never
[batch, length, d_inner, N]. The token-by-token chunk has a hand-written backward (a reverse-time
adjoint scan over a [b, N, d_inner] state; XLA's autodiff of the scan was over 10x its forward
on CPU). The decode state is the conv window and the SSM state; decoding
runs the same chunked scan on any number of new tokens (prefill is one pass). Packed documents:
at a segment start the decay is 0 (h restarts from the drive alone) and the convolution sees no
input of an earlier segment.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import chunked
from research.model.attention import core
from research.model.attention import masks
from research.model.attention import modules

# The short convolution and the time step's initialisation live in modules.py (shared by the
# recurrent mixers); their names here serve code that imports them from this file.
causal_depthwise_conv = modules.causal_depthwise_conv
decode_window = modules.decode_window
dt_bias_init = modules.dt_bias_init


def _combine(left, right):
  """Composition of the affine maps h -> a h + b (left first), for the associative scan."""
  a_left, b_left = left
  a_right, b_right = right
  return a_left * a_right, a_right * b_left + b_right


def _associative_chunk(h_BxExN, chunk, A_ExN):
  """One chunk as a parallel (associative) scan: log-depth, suits GPUs and TPUs."""
  x, delta, B, C, keep = chunk  # [b, c, E], [b, c, E], [b, c, N], [b, c, N], [b, c]
  decay = jnp.exp(delta[..., None] * A_ExN) * keep[:, :, None, None]
  drive = (delta * x)[..., None] * B[:, :, None, :]
  decay_cum, drive_cum = jax.lax.associative_scan(_combine, (decay, drive), axis=1)
  h = decay_cum * h_BxExN[:, None] + drive_cum
  return h[:, -1], jnp.einsum("bcen,bcn->bce", h, C)


def _decay_and_drive(x_t, delta_t, B_t, keep_t, A_NxE):
  """exp(delta_t A) (0 where the state restarts) and delta_t x_t B_t^T, each [b, N, E]."""
  decay = jnp.exp(delta_t[:, None, :] * A_NxE) * keep_t[:, None, None]
  return decay, B_t[..., None] * (delta_t * x_t)[:, None, :]


def _forward_states(h_BxNxE, chunk, A_NxE):
  """The chunk token by token; returns h_c and every h_{t-1}, [c, b, N, E] (for the backward)."""

  def step(h, inputs):
    x_t, delta_t, B_t, _, keep_t = inputs
    decay, drive = _decay_and_drive(x_t, delta_t, B_t, keep_t, A_NxE)
    return decay * h + drive, h

  return jax.lax.scan(step, h_BxNxE, tuple(t.swapaxes(0, 1) for t in chunk))


def _sequential_chunk(h_BxExN, chunk, A_ExN):
  """One chunk token by token: the [b, E, N] state stays in cache, which is fastest on CPUs.
  Inside, the state is laid out [b, N, E] (contractions over N are then vector adds).

  Its backward (_sequential_chunk_bwd) is written out rather than derived by autodiff, which
  on XLA's CPU backend costs over 10x the forward (stacked per-step residuals, transposes);
  tests/test_kernels.py checks it against autodiff of the reference scan.
  """
  h, y = _sequential_chunk_nxe(h_BxExN.swapaxes(1, 2), chunk, A_ExN.T)
  return h.swapaxes(1, 2), y


@jax.custom_vjp
def _sequential_chunk_nxe(h_BxNxE, chunk, A_NxE):
  def step(h, inputs):
    x_t, delta_t, B_t, C_t, keep_t = inputs
    decay, drive = _decay_and_drive(x_t, delta_t, B_t, keep_t, A_NxE)
    h = decay * h + drive
    return h, jnp.einsum("bne,bn->be", h, C_t)

  h, y = jax.lax.scan(step, h_BxNxE, tuple(t.swapaxes(0, 1) for t in chunk))
  return h, y.swapaxes(0, 1)


def _sequential_chunk_fwd(h_BxNxE, chunk, A_NxE):
  return _sequential_chunk_nxe(h_BxNxE, chunk, A_NxE), (h_BxNxE, chunk, A_NxE)


def _sequential_chunk_bwd(residuals, cotangents):
  """Reverse-time adjoint of h_t = decay_t h_{t-1} + drive_t, y_t = h_t C_t.

  g_t (the gradient reaching h_t) = dh_c at t = c, g_t = dy_t C_t^T + decay_{t+1} g_{t+1};
  then d drive_t = g_t, d(delta_t A) = g_t h_{t-1} decay_t, dC_t = h_t^T dy_t, dh_0 = decay_1 g_1.
  The states h_t are recomputed from the chunk's start (the chunk is the rematerialised unit).
  keep comes from boolean resets and gets a zero gradient.
  """
  h0, chunk, A_NxE = residuals
  dh, dy_BxCxE = cotangents
  x, delta, B, C, keep = chunk
  _, previous = _forward_states(h0, chunk, A_NxE)

  # Every per-token contraction is a matrix-vector product over N or E ("bne,bn->be",
  # "bne,be->bn"; the sum over N against ones, not "bne,ne->be", which XLA:CPU runs as a dot
  # batched over E with transposed copies of both operands), and dA accumulates per batch row
  # elementwise (summed over the batch once per chunk): 0.45 -> 0.39 s for the scan's fwd+bwd
  # at 4096 (d_inner 1024, N 16) on one core.
  ones_BxN = jnp.ones_like(B[:, 0])

  def step(carry, inputs):
    g, dA = carry
    x_t, delta_t, B_t, C_t, keep_t, dy_t, h_prev = inputs
    decay, drive = _decay_and_drive(x_t, delta_t, B_t, keep_t, A_NxE)
    h_t = decay * h_prev + drive
    g = g + C_t[..., None] * dy_t[:, None, :]
    d_exponent = g * h_prev * decay  # d(delta_t A)
    d_scaled_x = jnp.einsum("bne,bn->be", g, B_t)  # d(delta_t x_t)
    grads = (d_scaled_x * delta_t,
             jnp.einsum("bne,bn->be", d_exponent * A_NxE, ones_BxN) + d_scaled_x * x_t,
             jnp.einsum("bne,be->bn", g, delta_t * x_t),
             jnp.einsum("bne,be->bn", h_t, dy_t))
    return (g * decay, dA + d_exponent * delta_t[:, None, :]), grads

  time_major = tuple(t.swapaxes(0, 1) for t in (x, delta, B, C, keep, dy_BxCxE))
  (dh0, dA), (dx, ddelta, dB, dC) = jax.lax.scan(
      step, (dh, jnp.zeros_like(dh)), (*time_major, previous), reverse=True)
  batch_major = tuple(t.swapaxes(0, 1) for t in (dx, ddelta, dB, dC))
  return dh0, (*batch_major, jnp.zeros_like(keep)), dA.sum(0)


_sequential_chunk_nxe.defvjp(_sequential_chunk_fwd, _sequential_chunk_bwd)


SCANS = {"associative": _associative_chunk, "sequential": _sequential_chunk}


def scan_for_backend(name):
  """model.mamba.scan: "auto" is sequential on CPU and associative on accelerators."""
  if name == "auto":
    return "sequential" if core.target_platform() == "cpu" else "associative"
  return name


def chunked_selective_scan(x, delta, A, B, C, h0, *, chunk_size=64, scan="associative",
                           resets=None):
  """y_t = C_t h_t with h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t, from h0, in chunks.

  x, delta: [b, L, E]; A: [E, N]; B, C: [b, L, N]; h0: [b, E, N]. resets [b, L] bool (packed
  documents): where True, h_{t-1} is dropped (decay 0). Returns (y [b, L, E], h_L).
  Within a chunk the scan is `scan` (see SCANS); the D x skip term is the caller's.
  """
  b, length, _ = x.shape
  chunk = min(chunk_size, length)

  def to_chunks(t):  # [b, L, ...] -> [Z, b, C, ...]
    return chunked.split_chunks(t, chunk).swapaxes(0, 1)

  # Padding has delta = 0: decay 1 and drive 0 leave the state unchanged. keep = 0 drops h_{t-1}
  # at a reset; padding keeps the state (keep 1: not a reset).
  resets = jnp.zeros((b, length), bool) if resets is None else resets
  keep = (~to_chunks(resets)).astype(x.dtype)
  chunk_scan = SCANS[scan]
  body = lambda h, c: chunk_scan(h, c, A)
  if scan == "associative":  # the sequential chunk recomputes its states in its own backward
    body = jax.checkpoint(body)
  h, y = jax.lax.scan(body, h0, (*map(to_chunks, (x, delta, B, C)), keep))
  return chunked.merge_chunks(y.swapaxes(0, 1), length), h


class Mamba(chunked.ChunkedRecurrentMixer):
  hyperparameters = {"state_size": 16, "conv_width": 4, "expand": 2,
                     "dt_rank": 0,  # 0: ceil(d_model / 16)
                     "chunk_size": 64,
                     "scan": "auto"}  # within a chunk: associative | sequential | auto
  test_settings = {"chunk_size": 8, "state_size": 4}

  @classmethod
  def validate(cls, settings, model_config):
    for field in ("state_size", "conv_width", "expand", "chunk_size"):
      if settings[field] < 1:
        raise ValueError(f"model.mamba.{field} must be >= 1, got {settings[field]}")
    if settings.dt_rank < 0:
      raise ValueError(f"model.mamba.dt_rank must be >= 0 (0: ceil(d_model / 16)), got "
                       f"{settings.dt_rank}")
    if settings.scan not in ("auto", *SCANS):
      raise ValueError(f"unknown model.mamba.scan {settings.scan!r}; valid: auto, "
                       f"{', '.join(SCANS)}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d = model_config.d_model
    e = settings.expand * d
    n = settings.state_size
    r = settings.dt_rank or math.ceil(d / 16)
    self.d_inner, self.state_size, self.dt_rank = e, n, r
    self.conv_width = int(settings.conv_width)
    self.chunk_size = int(settings.chunk_size)
    self.scan = scan_for_backend(settings.scan)
    self.dtype = dtype = nn.compute_dtype(model_config)
    self.in_proj = nn.dense("BLD,DE->BLE", (d, 2 * e), ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.conv_kernel = modules.short_conv_kernel(
        rngs, self.conv_width, e, ("mlp",),
        init=nnx.initializers.lecun_normal(in_axis=0, out_axis=1))
    self.conv_bias = modules.short_conv_bias(e, ("mlp",))
    self.x_proj = nn.dense("BLE,EF->BLF", (e, r + 2 * n), ("mlp", "ssm_proj"), rngs=rngs,
                           dtype=dtype)
    self.dt_proj = nn.dense(
        "BLR,RE->BLE", (r, e), ("ssm_proj", "mlp"), bias_shape=(e,), bias_axes=("mlp",),
        rngs=rngs, dtype=dtype, bias_init=modules.dt_bias_init,
        init=lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -r ** -0.5, r ** -0.5))
    # A = -exp(A_log) and the skip D are decay rates and gains, not weights: no weight decay.
    self.A_log = nn.param(jnp.log(jnp.tile(jnp.arange(1, n + 1, dtype=jnp.float32), (e, 1))),
                          ("mlp", "state"), weight_decay=False)
    self.D = nn.param(jnp.ones((e,)), ("mlp",), weight_decay=False)
    self.out_proj = nn.dense("BLE,ED->BLD", (e, d), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def _mix(self, u_BxTxD, cache, segments_BxT=None):
    x, z = jnp.split(self.in_proj(u_BxTxD), 2, axis=-1)
    x, window = modules.causal_depthwise_conv(x, cache["conv"], self.conv_kernel[...],
                                              self.conv_bias[...], segments_BxT)
    x = jax.nn.silu(x)
    dt, B, C = jnp.split(self.x_proj(x), [self.dt_rank, self.dt_rank + self.state_size], axis=-1)
    delta = jax.nn.softplus(self.dt_proj(dt).astype(jnp.float32))
    A = -jnp.exp(self.A_log[...])
    x32 = x.astype(jnp.float32)
    y, h = chunked_selective_scan(x32, delta, A, B.astype(jnp.float32), C.astype(jnp.float32),
                                  cache["ssm"], chunk_size=self.chunk_size, scan=self.scan,
                                  resets=(None if segments_BxT is None
                                          else masks.document_starts(segments_BxT)))
    # D broadcast to the full shape: XLA:CPU sums slowly over an axis behind a kept batch
    # axis of size 1, which implicit broadcasting would leave in D's gradient.
    y = (y + jnp.broadcast_to(self.D[...], x32.shape) * x32).astype(self.dtype) * jax.nn.silu(z)
    return self.out_proj(y), {"conv": window, "ssm": h}

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    return {"conv": jnp.zeros((batch_size, self.conv_width - 1, self.d_inner), self.dtype),
            "ssm": jnp.zeros((batch_size, self.d_inner, self.state_size), jnp.float32)}

  def mixing_flops_per_token(self, context_length):
    del context_length
    # decay exp and multiply, drive (2), scan combine (3), C contraction (2); the conv.
    return 9 * self.d_inner * self.state_size + 2 * self.conv_width * self.d_inner
