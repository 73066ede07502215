"""What a position scheme is: three hooks that every mixer calls, each a no-op by default.

  embedding(positions_BxL, d_model)   [B, L, D] added to the token embeddings, or None
  queries(q_BxLxNxH, positions_BxL)   queries after the scheme (rotations, xPos scaling)
  keys(k_BxLxKxH, positions_BxL)      keys likewise
  bias(q_positions_BxT, k_positions_BxS)
                                      [B, N, T, S] float32 added to the attention logits, or None
  logit_scale()                       a softmax temperature on the logits (YaRN), 1 otherwise

Positions are per token, int32 [B, L]; B is 1 when every row has the same positions (the
usual arange), so a bias is computed once, not once per row. The causal mask is by token index,
never by position, so positions may be any non-decreasing numbers (randomized positions).

A scheme is an nnx.Module and may own parameters (made with `research.nn.param` or `nn.dense`:
logical axes and weight decay declared where they are created, so sharding and the optimizer
need no edit). Its hyperparameters are the dict `hyperparameters`, exposed as `model.<name>`.
Which hooks a scheme uses is read off the methods it overrides (`hooks()`); a mixer declares the
hooks it honours (`research.attention.base.Mixer.position_hooks`), and the model refuses a pair
where the scheme uses a hook that the mixer cannot honour.
"""

import jax.numpy as jnp
from flax import nnx

EMBED, QK, BIAS = "embed", "qk", "bias"


class PositionScheme(nnx.Module):
  """Base class: no position information at all."""

  hyperparameters = {}
  # One instance for the whole model (T5 shares its bias table across layers), or one per
  # attention layer (KERPLE and FIRE learn a bias per layer).
  shared_across_layers = True

  def __init__(self, settings, model_config, *, rngs):
    del settings, model_config, rngs

  @classmethod
  def hooks(cls) -> frozenset:
    """The hooks this scheme overrides: a subset of {embed, qk, bias}."""
    base = PositionScheme
    used = set()
    if cls.embedding is not base.embedding:
      used.add(EMBED)
    if cls.queries is not base.queries or cls.keys is not base.keys:
      used.add(QK)
    if cls.bias is not base.bias:
      used.add(BIAS)
    return frozenset(used)

  @classmethod
  def validate(cls, settings, model_config):
    """Raise ValueError, naming what is valid, if the settings cannot build this scheme."""
    del settings, model_config

  @classmethod
  def max_length(cls, settings):
    """The most positions the scheme can represent (a learned table's size); None: unbounded."""
    del settings
    return None

  def embedding(self, positions_BxL, d_model):
    del positions_BxL, d_model
    return None

  def queries(self, q_BxLxNxH, positions_BxL):
    del positions_BxL
    return q_BxLxNxH

  def keys(self, k_BxLxKxH, positions_BxL):
    del positions_BxL
    return k_BxLxKxH

  def bias(self, q_positions_BxT, k_positions_BxS):
    del q_positions_BxT, k_positions_BxS
    return None

  def logit_scale(self):
    return 1.0


def distance(q_positions_BxT, k_positions_BxS):
  """i - j for every query position i and key position j, float32 [B, 1, T, S] (a head axis)."""
  return (q_positions_BxT[:, None, :, None] - k_positions_BxS[:, None, None, :]).astype(jnp.float32)
