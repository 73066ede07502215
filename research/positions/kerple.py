"""KERPLE, logarithmic variant (Chi et al., arXiv:2205.09921):

  bias[h, i, j] = -r1_h * log(1 + r2_h * |i - j|),   r1_h, r2_h > 0,
one pair of learned scalars per head and per layer. As in the authors' code, r1 is initialised
U(0, 2), r2 U(0, 1), and both are held at >= 0.01 (the code clamps them in place before each use;
here the clamp is in the forward pass, which gives the same bias). No weight decay.
"""

import jax
import jax.numpy as jnp

from research import nn
from research.positions import base

MINIMUM = 1e-2


class KerpleLog(base.PositionScheme):
  shared_across_layers = False

  def __init__(self, settings, geometry, *, rngs):
    del settings
    n = geometry.num_heads
    self.r1 = nn.param(2.0 * jax.random.uniform(rngs.params(), (n,)), ("position_heads",),
                       weight_decay=False)
    self.r2 = nn.param(jax.random.uniform(rngs.params(), (n,)), ("position_heads",),
                       weight_decay=False)

  def bias(self, q_positions_BxT, k_positions_BxS):
    r1 = jnp.maximum(self.r1[...], MINIMUM)[:, None, None]
    r2 = jnp.maximum(self.r2[...], MINIMUM)[:, None, None]
    return -r1 * jnp.log1p(r2 * jnp.abs(base.distance(q_positions_BxT, k_positions_BxS)))
