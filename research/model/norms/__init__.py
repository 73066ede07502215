"""Normalisation layers of the blocks (pre-norm before each sublayer, and the final norm):
`model.norm`, each with its settings in model.<name> (e.g. model.rms_norm.eps).

To add one: a class built as `cls(settings, d_model, rngs=..., dtype=...)` that maps
[..., d_model] to the same shape, in a new file, registered below (one line).
"""

from research.model.norms.layer_norm import LayerNorm
from research.model.norms.rms_norm import RMSNorm
from research.model.registry import Registry

REGISTRY = Registry("norm", "model.norm")
REGISTRY.register("rms_norm", RMSNorm)
REGISTRY.register("layer_norm", LayerNorm)


def build(model_config, *, rngs, dtype):
  """The configured norm over model.d_model features."""
  name = model_config.get("norm", "rms_norm")
  cls = REGISTRY.lookup(name)
  return cls(REGISTRY.settings(name, model_config), model_config.d_model, rngs=rngs, dtype=dtype)


def validate(model_config):
  name = model_config.get("norm", "rms_norm")
  REGISTRY.lookup(name).validate(REGISTRY.settings(name, model_config))
