"""Which keys a query may see: causal by token index, a sliding window with sinks, documents.

  visible(i, j) = j <= i
                  and (W = 0  or  i - j < W  or  d(j) < S)     sliding window W with S sinks
                  and segment(i) = segment(j)                  packed documents
where d(j) is j's index within its document (j itself without segments): the sinks are the first
S tokens of each document.
Local attention over the last W tokens (Longformer, arXiv:2004.05150) plus the first S tokens
that every query keeps seeing (attention sinks, StreamingLLM, arXiv:2309.17453); W = 0 is full
causal attention. Indices i, j count tokens (in decoding: tokens since the start of the cache),
never the position scheme's positions, which may restart at each document.

Segments are per-token document ids [B, L], non-decreasing along each row: a packed row of
several documents. Attention never crosses a segment boundary and recurrent mixers restart their
state at a segment start, so a packed row computes what each document alone would.
"""

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


def document_starts(segments_BxL):
  """[B, L] bool: True where a token starts a new segment (never at t = 0: a state passed in
  belongs to the first token's document)."""
  return jnp.pad(segments_BxL[:, 1:] != segments_BxL[:, :-1], [(0, 0), (1, 0)])


def visible(q_index_T, k_index_S, window=0, sinks=0, k_document_index_BxS=None):
  """[T, S] bool (or [B, T, S] given the keys' indices within their documents, [B, S]): causal,
  and within the window or a sink. Indices count tokens."""
  q, k = q_index_T[:, None], k_index_S[None, :]
  seen = k <= q
  if window:
    if k_document_index_BxS is None or not sinks:
      seen &= (q - k < window) | (k < sinks)
    else:
      seen = seen & ((q - k < window) | (k_document_index_BxS[:, None, :] < sinks))
  return seen


def same_segment(q_segments_BxT, k_segments_BxS):
  """[B, 1, T, S] bool (broadcasts over heads)."""
  return (q_segments_BxT[:, :, None] == k_segments_BxS[:, None, :])[:, None]


def allowed(q_index_T, k_index_S, window=0, sinks=0, q_segments_BxT=None, k_segments_BxS=None,
            k_document_index_BxS=None):
  """[B | 1, 1, T, S] bool, broadcasting over heads: visible, and in the same segment when
  segment ids are given (k_document_index_BxS: the keys' indices within their documents, for
  the sinks of packed documents)."""
  seen = visible(q_index_T, k_index_S, window, sinks, k_document_index_BxS)
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


def all_chunk_segments(segments_BxL, padded_length, chunk):
  """chunk_segments of every chunk at once, for forms that process all chunks in parallel and
  scan only the state: segments [B, L] (None: one document) padded to `padded_length` by
  repeating the last one, so padding joins the last segment. Returns (same [B, Z, C, C],
  sees_state [B, Z, C], keeps_state [B, Z], adds_to_state [B, Z, C]) for Z chunks of C tokens;
  the state entering chunk z was summed over the segment of the token before it."""
  b, length = segments_BxL.shape
  num_chunks = padded_length // chunk
  segments = jnp.pad(segments_BxL, [(0, 0), (0, padded_length - length)], mode="edge")
  segments_BxZxC = segments.reshape(b, num_chunks, chunk)
  carried_BxZ = jnp.concatenate([segments[:, :1], segments_BxZxC[:, :-1, -1]], axis=1)
  same, sees_state, keeps_state, adds = chunk_segments(
      segments_BxZxC.reshape(b * num_chunks, chunk), carried_BxZ.reshape(b * num_chunks))
  return (same.reshape(b, num_chunks, chunk, chunk), sees_state.reshape(b, num_chunks, chunk),
          keeps_state.reshape(b, num_chunks), adds.reshape(b, num_chunks, chunk))


def key_blocks(query_block, block, window, sinks, packed=False):
  """(number of sink blocks visited, first key block of the window) for a query block: key
  blocks [0, sink blocks) and [first, query_block] may hold a visible key, no others. With
  sinks in packed documents (packed=True) a sink may be in any block: every block is visited."""
  if not window or (packed and sinks):
    return 0, 0
  first = jnp.maximum(0, (query_block * block - window + 1) // block)
  return jnp.minimum(-(-sinks // block), first), first


def last_query_block(key_block, block, window, sinks, num_blocks, packed=False):
  """The last query block that may see a key of `key_block` (inclusive)."""
  if not window or (packed and sinks):
    return num_blocks - 1
  last = jnp.minimum(num_blocks - 1, ((key_block + 1) * block + window - 2) // block)
  return jnp.where(key_block * block < sinks, num_blocks - 1, last)
