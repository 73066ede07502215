"""Rotary position embedding, RoPE (Su et al., arXiv:2104.09864), with context extension.

Each 2-D slice (x[2i], x[2i+1]) of a query or key at position m is rotated by m * theta_i,
theta_i = base^(-2i/d), so <R(m) q, R(n) k> depends on m - n only.

Scaling to longer contexts, s = rope_scaling_factor = L_target / L_train:
  pi    position interpolation: m -> m / s.
  ntk   NTK-aware: base -> base * s^(d / (d - 2)).
  yarn  YaRN (arXiv:2309.00071): NTK-by-parts, theta_i' = (1 - g) theta_i / s + g theta_i with the
        ramp g(r) = clip((r - alpha) / (beta - alpha), 0, 1), r = L_train / wavelength_i, alpha = 1,
        beta = 32; plus the temperature sqrt(1/t) = 0.1 ln s + 1, applied once: softmax attention
        multiplies q and k each by `magnitude()`, so the logits are scaled by 1/t. `rotate` is a
        pure rotation (linear attention and retention have no softmax temperature).
"""

import dataclasses
import math

import jax.numpy as jnp

from research.positions import base

SCALINGS = ("none", "pi", "ntk", "yarn")
YARN_ALPHA = 1.0
YARN_BETA = 32.0


@dataclasses.dataclass(frozen=True)
class RoPE(base.PositionScheme):
  kind = base.QK
  base_frequency: float = 10000.0
  scaling: str = "none"
  factor: float = 1.0
  original_length: int = 128

  def __post_init__(self):
    if self.scaling not in SCALINGS:
      raise ValueError(f"unknown rope_scaling {self.scaling!r}; valid: {', '.join(SCALINGS)}")
    if self.factor <= 0:
      raise ValueError(f"rope_scaling_factor must be > 0, got {self.factor}")

  @classmethod
  def from_config(cls, model_config):
    return cls(
        base_frequency=float(model_config.rope_base),
        scaling=model_config.rope_scaling,
        factor=float(model_config.rope_scaling_factor),
        original_length=int(model_config.rope_original_length),
    )

  def frequencies(self, head_dim):
    """theta_i for i < head_dim / 2, after scaling."""
    if head_dim % 2:
      raise ValueError(f"RoPE needs an even head dimension, got {head_dim} (d_model / num_heads)")
    s = self.factor
    base_frequency = self.base_frequency
    if self.scaling == "ntk":
      base_frequency = base_frequency * s ** (head_dim / (head_dim - 2))
    theta = base_frequency ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if self.scaling == "yarn":
      ratio = self.original_length * theta / (2 * math.pi)  # L_train / wavelength
      ramp = jnp.clip((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA), 0.0, 1.0)
      theta = (1 - ramp) * theta / s + ramp * theta
    return theta

  def magnitude(self):
    """sqrt(1/t) of YaRN, 1 otherwise: softmax attention's q and k are each scaled by it."""
    if self.scaling == "yarn" and self.factor > 1:
      return 0.1 * math.log(self.factor) + 1.0
    return 1.0

  def rotate(self, x_BxLxNxH, positions_L):
    head_dim = x_BxLxNxH.shape[-1]
    positions = positions_L.astype(jnp.float32)
    if self.scaling == "pi":
      positions = positions / self.factor
    angle_LxHalf = positions[:, None] * self.frequencies(head_dim)
    cos = jnp.cos(angle_LxHalf)[:, None, :]
    sin = jnp.sin(angle_LxHalf)[:, None, :]
    x = x_BxLxNxH.astype(jnp.float32)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x_BxLxNxH.dtype)
