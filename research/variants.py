"""The three variant registries together: mixers, position schemes, feed-forwards.

Everything that enumerates variants across registries (the default config's sub-dicts, the
conformance suite's small settings, the generated variant tables) reads them from here.
"""

from research import attention
from research import feed_forward
from research import positions

REGISTRIES = (attention.REGISTRY, positions.REGISTRY, feed_forward.REGISTRY)


def default_settings() -> dict:
  """{settings key: defaults} of every registered variant with hyperparameters."""
  out = {}
  for registry in REGISTRIES:
    out.update(registry.default_settings())
  return out


def test_settings() -> dict:
  """{settings key: small settings for the conformance suite} (each variant's test_settings)."""
  out = {}
  for registry in REGISTRIES:
    out.update(registry.test_settings())
  return out
