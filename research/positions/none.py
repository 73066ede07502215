"""No explicit positions: the causal mask (or a recurrence) is the only order signal."""

import dataclasses

from research.positions import base


@dataclasses.dataclass(frozen=True)
class NoPosition(base.PositionScheme):
  kind = base.NONE
