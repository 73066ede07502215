"""T5 relative position bias, unidirectional (Raffel et al., arXiv:1910.10683, section 2.1).

A learned scalar per (bucket, head) is added to the logits; the bucket of the distance
n = max(i - j, 0) is n itself below num_buckets / 2 (exact), then log-spaced up to max_distance,
and the last bucket beyond:
  bucket(n) = n                                                             if n < e = buckets / 2
            = min(e + floor(ln(n / e) / ln(max_distance / e) * (buckets - e)), buckets - 1)   else
(mesh_tensorflow's `_relative_position_bucket` with bidirectional=False; 32 buckets, max distance
128.) The table is shared by all layers, as in T5, initialised normal(d_model^-0.5) as in HF's
T5, and takes no weight decay (it is a bias, not a weight matrix).
"""

import math

import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.positions import base


def relative_bucket(distance, num_buckets, max_distance):
  """The unidirectional T5 bucket (int32) of each distance i - j (negative distances: 0)."""
  n = jnp.maximum(distance, 0).astype(jnp.int32)
  exact = num_buckets // 2
  log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact)
  large = exact + (log_ratio * (num_buckets - exact)).astype(jnp.int32)
  return jnp.where(n < exact, n, jnp.minimum(large, num_buckets - 1))


class T5Bias(base.PositionScheme):
  hyperparameters = {"num_buckets": 32, "max_distance": 128}

  def __init__(self, settings, geometry, *, rngs):
    self.num_buckets, self.max_distance = int(settings.num_buckets), int(settings.max_distance)
    shape = (self.num_buckets, geometry.num_heads)
    init = nnx.initializers.normal(geometry.d_model ** -0.5)
    self.table = nn.param(init(rngs.params(), shape), ("relative_buckets", "position_heads"),
                          weight_decay=False)

  @classmethod
  def validate(cls, settings, geometry):
    if settings.num_buckets < 2:
      raise ValueError(f"model.t5.num_buckets must be >= 2 (half of them exact), got "
                       f"{settings.num_buckets}")
    if settings.max_distance <= settings.num_buckets // 2:
      raise ValueError(f"model.t5.max_distance must exceed num_buckets / 2 = "
                       f"{settings.num_buckets // 2} (the exact buckets), got {settings.max_distance}")

  def bias(self, q_positions_BxT, k_positions_BxS):
    buckets = relative_bucket(base.distance(q_positions_BxT, k_positions_BxS)[:, 0],
                              self.num_buckets, self.max_distance)  # [B, T, S]
    return jnp.moveaxis(jnp.take(self.table[...], buckets, axis=0), -1, 1)  # [B, N, T, S]
