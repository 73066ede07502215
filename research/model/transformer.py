"""Decoder-only language model assembled from the registries.

  h_0 = embed(tokens) [+ position embedding term]
  h_l = h'_l + FF_l(Norm(h'_l)),  h'_l = h_{l-1} + Mixer_l(Norm(h_{l-1}))   (pre-norm)
  logits = head(Norm(h_L))                                               (float32)
Norm is model.norm (research.model.norms: RMSNorm by default, LayerNorm); head is its own matrix, or
with model.tie_embeddings the embedding table transposed (logits = Norm(h_L) E^T, as GPT-2 and
the small Llama-family checkpoints do).
Mixer_l is model.attention, or model.layer_pattern[l % len(pattern)] for hybrids; FF_l, the
feed-forward (research.model.feed_forward: an MLP, a mixture of experts), is model.feed_forward, or
model.feed_forward_pattern[l % len(pattern)]. In a hybrid, recurrent layers (mamba) run without a
qk or bias position scheme that the attention layers take, as in Jamba (arXiv:2403.19887), whose
pattern is attention:Mamba 1:7 with a mixture of experts every other layer (configs/jamba.py).
Every block is mixer + MLP by default so that variants differ only in the mixer;
model.mlp_ratio = 0 drops the feed-forward (the Mamba paper's stack).

Positions are per token, [B, L] (B = 1 when all rows share them). In evaluation and decoding they
are 0, 1, 2, ...; in training, `training_positions` may draw them: with
model.randomize_max_length = M > 0, each row's positions are a sorted random subset of [0, M)
(randomized positional encodings, Ruoss et al., arXiv:2305.16843), for any position scheme.

Packed documents: segment ids [B, L] (non-decreasing per row) keep every mixer within a document
(research.model.attention.masks); positions then restart at 0 at each document start unless given.
A packed row gives each document the logits it would get alone.

Decoding: `init_cache(batch, max_length)`, then `prefill(prompt, cache)` (every mixer fills its
cache in one chunk-parallel pass) and `decode(tokens, cache)` for the tokens that follow. With
`init_cache(..., documents=True)` both take the new tokens' segment ids, and a document may start
at any token of any row (Mixer.document_decode_refusal says which mixers cannot).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import attention
from research.model import feed_forward
from research.model import nn
from research.model import norms
from research.model.attention import masks
from research.model import positions as positions_lib
from research.model import sharding


# model.remat: what each block keeps for the backward pass (jax.checkpoint policies, as MaxText's
# remat_policy): "none" every activation its operations save; "full" only the block's input, the
# rest recomputed in the backward pass (one more forward of the block); "dots" the outputs of its
# matrix products; "dots_no_batch" those without batch dimensions (the projections by weights,
# not attention's q k^T). The same numbers either way; memory for compute.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class IncompatibleError(ValueError):
  """A valid attention type and position scheme that do not go together (sweeps skip these)."""


def _tiled(model_config, pattern_field, default_field):
  """model.<pattern_field> tiled to model.num_layers, or model.<default_field> for every layer."""
  pattern = tuple(model_config[pattern_field]) or (model_config[default_field],)
  if model_config.num_layers < 1 or model_config.num_layers % len(pattern):
    raise ValueError(f"model.num_layers={model_config.num_layers} must be a positive multiple of "
                     f"len(model.{pattern_field})={len(pattern)}")
  return tuple(pattern[i % len(pattern)] for i in range(model_config.num_layers))


def layer_types(model_config):
  """The attention type of each layer."""
  return _tiled(model_config, "layer_pattern", "attention")


def feed_forward_types(model_config):
  """The feed-forward of each layer."""
  return _tiled(model_config, "feed_forward_pattern", "feed_forward")


def _honours(mixer_cls, scheme_cls):
  """Whether the mixer applies every hook the scheme uses (the embedding term is the model's)."""
  return scheme_cls.hooks() - {positions_lib.EMBED} <= mixer_cls.position_hooks


def compatible_positions(mixer_cls):
  return [name for name, cls in positions_lib.REGISTRY.items() if _honours(mixer_cls, cls)]


def position_geometries(model_config):
  """Per layer, the geometry its mixer hands the position scheme, or None for a layer that runs
  without the scheme (a hybrid's recurrent layer that cannot honour it)."""
  scheme = positions_lib.REGISTRY.lookup(model_config.position)
  geometries = []
  for layer, name in enumerate(layer_types(model_config)):
    mixer_cls = attention.REGISTRY.lookup(name)
    geometries.append(mixer_cls.position_geometry(attention.REGISTRY.settings(name, model_config),
                                                  model_config, layer)
                      if _honours(mixer_cls, scheme) else None)
  return geometries


def scheme_geometries(model_config):
  """The geometries the position scheme is built and validated for: those of the layers that
  use it, or, where none does (a hybrid of recurrent layers only), the first layer's own."""
  used = [g for g in position_geometries(model_config) if g]
  if used:
    return used
  name = layer_types(model_config)[0]
  return [attention.REGISTRY.lookup(name).position_geometry(
      attention.REGISTRY.settings(name, model_config), model_config, 0)]


def validate(model_config):
  """Raise ValueError naming what is wrong and what is valid; builds nothing."""
  types = layer_types(model_config)
  field = "model.layer_pattern" if model_config.layer_pattern else "model.attention"
  mixers = {name: attention.REGISTRY.lookup(name, field) for name in types}
  nn.compute_dtype(model_config)
  if model_config.get("remat", "none") not in REMAT_POLICIES:
    raise ValueError(f"unknown model.remat {model_config.remat!r}; valid: "
                     f"{', '.join(REMAT_POLICIES)}")
  d, heads = model_config.d_model, model_config.num_heads
  if d < 1 or heads < 1 or d % heads:
    raise ValueError(f"d_model={d} is not divisible by num_heads={heads}; valid num_heads: "
                     f"{[h for h in range(1, d + 1) if d % h == 0]}")
  if model_config.vocab_size < 1:
    raise ValueError(f"model.vocab_size must be >= 1, got {model_config.vocab_size}")
  for name in ("mlp_ratio", "randomize_max_length"):
    if model_config[name] < 0:
      raise ValueError(f"model.{name} must be >= 0 (0 turns it off), got {model_config[name]}")
  norms.validate(model_config)
  pattern = "model.feed_forward_pattern" if model_config.feed_forward_pattern else None
  for name in dict.fromkeys(feed_forward_types(model_config)):
    feed_forward.REGISTRY.lookup(name, pattern).validate(
        feed_forward.REGISTRY.settings(name, model_config), model_config)
  scheme = positions_lib.REGISTRY.lookup(model_config.position)
  hybrid = len(mixers) > 1
  for name, mixer_cls in mixers.items():
    if not _honours(mixer_cls, scheme) and not (hybrid and mixer_cls.recurrent):
      missing = sorted(scheme.hooks() - {positions_lib.EMBED} - mixer_cls.position_hooks)
      raise IncompatibleError(
          f"attention {name!r} does not support position {model_config.position!r} (it needs "
          f"the {' and '.join(missing)} hook, which {name!r} cannot honour); compatible "
          f"positions: {', '.join(compatible_positions(mixer_cls))}")
    mixer_cls.validate(attention.REGISTRY.settings(name, model_config), model_config)
  positions_lib.validate(model_config, scheme_geometries(model_config))


def validate_lengths(model_config, train_length, eval_lengths):
  """The position scheme must represent every training and evaluation length."""
  name, table = model_config.position, positions_lib.max_length(model_config)
  randomized = model_config.randomize_max_length
  if randomized and randomized < train_length:
    raise ValueError(f"model.randomize_max_length={randomized} must be >= train.seq_len="
                     f"{train_length} (positions are drawn from [0, randomize_max_length)), or 0")
  if table is None:
    return
  key = positions_lib.REGISTRY.settings_key(name)
  needed = {"train.seq_len": train_length, "model.randomize_max_length": randomized,
            "the longest of eval.lengths": max(eval_lengths, default=0)}
  for what, length in needed.items():
    if length > table:
      raise ValueError(f"{what} = {length} exceeds the {table} positions of the {name!r} table "
                       f"(model.{key}.max_length): positions beyond it have no embedding (they "
                       f"would read NaN). Use lengths <= {table}, or a larger table (its extra "
                       f"rows are trained only with model.randomize_max_length)")


class Block(nnx.Module):

  def __init__(self, mixer, feed_forward_name, model_config, *, rngs):
    dtype = nn.compute_dtype(model_config)
    self.mixer_norm = norms.build(model_config, rngs=rngs, dtype=dtype)
    self.mixer = mixer
    # Named `mlp` whatever the feed-forward: the parameter paths of every checkpoint, the first
    # runs' (which had only the MLP) included, stay the same.
    kept = bool(model_config.mlp_ratio)
    self.mlp_norm = norms.build(model_config, rngs=rngs, dtype=dtype) if kept else None
    self.mlp = feed_forward.REGISTRY.lookup(feed_forward_name)(
        model_config, feed_forward.REGISTRY.settings(feed_forward_name, model_config),
        rngs=rngs) if kept else None

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None, carry=None):
    """The block's output, and the carry of what its mixer leaves for later layers (a dict:
    research.model.attention.base.Mixer.call_with_carry)."""
    y, carry = self.mixer.call_with_carry(self.mixer_norm(x_BxLxD), positions_BxL, segments_BxL,
                                          {} if carry is None else carry)
    x = sharding.constrain(self.feed_forward(x_BxLxD + y, segments_BxL),
                           ("batch", "length", "embed"))
    return x, carry

  def feed_forward(self, x_BxLxD, segments_BxL=None):
    """The feed-forward sublayer with its residual (the identity when there is none)."""
    if self.mlp is None:
      return x_BxLxD
    return x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD), segments_BxL)

  def init_cache(self, batch_size, max_length):
    return {"mixer": self.mixer.init_cache(batch_size, max_length),
            "feed_forward": (None if self.mlp is None
                             else self.mlp.init_cache(batch_size, max_length))}

  def decode(self, x_BxTxD, cache, index, carry=None, documents=None):
    kept = {} if documents is None else {"documents": documents}
    y, mixer_cache, carry = self.mixer.decode_with_carry(
        self.mixer_norm(x_BxTxD), cache["mixer"], index, {} if carry is None else carry, **kept)
    x, feed_forward_cache = x_BxTxD + y, cache["feed_forward"]
    if self.mlp is not None:
      y, feed_forward_cache = self.mlp.decode(self.mlp_norm(x), feed_forward_cache, index,
                                              **kept)
      x = x + y
    return x, {"mixer": mixer_cache, "feed_forward": feed_forward_cache}, carry

  def cache_bytes(self, batch_size, context_length):
    feed_forward = (0 if self.mlp is None
                    else nn.tree_bytes(nn.cache_shapes(self.mlp, batch_size, context_length)))
    return self.mixer.cache_bytes(batch_size, context_length) + feed_forward


class LanguageModel(nnx.Module):

  def __init__(self, model_config, *, rngs):
    validate(model_config)
    d, dtype = model_config.d_model, nn.compute_dtype(model_config)
    self.dtype = dtype
    self.randomize_max_length = int(model_config.randomize_max_length)
    self.remat = str(model_config.get("remat", "none"))
    scheme = positions_lib.REGISTRY.lookup(model_config.position)
    geometries = position_geometries(model_config)
    shared = {}  # a scheme shared across layers: one per geometry, the layer index aside

    def scheme_for(geometry):
      if not scheme.shared_across_layers:
        return positions_lib.build(model_config, geometry, rngs=rngs)
      if geometry.shared() not in shared:
        shared[geometry.shared()] = positions_lib.build(model_config, geometry.shared(), rngs=rngs)
      return shared[geometry.shared()]

    # A shared scheme (of the first attention layer's geometry) also owns the embedding term; it
    # is built first, so that parameters are drawn in the order they always were.
    first = scheme_geometries(model_config)[0]
    self.position = scheme_for(first) if scheme.shared_across_layers else None
    self.embed = nn.embed(model_config.vocab_size, d, ("vocab", "embed"), rngs=rngs, dtype=dtype,
                          stddev=1.0)
    blocks, refusals = [], []
    for layer, (name, feed_forward_name, geometry) in enumerate(zip(
        layer_types(model_config), feed_forward_types(model_config), geometries)):
      mixer_cls = attention.REGISTRY.lookup(name)
      position = (scheme_for(geometry) if geometry is not None  # None: a hybrid's recurrent layer
                  else positions_lib.NoPosition(None, first, rngs=rngs))
      settings = attention.REGISTRY.settings(name, model_config)
      mixer = mixer_cls(settings, model_config, position, rngs=rngs, layer_index=layer)
      reason = mixer_cls.document_decode_refusal(settings)
      if reason and f"{name}: {reason}" not in refusals:
        refusals.append(f"{name}: {reason}")
      blocks.append(Block(mixer, feed_forward_name, model_config, rngs=rngs))
    self.blocks = nnx.List(blocks)
    # Why decode cannot take packed documents (Mixer.document_decode_refusal), per mixer.
    self.document_decode_refusals = tuple(refusals)
    self.final_norm = norms.build(model_config, rngs=rngs, dtype=dtype)
    self.head = None if model_config.get("tie_embeddings", False) else nn.dense(
        "BLD,DV->BLV", (d, model_config.vocab_size), ("embed", "vocab"), rngs=rngs, dtype=dtype)

  def _embed(self, tokens_BxT, positions_BxT):
    # Gather from the whole table (all-gathered, as FSDP does before any use of a parameter):
    # the partitioner cannot gather from a table split along embed into a batch-split output.
    table_VxD = sharding.constrain(self.embed.embedding[...], (None, None))
    x = jnp.take(table_VxD, tokens_BxT, axis=0).astype(self.dtype)
    term = None if self.position is None else self.position.embedding(positions_BxT, x.shape[-1])
    if term is not None:
      x = x + term.astype(x.dtype)
    return sharding.constrain(x, ("batch", "length", "embed"))

  def _logits(self, x):
    return self.head_logits(self.final_norm(x))

  def head_logits(self, x_BxLxD):
    """float32 logits [B, L, V] of final-normed hidden states (`features`): the output head."""
    x = x_BxLxD
    if self.head is None:  # tied: the embedding table, all-gathered as in _embed
      table_VxD = sharding.constrain(self.embed.embedding[...], (None, None))
      return nn.token_major_einsum("BLD,VD->BLV", x, table_VxD.astype(x.dtype)).astype(
          jnp.float32)
    return self.head(x).astype(jnp.float32)

  def training_positions(self, key, batch_size, length):
    """Positions [B, L] for a training batch: 0..L-1 (shared, B = 1), or with
    model.randomize_max_length = M each row a sorted random subset of [0, M), drawn from `key`."""
    if not self.randomize_max_length:
      return jnp.arange(length)[None]
    draw = lambda k: jnp.sort(jax.random.permutation(k, self.randomize_max_length)[:length])
    return jax.vmap(draw)(jax.random.split(key, batch_size)).astype(jnp.int32)

  def __call__(self, tokens_BxL, positions_BxL=None, segments_BxL=None):
    """Logits [batch, length, vocab]. positions default to 0..length-1, or with segment ids
    (packed documents) to 0.. from each document's start."""
    return self.head_logits(self.features(tokens_BxL, positions_BxL, segments_BxL))

  def features(self, tokens_BxL, positions_BxL=None, segments_BxL=None):
    """The final-normed hidden states [B, L, D] that the head maps to logits (`head_logits`):
    evaluation scores long windows from them a chunk of positions at a time."""
    positions_BxL = self._positions(tokens_BxL, positions_BxL, segments_BxL)
    x, carry = self._embed(tokens_BxL, positions_BxL), {}
    run = _run_block if self.remat == "none" else nnx.remat(
        _run_block, policy=REMAT_POLICIES[self.remat])
    for block in self.blocks:
      x, carry = run(block, x, positions_BxL, segments_BxL, carry)
    return self.final_norm(x)

  @staticmethod
  def _positions(tokens_BxL, positions_BxL, segments_BxL):
    masks.check_segments(segments_BxL)
    if positions_BxL is not None:
      return positions_BxL
    return masks.indices_in_documents(tokens_BxL.shape[1], segments_BxL)

  def attention_weights(self, tokens_BxL, positions_BxL=None, segments_BxL=None):
    """Per layer, the attention probabilities [B, N, L, L] of the forward pass of `__call__`
    (float32; a mixer's `attention_weights`), or None for a layer whose mixer has none."""
    positions_BxL = self._positions(tokens_BxL, positions_BxL, segments_BxL)
    x, carry = self._embed(tokens_BxL, positions_BxL), {}
    weights = []
    for block in self.blocks:
      weights.append(block.mixer.attention_weights(block.mixer_norm(x), positions_BxL,
                                                   segments_BxL)
                     if block.mixer.has_attention_weights else None)
      x, carry = block(x, positions_BxL, segments_BxL, carry)
    return weights

  def probe(self, tokens_BxL, positions_BxL=None, segments_BxL=None, *, input_offset_BxLxD=None,
            edit_attention=None):
    """The logits of `__call__` with two hooks for analyses (research.analysis): the embedded
    input plus `input_offset_BxLxD` (its gradient at zero is the gradient with respect to the
    input embeddings), and each layer l of `edit_attention` ({l: edit}, softmax layers) run
    with its attention probabilities P replaced by edit(P, mask)
    (SoftmaxAttention.with_edited_weights, materialised: the xla path)."""
    edit_attention = edit_attention or {}
    positions_BxL = self._positions(tokens_BxL, positions_BxL, segments_BxL)
    x = self._embed(tokens_BxL, positions_BxL)
    if input_offset_BxLxD is not None:
      x = x + input_offset_BxLxD.astype(x.dtype)
    carry = {}  # an edited (softmax) layer leaves nothing for later layers
    for layer, block in enumerate(self.blocks):
      if layer in edit_attention:
        y = block.mixer.with_edited_weights(block.mixer_norm(x), positions_BxL, segments_BxL,
                                            edit_attention[layer])
        x = block.feed_forward(x + y, segments_BxL)
      else:
        x, carry = block(x, positions_BxL, segments_BxL, carry)
    return self._logits(x)

  def init_cache(self, batch_size, max_length, documents=False):
    """An empty decode cache for `batch_size` rows of up to `max_length` tokens. With
    `documents`, for packed documents: every decode then takes the new tokens' segment ids,
    and a document may start at any token of any row (the cache keeps where each row's open
    document started, and its segment id); refused, naming them, where a mixer cannot."""
    if documents and self.document_decode_refusals:
      raise ValueError(f"this model cannot decode packed documents: "
                       f"{'; '.join(self.document_decode_refusals)}; mixers that can (at "
                       f"their default settings): {', '.join(document_decoders())}")
    cache = {"index": jnp.zeros((), jnp.int32),
             "layers": [block.init_cache(batch_size, max_length) for block in self.blocks]}
    if documents:
      cache["documents"] = {"segment": jnp.zeros((batch_size,), jnp.int32),
                            "start": jnp.zeros((batch_size,), jnp.int32)}
    return cache

  def prefill(self, tokens_BxT, cache, segments_BxT=None):
    """Logits of a prompt (or the next chunk of one) and the cache filled with it, in one
    chunk-parallel pass per layer: softmax layers write all T keys and values at once, recurrent
    ones run their chunked form from the cached state. The same computation as `decode`, which
    takes any number of tokens; named for what it is used for."""
    return self.decode(tokens_BxT, cache, segments_BxT)

  def decode(self, tokens_BxT, cache, segments_BxT=None):
    """Logits for T new tokens that follow the cached ones, and the updated cache. A cache made
    with init_cache(..., documents=True) takes their segment ids [B, T] (packed documents:
    non-decreasing, continuing the cached ones; a changed id starts a document), as `__call__`
    takes a whole row's. Concrete ids are checked within the call; that they do not fall below
    the cached ones, or within a traced call, is not (a lower id starts a document too)."""
    index = cache["index"]
    documents = self._decode_documents(cache, tokens_BxT, segments_BxT)
    positions_BxT = ((index + jnp.arange(tokens_BxT.shape[1]))[None] if documents is None
                     else documents.positions_BxT)
    x = self._embed(tokens_BxT, positions_BxT)
    layers, carry = [], {}
    for block, layer_cache in zip(self.blocks, cache["layers"]):
      x, layer_cache, carry = block.decode(x, layer_cache, index, carry, documents)
      layers.append(layer_cache)
    cache = {**cache, "index": index + tokens_BxT.shape[1], "layers": layers}
    if documents is not None:
      cache["documents"] = {"segment": documents.segments_BxT[:, -1],
                            "start": documents.starts_BxT[:, -1]}
    return self._logits(x), cache

  @staticmethod
  def _decode_documents(cache, tokens_BxT, segments_BxT):
    """masks.DecodeDocuments of the new tokens, or None for a cache without documents; a
    mismatch of the two is refused before any work."""
    if "documents" not in cache:
      if segments_BxT is not None:
        raise ValueError("segment ids were given to a cache made without documents: "
                         "init_cache(batch, max_length, documents=True) decodes packed documents")
      return None
    if segments_BxT is None:
      raise ValueError("this cache decodes packed documents (init_cache(..., documents=True)): "
                       "pass the new tokens' segment ids, segments_BxT")
    masks.check_segments(segments_BxT)
    segments_BxT = jnp.asarray(segments_BxT, jnp.int32)
    if segments_BxT.shape != tuple(tokens_BxT.shape):
      raise ValueError(f"segment ids of shape {segments_BxT.shape} for tokens of shape "
                       f"{tuple(tokens_BxT.shape)}: one id per new token")
    return masks.decode_documents(segments_BxT, cache["index"],
                                  cache["documents"]["segment"], cache["documents"]["start"])

  def cache_bytes(self, batch_size, context_length):
    """Bytes of the decode cache (KV cache or recurrent state) over all layers."""
    return sum(block.cache_bytes(batch_size, context_length) for block in self.blocks)


def document_decoders():
  """The registered mixers whose decode takes packed documents at their default settings."""
  return [name for name, cls in attention.REGISTRY.items()
          if not cls.document_decode_refusal(cls.hyperparameters)]


def _run_block(block, x_BxLxD, positions_BxL, segments_BxL, carry):
  """A block's forward (the unit model.remat rematerialises)."""
  return block(x_BxLxD, positions_BxL, segments_BxL, carry)


def apply_to_batch(model, batch: dict):
  """The model's logits for a batch (research.data): its `inputs`, with the per-token
  `positions` and `segments` (packed documents: each token attends only within its segment)
  where the batch has them. Training, evaluation and the analyses all call the model so."""
  return model(batch["inputs"], positions_BxL=batch.get("positions"),
               segments_BxL=batch.get("segments"))


def build_model(model_config, *, rngs):
  """The language model described by `model_config` (validated first)."""
  return LanguageModel(model_config, rngs=rngs)


def _size(module):
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def count_params(model, *, embeddings=True):
  """Number of parameters. embeddings=False counts only those used in matmuls per token (for
  FLOPs): without the token embedding table (unless tied: then it is the head), the position
  schemes' parameters and the experts of a mixture of experts that a token is not routed to."""
  total = _size(model)
  if embeddings:
    return total
  modules = {id(m): m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}.values()
  schemes = sum(_size(m) for m in modules if isinstance(m, positions_lib.PositionScheme))
  idle = sum(m.idle_params_per_token() for m in modules
             if isinstance(m, feed_forward.FeedForward))
  table = 0 if model.head is None else _size(model.embed)  # a tied table is the head's matmul
  return total - table - schemes - idle
