"""Which keys a query may see: causal by token index, a sliding window with sinks, documents.

  visible(i, j) = j <= i
                  and (W = 0  or  i - j < W  or  d(j) < S)     sliding window W with S sinks
                  and segment(i) = segment(j)                  packed documents
where d(j) is j's index within its document (j itself without segments): the sinks are the first
S tokens of each document.
Local attention over the last W tokens (Longformer, arXiv:2004.05150) plus the first S tokens
that every query keeps seeing (attention sinks, StreamingLLM, arXiv:2309.17453); W = 0 is full
causal attention. A block-sparse pattern (`MaskSpec.keep`, e.g. the Sparse Transformer's strided
pattern, arXiv:1904.10509) is a further predicate keep(i, j) of the two token indices. Indices i, j
count tokens (in decoding: tokens since the start of the cache),
never the position scheme's positions, which may restart at each document.

A pair that is visible only because its key is a sink (i - j >= W, d(j) < S: `sink_pairs`) is
where StreamingLLM's positions differ from the tokens' own: its code (mit-han-lab/streaming-llm,
pos_shift) gives each cached key its slot as position and the query the slot it is appended to, so
a sink is seen from c(i) = p(i) - max(0, d(i) - (S + W - 1)), less than S + W away
(model.softmax.sink_positions = "cache"; research/model/attention/streaming.py). The attention
core does not know sinks: it reads the mask spec's `requeried_pairs` (these sink pairs), the pairs
whose logits a caller may take from other queries (core.OtherQueries), and `requeried_tiles`.

Segments are per-token document ids [B, L], non-decreasing along each row: a packed row of
several documents. Attention never crosses a segment boundary and recurrent mixers restart their
state at a segment start, so a packed row computes what each document alone would.
"""

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np


def check_window(window, sinks, field="model.softmax"):
  """Raise ValueError, naming what is valid, for a bad window / sinks setting."""
  if window < 0:
    raise ValueError(f"{field}.window must be >= 1 (the last W keys, the query's own included), "
                     f"or 0 for full causal attention; got {window}")
  if sinks < 0:
    raise ValueError(f"{field}.sinks must be >= 0, got {sinks}")
  if sinks and not window:
    raise ValueError(f"{field}.sinks={sinks} needs a sliding window ({field}.window >= 1): "
                     "without one every key is visible already")
  if sinks > window:
    raise ValueError(f"{field}.sinks={sinks} is larger than {field}.window={window}; valid: "
                     f"0..{window}")


def check_segments(segments_BxL):
  """Raise ValueError unless segment ids are integers, [B, L], non-decreasing along each row.

  A traced array (inside jit) cannot be checked here: the data pipeline checks its batches.
  """
  if segments_BxL is None or isinstance(segments_BxL, jax.core.Tracer):
    return
  segments = np.asarray(segments_BxL)
  if segments.ndim != 2 or not np.issubdtype(segments.dtype, np.integer):
    raise ValueError(f"segment ids must be integers of shape [batch, length], got "
                     f"{segments.dtype} of shape {segments.shape}")
  rows = np.nonzero((np.diff(segments, axis=1) < 0).any(axis=1))[0]
  if rows.size:
    raise ValueError(f"segment ids must be non-decreasing within each row (one id per packed "
                     f"document, in order); rows {rows[:8].tolist()} decrease")


def positions_in_documents(segments_BxL):
  """Per-token positions that restart at 0 at each segment start: t - (first index of t's
  segment in the row)."""
  index = jnp.arange(segments_BxL.shape[1])
  starts = jnp.concatenate([jnp.ones_like(segments_BxL[:, :1], bool),
                            segments_BxL[:, 1:] != segments_BxL[:, :-1]], axis=1)
  first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return (index - first).astype(jnp.int32)


def indices_in_documents(length, segments_BxL=None):
  """Each token's index within its document: [B, L] `positions_in_documents` of packed documents,
  or [1, L] the token indices 0..L-1 of a single one (segments None)."""
  if segments_BxL is None:
    return jnp.arange(length)[None]
  return positions_in_documents(segments_BxL)


def document_starts(segments_BxL):
  """[B, L] bool: True where a token starts a new segment (never at t = 0: a state passed in
  belongs to the first token's document)."""
  return jnp.pad(segments_BxL[:, 1:] != segments_BxL[:, :-1], [(0, 0), (1, 0)])


def visible(q_index_T, k_index_S, window=0, sinks=0, k_document_index_BxS=None, keep=None):
  """[T, S] bool (or [B, T, S] given the keys' indices within their documents, [B, S]): causal,
  within the window or a sink, and kept by the block-sparse predicate `keep(i, j)` when given.
  Indices count tokens."""
  q, k = q_index_T[:, None], k_index_S[None, :]
  seen = k <= q
  if keep is not None:
    seen = seen & keep(q, k)
  if window:
    if k_document_index_BxS is None or not sinks:
      seen &= (q - k < window) | (k < sinks)
    else:
      seen = seen & ((q - k < window) | (k_document_index_BxS[:, None, :] < sinks))
  return seen


def sink_pairs(q_index_T, k_index_S, window=0, sinks=0, k_document_index_BxS=None):
  """[T, S] bool (or [B, T, S] given the keys' indices within their documents): the pairs that
  see each other only because the key is a sink, i.e. j <= i, i - j >= W and d(j) < S (empty
  without a window or sinks). Under StreamingLLM's cache positions these pairs take the query at
  its cache position (research.model.attention.streaming); every other visible pair keeps its
  positions."""
  q, k = q_index_T[:, None], k_index_S[None, :]
  if not (window and sinks):
    return jnp.zeros(q.shape[:1] + k.shape[1:], bool)
  far = (k <= q) & (q - k >= window)
  if k_document_index_BxS is None:
    return far & (k < sinks)
  return far & (k_document_index_BxS[:, None, :] < sinks)


@dataclasses.dataclass(frozen=True)
class DecodeDocuments:
  """Packed documents in decoding: T new tokens at token indices index..index + T - 1 of a
  cache whose last token belongs to the document that started at `open_start_B`.

    segments_BxT   the new tokens' segment ids (continuing the ids of the cached tokens)
    positions_BxT  their positions: index within their documents
    starts_BxT     the token index at which each new token's document starts; a key at token
                   index j is in query t's document iff starts[t] <= j <= t (ids never decrease)
    open_start_B   where the document of the cache's last token started: the cached keys any new
                   token can see are those of this document, at positions j - open_start
    restart_B      the first new token starts a document, so a carried state is not its own
  """
  segments_BxT: jax.Array
  positions_BxT: jax.Array
  starts_BxT: jax.Array
  open_start_B: jax.Array
  restart_B: jax.Array

  def keys_in_documents(self, k_index_S):
    """[B, 1, T, S] bool: the key at token index k_index_S[s] (-1: none) is in query t's
    document (whether it is visible is the mask spec's to say)."""
    return (k_index_S[None, None, :] >= self.starts_BxT[:, :, None])[:, None]

  def cached_positions(self, k_index_BxS):
    """Positions [B, S] of cached keys at token indices k_index (in the open document; 0 for
    keys of earlier documents, which no new token sees)."""
    return jnp.maximum(k_index_BxS - self.open_start_B[:, None], 0).astype(jnp.int32)

  def restarted(self, cache, empty):
    """A recurrent mixer's cache (a pytree of [B, ...] arrays), with the rows whose first new
    token starts a document replaced by the `empty` cache (init_cache's)."""
    def select(carried, fresh):
      restart = self.restart_B.reshape((-1,) + (1,) * (carried.ndim - 1))
      return jnp.where(restart, fresh, carried)
    return jax.tree.map(select, cache, empty)


def decode_documents(segments_BxT, index, open_segment_B, open_start_B):
  """DecodeDocuments of T new tokens with segment ids `segments_BxT` that follow `index` cached
  ones, the last of them in segment `open_segment_B`, whose document started at `open_start_B`.
  A token starts a document where its id differs from the token's before it (the first token of
  an empty cache always does)."""
  t = segments_BxT.shape[1]
  token_index_T = index + jnp.arange(t, dtype=jnp.int32)
  previous_BxT = jnp.concatenate([open_segment_B[:, None], segments_BxT[:, :-1]], axis=1)
  begins_BxT = (segments_BxT != previous_BxT) | (token_index_T == 0)[None]
  starts_BxT = jax.lax.cummax(
      jnp.where(begins_BxT, token_index_T[None], open_start_B[:, None]), axis=1)
  return DecodeDocuments(segments_BxT=segments_BxT,
                         positions_BxT=(token_index_T[None] - starts_BxT).astype(jnp.int32),
                         starts_BxT=starts_BxT.astype(jnp.int32), open_start_B=open_start_B,
                         restart_B=begins_BxT[:, 0])


def visible_in_rows(q_index_T, k_index_BxS, starts_BxT, window=0, sinks=0, keep=None):
  """[B | 1, 1, T, S] bool: `visible` for keys given per row by token index (-1: an empty slot,
  never visible), each query's document starting at token starts[b, t] (0 without documents):
  the key is in that document (start <= j <= i) and within the window or one of the
  document's first S tokens (j - start < S)."""
  q, k, start = q_index_T[None, :, None], k_index_BxS[:, None, :], starts_BxT[:, :, None]
  seen = (k >= 0) & (k <= q) & (k >= start)
  if keep is not None:
    seen = seen & keep(q, k)
  if window:
    seen = seen & ((q - k < window) | (k - start < sinks))
  return seen[:, None]


def sink_pairs_in_rows(q_index_T, k_index_BxS, starts_BxT, window=0, sinks=0):
  """[B | 1, 1, T, S] bool: `sink_pairs` for keys given per row (see `visible_in_rows`): seen
  only as a sink of the query's document, W or more tokens back."""
  q, k, start = q_index_T[None, :, None], k_index_BxS[:, None, :], starts_BxT[:, :, None]
  if not (window and sinks):
    return jnp.zeros((k.shape[0], 1, q.shape[1], k.shape[2]), bool)
  return ((k >= 0) & (k <= q) & (k >= start) & (q - k >= window) & (k - start < sinks))[:, None]


def same_segment(q_segments_BxT, k_segments_BxS):
  """[B, 1, T, S] bool (broadcasts over heads)."""
  return (q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :])[:, None]


def allowed(q_index_T, k_index_S, window=0, sinks=0, q_segments_BxT=None, k_segments_BxS=None,
            k_document_index_BxS=None, keep=None):
  """[B | 1, 1, T, S] bool, broadcasting over heads: visible, and in the same segment when
  segment ids are given (k_document_index_BxS: the keys' indices within their documents, for
  the sinks of packed documents)."""
  seen = visible(q_index_T, k_index_S, window, sinks, k_document_index_BxS, keep)
  seen = seen[None, None] if seen.ndim == 2 else seen[:, None]
  if q_segments_BxT is not None:
    seen = seen & same_segment(q_segments_BxT, k_segments_BxS)
  return seen


def chunk_segments(segments_BxC, carried_segment_B):
  """The masks of one chunk of packed documents for a chunked recurrent form:
  (same [B, 1, C, C]: query and key in one segment, causal;
   sees_state [B, C, 1, 1]: the token is in the segment the carried state was summed over;
   keeps_state [B, 1, 1, 1]: the chunk ends in that segment, so the state carries on;
   adds_to_state [B, C, 1, 1]: the token is in the chunk's last segment, which the new state sums)."""
  c = segments_BxC.shape[1]
  causal = jnp.tril(jnp.ones((c, c), bool))
  same = (segments_BxC[:, :, None] == segments_BxC[:, None, :]) & causal
  sees_state = segments_BxC == carried_segment_B[:, None]
  last = segments_BxC[:, -1]
  adds = segments_BxC == last[:, None]
  keeps = last == carried_segment_B
  return (same[:, None], sees_state[:, :, None, None], keeps[:, None, None, None],
          adds[:, :, None, None])


def all_chunk_segments(segments_BxL, padded_length, chunk, batch_size=None):
  """chunk_segments of every chunk at once, for forms that process all chunks in parallel and
  scan only the state: segments [B, L] (None: one document in each of batch_size rows) padded to
  `padded_length` by repeating the last one, so padding joins the last segment. Returns (same
  [B, Z, C, C], sees_state [B, Z, C], keeps_state [B, Z], adds_to_state [B, Z, C]) for Z chunks
  of C tokens; the state entering chunk z was summed over the segment of the token before it."""
  if segments_BxL is None:
    segments_BxL = jnp.zeros((batch_size, padded_length), jnp.int32)
  b, length = segments_BxL.shape
  num_chunks = padded_length // chunk
  segments = jnp.pad(segments_BxL, [(0, 0), (0, padded_length - length)], mode="edge")
  segments_BxZxC = segments.reshape(b, num_chunks, chunk)
  carried_BxZ = jnp.concatenate([segments[:, :1], segments_BxZxC[:, :-1, -1]], axis=1)
  same, sees_state, keeps_state, adds = chunk_segments(
      segments_BxZxC.reshape(b * num_chunks, chunk), carried_BxZ.reshape(b * num_chunks))
  return (same.reshape(b, num_chunks, chunk, chunk), sees_state.reshape(b, num_chunks, chunk),
          keeps_state.reshape(b, num_chunks), adds.reshape(b, num_chunks, chunk))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Which keys each query sees, declared: always causal (by token index), a sliding window of
  the last `window` keys (0: all) with the first `sinks` tokens of each document kept, and
  `keep(i, j)`, a block-sparse pattern of query index i and key index j, [T, 1] and [1, S]
  integer arrays, which must keep each query's own key. `keep` is written with operators only (%,
  //, <, ==, &, |), so that it runs on
  numpy arrays (the tile schedule, computed once at trace time) and on traced ones (the mask
  inside a tile); it must be a pure function of the two indices. Segments (packed documents) are
  data, passed beside the spec. The blockwise backend never visits a tile the spec rules out.
  The attention core reads the sinks only through `allowed`, `tiles`, `keys_seen`,
  `reads_key_documents` and the requeried pairs (`requeries`, `requeried_pairs`,
  `requeried_tiles`, `requeried_keys`), never `sinks` itself; the rolling decode cache
  (research.model.attention.kv_cache) places the sinks in its slots.
  """
  window: int = 0
  sinks: int = 0
  keep: Optional[Callable] = None

  def check(self, field="model.softmax"):
    check_window(self.window, self.sinks, field)

  def allowed(self, q_index_T, k_index_S, q_segments_BxT=None, k_segments_BxS=None,
              k_document_index_BxS=None):
    """[B | 1, 1, T, S] bool: see `allowed`."""
    return allowed(q_index_T, k_index_S, self.window, self.sinks, q_segments_BxT,
                   k_segments_BxS, k_document_index_BxS, self.keep)

  def visible(self, q_index_T, k_index_S):
    """[T, S] bool: see `visible` (a query's first-token sinks, no segments)."""
    return visible(q_index_T, k_index_S, self.window, self.sinks, keep=self.keep)

  # What the attention core reads instead of the sinks themselves.

  @property
  def reads_key_documents(self):
    """Whether `allowed` needs the keys' indices within their documents in packed documents
    (the sinks are the first S tokens of each document)."""
    return bool(self.sinks)

  @property
  def requeries(self):
    """Whether any pair is a requeried pair (`requeried_pairs`): a window with sinks."""
    return bool(self.window and self.sinks)

  def requeried_pairs(self, q_index_T, k_index_S, k_document_index_BxS=None):
    """[T, S] (or [B, T, S]) bool: the pairs whose logits may come from other queries
    (core.OtherQueries): the sink pairs, see `sink_pairs`."""
    return sink_pairs(q_index_T, k_index_S, self.window, self.sinks, k_document_index_BxS)

  def requeried_keys(self, length, packed=False):
    """How many leading keys of a sequence of `length` may be in a requeried pair: the first S
    of a single document; any in packed documents."""
    return length if packed else min(self.sinks, length)

  def visible_in_rows(self, q_index_T, k_index_BxS, starts_BxT):
    """[B | 1, 1, T, S] bool: see `visible_in_rows` (a decode cache's slots)."""
    return visible_in_rows(q_index_T, k_index_BxS, starts_BxT, self.window, self.sinks,
                           self.keep)

  def requeried_pairs_in_rows(self, q_index_T, k_index_BxS, starts_BxT):
    """[B | 1, 1, T, S] bool: `requeried_pairs` for keys given per row (a decode cache's slots):
    see `sink_pairs_in_rows`."""
    return sink_pairs_in_rows(q_index_T, k_index_BxS, starts_BxT, self.window, self.sinks)

  def keys_seen(self, document_index_BxT):
    """int32 [B | 1, T]: how many keys each query sees, from its index d within its document
    (its token index in a single document): d + 1, or with a window W and sinks S
    min(d + 1, W) + min(S, max(0, d + 1 - W)) (the window's keys, then the document's first S
    tokens that are outside it). None with a block-sparse `keep`, which has no closed form: count
    the visible keys instead (research.model.attention.core.query_context)."""
    if self.keep is not None:
      return None
    seen = document_index_BxT.astype(jnp.int32) + 1
    if not self.window:
      return seen
    return jnp.minimum(seen, self.window) + jnp.clip(seen - self.window, 0, self.sinks)

  def requeried_tiles(self, num_blocks, block, packed=False):
    """[num_blocks, num_blocks] numpy bool: tile (i, j) may hold a requeried pair (a sink pair,
    `sink_pairs`): its farthest pair is W or more apart and its key block holds a sink (any
    block with packed documents)."""
    i, j = np.arange(num_blocks)[:, None], np.arange(num_blocks)[None, :]
    if not (self.window and self.sinks):
      return np.zeros((num_blocks, num_blocks), bool)
    far = (j <= i) & ((i + 1) * block - 1 - j * block >= self.window)
    return far & (packed | (j * block < self.sinks))

  def tiles(self, num_blocks, block, packed=False):
    """[num_blocks, num_blocks] numpy bool: tile (i, j) of query block i and key block j holds
    a visible pair. With sinks in packed documents (packed=True) a sink may be in any block (the
    first tokens of every document), so every causal tile of the window's reach counts."""
    i, j = np.arange(num_blocks)[:, None], np.arange(num_blocks)[None, :]
    tiles = j <= i
    if self.window:
      # The nearest pair of tile (i, j) is 1 + (i - j - 1) * block tokens apart (0 on the diagonal).
      near = (i - j - 1) * block + 1 < self.window
      sink = (packed & (self.sinks > 0)) | (j * block < self.sinks)
      tiles &= near | sink
    if self.keep is not None:  # one row of query blocks at a time: O(block x length) memory
      k_index = np.arange(num_blocks * block)[None, :]
      for row in range(num_blocks):
        q_index = (row * block + np.arange(block))[:, None]
        kept = np.broadcast_to(np.asarray(self.keep(q_index, k_index), bool) & (k_index <= q_index),
                               (block, k_index.size))
        if not kept[np.arange(block), q_index[:, 0]].all():
          raise ValueError("a block-sparse pattern must keep each query's own key (keep(i, i) "
                           "true for every i), so that every query sees at least one key")
        tiles[row] &= kept.reshape(block, num_blocks, block).any(axis=(0, 2))
    return tiles

  def schedule(self, num_blocks, block, packed=False):
    """The tiles to visit, as numpy int32 tables: (counts [Q], key blocks [Q, M]): query block i
    visits key blocks table[i, :counts[i]] in ascending order; and (counts [K], query blocks
    [K, M']) likewise per key block, for the backward pass. Padding entries repeat a visited
    block and are never read."""
    tiles = self.tiles(num_blocks, block, packed)

    def table(rows):
      counts = rows.sum(1).astype(np.int32)
      width = max(int(counts.max(initial=0)), 1)
      out = np.zeros((rows.shape[0], width), np.int32)
      for r, row in enumerate(rows):
        chosen = np.nonzero(row)[0]
        out[r, :chosen.size] = chosen
        out[r, chosen.size:] = chosen[-1] if chosen.size else 0
      return counts, out

    return table(tiles), table(tiles.T)


CAUSAL = MaskSpec()
