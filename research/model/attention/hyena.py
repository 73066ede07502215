"""Hyena: gated long convolutions with an implicit filter (Poli et al., arXiv:2302.10866).

Order 2, one head, one block, as zoology computes it (HazyResearch/zoology@
d88d6f5474f36998d82d5c3bd58a190248d0a669, zoology/mixers/hyena.py, class Hyena with its Filter,
PositionalEmbedding, ExponentialModulation, Sin and fftconv_ref):
  x1, x2, v = short_conv(in_proj(u))            in_proj D -> 3D with bias; a causal depthwise
                                                conv of width short_filter_order (3), with bias
  v = v * x1                                    (pre-gating)
  y_t = sum_{s <= t} h_{t-s} v_s + D v_t        (long causal convolution per channel, bias D)
  out = out_proj(y * x2)                        (post-gating; out_proj D -> D with bias)
The implicit filter h [positions, D] is a function of the tap n = 0, 1, ...:
  z_n = [t_n, cos(f_b w_n), -sin(f_b w_n)],  t_n = n / (l_max - 1),  w_n = 2 pi n / l_max,
        f = linspace(1e-4, bands - 1, bands), bands = (emb_dim - 1) / 2    (emb_dim 3: f = 1e-4)
  a = sin(freq * (W_0 z_n + b_0)),  a = sin(freq * (W_i a + b_i)) for i < num_inner_mlps,
  h_n = (W_out a) * (exp(-t_n |delta|) + shift),
        delta = linspace(ln(target) / slow_decay_pct, ln(target) / fast_decay_pct, D)
with one trainable frequency vector `freq` [filter_order] shared by every Sin (the reference
builds one Sin module and reuses it), W_out without bias, delta fixed (modulation_lr = 0: a
buffer), D ~ N(0, 1). l_max has no counterpart among this lab's settings: its default, 1024, is
what zoology's MQAR configs pass (l_max = input_seq_len, the longest of their train and test
lengths in original_mqar_configs.py; the figure-2 configs pass each run's own length).

Initialisation is what zoology's language model leaves (zoology/model.py, _init_weights, which
re-initialises every nn.Linear of a TransformerBlock): linear kernels N(0, 0.02) with zero biases
(in_proj and the filter MLP), out_proj N(0, 0.02 / sqrt(2 num_layers)); the short conv keeps
PyTorch's Conv1d default, U(-1/sqrt(W), 1/sqrt(W)) for its kernel and bias; freq = sin_freq
(w = 1), D ~ N(0, 1).

Long convolution. Training and evaluation: FFT (rfft / irfft of length 2L: zero-padded, so linear,
not circular, as fftconv_ref), float32. Packed documents (segments given): the exact masked
Toeplitz form y_t = sum_{0 <= t-s <= p_t} h_{t-s} v_s, p_t = t's position in its document, as
O(L^2 D) work per row scanned over blocks of queries (bounded memory); masking the inputs of one
FFT per row is not enough (every document would see its predecessors' convolved tail), and one FFT
per document has a data-dependent count. The short conv sees no input of an earlier document.
Decode: the cache keeps the short conv's window, the history of the filter inputs v (the gated
v * x1) [B, max_length, D] in the compute dtype, and the filter's max_length taps [max_length, D]
in float32, evaluated once when the cache is made (a function of the parameters, which do not
change while one cache is in use): it grows with the context (D * (itemsize + 4) bytes per token
and layer at batch 1, `cache_bytes_per_token`). One new token costs a dot product over the
history, O(context * D); several new tokens (a prefill chunk) one FFT over the whole history
buffer.

Lengths past l_max: the reference asserts L <= l_max (its z and t are tables of l_max rows, z
itself a parameter). Here z_n and the modulation are computed from n, so the filter is defined at
every tap: t_n grows past 1 linearly (the modulation keeps decaying), the sinusoid band continues
periodically. Below l_max the two agree (z as the reference initialises it).

Deviations: z_n is a fixed function of n, not trained (zoology registers z as a trainable
parameter tagged with lr_pos_emb = 1e-5, a per-parameter setting its trainer ignores, so it
trains at the global rate); per-parameter learning rates are not reproduced; weight decay
follows this lab's convention (the kernels of in_proj, the short conv and out_proj decay; biases,
D and freq do not) and the filter MLP takes none, as Filter declares (wd = 0; zoology's AdamW
decays every parameter at its global rate). Fixed at the reference's defaults, not settings:
num_heads = num_blocks = 1, dropout = filter_dropout = 0, no outer mixing, not bidirectional,
modulate = True, normalized = False. Positions are ignored: order comes from the convolutions.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import masks
from research.model.attention import modules

HIGHEST = jax.lax.Precision.HIGHEST
INIT_STD = 0.02  # zoology/model.py _init_weights: initializer_range
# Packed documents: queries per block of the masked Toeplitz form, so that a block holds about
# TOEPLITZ_BLOCK_ELEMENTS [query, key] pairs per channel and row.
TOEPLITZ_BLOCK_ELEMENTS = 1 << 14


def positional_features(n, l_max, emb_dim):
  """z_n [len(n), emb_dim] of zoology's PositionalEmbedding at taps n (float): [t, Re, Im] of
  exp(-i f w_n), t_n = n / (l_max - 1), w_n = 2 pi n / l_max; any n, also n >= l_max."""
  bands = (emb_dim - 1) // 2
  t = n / (l_max - 1)
  w = 2 * math.pi * n / l_max
  f = jnp.linspace(1e-4, bands - 1, bands, dtype=jnp.float32)
  angle = f[None, :] * w[:, None]
  return jnp.concatenate([t[:, None], jnp.cos(angle), -jnp.sin(angle)], axis=-1)


def fft_causal_conv(v_BxLxF, k_LxF):
  """y_t = sum_{s <= t} k_{t-s} v_s per channel, float32, by rfft of length 2L (linear)."""
  length = v_BxLxF.shape[1]
  n = 2 * length
  v_f = jnp.fft.rfft(v_BxLxF.astype(jnp.float32), n=n, axis=1)
  k_f = jnp.fft.rfft(k_LxF[:length].astype(jnp.float32), n=n, axis=0)
  return jnp.fft.irfft(v_f * k_f[None], n=n, axis=1)[:, :length]


def segment_causal_conv(v_BxLxF, k_LxF, segments_BxL):
  """y_t = sum_{0 <= t-s <= p_t} k_{t-s} v_s: the causal convolution restarted at each document
  start (p_t: t's position in its document). The masked [L, L] Toeplitz form, exact, O(L^2 F)
  per row, scanned over blocks of queries (each rematerialised in the backward pass)."""
  return reaching_conv_rows(v_BxLxF, k_LxF, 0, masks.positions_in_documents(segments_BxL))


def reaching_conv_rows(v_BxSxF, k_SxF, first_row, reach_BxT):
  """Rows first_row .. first_row + T - 1 of the causal convolution of v [B, S, F] whose row t
  reaches back reach[b, t] inputs at most: y_t = sum_{0 <= t-s <= reach_t} k_{t-s} v_s, [B, T,
  F] float32. The masked Toeplitz rows, O(T S F), scanned over blocks of rows (each
  rematerialised in the backward pass)."""
  b, slots, f = v_BxSxF.shape
  rows = reach_BxT.shape[1]
  block = max(1, min(rows, TOEPLITZ_BLOCK_ELEMENTS // slots))
  blocks = -(-rows // block)
  reach = jnp.pad(reach_BxT, [(0, 0), (0, blocks * block - rows)],
                  constant_values=-1)  # padding sees none
  reach = reach.reshape(b, blocks, block).swapaxes(0, 1)
  v = v_BxSxF.astype(jnp.float32)
  k = k_SxF[:slots].astype(jnp.float32)

  @jax.checkpoint
  def query_block(start, reach_BxC):
    lag_CxS = start + jnp.arange(block)[:, None] - jnp.arange(slots)[None]
    taps_CxSxF = k[jnp.clip(lag_CxS, 0, slots - 1)]
    visible_BxCxS = (lag_CxS[None] >= 0) & (lag_CxS[None] <= reach_BxC[..., None])
    return jnp.einsum("bcs,csf,bsf->bcf", visible_BxCxS.astype(jnp.float32), taps_CxSxF, v,
                      precision=HIGHEST)

  _, y = jax.lax.scan(lambda carry, inputs: (carry, query_block(*inputs)), None,
                      (first_row + jnp.arange(blocks) * block, reach))
  return y.swapaxes(0, 1).reshape(b, blocks * block, f)[:, :rows]


def causal_conv(v_BxLxF, k_LxF, segments_BxL=None):
  """The long causal convolution of a whole sequence: FFT, or per document with segments."""
  if segments_BxL is None:
    return fft_causal_conv(v_BxLxF, k_LxF)
  return segment_causal_conv(v_BxLxF, k_LxF, segments_BxL)


def write_history(history_BxSxF, v_BxTxF, index):
  """The history with the T new inputs written at slots index, index + 1, ..."""
  return jax.lax.dynamic_update_slice_in_dim(history_BxSxF, v_BxTxF.astype(history_BxSxF.dtype),
                                             index, axis=1)


def history_causal_conv(history_BxSxF, k_SxF, index, num_tokens, documents=None):
  """The long convolution's outputs [B, T, F] at slots index .. index + T - 1 of the history
  (which holds them already): one token, a dot product with the taps k_{index - s}, s <= index;
  several, one FFT over the whole buffer (slots past a token do not reach it). With `documents`
  (masks.DecodeDocuments: packed documents) a token's taps reach back to its document's start
  only: one token, the same dot product masked; several, the T masked Toeplitz rows
  (`reaching_conv_rows`, O(T S) against the FFT's O(S log S))."""
  slots = history_BxSxF.shape[1]
  if num_tokens == 1:
    lag_S = index - jnp.arange(slots)
    taps_SxF = jnp.where((lag_S >= 0)[:, None],
                         k_SxF[jnp.clip(lag_S, 0, slots - 1)].astype(jnp.float32), 0.0)
    history = history_BxSxF.astype(jnp.float32)
    if documents is not None:  # slots before the token's document start count as 0
      history = jnp.where((lag_S[None] <= documents.positions_BxT[:, :1])[..., None], history, 0.0)
    return jnp.einsum("sf,bsf->bf", taps_SxF, history, precision=HIGHEST)[:, None]
  if documents is not None:
    return reaching_conv_rows(history_BxSxF, k_SxF, index, documents.positions_BxT)
  full = fft_causal_conv(history_BxSxF, k_SxF)
  return jax.lax.dynamic_slice_in_dim(full, index, num_tokens, axis=1)


def history_and_filter_bytes(model_config):
  """Decode-cache bytes per token of a long convolution at batch 1: the input's d_model values
  in the compute dtype and the filter tap's d_model float32 values."""
  itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
  return model_config.d_model * (itemsize + 4)


def fft_conv_flops_per_token(length, channels):
  """FLOPs per token of fft_causal_conv: three real FFTs of n = 2L points (about 2.5 n log2 n
  each) and the complex product, over the L tokens."""
  length = max(int(length), 1)
  n = 2 * length
  return channels * (3 * 2.5 * n * math.log2(n) + 6 * (n // 2 + 1)) / length


class Hyena(base.Mixer):
  hyperparameters = {"l_max": 1024,  # the filter's time scale: t_n = n / (l_max - 1)
                     "filter_order": 64,  # width of the filter MLP
                     "short_filter_order": 3,  # width of the short depthwise conv
                     "emb_dim": 3,  # z_n: time, then (emb_dim - 1) / 2 cosines and sines
                     "num_inner_mlps": 2,
                     "sin_freq": 1.0,  # initial frequency of the Sin activations (w)
                     "fast_decay_pct": 0.3,
                     "slow_decay_pct": 1.5,
                     "decay_target": 1e-2,
                     "modulation_shift": 0.0}
  # l_max below the suite's length 19: the filter is evaluated past l_max there.
  test_settings = {"l_max": 16, "filter_order": 8}
  recurrent = True  # order comes from the convolutions: it runs beside any position scheme

  @classmethod
  def validate(cls, settings, model_config):
    del model_config
    for field in ("filter_order", "short_filter_order"):
      if settings[field] < 1:
        raise ValueError(f"model.hyena.{field} must be >= 1, got {settings[field]}")
    if settings.l_max < 2:
      raise ValueError(f"model.hyena.l_max must be >= 2 (t_n = n / (l_max - 1)), got "
                       f"{settings.l_max}")
    if settings.emb_dim < 3 or settings.emb_dim % 2 == 0:
      raise ValueError(f"model.hyena.emb_dim must be odd and >= 3 (time, cosines, sines), got "
                       f"{settings.emb_dim}")
    if settings.num_inner_mlps < 0:
      raise ValueError(f"model.hyena.num_inner_mlps must be >= 0, got {settings.num_inner_mlps}")
    for field in ("fast_decay_pct", "slow_decay_pct", "decay_target"):
      if settings[field] <= 0:
        raise ValueError(f"model.hyena.{field} must be > 0, got {settings[field]}")

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """The history of filter inputs (d_model values per token, in the compute dtype) and the
    filter's taps (d_model float32 values per position), at batch 1."""
    return history_and_filter_bytes(model_config)

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the convolutions
    d, order = model_config.d_model, int(settings.filter_order)
    self.d_model, self.filter_order = d, order
    self.l_max, self.emb_dim = int(settings.l_max), int(settings.emb_dim)
    self.short_width = int(settings.short_filter_order)
    self.modulation_shift = float(settings.modulation_shift)
    self.dtype = dtype = nn.compute_dtype(model_config)
    normal = nnx.initializers.normal(INIT_STD)
    self.in_proj = nn.dense("BLD,DE->BLE", (d, 3 * d), ("embed", "mlp"), bias_shape=(3 * d,),
                            bias_axes=("mlp",), rngs=rngs, dtype=dtype, init=normal)
    # PyTorch's Conv1d default, U(-1/sqrt(W), 1/sqrt(W)), for the kernel and the bias alike.
    self.short_kernel = modules.short_conv_kernel(rngs, self.short_width, 3 * d, ("mlp",))
    self.short_bias = modules.short_conv_bias(3 * d, ("mlp",), rngs=rngs, width=self.short_width)
    # The implicit filter: an MLP of z_n with Sin activations (one shared frequency vector);
    # Filter declares weight decay 0 for it.
    widths = [self.emb_dim] + [order] * (1 + int(settings.num_inner_mlps))
    self.filter_kernels = nnx.List([
        nn.param(normal(rngs.params(), (fan_in, order)), ("state", "state"), weight_decay=False)
        for fan_in in widths[:-1]])
    self.filter_biases = nnx.List([nn.param(jnp.zeros((order,)), ("state",), weight_decay=False)
                                   for _ in widths[:-1]])
    self.filter_out = nn.param(normal(rngs.params(), (order, d)), ("state", "mlp"),
                               weight_decay=False)
    self.freq = nn.param(jnp.full((order,), settings.sin_freq), ("state",), weight_decay=False)
    self.D = nn.param(jax.random.normal(rngs.params(), (d,)), ("mlp",), weight_decay=False)
    # ExponentialModulation's decay rates |delta|: a buffer (modulation_lr = 0), not a parameter.
    target = math.log(float(settings.decay_target))
    self.decay_range = (target / float(settings.slow_decay_pct),
                        target / float(settings.fast_decay_pct))
    num_layers = model_config.num_layers
    self.out_proj = nn.dense("BLD,DE->BLE", (d, d), ("mlp", "embed"), bias_shape=(d,),
                             bias_axes=("embed",), rngs=rngs, dtype=dtype,
                             init=nnx.initializers.normal(INIT_STD / math.sqrt(2 * num_layers)))

  def implicit_filter(self, length):
    """h [length, D], float32: the filter's taps 0 .. length - 1 (any length)."""
    n = jnp.arange(length, dtype=jnp.float32)
    a = positional_features(n, self.l_max, self.emb_dim)
    freq = self.freq[...]
    for kernel, bias in zip(self.filter_kernels, self.filter_biases):
      a = jnp.sin(freq * (jnp.matmul(a, kernel[...], precision=HIGHEST) + bias[...]))
    h = jnp.matmul(a, self.filter_out[...], precision=HIGHEST)
    t = n / (self.l_max - 1)
    rates = jnp.abs(jnp.linspace(*self.decay_range, self.d_model, dtype=jnp.float32))
    decay = jnp.exp(-t[:, None] * rates)
    return h * (decay + self.modulation_shift)

  def _gated_inputs(self, x_BxTxD, window, segments_BxT=None):
    u = self.in_proj(x_BxTxD)
    u, window = modules.causal_depthwise_conv(u, window, self.short_kernel[...],
                                              self.short_bias[...], segments_BxT)
    x1, x2, v = jnp.split(u, 3, axis=-1)
    return v * x1, x2, window

  def _output(self, long_BxTxD, v_BxTxD, x2_BxTxD):
    v = v_BxTxD.astype(jnp.float32)
    y = long_BxTxD + jnp.broadcast_to(self.D[...], v.shape) * v
    return self.out_proj((y * x2_BxTxD.astype(jnp.float32)).astype(self.dtype))

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    del positions_BxL  # order comes from the convolutions
    window = jnp.zeros((x_BxLxD.shape[0], self.short_width - 1, 3 * self.d_model), self.dtype)
    v, x2, _ = self._gated_inputs(x_BxLxD, window, segments_BxL)
    long = causal_conv(v, self.implicit_filter(x_BxLxD.shape[1]), segments_BxL)
    return self._output(long, v, x2)

  def init_cache(self, batch_size, max_length):
    return {"conv": jnp.zeros((batch_size, self.short_width - 1, 3 * self.d_model), self.dtype),
            "history": jnp.zeros((batch_size, max_length, self.d_model), self.dtype),
            "filter": self.implicit_filter(max_length)}

  # Packed documents: the short convolution restarts (its window and segment ids), the long one
  # reaches back to each token's document start (history_causal_conv).
  document_decode_refusal = classmethod(base.no_refusal)

  def decode(self, x_BxTxD, cache, index, documents=None):
    v, x2, window = self._gated_inputs(x_BxTxD, *modules.decode_window(cache["conv"], documents))
    history = write_history(cache["history"], v, index)
    long = history_causal_conv(history, cache["filter"], index, x_BxTxD.shape[1], documents)
    return self._output(long, v, x2), {**cache, "conv": window, "history": history}

  def mixing_flops_per_token(self, context_length):
    d, order = self.d_model, self.filter_order
    # The short conv, the two gates, the D term, the FFT convolution; per position of the filter,
    # its Sin activations and modulation (its matmuls are parameters: 2 FLOPs each per token).
    return (2 * self.short_width * 3 * d + 2 * d + 2 * d
            + fft_conv_flops_per_token(context_length, d)
            + 2 * order * len(self.filter_kernels) + 3 * d)
