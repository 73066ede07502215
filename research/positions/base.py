"""What a position scheme is: where it acts, and the hooks the model calls.

A scheme is parameter-free, so the same trained weights can be evaluated under another scheme
setting (for example RoPE with PI, NTK or YaRN scaling) without retraining.
"""

import dataclasses

import jax.numpy as jnp

# Where a scheme acts. Attention types declare which of these they support.
NONE = "none"  # no explicit position information
EMBED = "embed"  # added to the token embeddings
QK = "qk"  # rotates queries and keys
BIAS = "bias"  # added to the attention logits
KINDS = (NONE, EMBED, QK, BIAS)


@dataclasses.dataclass(frozen=True)
class PositionScheme:
  """Base class. Subclasses set `kind` and implement the hook for it."""

  kind = NONE

  @classmethod
  def from_config(cls, model_config):
    del model_config
    return cls()

  def embedding(self, positions_L, d_model):
    """[L, d_model] added to the token embeddings (kind == EMBED)."""
    raise NotImplementedError

  def rotate(self, x_BxLxNxH, positions_L):
    """Queries or keys with position applied (kind == QK)."""
    raise NotImplementedError

  def magnitude(self):
    """Factor on q and k in softmax attention (YaRN's temperature); 1 for most schemes."""
    return 1.0

  def slopes(self, num_heads):
    """Per-head slope of a linear distance bias (kind == BIAS): bias = -slope * (i - j)."""
    raise NotImplementedError

  def bias(self, num_heads, q_positions_T, k_positions_S):
    """[num_heads, T, S] logit bias (kind == BIAS), from positions, never cached."""
    distance_TxS = (q_positions_T[:, None] - k_positions_S[None, :]).astype(jnp.float32)
    return -self.slopes(num_heads)[:, None, None] * distance_TxS
