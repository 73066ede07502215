"""Position schemes, by name. Each is one file and one line below; see base.py for the hooks.

To add one: subclass `research.model.positions.base.PositionScheme` in a new file, override the
hooks it uses (embedding, queries/keys, bias), declare its `hyperparameters`, and register it here.
The conformance suite, the xla == blockwise test, sweeps and tables enumerate this registry.
"""

from research.model.positions.alibi import ALiBi, alibi_slopes
from research.model.positions.base import (BIAS, CONTEXT, EMBED, LENGTH, QK, SCORE_HOOKS, Geometry,
                                           PositionScheme)
from research.model.positions.cope import CoPE
from research.model.positions.fire import FIRE
from research.model.positions.kerple import KerpleLog
from research.model.positions.learned import Learned
from research.model.positions.none import NoPosition
from research.model.positions.prope import PartialRoPE
from research.model.positions.rope import SCALINGS, RoPE
from research.model.positions.sinusoidal import Sinusoidal
from research.model.positions.ssmax import SSMax
from research.model.positions.t5 import T5Bias
from research.model.positions.xpos import XPos
from research.model.registry import Registry

REGISTRY = Registry("position scheme", "model.position")
REGISTRY.register("none", NoPosition)
REGISTRY.register("sinusoidal", Sinusoidal)
REGISTRY.register("rope", RoPE)
REGISTRY.register("alibi", ALiBi)
REGISTRY.register("learned", Learned)
REGISTRY.register("t5", T5Bias)
REGISTRY.register("kerple", KerpleLog)
REGISTRY.register("fire", FIRE)
REGISTRY.register("xpos", XPos)
REGISTRY.register("prope", PartialRoPE)
REGISTRY.register("cope", CoPE)
REGISTRY.register("ssmax", SSMax)


def rotary(name: str) -> bool:
  """Whether scheme `name` rotates queries and keys (and so takes the RoPE scalings)."""
  return REGISTRY.lookup(name).rotary


def validate(model_config, geometries):
  """Check model.position and its settings for each geometry the mixers give it (at least one:
  research.model.attention.base.Mixer.position_geometry); returns the scheme class."""
  if not geometries:
    raise ValueError("positions.validate needs the geometry of at least one mixer that uses the "
                     "scheme (Mixer.position_geometry)")
  name = model_config.position
  cls = REGISTRY.lookup(name)
  settings = REGISTRY.settings(name, model_config)
  for geometry in dict.fromkeys(g.shared() for g in geometries):
    cls.validate(settings, geometry)
  return cls


def max_length(model_config):
  """The most positions model.position can represent (a learned table's size); None: unbounded."""
  name = model_config.position
  return REGISTRY.lookup(name).max_length(REGISTRY.settings(name, model_config))


def build(model_config, geometry, *, rngs) -> PositionScheme:
  """The scheme named by model.position, with its settings from model.<name>, for a mixer of
  `geometry` (Mixer.position_geometry; research.model.attention.position_scheme builds it for
  model.attention's mixer)."""
  name = model_config.position
  return REGISTRY.lookup(name)(REGISTRY.settings(name, model_config), geometry, rngs=rngs)
