"""Softmax attention with num_kv_heads key/value heads: MHA, MQA and GQA.

  softmax(m q k^T / sqrt(d_k) + bias, causal) v           (Vaswani et al., arXiv:1706.03762)
with q, k after the position scheme's query/key hooks, bias its score bias and m its logit scale
(YaRN's temperature; 1 otherwise). GQA (Ainslie et al., arXiv:2305.13245): K key/value heads
shared by groups of N / K query heads; K = N is MHA, K = 1 is MQA (Shazeer, arXiv:1911.02150).
K/V are never repeated in memory. KV cache bytes = 2 * K * head_dim * bytes_per_value * tokens
* batch per layer.

One score path (model.attention_backend):
  xla        jax.nn.dot_product_attention(implementation="xla"), the bias materialised
  blockwise  research.attention.blockwise: exact, online softmax, O(length) memory; the same bias
             function evaluated per tile, forward and backward (gradients to its parameters too)
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"), GPU only
  auto       (the default) the faster exact path for each call's length and device
             (`auto_backend`): cudnn on a GPU with bfloat16 / float16 compute where the mixer
             allows it; on a CPU xla below AUTO_BLOCKWISE_FROM (1024) tokens and blockwise from
             there on, the crossover of the two measured fwd+bwd on a 2-core CPU; xla otherwise
             (the blockwise crossover has not been measured on a GPU or TPU). A prefill into an
             empty cache takes the same rule, so a long prompt on a CPU runs blockwise.
Decoding attends the new queries to the cache (`cached_attention`: the same float32 logits,
bias, mask and softmax as the xla path), with the bias of the new positions against the cached
ones, for any number of new tokens in one pass (prefill). The cache keeps keys and values with
heads before length and batch and heads in one axis, [B K, S, H], so that both matmuls of a
decode step read it where it is written (in the [B, S, K, H] layout of the sequence path, XLA
copied the whole cache transposed at every step: about two thirds of a step's time at 4096
tokens). The bias is
`score_bias` of per-token bias inputs (here the positions); a subclass may add data-dependent
ones that the cache keeps per key (research/attention/fox.py: cumulative log forget gates).

Masks (research.attention.masks): causal; model.softmax.window = W > 0 keeps the last W keys
(Longformer's local attention, arXiv:2004.05150) and model.softmax.sinks = S the first S tokens
as well (StreamingLLM, arXiv:2309.17453); segment ids of packed documents keep attention within a
document. xla masks; blockwise skips the tiles that are fully masked, so with a window its time
grows as O(L W) (with sinks in packed documents, whose sinks can be in any tile, it visits every
causal tile). With a window the decode cache is a rolling buffer of S + W slots: token p is
kept in slot p (p < S) or S + (p - S) mod W, with its position, so its bytes do not grow with the
context.
"""

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from research import nn
from research.attention import base
from research.attention import masks
from research.attention.blockwise import blockwise_attention
from research.positions import BIAS, QK

BACKENDS = ("auto", "xla", "blockwise", "cudnn")
# `auto`: blockwise from this length on. Measured fwd+bwd on a 2-core CPU (mixers suite: batch 1,
# 8 heads, head_dim 64, block 128, fp32), xla / blockwise in ms: 256: 13.4 / 12.6, 512: 34.0 /
# 29.6, 768: 82.3 / 82.5, 1024: 190 / 123, 2048: 764 / 460. Below 1024 the two are within the
# machine's noise, and xla is one fused op without the loop overheads; from 1024 blockwise is
# ahead (1.5x) and the gap grows with the length, as does xla's O(length^2) memory.
AUTO_BLOCKWISE_FROM = 1024
_LARGE_NEGATIVE = -0.7 * float(jnp.finfo(jnp.float32).max)  # as jax.nn.dot_product_attention


# Cache entries stored heads before length, batch and key/value heads in one axis: [B K, S, H].
# Any other per-token array a subclass keeps (FoX's log forget gates) stays [B, S, ...].
HEADS_FIRST = frozenset({"key", "value"})


def to_cache_layout(name, x_BxTx___):
  """A per-token array of new tokens, [B, T, ...], in its cache layout."""
  if name not in HEADS_FIRST:
    return x_BxTx___
  b, t, k, h = x_BxTx___.shape
  return x_BxTx___.swapaxes(1, 2).reshape(b * k, t, h)


def auto_backend(length, backends, compute_dtype, platform=None):
  """The backend that `auto` runs for a sequence of `length` tokens: cudnn where it may run
  (a GPU, half-precision compute, among the mixer's `backends`); on a CPU xla for short
  sequences and blockwise from AUTO_BLOCKWISE_FROM tokens on, where skipping the masked half of
  the tiles and never writing the [length, length] scores outweighs the loop's overheads; xla
  on other devices (set blockwise there explicitly for O(length) memory)."""
  platform = platform or jax.default_backend()
  if ("cudnn" in backends and platform == "gpu"
      and jnp.dtype(compute_dtype) in (jnp.bfloat16, jnp.float16)):
    return "cudnn"
  if platform != "cpu":
    return "xla"
  return "blockwise" if length >= AUTO_BLOCKWISE_FROM else "xla"


def cached_attention(q_BxTxNxH, parts, scale):
  """softmax(scale q k^T + bias, mask) v of T queries against groups of keys in the cache's
  layout, in one softmax over all of them: parts are (k [B K, S_i, H], v [B K, S_i, H],
  bias [B', N | 1, T, S_i] or None, mask [B' | 1, 1, T, S_i]), e.g. the cache and the new
  tokens. Logits and softmax in float32, as jax.nn.dot_product_attention's xla implementation;
  the query heads of a group share their key/value head without a repeat.

  Both matmuls read the cache as it is stored, so that XLA's CPU dot copies none of it: one
  batch axis (two would be merged by a reshape that XLA fuses into the cache write, copying
  the cache for each reader), k the left operand with the logits keys first, [B K, S, G, T],
  and v the right operand contracted over S (asked for [.., T, S] logits, XLA swaps the
  operands and copies all of k transposed to [.., H, S] at every decode step, and v as well).
  The softmax then runs over the last axis, [B K, G, T, S] (a free relabelling when G T = 1: one
  query of an MHA decode step), where XLA:CPU reduces at memory speed; over the keys axis of
  [B K, S, G, T] its max and sum took ~0.35 ms each at 4096 keys and 8 heads, a third of the
  step. The scale multiplies q, not the logits (a copy of them at every step)."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = parts[0][0].shape[0] // b
  group = n // kv_heads
  q_XxGxTxH = (q_BxTxNxH.reshape(b, t, kv_heads, group, h).transpose(0, 2, 3, 1, 4)
               .reshape(b * kv_heads, group, t, h))  # X = B K

  def keys_first(x):  # [B' | 1, N | 1, T, S] -> [B K, S, G, T]
    x = (x.reshape(x.shape[0], kv_heads, group, *x.shape[2:]) if x.shape[1] == n
         else x[:, :, None])
    x = jnp.broadcast_to(x, (b, kv_heads, group) + x.shape[3:])
    return jnp.moveaxis(x.reshape(b * kv_heads, group, *x.shape[3:]), -1, 1)

  logits = []
  for k_XxSxH, _, bias, mask in parts:
    logits_XxSxGxT = jnp.einsum("XSH,XGTH->XSGT", k_XxSxH, q_XxGxTxH * scale,
                                preferred_element_type=jnp.float32)
    if bias is not None:
      logits_XxSxGxT = logits_XxSxGxT + keys_first(bias.astype(q_BxTxNxH.dtype))
    logits.append(jnp.where(keys_first(mask), logits_XxSxGxT, _LARGE_NEGATIVE))
  probs_XxGxTxS = jax.nn.softmax(jnp.moveaxis(jnp.concatenate(logits, axis=1), 1, -1), axis=-1)
  splits = list(itertools.accumulate(k.shape[1] for k, _, _, _ in parts[:-1]))
  out_XxGxTxH = sum(
      jnp.einsum("XGTS,XSH->XGTH", p.astype(v_XxSxH.dtype), v_XxSxH,
                 preferred_element_type=jnp.float32)
      for p, (_, v_XxSxH, _, _) in zip(jnp.split(probs_XxGxTxS, splits, axis=-1), parts))
  out_BxTxKxGxH = out_XxGxTxH.reshape(b, kv_heads, group, t, h).transpose(0, 3, 1, 2, 4)
  return out_BxTxKxGxH.reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


class SoftmaxAttention(base.Mixer):
  """Base of mha / mqa / gqa; subclasses say how many key/value heads."""
  hyperparameters = {"block_size": 128,  # blockwise backend: query and key block length
                     "window": 0,  # sliding window: the last W keys, the own included (0: all)
                     "sinks": 0}  # with a window, the first S tokens stay visible
  position_hooks = frozenset({QK, BIAS})
  backends = BACKENDS

  @classmethod
  def kv_heads(cls, model_config):
    raise NotImplementedError

  @classmethod
  def validate(cls, settings, model_config):
    heads, kv = model_config.num_heads, cls.kv_heads(model_config)
    if kv < 1 or heads % kv:
      divisors = [d for d in range(1, heads + 1) if heads % d == 0]
      raise ValueError(f"num_kv_heads={kv} does not divide num_heads={heads}; valid: {divisors}")
    backend = model_config.attention_backend
    if backend not in cls.backends:
      raise ValueError(f"unknown model.attention_backend {backend!r}; valid: "
                       f"{', '.join(cls.backends)}")
    if backend == "cudnn" and jax.default_backend() != "gpu":
      raise ValueError(f"attention_backend 'cudnn' needs a GPU, but JAX runs on "
                       f"{jax.default_backend()!r}; use 'xla' or 'blockwise'")
    if backend == "cudnn" and model_config.compute_dtype not in ("bfloat16", "float16"):
      raise ValueError(f"attention_backend 'cudnn' needs compute_dtype bfloat16 or float16, got "
                       f"{model_config.compute_dtype!r}")
    if settings.block_size < 1:
      raise ValueError(f"model.softmax.block_size must be >= 1, got {settings.block_size}")
    masks.check_window(settings.window, settings.sinks)

  def __init__(self, settings, model_config, position, *, rngs):
    d, n = model_config.d_model, model_config.num_heads
    k, h = self.kv_heads(model_config), model_config.d_model // model_config.num_heads
    self.position = position
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.backend = model_config.attention_backend
    self.block_size = int(settings.block_size)
    self.window, self.sinks = int(settings.window), int(settings.sinks)
    self.dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=self.dtype)
    self.key = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=self.dtype)
    self.value = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=self.dtype)
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=self.dtype)

  def _project(self, x_BxTxD, positions_BxT, segments_BxT=None, cache=None, index=0):
    """(queries, the per-token arrays that the decode cache keeps: {"key", "value"}) of T tokens
    at `index` onwards; a subclass may add arrays that continue from the cached ones."""
    del segments_BxT, cache, index
    q = self.position.queries(self.query(x_BxTxD), positions_BxT)
    k = self.position.keys(self.key(x_BxTxD), positions_BxT)
    return q, {"key": k, "value": self.value(x_BxTxD)}

  def _bias_inputs(self, positions_BxT, tokens):
    """What the score bias reads per token, given the tokens' positions and arrays (as returned
    by _project or kept in the cache): here the positions."""
    del tokens
    return positions_BxT

  def score_bias(self, position, q_inputs, k_inputs):
    """The score bias [B', N, T, S] float32 (or None) from the queries' and keys' bias inputs,
    with the scheme `position` (in the blockwise kernel, merged from the parameters it
    differentiates): the scheme's bias of their positions."""
    return position.bias(q_inputs, k_inputs)

  def _scale(self):
    return self.position.logit_scale() / self.head_dim ** 0.5

  def _bias_function(self):
    """(bias_fn(params, q_inputs, k_inputs), params): score_bias as a function of the scheme's
    parameters, for the blockwise kernel to evaluate (and differentiate) per tile."""
    graphdef, params = nnx.split(self.position)
    return (lambda p, q_inputs, k_inputs:
            self.score_bias(nnx.merge(graphdef, p), q_inputs, k_inputs)), params

  def _dot_product(self, q, k, v, q_inputs, k_inputs, mask, implementation):
    bias = self.score_bias(self.position, q_inputs, k_inputs)
    bias = None if bias is None else bias.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=mask is None,
                                        scale=self._scale(), implementation=implementation)

  def _cached_dot_product(self, q, q_inputs, parts):
    """Attention of the new tokens' queries to parts (per-token arrays in the cache's layout,
    their bias inputs, mask [1, 1, T, S_i]) in one softmax (cached_attention)."""
    return cached_attention(
        q, [(arrays["key"], arrays["value"], self.score_bias(self.position, q_inputs, k_inputs),
             mask) for arrays, k_inputs, mask in parts], self._scale())

  def _new_tokens_part(self, tokens, positions_1xT):
    """The new tokens as keys of each other: causal (within the window), in the cache layout."""
    index_T = positions_1xT[0]
    mask = masks.visible(index_T, index_T, self.window, self.sinks)[None, None]
    return ({name: to_cache_layout(name, x) for name, x in tokens.items()},
            self._bias_inputs(positions_1xT, tokens), mask)

  def _attend(self, q, tokens, positions_BxL, segments_BxL=None):
    """Attention of a whole sequence to itself through the configured backend."""
    k, v = tokens["key"], tokens["value"]
    inputs = self._bias_inputs(positions_BxL, tokens)
    backend = self.backend
    if backend == "auto":
      backend = auto_backend(q.shape[1], self.backends, self.dtype)
    if backend == "blockwise":
      bias_fn, bias_params = self._bias_function()
      return blockwise_attention(q, k, v, inputs, bias_fn, bias_params,
                                 block_size=self.block_size, scale=self._scale(),
                                 window=self.window, sinks=self.sinks, segments_BxT=segments_BxL)
    mask = None  # plain causal: the backend's own causal path
    if self.window or segments_BxL is not None:
      index = jnp.arange(q.shape[1])
      # In packed documents the sinks of each document are its first tokens.
      document_index = (None if segments_BxL is None or not self.sinks
                        else masks.positions_in_documents(segments_BxL))
      mask = masks.allowed(index, index, self.window, self.sinks, segments_BxL, segments_BxL,
                           document_index)
    return self._dot_product(q, k, v, inputs, inputs, mask, backend)

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    q, tokens = self._project(x_BxLxD, positions_BxL, segments_BxL)
    return self.out(self._attend(q, tokens, positions_BxL, segments_BxL))

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The attention probabilities of `__call__`, float32 [B, N, L (query), L (key)], for
    inspection (research.heads): the xla path's logits (m q k^T / sqrt(d) + bias), mask
    (causal, window and sinks, segments) and float32 softmax, materialised."""
    q, tokens = self._project(x_BxLxD, positions_BxL, segments_BxL)
    return self._probabilities(q, tokens, positions_BxL, segments_BxL)[0]

  def with_edited_weights(self, x_BxLxD, positions_BxL, segments_BxL, edit):
    """`__call__` with the probabilities P replaced by edit(P, mask) (mask [B | 1, 1, L, L]:
    the visible keys), for interventions (research.analyze's permutation test): sum_s P'[n, t, s]
    v[s, n // G] through the output projection; edit = lambda p, m: p gives `__call__`."""
    q, tokens = self._project(x_BxLxD, positions_BxL, segments_BxL)
    probs_BxNxLxL, mask = self._probabilities(q, tokens, positions_BxL, segments_BxL)
    values = jnp.repeat(tokens["value"], self.num_heads // self.num_kv_heads, axis=2)
    edited = edit(probs_BxNxLxL, mask).astype(values.dtype)
    return self.out(jnp.einsum("BNTS,BSNH->BTNH", edited, values))

  def _probabilities(self, q, tokens, positions_BxL, segments_BxL):
    """(float32 probabilities [B, N, L, L], the mask of visible keys) of a sequence to itself."""
    k = jnp.repeat(tokens["key"], self.num_heads // self.num_kv_heads, axis=2)  # q head n: n // G
    logits_BxNxLxL = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
    logits_BxNxLxL = logits_BxNxLxL * self._scale()
    inputs = self._bias_inputs(positions_BxL, tokens)
    bias = self.score_bias(self.position, inputs, inputs)
    if bias is not None:
      logits_BxNxLxL = logits_BxNxLxL + bias.astype(q.dtype)
    index = jnp.arange(q.shape[1])
    document_index = (None if segments_BxL is None or not self.sinks
                      else masks.positions_in_documents(segments_BxL))
    mask = masks.allowed(index, index, self.window, self.sinks, segments_BxL, segments_BxL,
                         document_index)
    logits_BxNxLxL = jnp.where(mask, logits_BxNxLxL, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits_BxNxLxL.astype(jnp.float32), axis=-1), mask

  def cache_length(self, max_length):
    """Slots of the decode cache: every token, or with a window the sinks and the window."""
    return self.sinks + self.window if self.window else max_length

  def init_cache(self, batch_size, max_length):
    slots = self.cache_length(max_length)
    shape = (batch_size * self.num_kv_heads, slots, self.head_dim)  # HEADS_FIRST
    cache = {"key": jnp.zeros(shape, self.dtype), "value": jnp.zeros(shape, self.dtype)}
    if self.window:  # the token index held by each slot; -1: empty
      cache["index"] = jnp.full((slots,), -1, jnp.int32)
    return cache

  def decode(self, x_BxTxD, cache, index):
    """T new tokens at indices index..index + T - 1 against the cache and each other, in one
    pass; returns their outputs and the cache with their keys and values written."""
    positions_1xT = base.new_positions(index, x_BxTxD.shape[1])
    q, tokens = self._project(x_BxTxD, positions_1xT, cache=cache, index=index)
    tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
    attend = self._decode_rolling if self.window else self._decode_full
    if x_BxTxD.shape[1] == 1:
      y, cache = attend(q, tokens, cache, positions_1xT)
    else:  # a prompt into an empty cache attends only to itself: the training path
      y, cache = jax.lax.cond(index == 0, self._prefill_empty, attend, q, tokens, cache,
                              positions_1xT)
    return self.out(y), cache

  def _prefill_empty(self, q, tokens, cache, positions_1xT):
    """Tokens 0..T-1 into an empty cache: the full-sequence attention of the configured backend
    (blockwise skips masked tiles), then the cache write."""
    write = self._write_rolling if self.window else self._write_full
    return self._attend(q, tokens, positions_1xT), write(tokens, cache, positions_1xT[0])

  def _slot(self, token_index):
    """The cache slot of a token: p, or with a window p (p < S) or S + (p - S) mod W."""
    if not self.window:
      return token_index
    return jnp.where(token_index < self.sinks, token_index,
                     self.sinks + (token_index - self.sinks) % self.window)

  @staticmethod
  def _write_full(tokens, cache, new_index_T):
    """Each per-token array (key, value, ...) of the new tokens into its cache entry."""
    new, slots = tokens["key"].shape[1], cache["key"].shape[1]
    if new > slots:
      raise ValueError(f"{new} new tokens do not fit in a decode cache of {slots} tokens: "
                       "init_cache with max_length >= the prompt and the tokens to generate")
    index = new_index_T[0]
    return {**cache, **{name: jax.lax.dynamic_update_slice_in_dim(
        cache[name], to_cache_layout(name, x), index, 1) for name, x in tokens.items()}}

  def _write_rolling(self, tokens, cache, new_index_T):
    """Keep what later tokens can still see: token p in its slot (_slot), if it is a sink or
    among the last W tokens."""
    last = new_index_T[-1]
    keep = (new_index_T < self.sinks) | (new_index_T > last - self.window)
    dropped = self.sinks + self.window  # out of range
    slot = jnp.where(keep, self._slot(new_index_T), dropped)

    write = lambda old, new: old.at[:, slot].set(new, mode="drop")
    return {**{name: write(cache[name], to_cache_layout(name, x)) for name, x in tokens.items()},
            "index": cache["index"].at[slot].set(new_index_T, mode="drop")}

  def _decode_full(self, q, tokens, cache, positions_1xT):
    """Write the new tokens, then attend to the cache up to them. (Reading the cache before
    the write, XLA copies it to keep the old values for the readers.)"""
    index = positions_1xT[0, 0]
    cache = self._write_full(tokens, cache, positions_1xT[0])
    # Slots after index + T are still empty; the causal mask (by index) hides them like the future.
    slots_S = jnp.arange(cache["key"].shape[1])
    mask = masks.visible(positions_1xT[0], slots_S)[None, None]
    y = self._cached_dot_product(q, self._bias_inputs(positions_1xT, tokens),
                                 [(cache, self._bias_inputs(slots_S[None], cache), mask)])
    # Past the cache's end, dynamic_update_slice would clamp and overwrite the last slots:
    # return NaN rather than silently wrong logits (init_cache with a larger max_length).
    y = jnp.where(index + tokens["key"].shape[1] <= slots_S.shape[0], y, jnp.nan)
    return y, cache

  def _decode_rolling(self, q, tokens, cache, positions_1xT):
    """Window + sinks decoding: attend to the cached slots and the new tokens, then write (the
    new tokens may overwrite slots that the first of them still see)."""
    new_index_T, key_index_S = positions_1xT[0], cache["index"]
    mask = masks.visible(new_index_T, key_index_S, self.window, self.sinks) & (key_index_S >= 0)
    # Empty slots (-1) are masked; their bias is taken at position 0 so that it stays finite.
    cached = (cache, self._bias_inputs(jnp.maximum(key_index_S, 0)[None], cache),
              mask[None, None])
    y = self._cached_dot_product(q, self._bias_inputs(positions_1xT, tokens),
                                 [cached, self._new_tokens_part(tokens, positions_1xT)])
    return y, self._write_rolling(tokens, cache, new_index_T)

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """Decode-cache bytes per token and layer: 2 * K * head_dim * bytes per value (keys and
    values)."""
    head_dim = model_config.d_model // model_config.num_heads
    itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
    return 2 * cls.kv_heads(model_config) * head_dim * itemsize

  def mixing_flops_per_token(self, context_length):
    # q k^T and p v, 2 FLOPs per multiply-add, each query sees (context + 1) / 2 keys on average
    # (at most the window and the sinks).
    keys = (context_length + 1) / 2
    if self.window:
      w = min(self.window, context_length)
      keys = (w * (w + 1) / 2 + (context_length - w) * min(w + self.sinks, context_length)) / context_length
    return 2 * 2 * self.num_heads * self.head_dim * keys


class MHA(SoftmaxAttention):

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads


class MQA(SoftmaxAttention):

  @classmethod
  def kv_heads(cls, model_config):
    return 1


class GQA(SoftmaxAttention):

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_kv_heads
