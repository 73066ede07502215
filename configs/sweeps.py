"""Sweep axes read from the registries, so that a new variant joins every sweep with no edit."""

from research.model import attention
from research.model import transformer as model_lib


def every_variant() -> list[tuple[str, str]]:
  """(attention, position): every attention type with each position scheme it supports."""
  return [(name, position) for name, cls in sorted(attention.REGISTRY.items())
          for position in model_lib.compatible_positions(cls)]


def every_mixer(preferred_position: str = "rope") -> list[tuple[str, str]]:
  """(attention, position): every attention type once, with preferred_position where it supports
  it and no position scheme otherwise."""
  return [(name, preferred_position
           if preferred_position in model_lib.compatible_positions(cls) else "none")
          for name, cls in sorted(attention.REGISTRY.items())]


def every_mixer_family(preferred_position: str = "rope") -> list[tuple[str, str]]:
  """every_mixer() without the entries registered as head-count variants of another (mqa and
  gqa run mha's code with fewer key/value heads): one run per mixer's code, for CPU presets."""
  return [(name, position) for name, position in every_mixer(preferred_position)
          if attention.REGISTRY.variant_of(name) is None]
