"""The interface every sequence mixer implements.

A mixer maps [batch, length, d_model] to the same shape, causally. It supports
  * full-sequence forward `__call__(x, positions)` for training and evaluation,
  * incremental decode `decode(x, cache, index)` from `init_cache(batch, max_length)`, for one or
    more new tokens at sequence positions index, index + 1, ...,
  * `cache_bytes(batch, context_length)`: the size of that cache, read off its shapes,
  * `mixing_flops_per_token(context_length)`: forward FLOPs per token that are not parameter
    matmuls (those are counted as 2 per parameter by `research.flops`).
It declares the position kinds (research.positions) it supports in `supported_positions`.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from research import positions as positions_lib


class Mixer(nnx.Module):
  supported_positions = positions_lib.KINDS
  # Values of model.attention_backend this mixer implements; () if it has a single path.
  backends = ()
  # A recurrent mixer carries order in its state, so in a hybrid it can sit beside layers that
  # take a qk or bias position scheme, and runs without it.
  recurrent = False

  @classmethod
  def validate(cls, model_config):
    """Raise ValueError, naming what is valid, if this mixer cannot be built from the config.

    The model checks what all mixers share (names, head counts, position support) first.
    """
    del model_config

  def __call__(self, x_BxLxD, positions_L):
    raise NotImplementedError

  def init_cache(self, batch_size, max_length):
    raise NotImplementedError

  def decode(self, x_BxTxD, cache, index):
    raise NotImplementedError

  def mixing_flops_per_token(self, context_length):
    raise NotImplementedError

  def cache_bytes(self, batch_size, context_length):
    shapes = jax.eval_shape(lambda: self.init_cache(batch_size, context_length))
    return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
