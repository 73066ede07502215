"""Sinusoidal absolute positions (Vaswani et al., arXiv:1706.03762).

PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d)),
added to the token embeddings; computed for any position, so there is no maximum length.
"""

import jax.numpy as jnp

from research.model.positions import base


class Sinusoidal(base.PositionScheme):
  hyperparameters = {"max_wavelength": 10000.0}

  def __init__(self, settings, geometry, *, rngs):
    del rngs
    self.max_wavelength = float(settings.max_wavelength)

  @classmethod
  def validate(cls, settings, geometry):
    if geometry.d_model % 2:
      raise ValueError(f"sinusoidal positions need an even d_model, got {geometry.d_model}")
    if settings.max_wavelength <= 0:
      raise ValueError(f"model.sinusoidal.max_wavelength must be > 0, got "
                       f"{settings.max_wavelength}")

  def embedding(self, positions_BxL, d_model):
    two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)
    angle_BxLxHalf = (positions_BxL.astype(jnp.float32)[..., None]
                      / self.max_wavelength ** (two_i / d_model))
    # Interleave so that even channels are sin and odd channels are cos.
    pe = jnp.stack([jnp.sin(angle_BxLxHalf), jnp.cos(angle_BxLxHalf)], axis=-1)
    return pe.reshape(*positions_BxL.shape, d_model)
