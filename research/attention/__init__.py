"""Sequence mixers ("attention types"), by name.

To add one: subclass `research.attention.base.Mixer` in a new file and register it below. The
conformance suite in tests/ is parametrized over this registry, so it covers the new entry.
"""

from research.attention.base import Mixer
from research.attention.linear import LinearAttention
from research.attention.retention import Retention
from research.attention.softmax import GQA, MHA, MQA, SoftmaxAttention
from research.attention.ssm import Mamba
from research.registry import Registry

REGISTRY = Registry("attention type", "model.attention")
REGISTRY.register("mha", MHA)
REGISTRY.register("mqa", MQA)
REGISTRY.register("gqa", GQA)
REGISTRY.register("linear", LinearAttention)
REGISTRY.register("mamba", Mamba)
REGISTRY.register("retention", Retention)
