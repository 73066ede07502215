"""KERPLE, logarithmic variant (Chi et al., arXiv:2205.09921):

  bias[h, i, j] = -r1_h * log(1 + r2_h * |i - j|),   r1_h, r2_h > 0,
one pair of learned scalars per head and per layer. As in the authors' code, r1 is initialised
U(0, 2), r2 U(0, 1), and both are held at >= 0.01. No weight decay.

The floor, against the authors' code (chijames/KERPLE@25be3d712e96a3353b374f1f8e36b97d86f97ffa,
megatron/mpu/layers.py, ParallelKerpleLog.forward): before each forward they clamp the stored
parameters in place (`self.bias_p.data = self.bias_p.data.clamp(min=self.eps)`, eps = 1e-2,
outside autograd) and then compute the bias from them, so the bias uses max(r, 0.01) and the
gradient with respect to r is the gradient at that clamped value: a parameter at the floor keeps
learning and leaves it as soon as its gradient points up. Here:
  * at initialisation the draws are clamped (their first forward clamps them before any update),
  * in the forward pass the clamp is straight-through, r + stop_gradient(max(r, 0.01) - r): the
    bias of the clamped value and its gradient, never the zero gradient of jnp.maximum below the
    floor (which would freeze such a parameter for good).
The training dynamics are theirs exactly for as long as every optimizer update leaves the stored
value >= 0.01 (the usual case): the same forward, the same gradient, the same optimizer state.
They differ once an update takes a stored value below the floor: theirs is projected back to
0.01 before the next forward (projected gradient descent: the next update starts from 0.01),
while here the stored value may keep drifting below 0.01 while the forward uses 0.01, and must
climb back to the floor before the bias moves again. Reproducing the projection exactly needs a
clamp of the stored value after each optimizer update (in the training loop), not in the module.
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.positions import base

MINIMUM = 1e-2


def at_least(value, minimum=MINIMUM):
  """max(value, minimum) in the forward pass; the gradient passes straight through to `value`
  (it is the gradient at the clamped value, as the authors' in-place clamp gives)."""
  return value + jax.lax.stop_gradient(jnp.maximum(value, minimum) - value)


class KerpleLog(base.PositionScheme):
  shared_across_layers = False

  def __init__(self, settings, geometry, *, rngs):
    del settings
    n = geometry.num_heads
    self.r1 = nn.param(jnp.maximum(2.0 * jax.random.uniform(rngs.params(), (n,)), MINIMUM),
                       ("position_heads",), weight_decay=False)
    self.r2 = nn.param(jnp.maximum(jax.random.uniform(rngs.params(), (n,)), MINIMUM),
                       ("position_heads",), weight_decay=False)

  def bias(self, q_positions_BxT, k_positions_BxS):
    r1 = at_least(self.r1[...])[:, None, None]
    r2 = at_least(self.r2[...])[:, None, None]
    return -r1 * jnp.log1p(r2 * jnp.abs(base.distance(q_positions_BxT, k_positions_BxS)))
