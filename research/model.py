"""Decoder-only language model assembled from the registries.

  h_0 = embed(tokens) [+ sinusoidal(positions)]
  h_l = h'_l + MLP(RMSNorm(h'_l)),  h'_l = h_{l-1} + Mixer_l(RMSNorm(h_{l-1}))   (pre-norm)
  logits = head(RMSNorm(h_L))                                                 (float32)
Mixer_l is model.attention, or model.layer_pattern[l % len(pattern)] for hybrids. In a hybrid,
recurrent layers (mamba) run without a qk or bias position scheme that the attention layers take,
as in Jamba (arXiv:2403.19887). Every block is mixer + MLP so that variants differ only in the
mixer; model.mlp_ratio = 0 drops the MLP (the Mamba paper's stack).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research import attention
from research import nn
from research import positions as positions_lib
from research import sharding


class IncompatibleError(ValueError):
  """A valid attention type and position scheme that do not go together (sweeps skip these)."""


def layer_types(model_config):
  """The attention type of each layer."""
  pattern = tuple(model_config.layer_pattern) or (model_config.attention,)
  if model_config.num_layers < 1 or model_config.num_layers % len(pattern):
    raise ValueError(f"model.num_layers={model_config.num_layers} must be a positive multiple of "
                     f"len(model.layer_pattern)={len(pattern)}")
  return tuple(pattern[i % len(pattern)] for i in range(model_config.num_layers))


def compatible_positions(mixer_cls):
  return [name for name, cls in positions_lib.REGISTRY.items()
          if cls.kind in mixer_cls.supported_positions]


def _layer_position(mixer_cls, position):
  """The position scheme a layer applies (a hybrid's recurrent layers may run without)."""
  if position.kind in mixer_cls.supported_positions:
    return position
  return positions_lib.NoPosition()


def validate(model_config):
  """Raise ValueError naming what is wrong and what is valid; builds nothing."""
  types = layer_types(model_config)
  field = "model.layer_pattern" if model_config.layer_pattern else "model.attention"
  mixers = {name: attention.REGISTRY.lookup(name, field) for name in types}
  position = positions_lib.from_config(model_config)
  nn.compute_dtype(model_config)
  d, heads = model_config.d_model, model_config.num_heads
  if d < 1 or heads < 1 or d % heads:
    raise ValueError(f"d_model={d} is not divisible by num_heads={heads}; valid num_heads: "
                     f"{[h for h in range(1, d + 1) if d % h == 0]}")
  if model_config.vocab_size < 1:
    raise ValueError(f"model.vocab_size must be >= 1, got {model_config.vocab_size}")
  hybrid = len(mixers) > 1
  for name, mixer_cls in mixers.items():
    supported = position.kind in mixer_cls.supported_positions
    if not supported and not (hybrid and mixer_cls.recurrent):
      raise IncompatibleError(
          f"attention {name!r} does not support position {model_config.position!r} (it acts on "
          f"{position.kind!r}); compatible positions: {', '.join(compatible_positions(mixer_cls))}")
    mixer_cls.validate(model_config)
  if position.kind == positions_lib.QK and (d // heads) % 2:
    raise ValueError(f"rope needs an even head dim, but d_model / num_heads = {d // heads}; "
                     f"choose num_heads so that d_model / num_heads is even")
  if position.kind == positions_lib.EMBED and d % 2:
    raise ValueError(f"sinusoidal positions need an even d_model, got {d}")


class MLP(nnx.Module):

  def __init__(self, d_model, hidden, *, rngs, dtype):
    self.up = nn.dense("BLD,DF->BLF", (d_model, hidden), ("embed", "mlp"), rngs=rngs, dtype=dtype)
    self.down = nn.dense("BLF,FD->BLD", (hidden, d_model), ("mlp", "embed"), rngs=rngs, dtype=dtype)

  def __call__(self, x_BxLxD):
    return self.down(jax.nn.gelu(self.up(x_BxLxD)))


class Block(nnx.Module):

  def __init__(self, mixer_cls, model_config, position, *, rngs):
    d, dtype = model_config.d_model, nn.compute_dtype(model_config)
    self.mixer_norm = nn.rms_norm(d, rngs=rngs, dtype=dtype)
    self.mixer = mixer_cls(model_config, _layer_position(mixer_cls, position), rngs=rngs)
    self.mlp_norm = nn.rms_norm(d, rngs=rngs, dtype=dtype) if model_config.mlp_ratio else None
    self.mlp = (MLP(d, model_config.mlp_ratio * d, rngs=rngs, dtype=dtype)
                if model_config.mlp_ratio else None)

  def _feed_forward(self, x):
    if self.mlp is None:
      return x
    return x + self.mlp(self.mlp_norm(x))

  def __call__(self, x_BxLxD, positions_L):
    x = x_BxLxD + self.mixer(self.mixer_norm(x_BxLxD), positions_L)
    return sharding.constrain(self._feed_forward(x), ("batch", "length", "embed"))

  def decode(self, x_BxTxD, cache, index):
    y, cache = self.mixer.decode(self.mixer_norm(x_BxTxD), cache, index)
    return self._feed_forward(x_BxTxD + y), cache


class LanguageModel(nnx.Module):

  def __init__(self, model_config, *, rngs):
    validate(model_config)
    d, dtype = model_config.d_model, nn.compute_dtype(model_config)
    self.dtype = dtype
    self.position = positions_lib.from_config(model_config)
    self.embed = nnx.Embed(model_config.vocab_size, d, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(1.0),
                           embedding_metadata={"logical_axes": ("vocab", "embed")}, rngs=rngs)
    self.blocks = nnx.List([
        Block(attention.REGISTRY.lookup(name), model_config, self.position, rngs=rngs)
        for name in layer_types(model_config)])
    self.final_norm = nn.rms_norm(d, rngs=rngs, dtype=dtype)
    self.head = nn.dense("BLD,DV->BLV", (d, model_config.vocab_size), ("embed", "vocab"),
                         rngs=rngs, dtype=dtype)

  def _embed(self, tokens_BxT, positions_T):
    # Gather from the whole table (all-gathered, as FSDP does before any use of a parameter):
    # the partitioner cannot gather from a table split along embed into a batch-split output.
    table_VxD = sharding.constrain(self.embed.embedding.value, (None, None))
    x = jnp.take(table_VxD, tokens_BxT, axis=0).astype(self.dtype)
    if self.position.kind == positions_lib.EMBED:
      x = x + self.position.embedding(positions_T, x.shape[-1]).astype(x.dtype)
    return sharding.constrain(x, ("batch", "length", "embed"))

  def _logits(self, x):
    return self.head(self.final_norm(x)).astype(jnp.float32)

  def __call__(self, tokens_BxL):
    """Logits [batch, length, vocab] for tokens at positions 0..length-1."""
    positions_L = jnp.arange(tokens_BxL.shape[1])
    x = self._embed(tokens_BxL, positions_L)
    for block in self.blocks:
      x = block(x, positions_L)
    return self._logits(x)

  def init_cache(self, batch_size, max_length):
    return {"index": jnp.zeros((), jnp.int32),
            "layers": [block.mixer.init_cache(batch_size, max_length) for block in self.blocks]}

  def decode(self, tokens_BxT, cache):
    """Logits for T new tokens that follow the cached ones, and the updated cache."""
    index = cache["index"]
    x = self._embed(tokens_BxT, index + jnp.arange(tokens_BxT.shape[1]))
    layers = []
    for block, layer_cache in zip(self.blocks, cache["layers"]):
      x, layer_cache = block.decode(x, layer_cache, index)
      layers.append(layer_cache)
    return self._logits(x), {"index": index + tokens_BxT.shape[1], "layers": layers}

  def cache_bytes(self, batch_size, context_length):
    """Bytes of the decode cache (KV cache or recurrent state) over all layers."""
    return sum(block.mixer.cache_bytes(batch_size, context_length) for block in self.blocks)


def build_model(model_config, *, rngs):
  """The language model described by `model_config` (validated first)."""
  return LanguageModel(model_config, rngs=rngs)


def count_params(model, *, embeddings=True):
  """Number of parameters; without the input embedding table if embeddings=False."""
  state = nnx.state(model, nnx.Param)
  total = sum(x.size for x in jax.tree.leaves(state))
  return total if embeddings else total - model.embed.embedding.value.size
