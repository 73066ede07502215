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
the floating-point inputs. With sink queries (core.SinkQueries: StreamingLLM's cache positions)
the tiles that may hold a sink pair (MaskSpec.sink_tiles, a flag per visited tile) also compute
the sink queries' logits and take them for the sink pairs, and their backward pass returns the
sink queries' dQ and d(sink inputs); the other tiles run as without them (a lax.cond per tile).
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
               sink=None):
    # q [B, K, G, T, H], k [B, K, T, H]: heads before length; sink: core.SinkQueries with q
    # (or None) in q's layout.
    self.q, self.k, self.inputs, self.segments = q, k, inputs, segments
    self.score_mod, self.score_params = score_mod, score_params
    self.block, self.scale, self.mask = block, scale, mask
    num_blocks = q.shape[3] // block
    packed = segments is not None
    # Sinks are the first tokens of each document: the keys' indices within their documents.
    self.document_index = (masks.positions_in_documents(segments)
                           if packed and mask.sinks else None)
    (key_counts, key_table), (query_counts, query_table) = mask.schedule(num_blocks, block,
                                                                         packed)
    (self.key_counts, self.key_table, self.query_counts, self.query_table) = (
        jnp.asarray(x) for x in (key_counts, key_table, query_counts, query_table))
    # The visited tiles that may hold a sink pair: their logits also take the sink queries.
    sink_tiles = (mask.sink_tiles(num_blocks, block, packed) if sink is not None
                  else np.zeros((num_blocks, num_blocks), bool))
    rows = np.arange(num_blocks)[:, None]
    any_sinks = bool(sink_tiles.any())
    self.key_sinks = jnp.asarray(sink_tiles[rows, key_table]) if any_sinks else None
    self.query_sinks = jnp.asarray(sink_tiles[query_table, rows]) if any_sinks else None
    self.sink = sink if any_sinks else None

  def key_blocks(self, i):
    """(count, j(c), whether tile (i, j(c)) may hold a sink pair (None: no tile does)): query
    block i visits key blocks j(0) < ... < j(count - 1)."""
    sinks = None if self.key_sinks is None else lambda c: self.key_sinks[i, c]
    return self.key_counts[i], lambda c: self.key_table[i, c], sinks

  def query_blocks(self, j):
    """(count, i(c), sink flags as in key_blocks): the query blocks that see key block j,
    ascending."""
    sinks = None if self.query_sinks is None else lambda c: self.query_sinks[j, c]
    return self.query_counts[j], lambda c: self.query_table[j, c], sinks

  def logits(self, i, j, with_pullback=False, sinks=False):
    """Modified, masked logits of one tile, [B, K, G, Q, S] in float32, and (with_pullback) the
    pullback from their cotangent to (d raw logits, d raw sink logits (None without sink
    queries of their own), d params, d float inputs of query block i, d float sink inputs of
    query block i, d float inputs of key block j); None when there is no score modification
    and no sink pair. sinks (static): the tile may hold sink pairs, whose logits come from the
    sink queries and their score inputs."""
    q_i = _block(self.q, i, self.block, axis=3)
    k_j = _block(self.k, j, self.block, axis=2)
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * self.scale
    q_index = i * self.block + jnp.arange(self.block)
    k_index = j * self.block + jnp.arange(self.block)
    document_index = (None if self.document_index is None
                      else _block(self.document_index, j, self.block))
    pullback = None
    if self.score_mod is not None or sinks:
      b, kv_heads, group, q_len, k_len = s.shape
      q_in = jax.tree.map(lambda x: _block(x, i, self.block), self.inputs)
      k_in = jax.tree.map(lambda x: _block(x, j, self.block), self.inputs)
      qs_in = (jax.tree.map(lambda x: _block(x, i, self.block), self.sink.inputs) if sinks
               else None)

      def apply(s_BxKxGxQxS, params, q_inputs, k_inputs):
        if self.score_mod is None:
          return s_BxKxGxQxS
        s_BxNxQxS = s_BxKxGxQxS.reshape(b, kv_heads * group, q_len, k_len)
        out = self.score_mod.apply(s_BxNxQxS, params, q_inputs, k_inputs)
        return out.astype(jnp.float32).reshape(s_BxKxGxQxS.shape)

      def modified(s_BxKxGxQxS, sink_s, params, q_floats, qs_floats, k_floats):
        k_inputs = _with_floats(k_in, k_floats)
        out = apply(s_BxKxGxQxS, params, _with_floats(q_in, q_floats), k_inputs)
        if not sinks:
          return out
        sink_out = apply(s_BxKxGxQxS if sink_s is None else sink_s, params,
                         _with_floats(qs_in, qs_floats), k_inputs)
        pairs = self.mask.sink_pairs(q_index, k_index, document_index)
        pairs = pairs[None, None, None] if pairs.ndim == 2 else pairs[:, None, None]
        return jnp.where(pairs, sink_out, out)

      sink_s = None
      if sinks and self.sink.q is not None:
        qs_i = _block(self.sink.q, i, self.block, axis=3)
        sink_s = jnp.einsum("bkgqh,bksh->bkgqs", qs_i, k_j,
                            preferred_element_type=jnp.float32) * self.scale
      args = (s, sink_s, self.score_params, _floats(q_in), _floats(qs_in) if sinks else [],
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

  def forward_logits(self, i, j, sinks):
    """The tile's logits (`logits`), with the sink queries where `sinks` (a traced flag, or None:
    no tile holds a sink pair)."""
    if sinks is None:
      return self.logits(i, j)[0]
    return jax.lax.cond(sinks, lambda: self.logits(i, j, sinks=True)[0],
                        lambda: self.logits(i, j)[0])


def _sink_heads_first(sink):
  return None if sink is None else sink._replace(
      q=None if sink.q is None else _heads_first(sink.q))


def _forward(q, k, v, inputs, segments, score_params, sink, block, scale, score_mod, mask,
             normaliser):
  """(out [B, T, K, G, V], the normaliser's residual per query, [num_blocks, B, K, G, block]:
  the row log-sum-exp for softmax) of q [B, T, K, G, H], k [B, T, K, H] and v [B, T, K, V]
  (sink: core.SinkQueries, q like q, or None)."""
  num_blocks = q.shape[1] // block
  like = q
  q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
  tiles = _Tiles(q, k, inputs, segments, score_mod, score_params, block, scale, mask,
                 _sink_heads_first(sink))
  b, kh, g = q.shape[:3]
  width = v.shape[-1]

  def query_block(i):
    count, key_block, sink_flag = tiles.key_blocks(i)

    def visit(c, carry):
      j = key_block(c)
      s = tiles.forward_logits(i, j, None if sink_flag is None else sink_flag(c))
      return normaliser.tile_visit(carry, s, _block(v, j, block, axis=2))

    carry = jax.lax.fori_loop(0, count, visit, normaliser.tile_init((b, kh, g, block), width))
    out, residual = normaliser.tile_finish(carry)
    return out.astype(q.dtype), residual

  out_blocks, lse_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(out_blocks, like.astype(v.dtype)), lse_blocks


_STATIC = (7, 8, 9, 10, 11)  # block, scale, score_mod, mask, normaliser


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _attention(q, k, v, inputs, segments, score_params, sink, block, scale, score_mod, mask,
               normaliser):
  return _forward(q, k, v, inputs, segments, score_params, sink, block, scale, score_mod,
                  mask, normaliser)[0]


def _attention_fwd(q, k, v, inputs, segments, score_params, sink, block, scale, score_mod, mask,
                   normaliser):
  out, lse = _forward(q, k, v, inputs, segments, score_params, sink, block, scale, score_mod,
                      mask, normaliser)
  return out, (q, k, v, inputs, segments, score_params, sink, out, lse)


def _attention_bwd(block, scale, score_mod, mask, normaliser, residuals, d_out):
  q_like, k_like, v_like, inputs, segments, score_params, sink, out, lse = residuals
  num_blocks = q_like.shape[1] // block
  q, k, v, d_out = (_heads_first(x) for x in (q_like, k_like, v_like, d_out))
  tiles = _Tiles(q, k, inputs, segments, score_mod, score_params, block, scale, mask,
                 _sink_heads_first(sink))
  sink_q = None if tiles.sink is None else tiles.sink.q
  sink_inputs = [] if tiles.sink is None else _floats(tiles.sink.inputs)
  # delta_i = rowsum(dO_i * O_i), [B, K, G, T]
  delta = jnp.einsum("bkgqh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def key_block(carry, j):
    """dK_j and dV_j sum over the query blocks i that see key block j; each tile (i, j) also
    adds its share to dQ_i (and to the sink queries' dQ_i), to d(score params) and to d(score
    inputs) of blocks i and j, so every tile's logits and score modification are recomputed
    once."""
    k_j, v_j = _block(k, j, block, axis=2), _block(v, j, block, axis=2)
    count, query_block, sink_flag = tiles.query_blocks(j)

    def visit(c, inner, sinks=False):
      i = query_block(c)
      dk, dv, dq, dq_sink, d_params, d_inputs, d_sink_inputs = inner
      s, pullback = tiles.logits(i, j, with_pullback=True, sinks=sinks)
      q_i, do_i = _block(q, i, block, axis=3), _block(d_out, i, block, axis=3)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
      p, ds = normaliser.tile_grads(s, lse[i], dp, delta_i)
      ds_sink = None
      if pullback is not None:
        ds, ds_sink, dp_params, dq_inputs, dqs_inputs, dk_inputs = pullback(ds)
        d_params = jax.tree.map(jnp.add, d_params, dp_params)
        d_inputs = [_add_to_block(_add_to_block(d, dq_in, i, block), dk_in, j, block)
                    for d, dq_in, dk_in in zip(d_inputs, dq_inputs, dk_inputs)]
        if sinks:
          d_sink_inputs = [_add_to_block(d, dqs_in, i, block)
                           for d, dqs_in in zip(d_sink_inputs, dqs_inputs)]
      dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p, do_i.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i.astype(jnp.float32)) * scale
      dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j.astype(jnp.float32)) * scale
      dq = _add_to_block(dq, dq_i, i, block, axis=3)
      if ds_sink is not None:  # the sink pairs' logits came from the sink queries
        qs_i = _block(sink_q, i, block, axis=3)
        dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds_sink, qs_i.astype(jnp.float32)) * scale
        dqs_i = jnp.einsum("bkgqs,bksh->bkgqh", ds_sink, k_j.astype(jnp.float32)) * scale
        dq_sink = _add_to_block(dq_sink, dqs_i, i, block, axis=3)
      return dk, dv, dq, dq_sink, d_params, d_inputs, d_sink_inputs

    def visit_tile(c, inner):
      if sink_flag is None:
        return visit(c, inner)
      return jax.lax.cond(sink_flag(c), functools.partial(visit, sinks=True), visit, c, inner)

    dk, dv, *carry = jax.lax.fori_loop(
        0, count, visit_tile,
        (jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32), *carry))
    return tuple(carry), (dk, dv)

  init = (jnp.zeros(q.shape, jnp.float32),
          None if sink_q is None else jnp.zeros(sink_q.shape, jnp.float32),
          jax.tree.map(jnp.zeros_like, score_params),
          [jnp.zeros(x.shape, jnp.float32) for x in _floats(inputs)],
          [jnp.zeros(x.shape, jnp.float32) for x in sink_inputs])
  (dq, dq_sink, d_params, d_inputs, d_sink_inputs), (dk, dv) = jax.lax.scan(
      key_block, init, jnp.arange(num_blocks))
  d_inputs = _with_floats(inputs, [d.astype(x.dtype) for d, x in zip(d_inputs, _floats(inputs))],
                          integers=lambda x: None)
  d_sink = None
  if sink is not None:  # the cotangent of the sink queries and of their float score inputs
    floats = _floats(sink.inputs)
    if tiles.sink is None:  # no tile held a sink pair
      d_sink_inputs = [jnp.zeros(x.shape, jnp.float32) for x in floats]
    d_sink = sink._replace(
        q=None if sink.q is None else (jnp.zeros_like(sink.q) if dq_sink is None
                                       else _length_second(dq_sink).astype(sink.q.dtype)),
        inputs=_with_floats(sink.inputs, [d.astype(x.dtype) for d, x in zip(d_sink_inputs, floats)],
                            integers=lambda x: None))
  return (_length_second(dq).astype(q.dtype), _unblock(dk, k_like), _unblock(dv, v_like),
          d_inputs, None, d_params, d_sink)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, inputs, score_mod, score_params, *, block_size,
              scale, mask, segments_BxT=None, sink_queries=None, normaliser=normalisers.SOFTMAX):
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
  if sink_queries is not None:
    sink_queries = sink_queries._replace(
        q=None if sink_queries.q is None else grouped(sink_queries.q),
        inputs=pad_inputs(sink_queries.inputs))
  segments = (None if segments_BxT is None
              else jnp.pad(segments_BxT, [(0, 0), (0, padded - t)], mode="edge"))
  out = _attention(q, k, v, inputs, segments, score_params, sink_queries, block, float(scale),
                   score_mod, mask, normaliser)
  return out.reshape(b, padded, n, v.shape[-1])[:, :t]

