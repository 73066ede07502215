"""Sigmoid attention (Ramapuram et al., "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention", arXiv:2409.04431): each key weighed alone, no normalisation over the row,

  o_i = sum_{j visible} sigmoid(q_i . k_j / sqrt(H) + b) v_j,     b = -log(n),

with n the training sequence length (their section 3.2: the bias keeps the row's total weight
near 1 at initialisation; model.sigmoid.bias_length = n, 0 for b = 0). Optionally the queries
and keys are layer-normalised per head before the position scheme (qk_norm; their multi-layer
configs turn it on).

Checked against the authors' code, apple/ml-sigmoid-attention@9273b49:
  * attention_simulator/src/attention_simulator/layers/attention.py, `Attention.forward`: q, k
    through q_norm / k_norm (LayerNorm of head_dim when qk_norm, else identity), then the
    qk_transform (RoPE), logits q k^T / sqrt(H) (+ the logits transform: ALiBi), the mask, times
    exp(attn_temp) (0: 1), plus attn_bias, then attn_activ_fn; layers/activations.py,
    `unnormalized_sigmoid_attention`: sigmoid of the logits, masked ones at -inf (weight 0).
  * layers/flash_sigmoid_attention.py, `RoPEFlashSigmoidAttention`: the same with FlashSigmoid's
    `sigmoid_bias`; examples/language_modeling/configs/
    experiment_realnews_transformer_bf16_flash_sigmoid_multilayer_rope.yaml: sigmoid_bias -7.62
    = -ln(2048) for training at 2048 tokens, qk_norm true with LayerNorm(eps=1e-6).
  Here the logit temperature stays 1 (their attn_temp default) and the output projection has no
  bias (their `bias: false`).

The normaliser is `BiasedSigmoid`, a research.model.attention.normalisers.Pointwise: everything
else is SoftmaxAttention's (research.model.attention.core's xla and blockwise backends with tile
skipping, windows and sinks, packed documents, the full and rolling decode caches, position
schemes' rotations, biases and length-aware scales). cuDNN, Pallas and Splash have softmax
kernels only.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import normalisers
from research.model.attention import softmax
from research.model.positions import BIAS, LENGTH, QK

QK_NORM_EPSILON = 1e-6  # the authors' multi-layer configs' LayerNorm eps


@dataclasses.dataclass(frozen=True)
class BiasedSigmoid(normalisers.Pointwise):
  """w = sigmoid(z + bias), each key alone."""
  bias: float = 0.0
  name = "sigmoid"

  def activation(self, z):
    return jax.nn.sigmoid(z + self.bias)


class SigmoidAttention(softmax.MHA):
  hyperparameters = {**softmax.SoftmaxAttention.hyperparameters,
                     "bias_length": 1024,  # n of b = -log(n): the training length; 0: b = 0
                     "qk_norm": False}  # LayerNorm of q and k per head before the positions
  position_hooks = frozenset({QK, BIAS, LENGTH})  # not MHA's context hook: CoPE needs softmax
  backends = ("auto", "xla", "blockwise")

  @classmethod
  def validate(cls, settings, model_config):
    super().validate(settings, model_config)
    if settings.bias_length < 0:
      raise ValueError(f"model.sigmoid.bias_length must be >= 0 (n of the bias -log(n), usually "
                       f"the training length; 0: no bias), got {settings.bias_length}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    super().__init__(settings, model_config, position, rngs=rngs, layer_index=layer_index)
    length = int(settings.bias_length)
    self.sigmoid = BiasedSigmoid(-math.log(length) if length else 0.0)
    self.qk_norm = bool(settings.qk_norm)
    if self.qk_norm:  # one LayerNorm of head_dim for queries and one for keys, across heads
      h = self.head_dim
      self.q_norm_scale, self.k_norm_scale = (
          nn.param(jnp.ones((h,)), ("head_dim",), weight_decay=False) for _ in range(2))
      self.q_norm_bias, self.k_norm_bias = (
          nn.param(jnp.zeros((h,)), ("head_dim",), weight_decay=False) for _ in range(2))

  def normaliser(self):
    return self.sigmoid

  def _layer_norm(self, x, scale, bias):
    x32 = x.astype(jnp.float32)
    centred = x32 - x32.mean(-1, keepdims=True)
    normed = centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + QK_NORM_EPSILON)
    return (normed * scale[...] + bias[...]).astype(x.dtype)

  def project(self, x_BxTxD, positions_BxT, segments_BxT=None, cache=None, index=0,
              documents=None):
    del segments_BxT, cache, index, documents
    q, k = self.query(x_BxTxD), self.key(x_BxTxD)
    if self.qk_norm:
      q = self._layer_norm(q, self.q_norm_scale, self.q_norm_bias)
      k = self._layer_norm(k, self.k_norm_scale, self.k_norm_bias)
    q = self.position.queries(q, positions_BxT)
    k = self.position.keys(k, positions_BxT)
    return q, {"key": k, "value": self.value(x_BxTxD)}
