"""Learned absolute positions (GPT-2 style; Radford et al. 2019): a trained table of max_length
vectors added to the token embeddings.

The table is initialised normal(0.5), half the token embeddings' scale (GPT-2's 0.01 against
0.02). A position beyond the table has no embedding: the config check refuses an evaluation
length above model.learned.max_length before any work, and a lookup past the table returns NaN
rather than silently reusing the last row.
"""

import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.positions import base

INIT_STDDEV = 0.5


class Learned(base.PositionScheme):
  hyperparameters = {"max_length": 2048}
  test_settings = {"max_length": 64}

  def __init__(self, settings, geometry, *, rngs):
    shape = (int(settings.max_length), geometry.d_model)
    self.table = nn.param(nnx.initializers.normal(INIT_STDDEV)(rngs.params(), shape),
                          ("max_positions", "position_embed"), weight_decay=True)

  @classmethod
  def validate(cls, settings, geometry):
    if settings.max_length < 1:
      raise ValueError(f"model.learned.max_length must be >= 1, got {settings.max_length}")

  @classmethod
  def max_length(cls, settings):
    return int(settings.max_length)

  def embedding(self, positions_BxL, d_model):
    del d_model
    return jnp.take(self.table[...], positions_BxL, axis=0, mode="fill", fill_value=jnp.nan)
