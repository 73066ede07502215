"""Mixture of Block Attention, MoBA (Lu et al., arXiv:2502.13189): softmax attention in which each
query sees its own block of keys, causally, and the top-k - 1 earlier blocks whose mean key it
scores highest.

  blocks     keys in blocks of C tokens (moba.chunk_size), counted from the sequence's (a packed
             document's) first token; the last block of a sequence may be shorter
  gate       s_n(i, b) = q_{n,i} . mean_{j in b} k_{n,j}       float32, unscaled, per query head
             for every block b that ends before query i's own block (a "past" block); -inf else
  routing    R_n(i) = own(i) + the top (k - 1) past blocks by s_n(i, .)     k = moba.topk
             (all past blocks where there are fewer than k - 1)
  output     o_{n,i} = sum_{j in R_n(i), j <= i} softmax_j(m q_{n,i} . k_{n,j} / sqrt(H) + bias) v_j
one softmax over the union of the selected blocks (m: the position scheme's logit scale, 1 but
for YaRN; bias: a bias scheme's, added to the selected keys' logits and not to the gate). The
selection is piecewise constant: gradients reach q, k and v through the softmax only. Query
head n reads key/value head n // (N / K), for the attention and for the block means; the mixer
has K = N (as their naive form), the functions below take any K dividing N (GQA).

Checked against the authors' code, MoonshotAI/MoBA@61e456b:
  * moba/moba_naive.py, `moba_attn_varlen_naive` (the reference this file's tests port): per
    sequence of cu_seqlens, blocks of moba_chunk_size from the sequence start, the last one
    partial; `key_gate_weight` the mean of each block's keys; the gate q . mean in float32 and
    unscaled; gate[:, :(i+1)C, i] = -inf, then gate[:, iC:(i+1)C, i] = +inf: past blocks keep
    their score, future blocks are -inf and the own block +inf; torch.topk with
    k = min(moba_topk, num_block), so the own block counts as one of the top k and k - 1 past
    blocks are added; `need_attend` = (gate >= the k-th value) & (in the top-k indices):
    exactly k blocks; where fewer than k - 1 blocks are past, the top k reaches -inf (future)
    blocks, which the causal tril masks anyway. Then (q k^T + 0 / -inf) * head_dim^-0.5 and one
    float32 softmax over every selected key. Gates get no gradient (set in place to 0 / -inf).
  * moba/moba_efficient.py, `moba_attn_varlen`: the same function. top (moba_topk - 1) over
    the "filtered" chunks (every chunk but each sequence's last), a chunk masked -inf unless it
    ends before the query (`gate_chunk_end_mask`) and lies in its sequence; -inf picks dropped
    (`gate.isinf()`); the own chunk by causal flash attention over cu_chunk; the selected
    chunks grouped by (chunk, head) and attended without a mask (varlen flash attention); the
    two merged by their log-sum-exp (`MixedAttention.forward`), i.e. one softmax over the union.
  * moba/wrapper.py, `moba_layer`: applied to the queries and keys the model hands its
    attention function (after the rotary embedding), key/value heads repeated (repeat_interleave)
    to the query heads, scale head_dim^-0.5 (the `scaling` argument is not read); in the decode
    phase it runs plain causal flash attention over the whole cache (a TODO in their code).
  * Defaults: block 512 and top-3, the paper's scaling-law runs (8K context, section 3.1; the
    README's example uses 4096 / 12).
Deviations: (1) decoding applies MoBA (theirs attends to the whole cache), so that decode equals
the forward; (2) block means are accumulated and kept in float32 (theirs round the mean to the
key dtype before the float32 gate: differs in bfloat16 only); (3) ties between gate scores go to
the earlier block (jax.lax.top_k; torch.topk's order among ties is unspecified); (4) packed
documents (segment ids) are cu_seqlens' sequences: blocks restart at each document's start, so
a packed row computes what each document alone would; (5) bias schemes and YaRN's logit scale,
which their code does not have, compose as above.

Backends (model.attention_backend):
  xla        the naive form: the routing as per-token score inputs, a core ScoreMod `modify`
             that masks every key outside the query's selected blocks, and core.attend's
             materialised xla path ([B, N, L, L]); attention_weights read the same computation.
  blockwise  MoBA's efficient form: (a) the own block: queries in row blocks of C attend to
             that block and the one before it, masked to their own document block, causally,
             [B, L/C, N, C, 2C]; (b) the selected blocks: the (query, head, pick) triples of a
             row sorted by (block, head) into tiles of moba.block_size queries that share one
             key block (MoBA's grouping of queries by KV chunk, padded per group to whole
             tiles), each tile a dense [block_size, C] attention; (a) and (b) merged by their
             log-sum-exp. A row has at most ceil(L N (k-1) / Q) + (L / C) N tiles (Q =
             block_size), all computed (static shapes): 2C + (k-1) C + Q logits per query and
             head (time O(L N H ((k+1) C + Q)), no [L, L] array), the tiles' keys and values
             gathered, O(L N H ((k-1) C / Q + 1)), and the gates' O(L (L / C) N H) (MoBA's
             own). With a bias scheme a tile's bias is computed for every head and one kept
             (position schemes take no head index): N times a tile's bias work. Measured once
             (2-core CPU, fwd+bwd, L = 2048, C = 64, k = 3, 4 heads of 32): 0.13 s against the
             xla form's 1.0 s.
  auto       blockwise where it computes fewer logits per query than the dense causal
             attention's (L + 1) / 2, else xla (a count, not a measured crossover).
cudnn is refused: the mask is data-dependent (a `modify`, which the core's cuDNN path refuses).

Decoding: the full KV cache (research.model.attention.kv_cache); at each step the means of the
cache's complete blocks are recomputed from the cached keys, the gates of the new tokens taken over
their past blocks, and the new tokens attend (research.model.attention.kv_cache.cached_attention,
the same ScoreMod) to their own block and their selected blocks: every cached key is read, as for
mha (O(context) per token), the unselected ones masked. A prompt into an empty cache runs the
sequence path of the configured backend. Packed documents (a document cache): blocks count from
each document's start, as in the packed forward pass; a token of the document the cache holds
routes over that document's blocks (their means gathered from its first slot on), a token of a
document that starts among the new tokens routes among them (its blocks are all there).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from research.model.attention import base
from research.model.attention import core
from research.model.attention import kv_cache
from research.model.attention import masks
from research.model.attention import softmax
from research.model.positions import BIAS, QK

BACKENDS = ("auto", "xla", "blockwise")
MASKED = float(jnp.finfo(jnp.float32).min)


class Blocks(NamedTuple):
  """MoBA's blocks of a row of L tokens (P rows: 1 without segments, else B).

  group     [P, L] the row-level index of each token's block (blocks restart at documents)
  complete  [P, L] the index of the token's block among the row's complete (C-token) blocks, or
            -1 in a shorter block (a document's last)
  first     [P, L] the index of the first complete block of the token's document
  before    [P, L] the number of complete blocks that start before the token's own block: the
            token's past blocks are the complete blocks first <= c < before
  starts    [P, L // C] the first token of each complete block (0 in unused slots)
  """
  group: jax.Array
  complete: jax.Array
  first: jax.Array
  before: jax.Array
  starts: jax.Array


def blocks(length, chunk, segments_BxL=None):
  """The Blocks of a row of `length` tokens in blocks of `chunk`, each document's from its start."""
  index_L = jnp.arange(length)
  within_PxL = masks.indices_in_documents(length, segments_BxL)
  offset_PxL = within_PxL % chunk
  starts_block = offset_PxL == 0
  group = jnp.cumsum(starts_block, axis=1) - 1
  # A block is complete if its last token (chunk - 1 on) is in the row and the same document.
  last_L = jnp.minimum(index_L + chunk - 1, length - 1)
  whole_PxL = (starts_block & (index_L + chunk - 1 < length)
               & (within_PxL[:, last_L] == within_PxL + chunk - 1))
  earlier_PxL = jnp.cumsum(whole_PxL, axis=1) - whole_PxL  # complete blocks starting before t
  block_start = index_L - offset_PxL
  at = lambda x, i: jnp.take_along_axis(x, i, axis=1)  # noqa: E731
  before = at(earlier_PxL, block_start)
  complete = jnp.where(at(whole_PxL, block_start), before, -1)
  count = length // chunk  # complete blocks hold `chunk` tokens each: at most this many
  starts = jax.vmap(lambda whole, earlier: jnp.zeros(count, jnp.int32).at[
      jnp.where(whole, earlier, count)].set(index_L, mode="drop"))(whole_PxL, earlier_PxL)
  return Blocks(group.astype(jnp.int32), complete.astype(jnp.int32),
                at(earlier_PxL, index_L - within_PxL).astype(jnp.int32),
                before.astype(jnp.int32), starts)


def _rows(x_PxM, batch):
  return jnp.broadcast_to(x_PxM, (batch,) + x_PxM.shape[1:])


def block_means(k_BxLxKxH, starts_PxG, chunk):
  """float32 [B, G, K, H]: the mean key of each complete block (the gate's key_gate_weight)."""
  b, _, kv, h = k_BxLxKxH.shape
  g = starts_PxG.shape[1]
  index_BxM = _rows((starts_PxG[:, :, None] + jnp.arange(chunk)).reshape(-1, g * chunk), b)
  keys = jax.vmap(lambda k, i: k[i])(k_BxLxKxH, index_BxM).reshape(b, g, chunk, kv, h)
  return keys.astype(jnp.float32).mean(axis=2)


def gate_scores(q_BxTxNxH, means_BxGxKxH):
  """s[b, n, t, g] = q[b, t, n] . mean[b, g, n // (N / K)], float32 [B, N, T, G], unscaled."""
  b, t, n, h = q_BxTxNxH.shape
  kv = means_BxGxKxH.shape[2]
  q = q_BxTxNxH.astype(jnp.float32).reshape(b, t, kv, n // kv, h)
  s = jnp.einsum("BTKJH,BGKH->BKJTG", q, means_BxGxKxH, precision=jax.lax.Precision.HIGHEST)
  return s.reshape(b, n, t, means_BxGxKxH.shape[1])


def select(gates_BxNxTxG, candidate, picks):
  """The top `picks` candidate blocks of each query and head, [B, T, N, picks] int32, -1 where
  fewer blocks are candidates (candidate: bool, broadcasting against the gates)."""
  values, index = jax.lax.top_k(jnp.where(candidate, gates_BxNxTxG, -jnp.inf), picks)
  return jnp.where(values > -jnp.inf, index, -1).astype(jnp.int32).transpose(0, 2, 1, 3)


def route(q_BxLxNxH, k_BxLxKxH, layout, chunk, topk):
  """Each query's selected past blocks (indices among the row's complete blocks), [B, L, N, P]
  with P = min(topk - 1, L // chunk), -1 for none; no gradient (the selection is discrete)."""
  b, length, n, _ = q_BxLxNxH.shape
  count = layout.starts.shape[1]
  picks = min(topk - 1, count)
  if picks <= 0:
    return jnp.zeros((b, length, n, 0), jnp.int32)
  means = block_means(jax.lax.stop_gradient(k_BxLxKxH), layout.starts, chunk)
  gates = gate_scores(jax.lax.stop_gradient(q_BxLxNxH), means)
  c = jnp.arange(count)
  candidate = (c >= layout.first[:, None, :, None]) & (c < layout.before[:, None, :, None])
  return select(gates, candidate, picks)


def cache_block_means(x_XxSxH, chunk, batch, start_B=None):
  """float32 [B, G, K, H]: the means of G = S // C blocks of C cached keys (or values) [B K, S,
  H], block g of row b holding slots start[b] + g C .. start[b] + (g + 1) C - 1 (start: where
  the row's open document starts, 0 without documents). A block that would reach past the
  cache's end repeats its last slot: no query sees such a block, its document being shorter.
  With a start the cache is gathered (a copy of every slot at each step, the document decode's
  cost; on XLA:CPU masked sums over fixed blocks, or a dot over C, were slower in the step)."""
  rows, slots, h = x_XxSxH.shape
  count = slots // chunk
  x = x_XxSxH.reshape(batch, rows // batch, slots, h)
  if start_B is None:
    x = x[:, :, :count * chunk]
  else:
    index_BxM = jnp.minimum(start_B[:, None] + jnp.arange(count * chunk), slots - 1)
    x = jnp.take_along_axis(x, index_BxM[:, None, :, None], axis=2)
  means = x.reshape(batch, rows // batch, count, chunk, h).astype(jnp.float32).mean(axis=3)
  return means.transpose(0, 2, 1, 3)


def in_document_blocks(routed_BxTxNxP, layout, picks):
  """[B, T, N, picks]: selected blocks given as indices among the row's complete blocks (`route`
  over T tokens in `layout`) as indices among their document's complete blocks, which a
  decode cache counts from the document's start; -1 for none, padded to `picks`."""
  # A document's complete blocks are consecutive among the row's from `first` on.
  routed = jnp.where(routed_BxTxNxP >= 0, routed_BxTxNxP - layout.first[:, :, None, None], -1)
  return jnp.pad(routed, [(0, 0)] * 3 + [(0, picks - routed.shape[-1])], constant_values=-1)


def routed_in_documents(q_BxTxNxH, k_BxTxKxH, segments_BxT, chunk, topk, picks):
  """[B, T, N, picks]: `route` of T tokens among themselves with blocks counted from each
  document's start (`in_document_blocks`); right for the tokens whose document starts among
  them."""
  layout = blocks(q_BxTxNxH.shape[1], chunk, segments_BxT)
  return in_document_blocks(route(q_BxTxNxH, k_BxTxKxH, layout, chunk, topk), layout, picks)


def visible_blocks(q_inputs, k_inputs):
  """[B | 1, N | 1, T, S] bool: key s is in query t's own block or in one of its selected
  blocks. Score inputs: (positions, group, complete, routed) as MoBA.score_inputs."""
  _, q_group, _, routed_BxTxNxP = q_inputs
  _, k_group, k_complete, _ = k_inputs
  seen = q_group[:, None, :, None] == k_group[:, None, None, :]
  routed = routed_BxTxNxP.transpose(0, 2, 1, 3)
  k_complete = k_complete[:, None, None, :]
  for pick in range(routed.shape[-1]):
    seen = seen | ((routed[..., pick:pick + 1] == k_complete) & (k_complete >= 0))
  return seen


def _partial(logits):
  """(softmax probabilities, log-sum-exp) over the last axis, float32."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.exp(logits - lse[..., None]), lse


def _windows(x_PxLx___, chunk, rows, front, back):
  """[P, L, ...] -> [P, rows, 2 chunk, ...]: for each row block of `chunk` tokens, the block
  before it and itself; `front` fills the chunk before the row, `back` the end of the last row
  block."""
  rest = [(0, 0)] * (x_PxLx___.ndim - 2)
  x = jnp.pad(x_PxLx___, [(0, 0), (chunk, 0)] + rest, constant_values=front)
  x = jnp.pad(x, [(0, 0), (0, rows * chunk - x_PxLx___.shape[1])] + rest, constant_values=back)
  x = x.reshape(x.shape[0], rows + 1, chunk, *x.shape[2:])
  return jnp.concatenate([x[:, :-1], x[:, 1:]], axis=2)


def own_block_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxV, group_PxL, positions_PxL, *, scale,
                        bias_fn, chunk):
  """Attention of each query to the keys of its own block up to itself: (outputs float32
  [B, L, N, V], log-sum-exp [B, L, N]). A query's block lies within its row block of `chunk`
  tokens and the one before (blocks restart at documents), so row blocks attend to those 2C keys,
  masked to the query's block."""
  b, length, n, h = q_BxLxNxH.shape
  kv, width = k_BxLxKxH.shape[2], v_BxLxKxV.shape[-1]
  rows = -(-length // chunk)
  tail = rows * chunk - length
  q = jnp.pad(q_BxLxNxH, [(0, 0), (0, tail), (0, 0), (0, 0)]).reshape(
      b, rows, chunk, kv, n // kv, h)
  logits = jnp.einsum("BRCKJH,BRSKH->BRKJCS", q, _windows(k_BxLxKxH, chunk, rows, 0, 0),
                      preferred_element_type=jnp.float32).reshape(b, rows, n, chunk, 2 * chunk)
  logits = logits * scale
  if bias_fn is not None:
    q_positions = jnp.pad(positions_PxL, [(0, 0), (0, tail)], mode="edge")
    k_positions = _windows(positions_PxL, chunk, rows, 0, 0)
    p = positions_PxL.shape[0]
    bias = bias_fn(q_positions.reshape(p * rows, chunk), k_positions.reshape(p * rows, -1))
    if bias is not None:
      bias = (bias.reshape(p, rows, *bias.shape[1:]) if bias.shape[0] == p * rows
              else bias[:, None])
      logits = logits + bias.astype(jnp.float32)
  index = jnp.arange(rows * chunk).reshape(rows, chunk)
  k_index = _windows(jnp.arange(length)[None], chunk, rows, -1, length)[0]
  q_group = jnp.pad(group_PxL, [(0, 0), (0, tail)], constant_values=-2).reshape(-1, rows, chunk)
  k_group = _windows(group_PxL, chunk, rows, -1, -3)
  mask = ((k_index[:, None, :] <= index[:, :, None]) & (k_index[:, None, :] >= 0)
          & (q_group[..., :, None] == k_group[..., None, :]))[:, :, None]
  probs, lse = _partial(jnp.where(mask, logits, MASKED))
  probs = probs.reshape(b, rows, kv, n // kv, chunk, 2 * chunk)
  out = jnp.einsum("BRKJCS,BRSKV->BRCKJV", probs, _windows(v_BxLxKxV, chunk, rows, 0, 0),
                   preferred_element_type=jnp.float32)
  out = out.reshape(b, rows * chunk, n, width)[:, :length]
  return out, lse.transpose(0, 1, 3, 2).reshape(b, rows * chunk, n)[:, :length]


def _routed_row(q_LxNxH, k_LxKxH, v_LxKxV, routed_LxNxP, starts_G, positions_L, *, scale,
                bias_fn, chunk, tile):
  """One row's attention of each (query, head) to each of its selected blocks: (outputs float32
  [L, N, P, V], log-sum-exp [L, N, P], -inf where a pick is empty).

  The M = L N P picks are sorted (stably) by expert = (block, head), each expert's picks padded
  to whole tiles of `tile` queries, so that a tile holds queries of one head that share one key
  block: a dense [tile, chunk] attention."""
  length, n, h = q_LxNxH.shape
  kv, width = k_LxKxH.shape[1], v_LxKxV.shape[-1]
  picks = routed_LxNxP.shape[-1]
  m, experts = length * n * picks, starts_G.shape[0] * n
  tiles = -(-m // tile) + experts  # sum over experts of ceil(count / tile) is at most this
  block_M = routed_LxNxP.reshape(m)
  head_M = jnp.broadcast_to(jnp.arange(n)[:, None], (length, n, picks)).reshape(m)
  valid_M = block_M >= 0
  expert_M = jnp.where(valid_M, block_M * n + head_M, experts)  # empty picks: last, dropped
  order_M = jnp.argsort(expert_M, stable=True)
  count_X = jnp.bincount(expert_M, length=experts + 1)
  tiles_X = -(-count_X[:experts] // tile)
  tile_end_X = jnp.cumsum(tiles_X)
  sorted_M = expert_M[order_M]
  rank_M = jnp.arange(m) - (jnp.cumsum(count_X) - count_X)[sorted_M]
  first_tile_M = (tile_end_X - tiles_X)[jnp.minimum(sorted_M, experts - 1)]
  slot_sorted_M = jnp.where(sorted_M < experts, first_tile_M * tile + rank_M, tiles * tile)
  entry_S = jnp.full(tiles * tile, m - 1, jnp.int32).at[slot_sorted_M].set(order_M, mode="drop")
  slot_M = jnp.zeros(m, jnp.int32).at[order_M].set(slot_sorted_M)
  expert_T = jnp.minimum(jnp.searchsorted(tile_end_X, jnp.arange(tiles), side="right"),
                         experts - 1)
  head_T = expert_T % n
  key_TxC = starts_G[expert_T // n][:, None] + jnp.arange(chunk)
  k_TxCxH = k_LxKxH[key_TxC, (head_T // (n // kv))[:, None]]
  v_TxCxV = v_LxKxV[key_TxC, (head_T // (n // kv))[:, None]]
  q_TxQxH = q_LxNxH.reshape(length * n, h)[entry_S // picks].reshape(tiles, tile, h)
  logits = jnp.einsum("TQH,TCH->TQC", q_TxQxH, k_TxCxH, preferred_element_type=jnp.float32)
  logits = logits * scale
  if bias_fn is not None:
    bias = bias_fn(positions_L[entry_S // (n * picks)].reshape(tiles, tile),
                   positions_L[key_TxC])
    if bias is not None:  # [tiles | 1, N | 1, tile, chunk]: each tile's own head
      bias = jnp.broadcast_to(bias, (tiles,) + bias.shape[1:])
      if bias.shape[1] > 1:
        bias = jnp.take_along_axis(bias, head_T[:, None, None, None], axis=1)
      logits = logits + bias[:, 0].astype(jnp.float32)
  probs, lse = _partial(logits)
  out = jnp.einsum("TQC,TCV->TQV", probs, v_TxCxV, preferred_element_type=jnp.float32)
  slot_M = jnp.minimum(slot_M, tiles * tile - 1)
  out_M = out.reshape(tiles * tile, width)[slot_M]
  lse_M = jnp.where(valid_M, lse.reshape(tiles * tile)[slot_M], -jnp.inf)
  return out_M.reshape(length, n, picks, width), lse_M.reshape(length, n, picks)


def sparse_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxV, layout, routed_BxLxNxP, positions_PxL, *,
                     scale, bias_fn, chunk, tile):
  """MoBA's efficient form (the `blockwise` backend): the own block and the selected blocks,
  merged by their log-sum-exp into one softmax over the union. bias_fn(q_positions [R, T],
  k_positions [R, S]) -> [R | 1, N | 1, T, S] or None."""
  b, length = q_BxLxNxH.shape[:2]
  out, lse = own_block_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxV, layout.group, positions_PxL,
                                 scale=scale, bias_fn=bias_fn, chunk=chunk)
  if routed_BxLxNxP.shape[-1]:
    row = functools.partial(_routed_row, scale=scale, bias_fn=bias_fn, chunk=chunk, tile=tile)
    routed_out, routed_lse = jax.vmap(row)(
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxV, routed_BxLxNxP, _rows(layout.starts, b),
        _rows(jnp.broadcast_to(positions_PxL, (positions_PxL.shape[0], length)), b))
    lse_parts = jnp.concatenate([lse[..., None], routed_lse], axis=-1)
    weights = jax.nn.softmax(lse_parts, axis=-1)[..., None]
    out = (weights * jnp.concatenate([out[..., None, :], routed_out], axis=-2)).sum(-2)
  return out.astype(v_BxLxKxV.dtype)


def sparse_logits_per_query(length, chunk, topk, heads, tile):
  """Logits the blockwise form computes per query and head: its own 2C window and its static
  tile count's tiles of `tile` queries by `chunk` keys, spread over the L N queries and heads."""
  picks = max(min(topk - 1, length // chunk), 0)
  routed = 0
  if picks:
    tiles = -(-length * heads * picks // tile) + (length // chunk) * heads
    routed = tiles * tile * chunk / (length * heads)
  return 2 * chunk + routed


class MoBA(softmax.SoftmaxAttention):
  """MoBA with as many key/value heads as heads, as their naive form (their wrapper repeats a
  GQA model's key/value heads to the query heads; the functions above take K < N)."""
  hyperparameters = {"chunk_size": 512,  # C: tokens per block (moba_chunk_size)
                     "topk": 3,  # blocks per query, its own included (moba_topk)
                     "block_size": 128}  # blockwise backend: queries per tile of a key block
  test_settings = {"chunk_size": 4, "topk": 2, "block_size": 4}
  position_hooks = frozenset({QK, BIAS})
  backends = BACKENDS
  has_attention_weights = True
  supports_sliding_window = False

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads

  @classmethod
  def chunk_length(cls, settings):
    return int(settings.chunk_size)

  @classmethod
  def validate(cls, settings, model_config):
    backend = model_config.attention_backend
    if backend == "cudnn":
      raise ValueError("attention 'moba' does not run on attention_backend 'cudnn': its block "
                       "selection is a data-dependent mask (a score `modify`, which the cuDNN "
                       "path refuses); valid: " + ", ".join(cls.backends))
    if backend not in cls.backends:
      raise ValueError(f"unknown model.attention_backend {backend!r}; valid: "
                       f"{', '.join(cls.backends)}")
    for name in ("chunk_size", "topk", "block_size"):
      if int(settings[name]) < 1:
        raise ValueError(f"model.moba.{name} must be an integer >= 1, got {settings[name]}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    # SoftmaxAttention's projections and cache under a causal mask (model.moba has no window):
    # MoBA's blocks are a score `modify`.
    super().__init__(settings, model_config, position, rngs=rngs, layer_index=layer_index)
    self.chunk_size, self.topk = int(settings.chunk_size), int(settings.topk)

  def project(self, x_BxTxD, positions_BxT, segments_BxT=None, cache=None, index=0,
              documents=None):
    """Queries and keys (after the qk scheme), values, and each token's blocks and routing (of a
    sequence: `decode` routes the new tokens itself)."""
    del cache, index, documents
    q, tokens = super().project(x_BxTxD, positions_BxT)
    layout = blocks(x_BxTxD.shape[1], self.chunk_size, segments_BxT)
    routed = route(q, tokens["key"], layout, self.chunk_size, self.topk)
    return q, {**tokens, "group": layout.group, "complete": layout.complete, "routed": routed}

  def score_inputs(self, positions_BxT, arrays):
    return positions_BxT, arrays["group"], arrays["complete"], arrays["routed"]

  def score_bias(self, position, q_inputs, k_inputs):
    return position.bias(q_inputs[0], k_inputs[0])

  def score_mod(self):
    """(core.ScoreMod, its parameters): the scheme's bias, and -inf outside the query's blocks."""
    graphdef, params = nnx.split(self.position)

    def bias(p, q_inputs, k_inputs):
      return self.score_bias(nnx.merge(graphdef, p), q_inputs, k_inputs)

    def modify(logits, p, q_inputs, k_inputs):
      del p
      return jnp.where(visible_blocks(q_inputs, k_inputs), logits, MASKED)

    return core.ScoreMod(bias=bias, modify=modify), params

  def resolved_backend(self, length):
    """The backend that runs a sequence of `length` tokens (auto: see the module docstring)."""
    if self.backend != "auto":
      return self.backend
    sparse = sparse_logits_per_query(length, self.chunk_size, self.topk, self.num_heads,
                                     self.block_size)
    return "blockwise" if sparse < (length + 1) / 2 else "xla"

  def attend(self, q_BxLxNxH, tokens, positions_BxL, segments_BxL=None, other_queries=None):
    del other_queries  # no window, so no requeried pairs
    length = q_BxLxNxH.shape[1]
    score_mod, params = self.score_mod()
    if self.resolved_backend(length) == "xla":
      return core.attend(q_BxLxNxH, tokens["key"], tokens["value"], scale=self.scale(),
                         score_mod=score_mod, score_params=params,
                         inputs=self.score_inputs(positions_BxL, tokens), mask=self.mask,
                         segments_BxT=segments_BxL, backend="xla")

    def bias_fn(q_positions, k_positions):
      return score_mod.bias(params, (q_positions,), (k_positions,))

    return sparse_attention(q_BxLxNxH, tokens["key"], tokens["value"],
                            blocks(length, self.chunk_size, segments_BxL), tokens["routed"],
                            positions_BxL, scale=self.scale(), bias_fn=bias_fn,
                            chunk=self.chunk_size, tile=self.block_size)

  def _route_from_cache(self, q_BxTxNxH, cache, positions_BxT, open_start_B=None):
    """[B, T, N, P]: the new tokens' selected blocks among the complete blocks of their
    document in the cache, from their means (`cache_block_means`: block g holds the document's
    tokens g C .. (g + 1) C - 1); positions_BxT are the tokens' indices within it."""
    count = cache["key"].shape[1] // self.chunk_size
    picks = min(self.topk - 1, count)
    if picks <= 0:
      return jnp.zeros(q_BxTxNxH.shape[:3] + (0,), jnp.int32)
    means = cache_block_means(cache["key"], self.chunk_size, q_BxTxNxH.shape[0], open_start_B)
    gates = gate_scores(q_BxTxNxH, means)
    candidate = jnp.arange(count) < (positions_BxT // self.chunk_size)[:, None, :, None]
    return select(gates, candidate, picks)

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens at indices index..index + T - 1: written to the cache, then attending to
    their own and selected blocks there; a prompt into an empty cache runs the sequence path.
    With `documents` (masks.DecodeDocuments) blocks count from each document's start: a token
    of the cache's open document routes over that document's blocks in the cache, one of a
    document that starts among the new tokens as the sequence path routes the new tokens."""
    t = x_BxTxD.shape[1]
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, t, documents)
    q, tokens = softmax.SoftmaxAttention.project(self, x_BxTxD, positions_BxT)
    score_mod, params = self.score_mod()

    def from_cache(q, tokens, cache):
      tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
      cache = self.kv_cache.write(tokens, cache, index_1xT[0])
      slots = cache["key"].shape[1]
      mask, k_positions = kv_cache.full_cache_keys(self.mask, index_1xT, slots, documents)
      routed = self._route_from_cache(
          q, cache, positions_BxT, None if documents is None else documents.open_start_B)
      if documents is not None:
        started = documents.starts_BxT >= index  # the token's document starts in this call
        routed = jnp.where(started[:, :, None, None],
                           routed_in_documents(q, tokens["key"], segments_BxT, self.chunk_size,
                                               self.topk, routed.shape[-1]), routed)
      k_blocks = k_positions // self.chunk_size
      q_inputs = (positions_BxT, positions_BxT // self.chunk_size, None, routed)
      y = kv_cache.cached_attention(
          q, [(cache["key"], cache["value"], q_inputs, (k_positions, k_blocks, k_blocks, None),
               mask)], self.scale(), score_mod, params)
      # Past the cache's end the write would clamp: NaN rather than wrong outputs.
      return jnp.where(index + t <= slots, y, jnp.nan), cache

    def prefill_empty(q, tokens, cache):
      tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
      layout = blocks(t, self.chunk_size, segments_BxT)
      routed = route(q, tokens["key"], layout, self.chunk_size, self.topk)
      sequence = {**tokens, "group": layout.group, "complete": layout.complete, "routed": routed}
      return (self.attend(q, sequence, positions_BxT, segments_BxT),
              self.kv_cache.write(tokens, cache, index_1xT[0]))

    if t == 1:
      y, cache = from_cache(q, tokens, cache)
    else:
      y, cache = jax.lax.cond(index == 0, prefill_empty, from_cache, q, tokens, cache)
    return self.out(y), cache

  def mixing_flops_per_token(self, context_length):
    """q k^T and p v over the keys each query's form computes (xla: the dense causal
    attention's (L + 1) / 2, masked afterwards, as counted for mha; blockwise: its own 2C
    window and its tiles, padding included), plus the gates against every complete block."""
    length = context_length
    if self.resolved_backend(length) == "xla":
      keys = (length + 1) / 2
    else:
      keys = sparse_logits_per_query(length, self.chunk_size, self.topk, self.num_heads,
                                     self.block_size)
    gates = 2 * self.num_heads * self.head_dim * (length // self.chunk_size)
    return 2 * self.num_heads * (self.head_dim + self.value_head_dim) * keys + gates
