"""BaseConv: a linear projection gating a convolution (Arora et al., Zoology, arXiv:2312.04927).

As zoology computes it (HazyResearch/zoology@d88d6f5474f36998d82d5c3bd58a190248d0a669,
zoology/mixers/base_conv.py, class BaseConv, and zoology/mixers/convolution.py):
  y = conv(u) * (W u + b) + u                      (use_act: silu(conv(u)) * silu(W u + b) + u)
with W [D, D] and b a dense layer, and conv one of
  kernel_size = K >= 1 (the default, K = 3)  ShortConvolution: a causal depthwise conv of K taps
                                             with bias, conv(u)_t = sum_{i<K} k_i u_{t-i} + c
  kernel_size = -1, implicit_long_conv       ImplicitLongConvolution: conv(u) = h * u + u, a
                                             causal long convolution with h_n = MLP(z_n), MLP =
                                             Linear(3, 16), ReLU, Linear(16, D), z_n the
                                             positional features of hyena.py
                                             (t_n = n / (l_max - 1), w_n = 2 pi n / l_max)
  kernel_size = -1, not implicit_long_conv   LongConvolution: conv(u) = h * u + u with an explicit
                                             filter h [l_max, D]
(the "+ u" inside both long convolutions is zoology's fft_conv). The default is Zoology's
BaseConv model of its Figure 2 (zoology/experiments/paper_configs/iclr24_zoology_figure2/
configs.py, base_conv: kernel_size [3, -1, 3, -1], one entry per layer): with
alternate_long_conv, layers 0, 2, ... take the short conv of kernel_size taps and layers 1, 3, ...
the implicit long convolution (the list's pattern, continued to any depth; kernel_size -1 makes
every layer long, alternate_long_conv False every layer short, the MQAR configs' conv_mixer that
they pair with another mixer in a hybrid). l_max = 1024 is what zoology's MQAR configs pass
(input_seq_len, the longest of their train and test lengths); it is used only by the long
convolutions.

Initialisation is what zoology's language model leaves (zoology/model.py, _init_weights
re-initialises every nn.Linear of a TransformerBlock): W ~ N(0, 0.02), b = 0, the implicit
filter's linear layers N(0, 0.02) with zero biases; the short conv keeps PyTorch's Conv1d
default, U(-1/sqrt(K), 1/sqrt(K)) for kernel and bias; the explicit filter N(0, 1).

Filter length: the short conv has K taps. The long convolutions have l_max taps; taps past l_max
are 0 (as in the reference, whose z table and explicit filter have l_max rows and whose FFT
zero-pads them), so every length is well defined. Below l_max: the implicit filter is evaluated at
taps 0 .. L - 1, as in the reference; the reference's explicit LongConvolution transforms all
l_max taps with a circular FFT of 2L points, so that when L < l_max taps L + t + 1 .. 2L - 1 reach
output t from later inputs (wrap-around: not causal); here the taps past L - 1 are dropped.

Long convolutions run as hyena.py's: FFT (length 2L) in training and evaluation, the exact masked
Toeplitz form for packed documents, and in decoding a cache holding the history of the inputs u
[B, max_length, D] and the filter's max_length taps, evaluated once when the cache is made (D *
(itemsize + 4) bytes per token and long layer at batch 1; one new token is a dot product over the
history, O(context * D)). The short conv's decode state is its window of K - 1 inputs; with packed
documents it sees no input of an earlier document.

Deviations: per-layer kernel sizes are one size and the alternation above (zoology takes any
list indexed by the layer; a list must name every layer there); weight decay follows this lab's
convention (kernels decay, biases do not; zoology's AdamW decays every parameter); the implicit
filter's z is fixed, as in the reference (requires_grad=False). Positions are ignored: order
comes from the convolution.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import hyena
from research.model.attention import modules

IMPLICIT_EMB_DIM = 3  # ImplicitLongConvolution's d_emb (BaseConv passes only d_model, l_max)
IMPLICIT_HIDDEN = 16  # ImplicitLongConvolution's d_hidden
SETTINGS_KEY = "baseconv"  # its registry name (research.model.attention): model.baseconv


def _is_long(settings, layer_index):
  """Whether layer `layer_index` takes the long convolution (kernel_size -1, or an odd layer
  with alternate_long_conv)."""
  return settings["kernel_size"] == -1 or (
      bool(settings["alternate_long_conv"]) and layer_index % 2 == 1)


class BaseConv(base.Mixer):
  hyperparameters = {"kernel_size": 3,  # taps of the short conv; -1: a long conv of l_max taps
                     "alternate_long_conv": True,  # odd layers long (Zoology's [3, -1, 3, -1])
                     "implicit_long_conv": True,  # kernel_size -1: h = MLP(z), else explicit h
                     "l_max": 1024,  # taps of the long convolutions (past them: 0)
                     "use_act": False}  # silu on both factors
  test_settings = {"l_max": 16}
  recurrent = True  # order comes from the convolution: it runs beside any position scheme

  @classmethod
  def validate(cls, settings, model_config):
    del model_config
    if settings.kernel_size < 1 and settings.kernel_size != -1:
      raise ValueError(f"model.baseconv.kernel_size must be >= 1 (a short conv of that many "
                       f"taps) or -1 (a long conv of l_max taps), got {settings.kernel_size}")
    if settings.l_max < 2:
      raise ValueError(f"model.baseconv.l_max must be >= 2, got {settings.l_max}")

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """The long convolutions keep the history of their inputs (d_model values per token); the
    short conv a window of fixed size (None)."""
    given = {**cls.hyperparameters, **(model_config.get(SETTINGS_KEY) or {})}
    layers = model_config.num_layers
    long_layers = sum(_is_long(given, layer) for layer in range(layers))
    if not long_layers:
      return None
    # The mean over the layers (the decode suite multiplies by num_layers).
    return hyena.history_and_filter_bytes(model_config) * long_layers / layers

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del position  # order comes from the convolution
    d = model_config.d_model
    self.d_model = d
    self.long = _is_long(settings, layer_index)
    self.kernel_size = -1 if self.long else int(settings.kernel_size)
    self.implicit = bool(settings.implicit_long_conv)
    self.l_max = int(settings.l_max)
    self.use_act = bool(settings.use_act)
    self.dtype = dtype = nn.compute_dtype(model_config)
    normal = nnx.initializers.normal(hyena.INIT_STD)
    self.projection = nn.dense("BLD,DE->BLE", (d, d), ("embed", "mlp"), bias_shape=(d,),
                               bias_axes=("mlp",), rngs=rngs, dtype=dtype, init=normal)
    if not self.long:
      # PyTorch's Conv1d default, U(-1/sqrt(W), 1/sqrt(W)), for the kernel and the bias alike.
      self.conv_kernel = modules.short_conv_kernel(rngs, self.kernel_size, d, ("mlp",))
      self.conv_bias = modules.short_conv_bias(d, ("mlp",), rngs=rngs, width=self.kernel_size)
    elif self.implicit:
      self.filter_in = nn.dense("LE,EF->LF", (IMPLICIT_EMB_DIM, IMPLICIT_HIDDEN),
                                ("state", "state"), bias_shape=(IMPLICIT_HIDDEN,),
                                bias_axes=("state",), rngs=rngs, dtype=jnp.float32, init=normal)
      self.filter_out = nn.dense("LF,FD->LD", (IMPLICIT_HIDDEN, d), ("state", "mlp"),
                                 bias_shape=(d,), bias_axes=("mlp",), rngs=rngs,
                                 dtype=jnp.float32, init=normal)
    else:
      self.filter = nn.param(jax.random.normal(rngs.params(), (self.l_max, d)), ("conv", "mlp"),
                             weight_decay=True)

  def long_filter(self, length):
    """h [length, D], float32: taps 0 .. length - 1, zero from l_max on."""
    if not self.implicit:
      h = self.filter[...][:length]
      return jnp.pad(h, [(0, length - h.shape[0]), (0, 0)])
    n = jnp.arange(length, dtype=jnp.float32)
    z = hyena.positional_features(n, self.l_max, IMPLICIT_EMB_DIM)
    h = self.filter_out(jax.nn.relu(self.filter_in(z)))
    return jnp.where((n < self.l_max)[:, None], h, 0.0)

  def _combine(self, conv_BxTxD, u_BxTxD):
    projected = self.projection(u_BxTxD).astype(jnp.float32)
    if self.use_act:
      conv_BxTxD, projected = jax.nn.silu(conv_BxTxD), jax.nn.silu(projected)
    return (conv_BxTxD * projected + u_BxTxD.astype(jnp.float32)).astype(self.dtype)

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    del positions_BxL  # order comes from the convolution
    if self.long:
      conv = (hyena.causal_conv(x_BxLxD, self.long_filter(x_BxLxD.shape[1]), segments_BxL)
              + x_BxLxD.astype(jnp.float32))
    else:
      window = jnp.zeros((x_BxLxD.shape[0], self.kernel_size - 1, self.d_model), self.dtype)
      conv, _ = modules.causal_depthwise_conv(x_BxLxD, window, self.conv_kernel[...],
                                              self.conv_bias[...], segments_BxL)
      conv = conv.astype(jnp.float32)
    return self._combine(conv, x_BxLxD)

  def init_cache(self, batch_size, max_length):
    if self.long:
      return {"history": jnp.zeros((batch_size, max_length, self.d_model), self.dtype),
              "filter": self.long_filter(max_length)}
    return {"conv": jnp.zeros((batch_size, self.kernel_size - 1, self.d_model), self.dtype)}

  # Packed documents: the long convolution reaches back to each token's document start
  # (hyena.history_causal_conv), the short one restarts (its window and segment ids).
  document_decode_refusal = classmethod(base.no_refusal)

  def decode(self, x_BxTxD, cache, index, documents=None):
    if self.long:
      history = hyena.write_history(cache["history"], x_BxTxD, index)
      conv = (hyena.history_causal_conv(history, cache["filter"], index, x_BxTxD.shape[1],
                                        documents)
              + x_BxTxD.astype(jnp.float32))
      return self._combine(conv, x_BxTxD), {**cache, "history": history}
    window, segments_BxT = modules.decode_window(cache["conv"], documents)
    conv, window = modules.causal_depthwise_conv(x_BxTxD, window, self.conv_kernel[...],
                                                 self.conv_bias[...], segments_BxT)
    return self._combine(conv.astype(jnp.float32), x_BxTxD), {"conv": window}

  def mixing_flops_per_token(self, context_length):
    d = self.d_model
    if self.long:
      conv = hyena.fft_conv_flops_per_token(context_length, d) + d  # and its "+ u"
    else:
      conv = 2 * self.kernel_size * d
    return conv + 2 * d  # the product and the residual
