"""No explicit positions (NoPE, Kazemnejad et al., arXiv:2305.19466): the causal mask (or a
recurrence) is the only order signal."""

from research.model.positions import base


class NoPosition(base.PositionScheme):
  """Every hook is the base class's no-op."""
