"""CoPE: contextual position encoding (Golovneva, Wang, Weston & Sukhbaatar, arXiv:2405.18719).

Positions are counted, not indexed: a query i counts the keys between j and itself that its
gates open, and the count (fractional) picks a learned embedding by linear interpolation:
  g_it = sigmoid(q_i . k_t / sqrt(d))        over the visible keys t (0 elsewhere)
  p_ij = sum_{t=j}^{i} g_it,  clamped to max_positions - 1
  z_i[p] = q_i . e[p]        for the integer positions p = 0 .. max_positions - 1
  logits_ij = (q_i . k_j + w_ij z_i[ceil p_ij] + (1 - w_ij) z_i[floor p_ij]) / sqrt(d),
  w_ij = p_ij - floor p_ij
with e [d, max_positions] per layer, shared by the heads, initialised to zeros (so a fresh model
attends as with no position information). The interpolation weight carries the gradient to the
gates; floor and ceil carry none.

Reference: facebookresearch/RAM@e6f051f, projects/cope/src/cope/context_position.py,
ContextPosSelfAttn.forward with its defaults (gates from the attention keys, not a separate key
projection or the values; the position logits added before the division by sqrt(d); CoPE on
every layer, not shared across layers; npos = its block size + 1). The lab's `max_positions` is
a setting (256 by default, 2x the lab's usual training length: a count past it is clamped, as
the reference clamps at npos - 1), and the table takes no weight decay as the lab's other
position tables of relative positions.

CoPE reads each query's whole row of gates, so it is the position schemes' `contextual` hook
(research/model/positions/base.py; research.model.attention.core.ScoreMod.contextual): softmax
attention (mha, mqa, gqa) runs it on the xla backend and from the full decode cache; blockwise (a
row tile by tile), cudnn and the rolling cache of a sliding window refuse it.
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.positions import base


class CoPE(base.PositionScheme):
  hyperparameters = {"max_positions": 256}
  test_settings = {"max_positions": 12}  # below the test length: the clamp is exercised
  shared_across_layers = False

  def __init__(self, settings, geometry, *, rngs):
    del rngs
    self.head_dim = geometry.head_dim
    self.table = nn.param(jnp.zeros((geometry.head_dim, int(settings.max_positions))),
                          ("head_dim", "max_positions"), weight_decay=False)

  @classmethod
  def validate(cls, settings, geometry):
    if settings.max_positions < 2:
      raise ValueError(f"model.cope.max_positions must be >= 2 (positions 0 .. max_positions - "
                       f"1 are interpolated), got {settings.max_positions}")

  def contextual(self, logits_BxNxTxS, q_BxTxNxH):
    table = self.table[...]
    gates = jax.nn.sigmoid(logits_BxNxTxS)  # 0 at the invisible keys (their logits are -inf-like)
    counted = jnp.flip(jnp.cumsum(jnp.flip(gates, -1), -1), -1)  # sum over t = j .. end of row
    counted = jnp.minimum(counted, table.shape[-1] - 1)
    floor = jnp.floor(counted)
    integer_logits_BxNxTxP = jnp.einsum("btnh,hp->bntp", q_BxTxNxH.astype(jnp.float32), table)
    at = lambda p: jnp.take_along_axis(integer_logits_BxNxTxP, p.astype(jnp.int32), axis=-1)
    weight = counted - floor
    position_logits = at(jnp.ceil(counted)) * weight + at(floor) * (1 - weight)
    return logits_BxNxTxS + position_logits / self.head_dim ** 0.5
