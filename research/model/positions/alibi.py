"""ALiBi: attention with linear biases (Press et al., arXiv:2108.12409).

bias[h, i, j] = -slope_h * (i - j). For n heads, n a power of two, slope_k = start^(k+1) with
start = 2^(-2^-(log2(n) - 3)) = 2^(-8/n). For other n: the slopes of the closest smaller power of
two p, then every other slope of 2p, the first n - p of them (the paper's reference code).
"""

import math

import jax.numpy as jnp
import numpy as np

from research.model.positions import base


def _power_of_two_slopes(n):
  start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
  return [start ** (k + 1) for k in range(n)]


def alibi_slopes(num_heads: int) -> np.ndarray:
  """The ALiBi slope of each head, as a float32 numpy array of shape [num_heads]."""
  if num_heads < 1:
    raise ValueError(f"ALiBi needs at least one head, got {num_heads}")
  p = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = _power_of_two_slopes(p)
  if p < num_heads:
    slopes += _power_of_two_slopes(2 * p)[0::2][: num_heads - p]
  return np.asarray(slopes, dtype=np.float32)


class ALiBi(base.PositionScheme):

  def __init__(self, settings, geometry, *, rngs):
    del settings, rngs
    self.num_heads = geometry.num_heads

  def bias(self, q_positions_BxT, k_positions_BxS):
    slopes_N = jnp.asarray(alibi_slopes(self.num_heads))
    return -slopes_N[:, None, None] * base.distance(q_positions_BxT, k_positions_BxS)
