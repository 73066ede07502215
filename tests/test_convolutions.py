"""BaseConv and Hyena (research/model/attention/baseconv.py, hyena.py) against naive float32
references written from zoology's code (HazyResearch/zoology@d88d6f5, zoology/mixers/base_conv.py,
convolution.py, hyena.py): the filter's inputs tap by tap (the reference's tables below l_max),
the convolutions as direct causal sums. The mixers run their FFT form here and their decode
cache past l_max; the conformance suite runs their masked Toeplitz form (packed documents equal
each document alone) and prefill then decode against the full forward, BaseConv with its short
(layer 0) and long (layer 1) convolutions. Parameters are redrawn, N(0, 0.5^2): zoology's init
(N(0, 0.02) linear layers) leaves the long convolution too small to see.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conftest import tiny_model_config
from tests.test_kernels import _assert_mixer_equals_naive, _mixer, _normal

def _redrawn(mixer, seed=0, scale=0.5):
  """The mixer with every parameter redrawn, N(0, scale^2)."""
  graphdef, params = nnx.split(mixer)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [scale * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


def _causal_sum(h_KxF, v_BxLxF):
  """y_t = sum_{s <= t} h_{t-s} v_s (h_j = 0 for j >= K), summed over an explicit [L, L] matrix
  of filter taps (one op: a loop over lags compiles 3x slower)."""
  length = v_BxLxF.shape[1]
  lag = np.arange(length)[:, None] - np.arange(length)[None]
  h = jnp.pad(h_KxF, [(0, max(0, length - h_KxF.shape[0])), (0, 0)])
  matrix = jnp.where((lag >= 0)[..., None], h[np.maximum(lag, 0)], 0.0)
  return jnp.einsum("tsf,bsf->btf", matrix, v_BxLxF)


def _short_conv(u_BxLxF, kernel_KxF, bias_F):
  """PyTorch's Conv1d(padding=K - 1)[..., :L]: tap K - 1 on the token itself."""
  return _causal_sum(kernel_KxF[::-1], u_BxLxF) + bias_F


def _positional_features(n, l_max, emb_dim=3):
  """zoology's PositionalEmbedding row n, its tables extended by the same formula past l_max."""
  bands = (emb_dim - 1) // 2
  f = np.linspace(1e-4, bands - 1, bands)
  if n < l_max:  # the reference's tables
    t = np.linspace(0, 1, l_max)[n]
    w = 2 * math.pi * np.linspace(0, l_max - 1, l_max)[n] / l_max
    assert np.isclose(t, n / (l_max - 1))
  else:
    t, w = n / (l_max - 1), 2 * math.pi * n / l_max
  return jnp.asarray(np.concatenate([[t], np.cos(f * w), -np.sin(f * w)]), jnp.float32)


def _dense(layer, x):
  return x @ layer.kernel[...] + layer.bias[...]


def _naive_hyena(mixer, x_BxLxD):
  """zoology's Hyena.forward with Filter.filter tap by tap."""
  d, length = x_BxLxD.shape[-1], x_BxLxD.shape[1]
  u = _short_conv(_dense(mixer.in_proj, x_BxLxD), mixer.short_kernel[...], mixer.short_bias[...])
  x1, x2, v = u[..., :d], u[..., d:2 * d], u[..., 2 * d:]
  v = v * x1
  target = math.log(1e-2)
  deltas = np.linspace(target / 1.5, target / 0.3, d, dtype=np.float32)
  # z_n and the modulation tap by tap (constants), then the MLP on all rows at once.
  a = jnp.stack([_positional_features(n, mixer.l_max) for n in range(length)])
  for kernel, bias in zip(mixer.filter_kernels, mixer.filter_biases):
    a = jnp.sin(mixer.freq[...] * (a @ kernel[...] + bias[...]))
  decay = np.stack([np.exp(-(n / (mixer.l_max - 1)) * np.abs(deltas)) for n in range(length)])
  taps = a @ mixer.filter_out[...] * decay
  y = _causal_sum(taps, v) + v * mixer.D[...]
  return _dense(mixer.out_proj, y * x2)


def _naive_baseconv(mixer, x_BxLxD):
  """zoology's BaseConv.forward: conv(u) * projection(u) + u."""
  length = x_BxLxD.shape[1]
  if mixer.kernel_size > 0:
    conv = _short_conv(x_BxLxD, mixer.conv_kernel[...], mixer.conv_bias[...])
  else:
    taps = []
    for n in range(length):
      if n >= mixer.l_max:  # past the reference's filter
        taps.append(jnp.zeros(x_BxLxD.shape[-1]))
      elif mixer.implicit:
        hidden = jax.nn.relu(_dense(mixer.filter_in, _positional_features(n, mixer.l_max)))
        taps.append(_dense(mixer.filter_out, hidden))
      else:
        taps.append(mixer.filter[...][n])
    conv = _causal_sum(jnp.stack(taps), x_BxLxD) + x_BxLxD  # fft_conv's "+ u"
  projected = _dense(mixer.projection, x_BxLxD)
  if mixer.use_act:
    conv, projected = jax.nn.silu(conv), jax.nn.silu(projected)
  return conv * projected + x_BxLxD


# l_max 16 < LENGTH: the implicit filter is evaluated past l_max; BaseConv's long taps are 0 there.
MIXERS = {
    "hyena": (lambda: _mixer("hyena", hyena=dict(l_max=16, filter_order=8)), _naive_hyena),
    "baseconv-act": (lambda: _mixer("baseconv", baseconv=dict(use_act=True, kernel_size=4)),
                     _naive_baseconv),
    "baseconv-implicit": (lambda: _mixer("baseconv", baseconv=dict(kernel_size=-1, l_max=16)),
                          _naive_baseconv),
    "baseconv-explicit": (lambda: _mixer("baseconv", baseconv=dict(
        kernel_size=-1, implicit_long_conv=False, l_max=16)), _naive_baseconv),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_equals_the_naive_reference_with_gradients(name):
  build, naive = MIXERS[name]
  _assert_mixer_equals_naive(_redrawn(build()), naive)


def test_hyena_decodes_from_a_longer_cache_as_the_naive_reference():
  """A cache of 32 slots (the filter evaluated at 32 taps, past l_max): a prefill of 5 tokens
  (the FFT over the history), then one token at a time (the dot product over it)."""
  build, naive = MIXERS["hyena"]
  mixer = _redrawn(build())
  length, slots = 12, 32
  x = _normal(1, (2, length, 32))
  graphdef, params = nnx.split(mixer)
  decode = jax.jit(lambda p, x, cache, index: nnx.merge(graphdef, p).decode(x, cache, index))
  out, cache = decode(params, x[:, :5], mixer.init_cache(2, slots), 0)
  outs = [out]
  for t in range(5, length):
    out, cache = decode(params, x[:, t:t + 1], cache, t)
    outs.append(out)
  want = jax.jit(lambda x: naive(mixer, x))(x)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=1e-4, rtol=1e-4)
  per_token = type(mixer).cache_bytes_per_token(tiny_model_config(attention="hyena"))
  # 32 float32 inputs and 32 float32 filter taps per position
  assert mixer.cache_bytes(1, 64) - mixer.cache_bytes(1, 32) == 32 * per_token == 32 * 32 * 8
