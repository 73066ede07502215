"""The decode cache of a softmax-family mixer, and attention of new tokens to it through the
core's score function (research.model.attention.core: the same ScoreMod and MaskSpec as `attend`).

Two layouts, chosen by the mask spec:
  full     every token p in slot p; its bytes grow with the context.
  rolling  with a sliding window W and S sinks: S + W slots, token p in slot p (p < S) or
           S + (p - S) mod W, with each row's token indices kept beside them, so the bytes do
           not grow (with documents, a document's token d < S in slot d).
Keys and values are stored heads before length, with batch and key/value heads in one axis,
[B K, S, H] (H may differ between keys and values), so that both matmuls of a decode step read
the cache where it is written (in the [B, S, K, H] layout of the sequence path, XLA copied the
whole cache transposed at every step: about two thirds of a step's time at 4096 tokens). Any
other per-token array a mixer keeps (FoX's cumulative log forget gates) is [B, S, ...].

Packed documents (masks.DecodeDocuments: a document may start anywhere, in any row) need no
entry of their own: segment ids never decrease, so a cached key is in a query's document iff its
token index is at or after that document's start, and its position is its index less that start.
The rolling layout keeps each row's token indices, [B, slots], as with documents the sink slots
hold the first S tokens of the row's open document.

Attention of T new tokens at indices index..index + T - 1 (`KVCache.attend`): the full layout
writes them first and attends to the cache up to them (reading before the write, XLA copies the
cache to keep the old values for the readers); the rolling layout attends to the cached slots and
the new tokens, then writes (new tokens may overwrite slots that the first of them still see).
The score inputs of cached keys are computed from their token indices and kept arrays by the
mixer's `score_inputs(positions, arrays)`, as for the sequence path. Where the sinks sit is the
rolling layout's to know: with other queries (core.OtherQueries, StreamingLLM's cache positions)
the pairs the mask spec requeries (a query and a sink outside its window: among the first S
slots, and any new token that is a sink of a later one) take their logits from them.
"""

import itertools

import jax
import jax.numpy as jnp

from research.model.attention import core
from research.model.attention import normalisers

# Cache entries stored heads before length, batch and key/value heads in one axis.
HEADS_FIRST = frozenset({"key", "value"})


def to_cache_layout(name, x_BxTx___):
  """A per-token array of new tokens, [B, T, ...], in its cache layout."""
  if name not in HEADS_FIRST:
    return x_BxTx___
  b, t, k, h = x_BxTx___.shape
  return x_BxTx___.swapaxes(1, 2).reshape(b * k, t, h)


def cached_attention(q_BxTxNxH, parts, scale, score_mod=None, score_params=(),
                     other_queries=None, document_index_BxT=None,
                     normaliser=normalisers.SOFTMAX):
  """softmax(score_mod(scale q k^T), mask) v of T queries against groups of keys in the cache's
  layout, in one softmax over all of them: parts are (k [B K, S_i, H], v [B K, S_i, V], q_inputs,
  k_inputs, mask [B' | 1, 1, T, S_i]) and optionally the part's requeried pairs [B' | 1, 1, T,
  P_i] (MaskSpec.requeried_pairs of its first P_i keys), e.g. the cache and the new tokens. The
  requeried pairs take their logits from `other_queries` (core.OtherQueries).
  Logits and softmax in float32, as jax.nn.dot_product_attention's xla implementation; the query
  heads of a group share their key/value head without a repeat.

  Both matmuls read the cache as it is stored, so that XLA's CPU dot copies none of it: one
  batch axis, k the left operand with the logits keys first, [B K, S, G, T], and v the right
  operand contracted over S (asked for [.., T, S] logits, XLA swaps the operands and copies all
  of k transposed at every decode step, and v as well). The softmax then runs over the last
  axis, [B K, G, T, S], where XLA:CPU reduces at memory speed. The scale multiplies q, not the
  logits (a copy of them at every step). A score `modify` sees the logits as [B, N, T, S]; a
  `contextual` one (CoPE) the row over all parts, which must then be in token order (the full
  layout's one part). A `query_scale` reads each query's core.QueryContext: the keys it sees,
  counted over the parts' masks, and `document_index_BxT`, its index within its document. A
  `normaliser` other than softmax (research.model.attention.normalisers) weighs the row with its
  materialised `weights`; one whose weights depend on the keys' order needs the parts in token
  order."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = parts[0][0].shape[0] // b
  group = n // kv_heads

  def grouped(q_BxTxNxH):  # -> [B K, G, T, H], X = B K
    return (q_BxTxNxH.reshape(b, t, kv_heads, group, h).transpose(0, 2, 3, 1, 4)
            .reshape(b * kv_heads, group, t, h))

  def keys_first(x):  # [B' | 1, N | 1, T, S] -> [B K, S, G, T]
    x = (x.reshape(x.shape[0], kv_heads, group, *x.shape[2:]) if x.shape[1] == n
         else x[:, :, None])
    x = jnp.broadcast_to(x, (b, kv_heads, group) + x.shape[3:])
    return jnp.moveaxis(x.reshape(b * kv_heads, group, *x.shape[3:]), -1, 1)

  def heads_and_queries_first(x_XxSxGxT):  # -> [B, N, T, S]
    s = x_XxSxGxT.shape[1]
    return x_XxSxGxT.reshape(b, kv_heads, s, group, t).transpose(0, 1, 3, 4, 2).reshape(
        b, n, t, s)

  context = None
  if score_mod is not None and score_mod.query_scale is not None:
    keys_seen = sum(part[4].sum(-1, dtype=jnp.int32) for part in parts)[:, 0]  # [B' | 1, T]
    context = core.QueryContext(keys_seen, document_index_BxT)

  def modified(logits_XxSxGxT, q_inputs, k_inputs):
    if score_mod is not None and score_mod.bias is not None:
      bias = score_mod.bias(score_params, q_inputs, k_inputs)
      if bias is not None:
        logits_XxSxGxT = logits_XxSxGxT + keys_first(bias.astype(q_BxTxNxH.dtype))
    if context is not None:  # [B | 1, N | 1, T] -> [B K, 1, G, T]
      query_scale = score_mod.query_scale(score_params, context)
      logits_XxSxGxT = logits_XxSxGxT * keys_first(query_scale[..., None].astype(jnp.float32))
    if score_mod is not None and score_mod.modify is not None:
      modified = score_mod.modify(heads_and_queries_first(logits_XxSxGxT), score_params,
                                  q_inputs, k_inputs)
      logits_XxSxGxT = keys_first(modified.astype(jnp.float32))
    return logits_XxSxGxT

  q_XxGxTxH = grouped(q_BxTxNxH) * scale
  other_q_XxGxTxH = (None if other_queries is None or other_queries.q is None
                     else grouped(other_queries.q) * scale)
  logits, visible = [], []
  for k_XxSxH, _, q_inputs, k_inputs, mask, *requeried in parts:
    raw = jnp.einsum("XSH,XGTH->XSGT", k_XxSxH, q_XxGxTxH, preferred_element_type=jnp.float32)
    logits_XxSxGxT = modified(raw, q_inputs, k_inputs)
    if other_queries is not None and requeried:  # the first P keys may be requeried
      pairs = requeried[0]
      p = pairs.shape[-1]
      other = (raw[:, :p] if other_q_XxGxTxH is None else
               jnp.einsum("XSH,XGTH->XSGT", k_XxSxH[:, :p], other_q_XxGxTxH,
                          preferred_element_type=jnp.float32))
      other = modified(other, other_queries.inputs, jax.tree.map(lambda x: x[:, :p], k_inputs))
      logits_XxSxGxT = jnp.concatenate(
          [jnp.where(keys_first(pairs), other, logits_XxSxGxT[:, :p]), logits_XxSxGxT[:, p:]],
          axis=1)
    visible.append(keys_first(mask))
    logits.append(jnp.where(visible[-1], logits_XxSxGxT, core.LARGE_NEGATIVE))
  logits_XxSxGxT = jnp.concatenate(logits, axis=1)
  if score_mod is not None and score_mod.rowwise:  # the parts' keys are in token order
    visible_XxSxGxT = jnp.concatenate(visible, axis=1)
    changed = core.masked_logits(heads_and_queries_first(logits_XxSxGxT),
                                 heads_and_queries_first(visible_XxSxGxT), score_mod,
                                 score_params, q_BxTxNxH, core.LARGE_NEGATIVE)
    logits_XxSxGxT = keys_first(changed)
  if normaliser == normalisers.SOFTMAX:
    probs_XxGxTxS = jax.nn.softmax(jnp.moveaxis(logits_XxSxGxT, 1, -1), axis=-1)
  else:
    visible_XxSxGxT = jnp.concatenate(visible, axis=1)
    weights = normaliser.weights(heads_and_queries_first(logits_XxSxGxT),
                                 heads_and_queries_first(visible_XxSxGxT))  # [B, N, T, S]
    probs_XxGxTxS = weights.reshape(b * kv_heads, group, t, weights.shape[-1])
  splits = list(itertools.accumulate(part[0].shape[1] for part in parts[:-1]))
  out_XxGxTxV = sum(
      jnp.einsum("XGTS,XSH->XGTH", p.astype(part[1].dtype), part[1],
                 preferred_element_type=jnp.float32)
      for p, part in zip(jnp.split(probs_XxGxTxS, splits, axis=-1), parts))
  width = out_XxGxTxV.shape[-1]
  out_BxTxKxGxV = out_XxGxTxV.reshape(b, kv_heads, group, t, width).transpose(0, 3, 1, 2, 4)
  return out_BxTxKxGxV.reshape(b, t, n, width).astype(q_BxTxNxH.dtype)


def full_cache_keys(mask_spec, index_1xT, num_slots, documents=None):
  """(mask [B | 1, 1, T, S], the keys' positions [B | 1, S]) of T new tokens at token indices
  index_1xT against a full cache of `num_slots` slots (token p in slot p), the new tokens
  written: visible by the mask spec (slots after the last new token are the future), and with
  `documents` (masks.DecodeDocuments) in the query's document, each key at its position in its
  document (the open one's before the new tokens, theirs after)."""
  slots_S = jnp.arange(num_slots)
  if documents is None:
    return mask_spec.visible(index_1xT[0], slots_S)[None, None], slots_S[None]
  starts_BxS = jnp.broadcast_to(documents.open_start_B[:, None],
                                (documents.starts_BxT.shape[0], num_slots))
  starts_BxS = jax.lax.dynamic_update_slice_in_dim(starts_BxS, documents.starts_BxT,
                                                   index_1xT[0, 0], 1)
  return (mask_spec.visible_in_rows(index_1xT[0], slots_S[None], documents.starts_BxT),
          jnp.maximum(slots_S[None] - starts_BxS, 0))


class KVCache:
  """The cache layout for a mask spec (full, or rolling with a window), and attention to it.

  A plain object (not a module): a mixer makes one in __init__ and keeps the cache itself as
  the dict `init` returns, which decode carries."""

  def __init__(self, num_kv_heads, mask=core.CAUSAL):
    self.num_kv_heads, self.mask = num_kv_heads, mask
    self.window, self.sinks = mask.window, mask.sinks

  @property
  def rolling(self):
    return bool(self.window)

  def slots(self, max_length):
    """Slots of the cache: every token, or with a window the sinks and the window."""
    return self.sinks + self.window if self.rolling else max_length

  def init(self, batch_size, max_length, *, key_dim, value_dim, dtype, extra=None):
    """An empty cache: keys [B K, slots, key_dim], values [B K, slots, value_dim] in `dtype`,
    and each extra entry name -> (per-token shape, dtype) as [B, slots, ...]."""
    slots = self.slots(max_length)
    rows = batch_size * self.num_kv_heads
    cache = {"key": jnp.zeros((rows, slots, key_dim), dtype),
             "value": jnp.zeros((rows, slots, value_dim), dtype)}
    for name, (shape, entry_dtype) in (extra or {}).items():
      cache[name] = jnp.zeros((batch_size, slots) + tuple(shape), entry_dtype)
    if self.rolling:  # the token index held by each slot of each row; -1: empty
      cache["index"] = jnp.full((batch_size, slots), -1, jnp.int32)
    return cache

  def slot(self, token_index, document_index=None):
    """The cache slot of token p: p, or with a window d if d < S (d: its index within its
    document, p without documents) or S + (p - S) mod W."""
    if not self.rolling:
      return token_index
    d = token_index if document_index is None else document_index
    return jnp.where(d < self.sinks, d, self.sinks + (token_index - self.sinks) % self.window)

  def last(self, cache, name, index):
    """Entry `name` of token index - 1, [B, ...] (zeros before the first token); a rolling
    cache finds its slot in each row's token indices (a decode always keeps its last token; a
    cache whose index was set without writing it, as the decode benchmark's, reads slot 0)."""
    previous = jnp.maximum(index - 1, 0)
    if self.rolling:
      slot_B = jnp.argmax(cache["index"] == previous, axis=1)
      last = cache[name][jnp.arange(slot_B.shape[0]), slot_B]
    else:
      last = cache[name][:, previous]
    return jnp.where(index > 0, last, jnp.zeros_like(last))

  def write(self, tokens, cache, new_index_T, documents=None):
    """The new tokens' arrays (key, value, ...) written into their slots (`documents`:
    masks.DecodeDocuments, where the rolling layout puts each document's sinks)."""
    if self.rolling:
      return self._write_rolling(tokens, cache, new_index_T, documents)
    new, slots = tokens["key"].shape[1], cache["key"].shape[1]
    if new > slots:
      raise ValueError(f"{new} new tokens do not fit in a decode cache of {slots} tokens: "
                       "init_cache with max_length >= the prompt and the tokens to generate")
    index = new_index_T[0]
    return {**cache, **{name: jax.lax.dynamic_update_slice_in_dim(
        cache[name], to_cache_layout(name, x), index, 1) for name, x in tokens.items()}}

  def _write_rolling(self, tokens, cache, new_index_T, documents=None):
    """Keep what later tokens can still see: token p in its slot, if it is a sink (of the
    row's last document, with documents) or, otherwise, among the last W tokens. Each row's
    slots are its own: with documents the sinks differ between rows."""
    batch = cache["index"].shape[0]
    index_1xT = new_index_T[None]
    if documents is None:
      within_BxT, in_last_document = index_1xT, True
    else:
      within_BxT = documents.positions_BxT
      in_last_document = documents.starts_BxT == documents.starts_BxT[:, -1:]
    keep = jnp.where(within_BxT < self.sinks, in_last_document,
                     index_1xT > new_index_T[-1] - self.window)
    dropped = self.sinks + self.window  # out of range
    slot_BxT = jnp.broadcast_to(jnp.where(keep, self.slot(index_1xT, within_BxT), dropped),
                                (batch, new_index_T.shape[0]))

    def write(old, new):  # [R, slots, ...] with R = B or B K (batch-major)
      slot = jnp.repeat(slot_BxT, old.shape[0] // batch, axis=0)
      return old.at[jnp.arange(old.shape[0])[:, None], slot].set(new, mode="drop")

    return {**{name: write(cache[name], to_cache_layout(name, x)) for name, x in tokens.items()},
            "index": write(cache["index"], jnp.broadcast_to(index_1xT, slot_BxT.shape))}

  def attend(self, q_BxTxNxH, tokens, cache, positions_1xT, *, scale, score_mod=None,
             score_params=(), score_inputs=lambda positions, arrays: positions,
             other_queries=None, documents=None, normaliser=normalisers.SOFTMAX):
    """(attention of the new tokens' queries to the cache and to each other [B, T, N, V], the
    cache with their arrays written). positions_1xT: the new tokens' token indices, which are
    also their positions unless `documents` (masks.DecodeDocuments: packed documents, a new one
    may start anywhere) gives positions within documents and keeps each query to the keys of
    its own; tokens: the new tokens' per-token arrays, [B, T, ...] (key and value [B, T, K,
    H]); score_inputs(positions, arrays) gives the score inputs of tokens at `positions` from
    their arrays (new ones, or as the cache keeps them); other_queries (core.OtherQueries) the
    queries of the pairs the mask requeries (StreamingLLM's cache positions); normaliser
    (research.model.attention.normalisers) what weighs the logits (softmax by default; the
    rolling layout's slots are out of order, so it refuses an order-dependent one)."""
    if self.rolling and normaliser.order_dependent:
      raise ValueError(f"{normaliser.name} attention cannot decode from a sliding window's "
                       "rolling cache: its weights depend on the keys' order")
    tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
    # The new tokens' indices within their documents (their token indices in one document).
    document_index_BxT = positions_1xT if documents is None else documents.positions_BxT
    q_inputs = score_inputs(document_index_BxT, tokens)
    if self.rolling:
      new_index_T, key_index_BxS = positions_1xT[0], cache["index"]
      # Each query's document starts at token 0 without documents: the stream's first S
      # tokens are the sinks.
      starts_BxT = (jnp.zeros_like(positions_1xT) if documents is None
                    else documents.starts_BxT)
      mask = self.mask.visible_in_rows(new_index_T, key_index_BxS, starts_BxT)
      own_mask = self.mask.visible_in_rows(new_index_T, new_index_T[None], starts_BxT)
      # Empty slots (-1) are masked; their score inputs are taken at position 0 (finite).
      key_positions = (jnp.maximum(key_index_BxS, 0) if documents is None
                       else documents.cached_positions(key_index_BxS))
      cached = (cache["key"], cache["value"], q_inputs, score_inputs(key_positions, cache), mask)
      own = (to_cache_layout("key", tokens["key"]), to_cache_layout("value", tokens["value"]),
             q_inputs, q_inputs, own_mask)
      if other_queries is not None and self.mask.requeries:
        # The requeried pairs are sink pairs: the sinks sit in the first S slots (a document's
        # token d < S in slot d); among the new tokens any may be a sink of a later one.
        cached += (self.mask.requeried_pairs_in_rows(new_index_T, key_index_BxS[:, :self.sinks],
                                                     starts_BxT),)
        own += (self.mask.requeried_pairs_in_rows(new_index_T, new_index_T[None], starts_BxT),)
      y = cached_attention(q_BxTxNxH, [cached, own], scale, score_mod, score_params,
                           other_queries, document_index_BxT, normaliser)
      return y, self._write_rolling(tokens, cache, new_index_T, documents)
    index = positions_1xT[0, 0]
    cache = self.write(tokens, cache, positions_1xT[0])
    # Slots after index + T are still empty; the causal mask (by index) hides them like the future.
    slots_S = jnp.arange(cache["key"].shape[1])
    mask, key_positions = full_cache_keys(self.mask, positions_1xT, slots_S.shape[0], documents)
    y = cached_attention(q_BxTxNxH, [(cache["key"], cache["value"], q_inputs,
                                      score_inputs(key_positions, cache), mask)],
                         scale, score_mod, score_params,
                         document_index_BxT=document_index_BxT, normaliser=normaliser)
    # Past the cache's end, dynamic_update_slice would clamp and overwrite the last slots:
    # return NaN rather than silently wrong logits (init_cache with a larger max_length).
    y = jnp.where(index + tokens["key"].shape[1] <= slots_S.shape[0], y, jnp.nan)
    return y, cache
