"""What a position scheme is: three hooks that every mixer calls, each a no-op by default.

  embedding(positions_BxL, d_model)   [B, L, D] added to the token embeddings, or None
  queries(q_BxLxNxH, positions_BxL)   queries after the scheme (rotations, xPos scaling)
  keys(k_BxLxKxH, positions_BxL)      keys likewise
  bias(q_positions_BxT, k_positions_BxS)
                                      [B, N, T, S] float32 added to the attention logits, or None
  logit_scale()                       a softmax temperature on the logits (YaRN), 1 otherwise
  length_scale(keys_seen_BxT, document_index_BxT)
                                      [B | 1, N | 1, T] float32, each query's logits times it:
                                      a function of how many keys the query sees and of its
                                      index in its document (SSMax's s log n), or None
  contextual(logits_BxNxTxS, q_BxTxNxH)
                                      the logits changed as a function of each query's whole
                                      row of (masked) logits and of the query: CoPE's positions
                                      counted by gates (research.model.attention.core.ScoreMod)

A scheme is told its geometry by the mixer that uses it (`Geometry`: d_model, the heads and head
dim of the queries and keys it acts on, how many of those dims rotate and at which frequencies,
the layer index), through `research.model.attention.base.Mixer.position_geometry`; nothing here
reads head counts from the model.

Positions are per token, int32 [B, L]; B is 1 when every row has the same positions (the
usual arange), so a bias is computed once, not once per row. The causal mask is by token index,
never by position, so positions may be any non-decreasing numbers (randomized positions).

A scheme is an nnx.Module and may own parameters (made with `research.model.nn.param` or `nn.dense`:
logical axes and weight decay declared where they are created, so sharding and the optimizer
need no edit). Its hyperparameters are the dict `hyperparameters`, exposed as `model.<name>`.
Which hooks a scheme uses is read off the methods it overrides (`hooks()`); a mixer declares the
hooks it honours (`research.model.attention.base.Mixer.position_hooks`), and the model refuses a
pair where the scheme uses a hook that the mixer cannot honour.
"""

import dataclasses

import jax.numpy as jnp
from flax import nnx

EMBED, QK, BIAS, CONTEXT, LENGTH = "embed", "qk", "bias", "context", "length"
# The hooks that enter the attention core's score computation, where each backend and decode
# cache has code of its own for them (the embedding term and the rotation of q and k happen
# before the core).
SCORE_HOOKS = frozenset({BIAS, CONTEXT, LENGTH})


@dataclasses.dataclass(frozen=True)
class Geometry:
  """What a scheme is built for: the model width (embedding terms), the heads and head dim of
  the queries and keys it rotates or biases, the leading `rotary_dims` of each head that rotary
  schemes rotate (head_dim unless a mixer decouples them), the index of the layer, and the
  rotation frequencies the mixer's architecture uses (`rotary_frequencies`: "rope",
  theta_i = base^(-2i/d), or RetNet's "retnet", base^(-i/(d/2 - 1));
  research/model/positions/rope.py)."""
  d_model: int
  num_heads: int
  head_dim: int
  rotary_dims: int
  layer_index: int = 0
  rotary_frequencies: str = "rope"

  def shared(self):
    """The geometry without the layer index: what a scheme shared across layers depends on."""
    return dataclasses.replace(self, layer_index=0)


class PositionScheme(nnx.Module):
  """Base class: no position information at all."""

  hyperparameters = {}
  # Small settings for the conformance suite (see
  # research.model.attention.base.Mixer.test_settings).
  test_settings = {}
  # Whether it rotates queries and keys, and so takes the RoPE scalings (model.<name>.scaling).
  rotary = False
  # One instance for the whole model (T5 shares its bias table across layers), or one per
  # attention layer (KERPLE and FIRE learn a bias per layer).
  shared_across_layers = True

  def __init__(self, settings, geometry: Geometry, *, rngs):
    del settings, geometry, rngs

  @classmethod
  def hooks(cls) -> frozenset:
    """The hooks this scheme overrides: a subset of {embed, qk, bias, context, length}."""
    base = PositionScheme
    used = set()
    if cls.embedding is not base.embedding:
      used.add(EMBED)
    if cls.queries is not base.queries or cls.keys is not base.keys:
      used.add(QK)
    if cls.bias is not base.bias:
      used.add(BIAS)
    if cls.contextual is not base.contextual:
      used.add(CONTEXT)
    if cls.length_scale is not base.length_scale:
      used.add(LENGTH)
    return frozenset(used)

  @classmethod
  def validate(cls, settings, geometry: Geometry):
    """Raise ValueError, naming what is valid, if the settings cannot build this scheme for a
    mixer of this geometry."""
    del settings, geometry

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

  def length_scale(self, keys_seen_BxT, document_index_BxT):
    """Each query's logits times [B | 1, N | 1, T] float32, given how many keys it sees (int32
    [B | 1, T]: causality, window, sinks and packed documents counted; in a decode cache, the
    cached and new keys it sees) and its index within its document; None: unchanged."""
    del keys_seen_BxT, document_index_BxT
    return None

  def contextual(self, logits_BxNxTxS, q_BxTxNxH):
    """Each query's row of float32 logits, the invisible keys at a large negative value, keys in
    token order, changed as a function of the row and the query [B, T, N, H]."""
    del q_BxTxNxH
    return logits_BxNxTxS


def distance(q_positions_BxT, k_positions_BxS):
  """i - j for every query position i and key position j, float32 [B, 1, T, S] (a head axis)."""
  return (q_positions_BxT[:, None, :, None] - k_positions_BxS[:, None, None, :]).astype(jnp.float32)
