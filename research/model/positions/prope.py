"""Partial RoPE, p-RoPE (Barbero et al., arXiv:2410.06205, "Round and Round We Go!").

Only the highest frequencies rotate: the first int(fraction * head_dim // 2) pairs keep their
RoPE frequency theta_i = base^(-2i/d); the remaining, lowest-frequency pairs get theta = 0 (an
infinite wavelength), so they carry no position and act as semantic channels. fraction = 1 is
RoPE, 0 is NoPE. Scalings (model.prope.scaling) act on the rotating pairs as in RoPE.
"""

import jax.numpy as jnp

from research.model.positions import rope


class PartialRoPE(rope.RoPE):
  hyperparameters = {**rope.RoPE.hyperparameters, "fraction": 0.75}

  def __init__(self, settings, geometry, *, rngs):
    super().__init__(settings, geometry, rngs=rngs)
    self.rotating_pairs = int(float(settings.fraction) * self.rotary_dims // 2)

  @classmethod
  def validate(cls, settings, geometry):
    super().validate(settings, geometry)
    if not 0 <= settings.fraction <= 1:
      raise ValueError(f"model.prope.fraction must be in [0, 1], got {settings.fraction}")

  def inverse_frequencies(self, positions_BxL=None):
    theta = super().inverse_frequencies(positions_BxL)
    return jnp.where(jnp.arange(theta.shape[0]) < self.rotating_pairs, theta, 0.0)
