"""xPos: RoPE with an exponential decay in the relative distance (Sun et al., arXiv:2212.10554).

Queries at position n are rotated as in RoPE and scaled by zeta_i^(n / scale_base), keys at m by
zeta_i^(-m / scale_base), zeta_i = (i / (d/2) + gamma) / (1 + gamma) for pair i (gamma = 0.4,
scale_base = 512 as in torchscale), so each pair's score carries zeta_i^((n - m) / scale_base):
a decay with distance that is stronger for the low pairs. The reference code centres the
positions of a window before exponentiating; the product depends on n - m only, so this code
uses the plain positions, which also keeps decoding consistent: in float32 the scale stays
finite up to about 35K positions.
"""

import jax.numpy as jnp

from research.model.positions import rope


class XPos(rope.RoPE):
  hyperparameters = {**rope.RoPE.hyperparameters, "scale_base": 512.0, "gamma": 0.4}

  def __init__(self, settings, geometry, *, rngs):
    super().__init__(settings, geometry, rngs=rngs)
    self.scale_base = float(settings.scale_base)
    self.gamma = float(settings.gamma)

  @classmethod
  def validate(cls, settings, geometry):
    super().validate(settings, geometry)
    if geometry.rotary_dims != geometry.head_dim:
      raise ValueError(f"xpos scales every channel of a head, so it needs rotary_dims == head_dim, "
                       f"got {geometry.rotary_dims} of {geometry.head_dim}; use rope or prope")
    if settings.scale_base <= 0 or settings.gamma <= 0:
      raise ValueError(f"model.xpos.scale_base and model.xpos.gamma must be > 0, got "
                       f"{settings.scale_base} and {settings.gamma}")

  def _scale(self, positions_BxL, sign):
    """zeta^(sign * position / scale_base) for every channel (each pair's zeta twice)."""
    half = self.rotary_dims // 2
    zeta = (jnp.arange(half, dtype=jnp.float32) / half + self.gamma) / (1 + self.gamma)
    power = sign * positions_BxL.astype(jnp.float32)[..., None] / self.scale_base
    return jnp.repeat(zeta ** power, 2, axis=-1)[:, :, None, :]  # [B, L, 1, H]

  def queries(self, q_BxLxNxH, positions_BxL):
    scaled = self.rotate(q_BxLxNxH, positions_BxL).astype(jnp.float32) * self._scale(positions_BxL, 1)
    return scaled.astype(q_BxLxNxH.dtype)

  def keys(self, k_BxLxKxH, positions_BxL):
    scaled = self.rotate(k_BxLxKxH, positions_BxL).astype(jnp.float32) * self._scale(positions_BxL, -1)
    return scaled.astype(k_BxLxKxH.dtype)
