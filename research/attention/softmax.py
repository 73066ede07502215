"""Softmax attention with num_kv_heads key/value heads: MHA, MQA and GQA.

  softmax(m q k^T / sqrt(d_k) + bias, causal) v           (Vaswani et al., arXiv:1706.03762)
with q, k after the position scheme's query/key hooks, bias its score bias and m its logit scale
(YaRN's temperature; 1 otherwise). GQA (Ainslie et al., arXiv:2305.13245): K key/value heads
shared by groups of N / K query heads; K = N is MHA, K = 1 is MQA (Shazeer, arXiv:1911.02150).
K/V are never repeated in memory. KV cache bytes = 2 * K * head_dim * bytes_per_value * tokens
* batch per layer.

One score path (model.attention_backend):
  xla        jax.nn.dot_product_attention(implementation="xla"), the bias materialised
  blockwise  research.attention.blockwise: exact, online softmax, O(length) memory; the same bias
             function evaluated per tile, forward and backward (gradients to its parameters too)
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"), GPU only
Decoding takes the xla path: the new queries against the cache, the bias of the new positions
against the cached ones.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research import nn
from research.attention import base
from research.attention.blockwise import blockwise_attention
from research.positions import BIAS, QK

BACKENDS = ("xla", "blockwise", "cudnn")


class SoftmaxAttention(base.Mixer):
  """Base of mha / mqa / gqa; subclasses say how many key/value heads."""
  hyperparameters = {"block_size": 128}  # blockwise backend: query and key block length
  position_hooks = frozenset({QK, BIAS})
  backends = BACKENDS

  @classmethod
  def kv_heads(cls, model_config):
    raise NotImplementedError

  @classmethod
  def validate(cls, settings, model_config):
    heads, kv = model_config.num_heads, cls.kv_heads(model_config)
    if kv < 1 or heads % kv:
      divisors = [d for d in range(1, heads + 1) if heads % d == 0]
      raise ValueError(f"num_kv_heads={kv} does not divide num_heads={heads}; valid: {divisors}")
    backend = model_config.attention_backend
    if backend not in BACKENDS:
      raise ValueError(f"unknown model.attention_backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "cudnn" and jax.default_backend() != "gpu":
      raise ValueError(f"attention_backend 'cudnn' needs a GPU, but JAX runs on "
                       f"{jax.default_backend()!r}; use 'xla' or 'blockwise'")
    if backend == "cudnn" and model_config.compute_dtype not in ("bfloat16", "float16"):
      raise ValueError(f"attention_backend 'cudnn' needs compute_dtype bfloat16 or float16, got "
                       f"{model_config.compute_dtype!r}")
    if settings.block_size < 1:
      raise ValueError(f"model.softmax.block_size must be >= 1, got {settings.block_size}")

  def __init__(self, settings, model_config, position, *, rngs):
    d, n = model_config.d_model, model_config.num_heads
    k, h = self.kv_heads(model_config), model_config.d_model // model_config.num_heads
    self.position = position
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.backend = model_config.attention_backend
    self.block_size = int(settings.block_size)
    self.dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=self.dtype)
    self.key = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=self.dtype)
    self.value = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=self.dtype)
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=self.dtype)

  def _project(self, x_BxTxD, positions_BxT):
    q = self.position.queries(self.query(x_BxTxD), positions_BxT)
    k = self.position.keys(self.key(x_BxTxD), positions_BxT)
    return q, k, self.value(x_BxTxD)

  def _scale(self):
    return self.position.logit_scale() / self.head_dim ** 0.5

  def _bias_function(self):
    """(bias_fn(params, q_positions, k_positions), params): the scheme's bias, as a function
    of its parameters, for the blockwise kernel to evaluate (and differentiate) per tile."""
    graphdef, params = nnx.split(self.position)
    return (lambda p, q_positions, k_positions:
            nnx.merge(graphdef, p).bias(q_positions, k_positions)), params

  def _dot_product(self, q, k, v, q_positions, k_positions, mask, implementation):
    bias = self.position.bias(q_positions, k_positions)
    bias = None if bias is None else bias.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=mask is None,
                                        scale=self._scale(), implementation=implementation)

  def __call__(self, x_BxLxD, positions_BxL):
    q, k, v = self._project(x_BxLxD, positions_BxL)
    if self.backend == "blockwise":
      bias_fn, bias_params = self._bias_function()
      y = blockwise_attention(q, k, v, positions_BxL, bias_fn, bias_params,
                              block_size=self.block_size, scale=self._scale())
    else:
      y = self._dot_product(q, k, v, positions_BxL, positions_BxL, None, self.backend)
    return self.out(y)

  def init_cache(self, batch_size, max_length):
    shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
    return {"key": jnp.zeros(shape, self.dtype), "value": jnp.zeros(shape, self.dtype)}

  def decode(self, x_BxTxD, cache, index):
    positions_1xT = base.new_positions(index, x_BxTxD.shape[1])
    q, k, v = self._project(x_BxTxD, positions_1xT)
    cache = {"key": jax.lax.dynamic_update_slice_in_dim(cache["key"], k.astype(self.dtype), index, 1),
             "value": jax.lax.dynamic_update_slice_in_dim(cache["value"], v.astype(self.dtype), index, 1)}
    # Slots after index + T are still empty; the causal mask (by index) hides them like the future.
    capacity = cache["key"].shape[1]
    k_positions_1xS = jnp.arange(capacity)[None]
    mask = (k_positions_1xS[0][None, :] <= positions_1xT[0][:, None])[None, None]
    y = self._dot_product(q, cache["key"], cache["value"], positions_1xT, k_positions_1xS, mask,
                          "xla")
    # Past the cache's end, dynamic_update_slice would clamp and overwrite the last slots:
    # return NaN rather than silently wrong logits (init_cache with a larger max_length).
    y = jnp.where(index + x_BxTxD.shape[1] <= capacity, y, jnp.nan)
    return self.out(y), cache

  def mixing_flops_per_token(self, context_length):
    # q k^T and p v, 2 FLOPs per multiply-add, each query sees (context + 1) / 2 keys on average.
    return 2 * 2 * self.num_heads * self.head_dim * (context_length + 1) / 2


class MHA(SoftmaxAttention):

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads


class MQA(SoftmaxAttention):

  @classmethod
  def kv_heads(cls, model_config):
    return 1


class GQA(SoftmaxAttention):

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_kv_heads
