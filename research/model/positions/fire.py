"""FIRE: functional interpolation for relative positions (Li et al., arXiv:2310.04418):

  bias[h, i, j] = f_theta(psi(i - j) / psi(max(L, i)))_h,   psi(x) = log(c |x| + 1),
f_theta an MLP 1 -> hidden (ReLU) -> heads, c and the threshold L = |s * L0| learned (s starts
at 1, L0 = init_threshold), as in the paper's reference code (init_c 0.1, L0 512, hidden 32,
eps 1e-6 added to the normaliser). Distances are normalised by the query position, so the MLP
sees inputs in [0, 1] at any length: the "progressive interpolation" that lets it extrapolate.
One FIRE per layer. The MLP's linear layers start as torch.nn.Linear does (U(+-1/sqrt(fan_in))).
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.positions import base

EPSILON = 1e-6


def _uniform(key, shape, fan_in):
  bound = fan_in ** -0.5
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


class FIRE(base.PositionScheme):
  hyperparameters = {"hidden": 32, "init_c": 0.1, "init_threshold": 512.0}
  shared_across_layers = False

  def __init__(self, settings, geometry, *, rngs):
    hidden, heads = int(settings.hidden), geometry.num_heads
    self.init_threshold = float(settings.init_threshold)
    self.hidden_kernel = nn.param(_uniform(rngs.params(), (hidden,), 1), ("fire_hidden",),
                                  weight_decay=True)
    self.hidden_bias = nn.param(_uniform(rngs.params(), (hidden,), 1), ("fire_hidden",),
                                weight_decay=False)
    self.out_kernel = nn.param(_uniform(rngs.params(), (hidden, heads), hidden),
                               ("fire_hidden", "position_heads"), weight_decay=True)
    self.out_bias = nn.param(_uniform(rngs.params(), (heads,), hidden), ("position_heads",),
                             weight_decay=False)
    self.c = nn.param(jnp.asarray(float(settings.init_c)), (), weight_decay=False)
    self.threshold_scale = nn.param(jnp.asarray(1.0), (), weight_decay=False)

  @classmethod
  def validate(cls, settings, geometry):
    if settings.hidden < 1:
      raise ValueError(f"model.fire.hidden must be >= 1, got {settings.hidden}")
    if settings.init_c <= 0 or settings.init_threshold <= 0:
      raise ValueError(f"model.fire.init_c and model.fire.init_threshold must be > 0, got "
                       f"{settings.init_c} and {settings.init_threshold}")

  def bias(self, q_positions_BxT, k_positions_BxS):
    c = self.c[...]
    threshold = jnp.abs(self.threshold_scale[...] * self.init_threshold)
    query = jnp.maximum(q_positions_BxT.astype(jnp.float32), threshold)  # [B, T]
    normaliser = jnp.log(jnp.abs(c * query) + 1) + EPSILON
    relative = jnp.log(jnp.abs(c * base.distance(q_positions_BxT, k_positions_BxS)[:, 0]) + 1)
    x_BxTxS = relative / normaliser[:, :, None]
    hidden_BxTxSxF = jax.nn.relu(x_BxTxS[..., None] * self.hidden_kernel[...] + self.hidden_bias[...])
    return (jnp.einsum("btsf,fn->bnts", hidden_BxTxSxF, self.out_kernel[...])
            + self.out_bias[...][:, None, None])
