"""Softmax attention with num_kv_heads key/value heads: MHA, MQA and GQA.

  softmax(m q k^T / sqrt(d_k) + bias, causal) v           (Vaswani et al., arXiv:1706.03762)
with q, k after the position scheme's query/key hooks, bias its score bias and m its logit scale
(YaRN's temperature; 1 otherwise). GQA (Ainslie et al., arXiv:2305.13245): K key/value heads
shared by groups of N / K query heads; K = N is MHA, K = 1 is MQA (Shazeer, arXiv:1911.02150).
K/V are never repeated in memory. KV cache bytes = 2 * K * head_dim * bytes_per_value * tokens
* batch per layer.

All of it runs through the public attention core (research.model.attention.core.attend: backends
xla, blockwise, cudnn, pallas, splash and auto, model.attention_backend) and its KV cache
(research.model.attention.kv_cache.KVCache): the scheme's bias is the core's ScoreMod, the window
and sinks its MaskSpec. A subclass changes what it projects (`project`), what its score function
reads per token (`score_inputs`) and the score itself (`score_bias`), and keeps every backend,
the masks, packed documents, the decode cache and the analyses: research/model/attention/fox.py adds
data-dependent forget gates that way.

Masks (research.model.attention.masks): causal; model.softmax.window = W > 0 keeps the last W keys
(Longformer's local attention, arXiv:2004.05150) and model.softmax.sinks = S the first S tokens
as well (StreamingLLM, arXiv:2309.17453); segment ids of packed documents keep attention within a
document. With a window the decode cache is a rolling buffer of S + W slots, so its bytes do not
grow with the context.

model.softmax.sink_positions says where the position scheme sees a sink that is outside the
window: "cache" (the default), StreamingLLM's positions in its rolling cache, or "original", each
token's own (research.model.attention.streaming, which this class mixes in).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import core
from research.model.attention import masks
from research.model.attention import normalisers
from research.model.attention import streaming
from research.model.attention.kv_cache import KVCache
from research.model import positions
from research.model.positions import BIAS, CONTEXT, LENGTH, QK, SCORE_HOOKS

BACKENDS = core.BACKENDS
SINK_POSITIONS = streaming.SINK_POSITIONS  # model.softmax.sink_positions
# model.softmax.projection_bias: which projections have a bias.
PROJECTION_BIASES = ("none", "qkv", "all")


class SoftmaxAttention(streaming.SinkPositions, base.Mixer):
  """Base of mha / mqa / gqa (and of softmax-family variants); subclasses say how many
  key/value heads (`kv_heads`)."""
  hyperparameters = {"block_size": 128,  # blockwise backend: query and key block length
                     "window": 0,  # sliding window: the last W keys, the own included (0: all)
                     "sinks": 0,  # with a window, the first S tokens stay visible
                     # how the position scheme sees a sink outside the window: "cache"
                     # (StreamingLLM's pos_shift: at its slot in the rolling cache, so every
                     # distance is < sinks + window) or "original" (its token's own position)
                     "sink_positions": "cache",
                     # biases of the projections: "none", "qkv" (Qwen2's) or "all" (q, k, v and
                     # the output: GPT-2's, Llama's attention_bias); zeros at init
                     "projection_bias": "none"}
  test_settings = {"block_size": 8}
  position_hooks = frozenset({QK, BIAS})
  backends = BACKENDS
  has_attention_weights = True
  supports_sliding_window = True

  # Head geometry, one classmethod each so that a variant changes one of them: N query heads of
  # key_dim, K key/value heads (kv_heads), values of value_dim (which may exceed key_dim).

  @classmethod
  def kv_heads(cls, model_config):
    raise NotImplementedError

  @classmethod
  def query_heads(cls, model_config):
    return model_config.num_heads

  @classmethod
  def key_dim(cls, model_config):
    return model_config.d_model // model_config.num_heads

  @classmethod
  def value_dim(cls, model_config):
    return cls.key_dim(model_config)

  @classmethod
  def position_geometry(cls, settings, model_config, layer_index=0):
    """The scheme rotates and biases this mixer's queries and keys: N heads of key_dim."""
    del settings
    key_dim = cls.key_dim(model_config)
    return positions.Geometry(model_config.d_model, cls.query_heads(model_config), key_dim,
                              key_dim, layer_index)

  @classmethod
  def chunk_length(cls, settings):
    return int(settings.block_size)  # the blockwise backend's tiles

  @classmethod
  def validate(cls, settings, model_config):
    base.check_kv_heads(cls.query_heads(model_config), cls.kv_heads(model_config))
    backend = model_config.attention_backend
    if backend not in cls.backends:
      raise ValueError(f"unknown model.attention_backend {backend!r}; valid: "
                       f"{', '.join(cls.backends)}")
    if backend == "cudnn":
      reasons = core.refusals("cudnn", dtype=model_config.compute_dtype)
      if reasons:
        raise ValueError(f"attention_backend 'cudnn' cannot run here: {'; '.join(reasons)}; "
                         "use 'xla' or 'blockwise'")
    if backend in ("pallas", "splash"):
      cls._check_kernel(backend, settings, model_config)
    if settings.block_size < 1:
      raise ValueError(f"model.softmax.block_size must be >= 1, got {settings.block_size}")
    masks.check_window(settings.window, settings.sinks)
    cls._check_contextual(settings, model_config)
    if settings.get("projection_bias", "none") not in PROJECTION_BIASES:
      raise ValueError(f"unknown model.softmax.projection_bias {settings.projection_bias!r}; "
                       f"valid: {', '.join(map(repr, PROJECTION_BIASES))}")
    streaming.check_sink_positions(settings.sink_positions)

  @classmethod
  def _check_kernel(cls, backend, settings, model_config):
    """What the Pallas kernels (pallas, splash) cannot express (core.refusals), named before any
    work (packed documents, which splash takes without sinks, are the data's: refused when
    traced)."""
    scores = positions.REGISTRY.lookup(model_config.position).hooks() & cls.position_hooks
    mask = cls.mask_spec(settings)
    reasons = core.refusals(
        backend, mask=mask, score_mod=core.ScoreMod() if scores & SCORE_HOOKS else None,
        head_dim=cls.key_dim(model_config), value_dim=cls.value_dim(model_config),
        other_queries=bool(mask.requeries and settings.sink_positions == "cache"))
    if reasons:
      raise ValueError(f"attention_backend {backend!r} cannot run model.position="
                       f"{model_config.position!r} with this model: {'; '.join(reasons)}")

  @classmethod
  def _check_contextual(cls, settings, model_config):
    """A contextual scheme (CoPE) reads whole rows of logits in key order: the xla backend and
    the full decode cache have them, blockwise, cudnn and a sliding window's rolling cache not."""
    scheme = positions.REGISTRY.lookup(model_config.position)
    if CONTEXT not in scheme.hooks() & cls.position_hooks:
      return
    name = model_config.position
    if model_config.attention_backend not in core.CONTEXTUAL_BACKENDS:
      raise ValueError(f"model.position={name!r} needs each query's whole row of logits, which "
                       f"attention_backend {model_config.attention_backend!r} does not give; "
                       f"valid: {', '.join(map(repr, core.CONTEXTUAL_BACKENDS))}")
    if settings.get("window", 0):
      raise ValueError(f"model.position={name!r} counts positions over keys in token order, "
                       "which the rolling cache of a sliding window does not keep: set "
                       "model.softmax.window=0")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    d, n, k = model_config.d_model, self.query_heads(model_config), self.kv_heads(model_config)
    h, v = self.key_dim(model_config), self.value_dim(model_config)
    self.position = position
    self.layer_index = layer_index
    self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim = n, k, h, v
    self.backend = model_config.attention_backend
    self.block_size = int(settings.block_size)
    self.mask = self.mask_spec(settings)
    self.sink_positions = str(settings.get("sink_positions", "original"))
    self.kv_cache = KVCache(k, self.mask)
    self.dtype = nn.compute_dtype(model_config)
    biases = str(settings.get("projection_bias", "none"))
    qkv = biases != "none"
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=self.dtype, bias=qkv)
    self.key = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=self.dtype, bias=qkv)
    self.value = base.head_projection(d, k, v, "kv_heads", rngs=rngs, dtype=self.dtype, bias=qkv)
    self.out = base.output_projection(n, v, d, rngs=rngs, dtype=self.dtype,
                                      bias=biases == "all")

  # What a subclass changes: the mask, the projections, the score function's per-token inputs,
  # the score.

  @classmethod
  def mask_spec(cls, settings):
    """The keys each query sees (research.model.attention.masks.MaskSpec): the sliding window
    and sinks of the settings (model.softmax), causal where the settings have neither."""
    return masks.MaskSpec(window=int(settings.get("window", 0)),
                          sinks=int(settings.get("sinks", 0)))

  def sequence_mask(self, segments_BxL=None):
    """The mask spec of a sequence (with these segments, or None): `mask`."""
    del segments_BxL
    return self.mask

  def project(self, x_BxTxD, positions_BxT, segments_BxT=None, cache=None, index=0,
              documents=None):
    """(queries [B, T, N, H], the per-token arrays that the decode cache keeps: {"key": [B, T,
    K, H], "value": [B, T, K, V], ...}) of T tokens at `index` onwards; a subclass may add
    arrays that continue from the cached ones (restarting where `documents`,
    masks.DecodeDocuments, starts one)."""
    del segments_BxT, cache, index, documents
    q = self.position.queries(self.query(x_BxTxD), positions_BxT)
    k = self.position.keys(self.key(x_BxTxD), positions_BxT)
    return q, {"key": k, "value": self.value(x_BxTxD)}

  def score_inputs(self, positions_BxT, arrays):
    """What the score function reads per token, given the tokens' positions and arrays (as
    returned by `project` or kept in the cache): here the positions."""
    del arrays
    return positions_BxT

  def score_bias(self, position, q_inputs, k_inputs):
    """The score bias [B', N, T, S] float32 (or None) from the queries' and keys' score inputs,
    with the scheme `position` (merged from the parameters the core differentiates): the
    scheme's bias of their positions."""
    return position.bias(q_inputs, k_inputs)

  def score_mod(self):
    """(core.ScoreMod, its parameters): score_bias as a function of the scheme's parameters, and
    where this mixer applies them the scheme's contextual change of the logits (CoPE) and its
    length-aware scale of each query's logits (SSMax)."""
    graphdef, params = nnx.split(self.position)
    bias = lambda p, q_inputs, k_inputs: self.score_bias(nnx.merge(graphdef, p), q_inputs,
                                                         k_inputs)
    applied = self.position.hooks() & self.position_hooks
    contextual = query_scale = None
    if CONTEXT in applied:
      contextual = lambda logits, p, q: nnx.merge(graphdef, p).contextual(logits, q)
    if LENGTH in applied:
      query_scale = lambda p, context: nnx.merge(graphdef, p).length_scale(*context)
    return core.ScoreMod(bias=bias, contextual=contextual, query_scale=query_scale), params

  def scale(self):
    return self.position.logit_scale() / self.head_dim ** 0.5

  def normaliser(self):
    """What weighs the logits (research.model.attention.normalisers): softmax. A variant with
    another returns it here, and keeps every backend that runs it, the masks, packed documents
    and both decode caches."""
    return normalisers.SOFTMAX

  # The sequence path, the analyses and decoding, all through the core.

  def attend(self, q_BxLxNxH, tokens, positions_BxL, segments_BxL=None, other_queries=None):
    """Attention of a whole sequence to itself through the configured backend (other_queries:
    StreamingLLM's, see `sink_queries`)."""
    score_mod, params = self.score_mod()
    return core.attend(q_BxLxNxH, tokens["key"], tokens["value"], scale=self.scale(),
                       score_mod=score_mod, score_params=params,
                       inputs=self.score_inputs(positions_BxL, tokens),
                       mask=self.sequence_mask(segments_BxL), segments_BxT=segments_BxL,
                       backend=self.backend,
                       block_size=self.block_size, backends=self.backends,
                       other_queries=other_queries, normaliser=self.normaliser())

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    q, tokens = self.project(x_BxLxD, positions_BxL, segments_BxL)
    sinks = self.sequence_sink_queries(x_BxLxD, positions_BxL, tokens, segments_BxL)
    return self.out(self.attend(q, tokens, positions_BxL, segments_BxL, sinks))

  def _probabilities(self, x_BxLxD, positions_BxL, segments_BxL):
    q, tokens = self.project(x_BxLxD, positions_BxL, segments_BxL)
    score_mod, params = self.score_mod()
    probs, visible = core.probabilities(
        q, tokens["key"], scale=self.scale(), score_mod=score_mod, score_params=params,
        inputs=self.score_inputs(positions_BxL, tokens), mask=self.sequence_mask(segments_BxL),
        segments_BxT=segments_BxL,
        other_queries=self.sequence_sink_queries(x_BxLxD, positions_BxL, tokens, segments_BxL),
        normaliser=self.normaliser())
    return probs, visible, tokens

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The attention probabilities of `__call__`, float32 [B, N, L (query), L (key)], for
    inspection (research.analysis.heads): the core's logits, mask (causal, window and sinks,
    segments)
    and float32 softmax, materialised."""
    return self._probabilities(x_BxLxD, positions_BxL, segments_BxL)[0]

  def with_edited_weights(self, x_BxLxD, positions_BxL, segments_BxL, edit):
    """`__call__` with the probabilities P replaced by edit(P, mask) (mask [B | 1, 1, L, L]:
    the visible keys), for interventions (research.analysis.analyze's permutation test): sum_s
    P'[n, t, s]
    v[s, n // G] through the output projection; edit = lambda p, m: p gives `__call__`."""
    probs_BxNxLxL, visible, tokens = self._probabilities(x_BxLxD, positions_BxL, segments_BxL)
    values = tokens["value"]
    return self.out(core.grouped_values(edit(probs_BxNxLxL, visible), values).astype(values.dtype))

  def kv_group_size(self):
    return self.num_heads // self.num_kv_heads

  def init_cache(self, batch_size, max_length):
    return self.kv_cache.init(batch_size, max_length, key_dim=self.head_dim,
                              value_dim=self.value_head_dim, dtype=self.dtype)

  # Packed documents decode through the cache (kv_cache.KVCache.attend: the rolling layout
  # keeps each row's open document's sinks).
  document_decode_refusal = classmethod(base.no_refusal)

  def decode_cache(self, documents=None):
    """(the KVCache through which new tokens attend to the cache, the score_inputs function it
    takes) when decoding with `documents` or without: `kv_cache` and `score_inputs`."""
    del documents
    return self.kv_cache, self.score_inputs

  def decode_inputs(self, x_BxTxD, cache, index, documents=None):
    """(token indices [1, T], positions [B | 1, T], segment ids [B, T] or None, queries, the
    per-token arrays of `project`, sink queries) of T new tokens at `index`: the positions are
    the token indices without documents and restart at each document with them, and so does
    each token's index within its document (the sinks' cache positions)."""
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, x_BxTxD.shape[1],
                                                                   documents)
    q, tokens = self.project(x_BxTxD, positions_BxT, cache=cache, index=index,
                             documents=documents)
    sinks = self.sink_queries(x_BxTxD, positions_BxT, tokens, positions_BxT, cache=cache,
                              index=index)
    return index_1xT, positions_BxT, segments_BxT, q, tokens, sinks

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens at indices index..index + T - 1 against the cache and each other, in one
    pass; returns their outputs and the cache with their arrays written. A prompt into an empty
    cache attends only to itself: the sequence path (blockwise skips masked tiles). `documents`
    (masks.DecodeDocuments): packed documents, each token sees only its own."""
    index_1xT, positions_BxT, segments_BxT, q, tokens, sinks = self.decode_inputs(
        x_BxTxD, cache, index, documents)
    score_mod, params = self.score_mod()

    def from_cache(q, tokens, cache):
      layout, score_inputs = self.decode_cache(documents)
      return layout.attend(q, tokens, cache, index_1xT, scale=self.scale(), score_mod=score_mod,
                           score_params=params, score_inputs=score_inputs, other_queries=sinks,
                           documents=documents, normaliser=self.normaliser())

    def prefill_empty(q, tokens, cache):
      tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
      return (self.attend(q, tokens, positions_BxT, segments_BxT, other_queries=sinks),
              self.kv_cache.write(tokens, cache, index_1xT[0], documents))

    if x_BxTxD.shape[1] == 1:
      y, cache = from_cache(q, tokens, cache)
    else:
      y, cache = jax.lax.cond(index == 0, prefill_empty, from_cache, q, tokens, cache)
    return self.out(y), cache

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """Decode-cache bytes per token and layer: K * (key_dim + value_dim) * bytes per value
    (2 K head_dim bytes for mha / mqa / gqa)."""
    itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
    width = cls.key_dim(model_config) + cls.value_dim(model_config)
    return cls.kv_heads(model_config) * width * itemsize

  def mixing_flops_per_token(self, context_length):
    # q k^T and p v, 2 FLOPs per multiply-add, each query sees (context + 1) / 2 keys on average
    # (at most the window and the sinks).
    keys = (context_length + 1) / 2
    window, sinks = self.mask.window, self.mask.sinks
    if window:
      w = min(window, context_length)
      keys = (w * (w + 1) / 2 + (context_length - w) * min(w + sinks, context_length)) / context_length
    flops = 2 * self.num_heads * (self.head_dim + self.value_head_dim) * keys
    if self.moves_sinks() and QK in self.position.hooks():
      # The sink queries' logits: S more q k^T per query past the window (cache positions).
      far = max(context_length - window, 0) / context_length
      flops += 2 * self.num_heads * self.head_dim * sinks * far
    return flops


class MHA(SoftmaxAttention):
  # mha, mqa and gqa also apply a contextual scheme (CoPE), on the xla backend, and a
  # length-aware scale of each query's logits (SSMax), on every backend but the fused kernels.
  position_hooks = frozenset({QK, BIAS, CONTEXT, LENGTH})

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads


class MQA(SoftmaxAttention):
  position_hooks = MHA.position_hooks

  @classmethod
  def kv_heads(cls, model_config):
    return 1


class GQA(SoftmaxAttention):
  position_hooks = MHA.position_hooks
  reads_num_kv_heads = True

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_kv_heads
