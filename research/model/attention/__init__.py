"""Sequence mixers ("attention types"), by name.

To add one: subclass `research.model.attention.base.Mixer` in a new file and register it below (one
line). The conformance suite in tests/ is parametrized over this registry, so it covers the new
entry; so are the benchmarks, the variants table and the sweeps that enumerate it.
"""

from research.model.attention.base import Mixer
from research.model.attention.baseconv import BaseConv
from research.model.attention.deltanet import DeltaNet
from research.model.attention.diff import DifferentialAttention
from research.model.attention.fox import ForgettingAttention
from research.model.attention.gated_deltanet import GatedDeltaNet
from research.model.attention.gated_deltaproduct import GatedDeltaProduct
from research.model.attention.gla import GatedLinearAttention
from research.model.attention.hyena import Hyena
from research.model.attention.kda import KimiDeltaAttention
from research.model.attention.linear import LinearAttention
from research.model.attention.log_linear_mamba2 import LogLinearMamba2
from research.model.attention.mamba2 import Mamba2
from research.model.attention.mamba3 import Mamba3
from research.model.attention.mla import MultiHeadLatentAttention
from research.model.attention.moba import MoBA
from research.model.attention.nsa import NativeSparseAttention
from research.model.attention.path import PaTHAttention
from research.model.attention.retention import Retention
from research.model.attention.rwkv6 import RWKV6
from research.model.attention.rwkv7 import RWKV7
from research.model.attention.sigmoid import SigmoidAttention
from research.model.attention.softmax import GQA, MHA, MQA, SoftmaxAttention
from research.model.attention.sparse import SparseAttention
from research.model.attention.ssm import Mamba
from research.model.attention.stickbreaking import StickBreakingAttention
from research.model import positions
from research.model.registry import Registry

REGISTRY = Registry("attention type", "model.attention")
REGISTRY.register("mha", MHA, settings="softmax")
REGISTRY.register("mqa", MQA, settings="softmax", variant_of="mha")
REGISTRY.register("gqa", GQA, settings="softmax", variant_of="mha")
REGISTRY.register("linear", LinearAttention)
REGISTRY.register("mamba", Mamba)
REGISTRY.register("mamba2", Mamba2)
REGISTRY.register("retention", Retention)
REGISTRY.register("fox", ForgettingAttention, settings="softmax")
REGISTRY.register("gated_deltanet", GatedDeltaNet)
REGISTRY.register("rwkv6", RWKV6)
REGISTRY.register("deltanet", DeltaNet)
REGISTRY.register("gated_deltaproduct", GatedDeltaProduct)
REGISTRY.register("gla", GatedLinearAttention)
REGISTRY.register("baseconv", BaseConv)
REGISTRY.register("hyena", Hyena)
REGISTRY.register("diff", DifferentialAttention, settings="softmax")
REGISTRY.register("mla", MultiHeadLatentAttention)
REGISTRY.register("sparse", SparseAttention)
REGISTRY.register("stickbreaking", StickBreakingAttention)
REGISTRY.register("moba", MoBA)
REGISTRY.register("rwkv7", RWKV7)
REGISTRY.register("nsa", NativeSparseAttention)
REGISTRY.register("path", PaTHAttention)
REGISTRY.register("sigmoid", SigmoidAttention)
REGISTRY.register("kda", KimiDeltaAttention)
REGISTRY.register("mamba3", Mamba3)
REGISTRY.register("log_linear_mamba2", LogLinearMamba2)


def position_scheme(model_config, *, rngs, layer_index=0):
  """model.position validated and built for the geometry that model.attention's mixer hands it
  at layer `layer_index`, for a mixer built on its own (tests, benchmarks). Unlike the model, it
  does not check that the mixer honours the scheme's hooks (research.model.transformer.validate)."""
  name = model_config.attention
  geometry = REGISTRY.lookup(name).position_geometry(REGISTRY.settings(name, model_config),
                                                     model_config, layer_index)
  positions.validate(model_config, [geometry])
  return positions.build(model_config, geometry, rngs=rngs)


def kv_head_variants():
  """The registered head-count variants whose key/value heads are model.num_kv_heads (gqa; its
  class reads_num_kv_heads and it is registered variant_of mha): the benchmarks run them at
  fewer key/value heads than heads, where they differ from the entry they vary."""
  return [name for name, cls in REGISTRY.items()
          if cls.reads_num_kv_heads and REGISTRY.variant_of(name)]
