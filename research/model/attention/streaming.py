"""StreamingLLM's cache positions: where a softmax layer's position scheme sees a sink that is
outside its window (model.softmax.sink_positions; Xiao et al., arXiv:2309.17453).

"cache" (the default) is StreamingLLM's pos_shift (mit-han-lab/streaming-llm@2e50426,
streaming_llm/pos_shift/modify_llama.py): there every cached key is rotated at its slot (sinks
first, then the window in token order) and the query at the slot it is appended to, so a sink is
at most S + W - 1 away. Here the pairs seen only through a sink (the mask spec's requeried pairs,
research.model.attention.masks.sink_pairs) take the query at its cache position

  c(i) = p(i) - max(0, d(i) - (S + W - 1))                              (`cache_positions`)

with p the position and d the index within the document: for a qk scheme the query is projected
at c(i), for a bias scheme the bias is taken at (c(i), p(s)); the window's pairs keep their
positions, which for any scheme of the distance alone is StreamingLLM's arithmetic. The layer
hands these queries to the attention core as core.OtherQueries, in training, evaluation (xla,
blockwise) and decoding alike; the core never reads the sinks. "original" keeps every token at
its own position (what configs saved before the setting existed mean:
research/runs/migrations.py).
"""

import jax.numpy as jnp

from research.model.attention import core
from research.model.attention import masks
from research.model.positions import QK

# model.softmax.sink_positions: the positions the sinks are seen at.
SINK_POSITIONS = ("cache", "original")


def check_sink_positions(value, field="model.softmax"):
  """Raise ValueError, naming what is valid, for a bad sink_positions setting."""
  if value not in SINK_POSITIONS:
    raise ValueError(f"unknown {field}.sink_positions {value!r}; valid: "
                     f"{', '.join(map(repr, SINK_POSITIONS))} (StreamingLLM's positions in the "
                     "rolling cache, or each token's own position)")


def cache_positions(positions_BxL, document_index_BxL, window, sinks):
  """The position each query takes against the sinks under StreamingLLM's cache positions
  (every cached key at its slot, the query at the slot it is appended to): the query's position
  less the number of tokens of its document that the rolling cache of S sinks and W window slots
  has evicted by then, c(i) = p(i) - max(0, d(i) - (S + W - 1)), so that a sink s (at position
  d(s)) is min(d(i), S + W - 1) - d(s) < S + W away; a window key keeps its distance
  p(i) - p(j)."""
  evicted = jnp.maximum(document_index_BxL - (sinks + window - 1), 0)
  return (positions_BxL - evicted).astype(positions_BxL.dtype)


class SinkPositions:
  """What a softmax-family mixer (research.model.attention.softmax.SoftmaxAttention) does for
  StreamingLLM's cache positions. Reads the mixer's `sink_positions`, `mask`, `position`,
  `position_hooks`, `project` and `score_inputs`."""

  def moves_sinks(self):
    """Whether sink_positions = "cache" changes anything: sinks, and a position scheme whose
    queries / keys (qk) or bias this mixer applies."""
    return (self.sink_positions == "cache" and self.mask.requeries
            and bool(self.position.hooks() & self.position_hooks))

  def sink_queries(self, x_BxTxD, positions_BxT, tokens, document_index_BxT, segments_BxT=None,
                   cache=None, index=0):
    """core.OtherQueries of T tokens (None where moves_sinks() is False): the pairs a sink is
    seen in only as a sink (W or more tokens back) take the query at its cache position
    c = cache_positions(positions, document_index): its queries from `project` at c (for a qk
    scheme; None for a bias scheme, whose queries do not change) and its score inputs at c; the
    sink keys keep their own positions, the first S of the document. As StreamingLLM's
    pos_shift, every distance to a sink is then below S + W."""
    if not self.moves_sinks():
      return None
    c_BxT = cache_positions(positions_BxT, document_index_BxT, self.mask.window, self.mask.sinks)
    q = None
    if QK in self.position.hooks() & self.position_hooks:
      q = self.project(x_BxTxD, c_BxT, segments_BxT, cache=cache, index=index)[0]
    return core.OtherQueries(q, self.score_inputs(c_BxT, tokens))

  def sequence_sink_queries(self, x_BxLxD, positions_BxL, tokens, segments_BxL):
    """`sink_queries` of a whole sequence (packed documents: each its own sinks)."""
    if not self.moves_sinks():
      return None
    document_index = masks.indices_in_documents(x_BxLxD.shape[1], segments_BxL)
    return self.sink_queries(x_BxLxD, positions_BxL, tokens, document_index, segments_BxL)
