"""Softmax attention with num_kv_heads key/value heads: MHA, MQA and GQA.

  softmax(q k^T / sqrt(d_k) + bias, causal) v            (Vaswani et al., arXiv:1706.03762)
GQA (Ainslie et al., arXiv:2305.13245): K key/value heads shared by groups of N / K query heads;
K = N is MHA, K = 1 is MQA (Shazeer, arXiv:1911.02150). K/V are never repeated in memory.
KV cache bytes = 2 * K * head_dim * bytes_per_value * tokens * batch per layer.

Backends (model.attention_backend):
  xla        jax.nn.dot_product_attention(implementation="xla")
  blockwise  research.attention.blockwise: exact, online softmax, O(length) memory
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"), GPU only
Decoding always takes the xla path: one query block against the cache is already small.
"""

import jax
import jax.numpy as jnp

from research import nn
from research import positions as positions_lib
from research.attention import base
from research.attention.blockwise import blockwise_attention

BACKENDS = ("xla", "blockwise", "cudnn")


class SoftmaxAttention(base.Mixer):
  """Base of mha / mqa / gqa; subclasses say how many key/value heads."""
  backends = BACKENDS

  @classmethod
  def kv_heads(cls, model_config):
    raise NotImplementedError

  @classmethod
  def validate(cls, model_config):
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
    if model_config.block_size < 1:
      raise ValueError(f"model.block_size must be >= 1, got {model_config.block_size}")

  def __init__(self, model_config, position, *, rngs):
    d, n = model_config.d_model, model_config.num_heads
    k, h = self.kv_heads(model_config), model_config.d_model // model_config.num_heads
    self.position = position
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.backend = model_config.attention_backend
    self.block_size = model_config.block_size
    self.dtype = nn.compute_dtype(model_config)
    project = lambda heads, axis: nn.dense(
        "BLD,DNH->BLNH", (d, heads, h), ("embed", axis, "head_dim"), rngs=rngs, dtype=self.dtype)
    self.query = project(n, "heads")
    self.key = project(k, "kv_heads")
    self.value = project(k, "kv_heads")
    self.out = nn.dense("BLNH,NHD->BLD", (n, h, d), ("heads", "head_dim", "embed"), rngs=rngs,
                        dtype=self.dtype)

  def _project(self, x_BxLxD, positions_L):
    q, k, v = self.query(x_BxLxD), self.key(x_BxLxD), self.value(x_BxLxD)
    if self.position.kind == positions_lib.QK:
      # YaRN's temperature sqrt(1/t) on q and k: the logits are scaled by 1/t, once.
      m = self.position.magnitude()
      q, k = self.position.rotate(q, positions_L) * m, self.position.rotate(k, positions_L) * m
    return q, k, v

  def _slopes(self):
    if self.position.kind == positions_lib.BIAS:
      return self.position.slopes(self.num_heads)
    return None

  def _dot_product(self, q, k, v, q_positions_T, k_positions_S, causal, implementation):
    bias = None
    if self.position.kind == positions_lib.BIAS:
      bias = self.position.bias(self.num_heads, q_positions_T, k_positions_S)[None].astype(q.dtype)
    mask = None if causal else (k_positions_S[None, :] <= q_positions_T[:, None])[None, None]
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=causal,
                                        implementation=implementation)

  def __call__(self, x_BxLxD, positions_L):
    q, k, v = self._project(x_BxLxD, positions_L)
    if self.backend == "blockwise":
      y = blockwise_attention(q, k, v, self._slopes(), block_size=self.block_size)
    else:
      y = self._dot_product(q, k, v, positions_L, positions_L, True, self.backend)
    return self.out(y)

  def init_cache(self, batch_size, max_length):
    shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
    return {"key": jnp.zeros(shape, self.dtype), "value": jnp.zeros(shape, self.dtype)}

  def decode(self, x_BxTxD, cache, index):
    positions_T = index + jnp.arange(x_BxTxD.shape[1])
    q, k, v = self._project(x_BxTxD, positions_T)
    cache = {"key": jax.lax.dynamic_update_slice_in_dim(cache["key"], k.astype(self.dtype), index, 1),
             "value": jax.lax.dynamic_update_slice_in_dim(cache["value"], v.astype(self.dtype), index, 1)}
    # Slots after index + T are still empty; the causal mask hides them like the future.
    capacity = cache["key"].shape[1]
    k_positions_S = jnp.arange(capacity)
    y = self._dot_product(q, cache["key"], cache["value"], positions_T, k_positions_S, False, "xla")
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
