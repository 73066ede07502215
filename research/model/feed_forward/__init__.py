"""Feed-forward layers (the second half of every block), by name.

To add one: implement the interface of `research.model.feed_forward.base` (subclassing `FeedForward`
gives the defaults of a token-wise layer) in a new file and register it below (one line). Its
hyperparameters appear in the default config (research/defaults.py) as model.<name>; a model picks one for every block
(model.feed_forward) or a pattern tiled over the layers (model.feed_forward_pattern).
"""

from research.model.feed_forward.base import OBJECTIVE, AuxiliaryLoss, FeedForward, auxiliary_losses
from research.model.feed_forward.mlp import MLP
from research.model.feed_forward.moe import MixtureOfExperts
from research.model.feed_forward.rwkv_channel_mix import RWKVChannelMix
from research.model.feed_forward.rwkv7_channel_mix import RWKV7ChannelMix
from research.model.feed_forward.swiglu import SwiGLU
from research.model.registry import Registry

REGISTRY = Registry("feed-forward", "model.feed_forward")
REGISTRY.register("mlp", MLP)
REGISTRY.register("moe", MixtureOfExperts)
REGISTRY.register("rwkv_channel_mix", RWKVChannelMix)
REGISTRY.register("rwkv7_channel_mix", RWKV7ChannelMix)
REGISTRY.register("swiglu", SwiGLU)
