"""Position schemes, by name. Each declares where it acts: none, embed, qk or bias."""

from research.positions.alibi import ALiBi, alibi_slopes
from research.positions.base import BIAS, EMBED, KINDS, NONE, QK, PositionScheme
from research.positions.none import NoPosition
from research.positions.rope import RoPE
from research.positions.sinusoidal import Sinusoidal
from research.registry import Registry

REGISTRY = Registry("position scheme", "model.position")
REGISTRY.register("none", NoPosition)
REGISTRY.register("sinusoidal", Sinusoidal)
REGISTRY.register("rope", RoPE)
REGISTRY.register("alibi", ALiBi)


def from_config(model_config):
  """The position scheme named by `model_config.position`, configured from it."""
  return REGISTRY.lookup(model_config.position).from_config(model_config)
