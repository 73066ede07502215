"""Exact causal attention in blocks with an online softmax (FlashAttention, arXiv:2205.14135;
Rabe & Staats, arXiv:2112.05682), in pure JAX, with any score modification evaluated per tile.
The `blockwise` backend of `research.model.attention.core.attend`; call it through `attend`.

For each block of queries, keys are visited block by block keeping a running max m, running sum
l and unnormalised output acc:
  s = score_mod(scale q k^T),   m' = max(m, rowmax s),
  p = exp(s - m'),   l' = l exp(m - m') + rowsum p,   acc' = acc exp(m - m') + p v,   out = acc / l.
The tiles visited are the mask spec's schedule (research.model.attention.masks.MaskSpec.schedule),
fixed at trace time: the causal ones, and of those only the tiles that hold a key within the
window or a sink and that the block-sparse pattern keeps, so time grows as O(visited tiles).
Inside a tile the mask is by token index, and by segment (packed documents) when given. The
forward pass keeps only out and the row log-sum-exp (O(length) memory); the custom VJP
recomputes each [block, block] tile, including its score modification, so no [length, length]
matrix is ever stored; the backward pass visits each tile once (one loop over key blocks that
also accumulates dQ). The score modification (research.model.attention.core.ScoreMod) is a function
of the tile's logits, of parameters (a position scheme's) and of per-token inputs, a pytree of
[B, T, ...] arrays cut into the tile's query and key blocks: the positions, and any
data-dependent per-token values (the Forgetting Transformer's cumulative log forget gates). The
backward pass pulls each tile's dlogits back through it, to the raw logits, the parameters and
the floating-point inputs. With other queries (core.OtherQueries: StreamingLLM's cache positions)
the tiles that may hold a pair the mask spec requeries (MaskSpec.requeried_tiles, a flag per
visited tile) also compute the other queries' logits and take them for the requeried pairs, and
their backward pass returns the other queries' dQ and d(other inputs); the other tiles run as
without them (a lax.cond per tile).
Grouped-query attention groups the query heads over the shared key/value heads (no repeat of K or
V in memory); values may be wider than queries and keys.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from research.model.attention import masks
from research.model.attention import normalisers

_MASKED = normalisers.MASKED


def _block(x, index, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _add_to_block(x, update, index, size, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, _block(x, index, size, axis) + update,
                                             index * size, axis=axis)


def _heads_first(x):
  """[B, T, K, (G,) H] -> [B, K, (G,) T, H]: every tile's matmuls then read contiguous rows."""
  return jnp.moveaxis(x, 1, -2)


def _length_second(x):
  """The inverse of _heads_first."""
  return jnp.moveaxis(x, -2, 1)


def _is_float(x):
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _floats(tree):
  """The floating-point leaves of a pytree (those that get gradients), in order."""
  return [x for x in jax.tree.leaves(tree) if _is_float(x)]


def _with_floats(tree, floats, integers=lambda x: x):
  """`tree` with its floating-point leaves replaced, in order, by `floats` (and the others by
  integers(leaf))."""
  floats = iter(floats)
  return jax.tree.map(lambda x: next(floats) if _is_float(x) else integers(x), tree)


def _unblock(blocks, like):
  """[num_blocks, B, K, (G,) block, H] -> like's [B, num_blocks * block, K, (G,) H] and dtype."""
  blocks = jnp.moveaxis(blocks, 0, -3)  # [B, K, (G,) num_blocks, block, H]
  return _length_second(blocks.reshape(blocks.shape[:-3] + (-1, blocks.shape[-1]))).astype(
      like.dtype)


class _Tiles:
  """The logits of tile (i, j) and, for the backward pass, their pullback."""

  def __init__(self, q, k, inputs, segments, score_mod, score_params, block, scale, mask,
               other=None):
    # q [B, K, G, T, H], k [B, K, T, H]: heads before length; other: core.OtherQueries with q
    # (or None) in q's layout.
    self.q, self.k, self.inputs, self.segments = q, k, inputs, segments
    self.score_mod, self.score_params = score_mod, score_params
    self.block, self.scale, self.mask = block, scale, mask
    num_blocks = q.shape[3] // block
    packed = segments is not None
    # The keys' indices within their documents, where the mask reads them (its sinks).
    self.document_index = (masks.positions_in_documents(segments)
                           if packed and mask.reads_key_documents else None)
    (key_counts, key_table), (query_counts, query_table) = mask.schedule(num_blocks, block,
                                                                         packed)
    (self.key_counts, self.key_table, self.query_counts, self.query_table) = (
        jnp.asarray(x) for x in (key_counts, key_table, query_counts, query_table))
    # The visited tiles that may hold a requeried pair: their logits also take the other queries.
    requeried_tiles = (mask.requeried_tiles(num_blocks, block, packed) if other is not None
                  else np.zeros((num_blocks, num_blocks), bool))
    rows = np.arange(num_blocks)[:, None]
    any_requeried = bool(requeried_tiles.any())
    self.key_requeried = jnp.asarray(requeried_tiles[rows, key_table]) if any_requeried else None
    self.query_requeried = (jnp.asarray(requeried_tiles[query_table, rows]) if any_requeried
                            else None)
    self.other = other if any_requeried else None

  def key_blocks(self, i):
    """(count, j(c), whether tile (i, j(c)) may hold a requeried pair (None: no tile does)): query
    block i visits key blocks j(0) < ... < j(count - 1)."""
    requeried = None if self.key_requeried is None else lambda c: self.key_requeried[i, c]
    return self.key_counts[i], lambda c: self.key_table[i, c], requeried

  def query_blocks(self, j):
    """(count, i(c), requeried flags as in key_blocks): the query blocks that see key block j,
    ascending."""
    requeried = None if self.query_requeried is None else lambda c: self.query_requeried[j, c]
    return self.query_counts[j], lambda c: self.query_table[j, c], requeried

  def logits(self, i, j, with_pullback=False, requeried=False):
    """Modified, masked logits of one tile, [B, K, G, Q, S] in float32, and (with_pullback) the
    pullback from their cotangent to (d raw logits, d raw other logits (None without other
    queries of their own), d params, d float inputs of query block i, d float other inputs of
    query block i, d float inputs of key block j); None when there is no score modification
    and no requeried pair. requeried (static): the tile may hold requeried pairs, whose logits
    come from the other queries and their score inputs."""
    q_i = _block(self.q, i, self.block, axis=3)
    k_j = _block(self.k, j, self.block, axis=2)
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * self.scale
    q_index = i * self.block + jnp.arange(self.block)
    k_index = j * self.block + jnp.arange(self.block)
    document_index = (None if self.document_index is None
                      else _block(self.document_index, j, self.block))
    pullback = None
    if self.score_mod is not None or requeried:
      b, kv_heads, group, q_len, k_len = s.shape
      q_in = jax.tree.map(lambda x: _block(x, i, self.block), self.inputs)
      k_in = jax.tree.map(lambda x: _block(x, j, self.block), self.inputs)
      qo_in = (jax.tree.map(lambda x: _block(x, i, self.block), self.other.inputs) if requeried
               else None)

      def apply(s_BxKxGxQxS, params, q_inputs, k_inputs):
        if self.score_mod is None:
          return s_BxKxGxQxS
        s_BxNxQxS = s_BxKxGxQxS.reshape(b, kv_heads * group, q_len, k_len)
        out = self.score_mod.apply(s_BxNxQxS, params, q_inputs, k_inputs)
        return out.astype(jnp.float32).reshape(s_BxKxGxQxS.shape)

      def modified(s_BxKxGxQxS, other_s, params, q_floats, qo_floats, k_floats):
        k_inputs = _with_floats(k_in, k_floats)
        out = apply(s_BxKxGxQxS, params, _with_floats(q_in, q_floats), k_inputs)
        if not requeried:
          return out
        other_out = apply(s_BxKxGxQxS if other_s is None else other_s, params,
                          _with_floats(qo_in, qo_floats), k_inputs)
        pairs = self.mask.requeried_pairs(q_index, k_index, document_index)
        pairs = pairs[None, None, None] if pairs.ndim == 2 else pairs[:, None, None]
        return jnp.where(pairs, other_out, out)

      other_s = None
      if requeried and self.other.q is not None:
        qo_i = _block(self.other.q, i, self.block, axis=3)
        other_s = jnp.einsum("bkgqh,bksh->bkgqs", qo_i, k_j,
                            preferred_element_type=jnp.float32) * self.scale
      args = (s, other_s, self.score_params, _floats(q_in), _floats(qo_in) if requeried else [],
              _floats(k_in))
      if with_pullback:
        s, pullback = jax.vjp(modified, *args)
      else:
        s = modified(*args)
    q_segments, k_segments = ((None, None) if self.segments is None else
                              (_block(self.segments, i, self.block),
                               _block(self.segments, j, self.block)))
    seen = self.mask.allowed(q_index, k_index, q_segments, k_segments, document_index)
    return jnp.where(seen[:, :, None], s, _MASKED), pullback  # [B | 1, 1, 1, Q, S] over K, G

  def forward_logits(self, i, j, requeried):
    """The tile's logits (`logits`), with the other queries where `requeried` (a traced flag, or
    None: no tile holds a requeried pair)."""
    if requeried is None:
      return self.logits(i, j)[0]
    return jax.lax.cond(requeried, lambda: self.logits(i, j, requeried=True)[0],
                        lambda: self.logits(i, j)[0])


def _other_heads_first(other):
  return None if other is None else other._replace(
      q=None if other.q is None else _heads_first(other.q))


def _forward(q, k, v, inputs, segments, score_params, other, block, scale, score_mod, mask,
             normaliser):
  """(out [B, T, K, G, V], the normaliser's residual per query, [num_blocks, B, K, G, block]:
  the row log-sum-exp for softmax) of q [B, T, K, G, H], k [B, T, K, H] and v [B, T, K, V]
  (other: core.OtherQueries, q like q, or None)."""
  num_blocks = q.shape[1] // block
  like = q
  q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
  tiles = _Tiles(q, k, inputs, segments, score_mod, score_params, block, scale, mask,
                 _other_heads_first(other))
  b, kh, g = q.shape[:3]
  width = v.shape[-1]

  def query_block(i):
    count, key_block, requeried_flag = tiles.key_blocks(i)

    def visit(c, carry):
      j = key_block(c)
      s = tiles.forward_logits(i, j, None if requeried_flag is None else requeried_flag(c))
      return normaliser.tile_visit(carry, s, _block(v, j, block, axis=2))

    carry = jax.lax.fori_loop(0, count, visit, normaliser.tile_init((b, kh, g, block), width))
    out, residual = normaliser.tile_finish(carry)
    return out.astype(q.dtype), residual

  out_blocks, lse_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(out_blocks, like.astype(v.dtype)), lse_blocks


_STATIC = (7, 8, 9, 10, 11)  # block, scale, score_mod, mask, normaliser


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _attention(q, k, v, inputs, segments, score_params, other, block, scale, score_mod, mask,
               normaliser):
  return _forward(q, k, v, inputs, segments, score_params, other, block, scale, score_mod,
                  mask, normaliser)[0]


def _attention_fwd(q, k, v, inputs, segments, score_params, other, block, scale, score_mod, mask,
                   normaliser):
  out, lse = _forward(q, k, v, inputs, segments, score_params, other, block, scale, score_mod,
                      mask, normaliser)
  return out, (q, k, v, inputs, segments, score_params, other, out, lse)


def _attention_bwd(block, scale, score_mod, mask, normaliser, residuals, d_out):
  q_like, k_like, v_like, inputs, segments, score_params, other, out, lse = residuals
  num_blocks = q_like.shape[1] // block
  q, k, v, d_out = (_heads_first(x) for x in (q_like, k_like, v_like, d_out))
  tiles = _Tiles(q, k, inputs, segments, score_mod, score_params, block, scale, mask,
                 _other_heads_first(other))
  other_q = None if tiles.other is None else tiles.other.q
  other_inputs = [] if tiles.other is None else _floats(tiles.other.inputs)
  # delta_i = rowsum(dO_i * O_i), [B, K, G, T]
  delta = jnp.einsum("bkgqh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def key_block(carry, j):
    """dK_j and dV_j sum over the query blocks i that see key block j; each tile (i, j) also
    adds its share to dQ_i (and to the other queries' dQ_i), to d(score params) and to d(score
    inputs) of blocks i and j, so every tile's logits and score modification are recomputed
    once."""
    k_j, v_j = _block(k, j, block, axis=2), _block(v, j, block, axis=2)
    count, query_block, requeried_flag = tiles.query_blocks(j)

    def visit(c, inner, requeried=False):
      i = query_block(c)
      dk, dv, dq, dq_other, d_params, d_inputs, d_other_inputs = inner
      s, pullback = tiles.logits(i, j, with_pullback=True, requeried=requeried)
      q_i, do_i = _block(q, i, block, axis=3), _block(d_out, i, block, axis=3)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
      p, ds = normaliser.tile_grads(s, lse[i], dp, delta_i)
      ds_other = None
      if pullback is not None:
        ds, ds_other, dp_params, dq_inputs, dqo_inputs, dk_inputs = pullback(ds)
        d_params = jax.tree.map(jnp.add, d_params, dp_params)
        d_inputs = [_add_to_block(_add_to_block(d, dq_in, i, block), dk_in, j, block)
                    for d, dq_in, dk_in in zip(d_inputs, dq_inputs, dk_inputs)]
        if requeried:
          d_other_inputs = [_add_to_block(d, dqo_in, i, block)
                            for d, dqo_in in zip(d_other_inputs, dqo_inputs)]
      dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p, do_i.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i.astype(jnp.float32)) * scale
      dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j.astype(jnp.float32)) * scale
      dq = _add_to_block(dq, dq_i, i, block, axis=3)
      if ds_other is not None:  # the requeried pairs' logits came from the other queries
        qo_i = _block(other_q, i, block, axis=3)
        dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds_other, qo_i.astype(jnp.float32)) * scale
        dqo_i = jnp.einsum("bkgqs,bksh->bkgqh", ds_other, k_j.astype(jnp.float32)) * scale
        dq_other = _add_to_block(dq_other, dqo_i, i, block, axis=3)
      return dk, dv, dq, dq_other, d_params, d_inputs, d_other_inputs

    def visit_tile(c, inner):
      if requeried_flag is None:
        return visit(c, inner)
      return jax.lax.cond(requeried_flag(c), functools.partial(visit, requeried=True), visit, c,
                          inner)

    dk, dv, *carry = jax.lax.fori_loop(
        0, count, visit_tile,
        (jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32), *carry))
    return tuple(carry), (dk, dv)

  init = (jnp.zeros(q.shape, jnp.float32),
          None if other_q is None else jnp.zeros(other_q.shape, jnp.float32),
          jax.tree.map(jnp.zeros_like, score_params),
          [jnp.zeros(x.shape, jnp.float32) for x in _floats(inputs)],
          [jnp.zeros(x.shape, jnp.float32) for x in other_inputs])
  (dq, dq_other, d_params, d_inputs, d_other_inputs), (dk, dv) = jax.lax.scan(
      key_block, init, jnp.arange(num_blocks))
  d_inputs = _with_floats(inputs, [d.astype(x.dtype) for d, x in zip(d_inputs, _floats(inputs))],
                          integers=lambda x: None)
  d_other = None
  if other is not None:  # the cotangent of the other queries and of their float score inputs
    floats = _floats(other.inputs)
    if tiles.other is None:  # no tile held a requeried pair
      d_other_inputs = [jnp.zeros(x.shape, jnp.float32) for x in floats]
    d_other = other._replace(
        q=None if other.q is None else (jnp.zeros_like(other.q) if dq_other is None
                                        else _length_second(dq_other).astype(other.q.dtype)),
        inputs=_with_floats(other.inputs,
                            [d.astype(x.dtype) for d, x in zip(d_other_inputs, floats)],
                            integers=lambda x: None))
  return (_length_second(dq).astype(q.dtype), _unblock(dk, k_like), _unblock(dv, v_like),
          d_inputs, None, d_params, d_other)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, inputs, score_mod, score_params, *, block_size,
              scale, mask, segments_BxT=None, other_queries=None, normaliser=normalisers.SOFTMAX):
  """normaliser(score_mod(scale q k^T), mask) v of a sequence to itself, in blocks of
  block_size (softmax by default; any research.model.attention.normalisers.Normaliser with a
  per-tile form); see research.model.attention.core.attend for the arguments."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  block = min(block_size, t)
  padded = -(-t // block) * block
  # Padding sits after every real position, so causality already hides it from real queries.
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  grouped = lambda x: jnp.pad(x, pad).reshape(b, padded, kv_heads, n // kv_heads, h)
  q = grouped(q_BxTxNxH)
  k, v = jnp.pad(k_BxTxKxH, pad), jnp.pad(v_BxTxKxV, pad)
  pad_inputs = lambda tree: jax.tree.map(
      lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2), mode="edge"),
      tree)
  inputs = pad_inputs(inputs)
  if other_queries is not None:
    other_queries = other_queries._replace(
        q=None if other_queries.q is None else grouped(other_queries.q),
        inputs=pad_inputs(other_queries.inputs))
  segments = (None if segments_BxT is None
              else jnp.pad(segments_BxT, [(0, 0), (0, padded - t)], mode="edge"))
  out = _attention(q, k, v, inputs, segments, score_params, other_queries, block, float(scale),
                   score_mod, mask, normaliser)
  return out.reshape(b, padded, n, v.shape[-1])[:, :t]

