"""Sinusoidal absolute positions (Vaswani et al., arXiv:1706.03762).

PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d)),
added to the token embeddings; computed for any position, so there is no maximum length.
"""

import dataclasses

import jax.numpy as jnp

from research.positions import base


@dataclasses.dataclass(frozen=True)
class Sinusoidal(base.PositionScheme):
  kind = base.EMBED
  max_wavelength: float = 10000.0

  def embedding(self, positions_L, d_model):
    if d_model % 2:
      raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
    angle_LxHalf = positions_L.astype(jnp.float32)[:, None] / self.max_wavelength ** (two_i / d_model)
    # Interleave so that even channels are sin and odd channels are cos.
    return jnp.stack([jnp.sin(angle_LxHalf), jnp.cos(angle_LxHalf)], axis=-1).reshape(-1, d_model)
