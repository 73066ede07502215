"""Gated linear attention (Yang, Wang, Shen, Panda & Kim, arXiv:2312.06635).

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/gla.py (GatedLinearAttention with
its defaults: expand_k = 0.5, expand_v = 1, no feature map, no short convolution, the output
gate with swish fused into the norm, gate_low_rank_dim = 16, gate_logit_normalizer = 16,
clamp_min None) and fla/ops/gla/naive.py (naive_recurrent_gla). Per head, a matrix state
S [K, E] (keys x values) that decays per key channel:
  S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,      o_t = S_t^T (q_t K^-1/2)
  log alpha_t = logsigmoid((x_t W_down) W_up + b) / 16            (rank 16, in (0, 1) per channel)
  out = (RMSNorm(o) * swish(x W_g)) W_o                           (per head, a learned gain)
with q, k, v, g linear projections of x; key head dim K = expand_k d_model / num_heads, value
head dim E = expand_v d_model / num_heads. Initialisation is the lab's (LeCun normal kernels,
b = 0 as fla's), not fla's model-level normal(0.02).

Training, evaluation and decoding run one chunked form, shared with RWKV-6
(research/model/attention/vector_decay.py: sub-chunks keep every decay factor <= 1, as fla's
chunk_gla's secondary chunking), with the current token inside the state (no bonus). Packed
documents restart the state at each segment start; the decode state is S alone.
"""

import math

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import modules
from research.model.attention import vector_decay


def _head_dims(settings, model_config):
  return (round(model_config.d_model * settings.expand_k) // model_config.num_heads,
          round(model_config.d_model * settings.expand_v) // model_config.num_heads)


class GatedLinearAttention(chunked.ChunkedRecurrentMixer):
  # Chunks of 32 in sub-chunks of 8, as RWKV-6's (the same kernel; tuned on a 2-core CPU);
  # fla's chunk_gla uses 64 / 16 on GPUs.
  hyperparameters = {"expand_k": 0.5,  # key width = expand_k * d_model
                     "expand_v": 1.0,  # value width = expand_v * d_model
                     "gate_low_rank_dim": 16,
                     "gate_logit_normalizer": 16.0,
                     "chunk_size": 32,
                     "sub_chunk_size": 8}
  test_settings = {"chunk_size": 8, "sub_chunk_size": 4}

  @classmethod
  def validate(cls, settings, model_config):
    for field in ("gate_low_rank_dim", "chunk_size", "sub_chunk_size"):
      if settings[field] < 1:
        raise ValueError(f"model.gla.{field} must be >= 1, got {settings[field]}")
    if settings.gate_logit_normalizer <= 0:
      raise ValueError(f"model.gla.gate_logit_normalizer must be > 0, got "
                       f"{settings.gate_logit_normalizer}")
    d, n = model_config.d_model, model_config.num_heads
    for field in ("expand_k", "expand_v"):
      width = d * settings[field]
      if not (settings[field] > 0 and math.isclose(width, round(width))
              and round(width) % n == 0 and round(width) >= n):
        raise ValueError(f"model.gla.{field}={settings[field]} gives a width of d_model * "
                         f"{field} = {d} * {settings[field]} = {width:g}; valid: a positive "
                         f"multiple of num_heads={n} (e.g. {field}=0.5 or 1)")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d, n = model_config.d_model, model_config.num_heads
    h, e = _head_dims(settings, model_config)
    self.num_heads, self.head_dim, self.value_dim = n, h, e
    self.chunk_size = int(settings.chunk_size)
    self.sub_chunk_size = int(settings.sub_chunk_size)
    self.gate_logit_normalizer = float(settings.gate_logit_normalizer)
    self.dtype = dtype = nn.compute_dtype(model_config)
    self.query, self.key = (base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype)
                            for _ in range(2))
    self.value, self.gate = (base.head_projection(d, n, e, "heads", rngs=rngs, dtype=dtype)
                             for _ in range(2))
    rank = int(settings.gate_low_rank_dim)
    self.decay_down = nn.dense("BLD,DR->BLR", (d, rank), ("embed", "ssm_proj"), rngs=rngs,
                               dtype=dtype)
    self.decay_up = nn.dense("BLR,RNH->BLNH", (rank, n, h), ("ssm_proj", "heads", "head_dim"),
                             rngs=rngs, dtype=dtype, bias_shape=(n, h),
                             bias_axes=("heads", "head_dim"))
    self.norm_scale = nn.param(jnp.ones((e,)), ("head_dim",), weight_decay=False)
    self.out = base.output_projection(n, e, d, rngs=rngs, dtype=dtype)

  def _mix(self, x_BxTxD, cache, segments_BxT=None):
    q_BxTxNxH = self.query(x_BxTxD).astype(jnp.float32) * self.head_dim ** -0.5
    k_BxTxNxH = self.key(x_BxTxD).astype(jnp.float32)
    v_BxTxNxE = self.value(x_BxTxD).astype(jnp.float32)
    log_decay_BxTxNxH = jax.nn.log_sigmoid(
        self.decay_up(self.decay_down(x_BxTxD)).astype(jnp.float32)) / self.gate_logit_normalizer
    o_BxTxNxE, state = vector_decay.chunked_vector_decay(
        q_BxTxNxH, k_BxTxNxH, v_BxTxNxE, log_decay_BxTxNxH, cache["state"],
        chunk_size=self.chunk_size, sub_chunk_size=self.sub_chunk_size, segments=segments_BxT)
    o_BxTxNxE = modules.gated_rms_norm(o_BxTxNxE, self.gate(x_BxTxD), self.norm_scale[...])
    return self.out(o_BxTxNxE.astype(self.dtype)), {"state": state}

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    return {"state": jnp.zeros((batch_size, self.num_heads, self.head_dim, self.value_dim),
                               jnp.float32)}

  def mixing_flops_per_token(self, context_length):
    n, h, e = self.num_heads, self.head_dim, self.value_dim
    c = min(self.chunk_size, context_length)
    sub = vector_decay.sub_chunk_length(c, self.sub_chunk_size)
    # Within a chunk: q.k scores over the chunk's (C + 1) / 2 earlier tokens on average and
    # scores @ v; the per-pair decay factors of a sub-chunk; across chunks: q S_0 and the state
    # update; the norm and gate.
    within = 2 * (c + 1) / 2 * (h + e) + 4 * sub * h
    across = 2 * 2 * h * e + 2 * h * e
    return n * (within + across) + 6 * n * e
