"""Exact causal attention in blocks with an online softmax (FlashAttention, arXiv:2205.14135;
Rabe & Staats, arXiv:2112.05682), in pure JAX, with any score modification evaluated per tile.
The `blockwise` backend of `research.attention.core.attend`; call it through `attend`.

For each block of queries, keys are visited block by block keeping a running max m, running sum
l and unnormalised output acc:
  s = score_mod(scale q k^T),   m' = max(m, rowmax s),
  p = exp(s - m'),   l' = l exp(m - m') + rowsum p,   acc' = acc exp(m - m') + p v,   out = acc / l.
The tiles visited are the mask spec's schedule (research.attention.masks.MaskSpec.schedule),
fixed at trace time: the causal ones, and of those only the tiles that hold a key within the
window or a sink and that the block-sparse pattern keeps, so time grows as O(visited tiles).
Inside a tile the mask is by token index, and by segment (packed documents) when given. The
forward pass keeps only out and the row log-sum-exp (O(length) memory); the custom VJP
recomputes each [block, block] tile, including its score modification, so no [length, length]
matrix is ever stored; the backward pass visits each tile once (one loop over key blocks that
also accumulates dQ). The score modification (research.attention.core.ScoreMod) is a function of
the tile's logits, of parameters (a position scheme's) and of per-token inputs, a pytree of
[B, T, ...] arrays cut into the tile's query and key blocks: the positions, and any
data-dependent per-token values (the Forgetting Transformer's cumulative log forget gates). The
backward pass pulls each tile's dlogits back through it, to the raw logits, the parameters and
the floating-point inputs. Grouped-query attention groups the query heads over the shared
key/value heads (no repeat of K or V in memory); values may be wider than queries and keys.
"""

import functools

import jax
import jax.numpy as jnp

from research.attention import masks

_MASKED = -1e30


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

  def __init__(self, q, k, inputs, segments, score_mod, score_params, block, scale, mask):
    # q [B, K, G, T, H], k [B, K, T, H]: heads before length.
    self.q, self.k, self.inputs, self.segments = q, k, inputs, segments
    self.score_mod, self.score_params = score_mod, score_params
    self.block, self.scale, self.mask = block, scale, mask
    num_blocks = q.shape[3] // block
    packed = segments is not None
    # Sinks are the first tokens of each document: the keys' indices within their documents.
    self.document_index = (masks.positions_in_documents(segments)
                           if packed and mask.sinks else None)
    (self.key_counts, self.key_table), (self.query_counts, self.query_table) = (
        (jnp.asarray(c), jnp.asarray(t)) for c, t in mask.schedule(num_blocks, block, packed))

  def key_blocks(self, i):
    """(count, j(c)): query block i visits key blocks j(0) < ... < j(count - 1)."""
    return self.key_counts[i], lambda c: self.key_table[i, c]

  def query_blocks(self, j):
    """(count, i(c)): the query blocks that see key block j, ascending."""
    return self.query_counts[j], lambda c: self.query_table[j, c]

  def logits(self, i, j, with_pullback=False):
    """Modified, masked logits of one tile, [B, K, G, Q, S] in float32, and (with_pullback) the
    pullback from their cotangent to (d raw logits, d params, d float inputs of query block i,
    d float inputs of key block j); None when there is no score modification."""
    q_i = _block(self.q, i, self.block, axis=3)
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, _block(self.k, j, self.block, axis=2),
                   preferred_element_type=jnp.float32) * self.scale
    pullback = None
    if self.score_mod is not None:
      b, kv_heads, group, q_len, k_len = s.shape
      q_in = jax.tree.map(lambda x: _block(x, i, self.block), self.inputs)
      k_in = jax.tree.map(lambda x: _block(x, j, self.block), self.inputs)

      def modified(s_BxKxGxQxS, params, q_floats, k_floats):
        s_BxNxQxS = s_BxKxGxQxS.reshape(b, kv_heads * group, q_len, k_len)
        out = self.score_mod.apply(s_BxNxQxS, params, _with_floats(q_in, q_floats),
                                   _with_floats(k_in, k_floats))
        return out.astype(jnp.float32).reshape(s_BxKxGxQxS.shape)

      args = (s, self.score_params, _floats(q_in), _floats(k_in))
      if with_pullback:
        s, pullback = jax.vjp(modified, *args)
      else:
        s = modified(*args)
    q_index = i * self.block + jnp.arange(self.block)
    k_index = j * self.block + jnp.arange(self.block)
    document_index = (None if self.document_index is None
                      else _block(self.document_index, j, self.block))
    q_segments, k_segments = ((None, None) if self.segments is None else
                              (_block(self.segments, i, self.block),
                               _block(self.segments, j, self.block)))
    seen = self.mask.allowed(q_index, k_index, q_segments, k_segments, document_index)
    return jnp.where(seen[:, :, None], s, _MASKED), pullback  # [B | 1, 1, 1, Q, S] over K, G


def _forward(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask):
  """(out [B, T, K, G, V], row log-sum-exp [num_blocks, B, K, G, block]) of q [B, T, K, G, H],
  k [B, T, K, H] and v [B, T, K, V]."""
  num_blocks = q.shape[1] // block
  like = q
  q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
  tiles = _Tiles(q, k, inputs, segments, score_mod, score_params, block, scale, mask)
  b, kh, g = q.shape[:3]
  width = v.shape[-1]

  def query_block(i):
    count, key_block = tiles.key_blocks(i)

    def visit(c, carry):
      # A row whose keys so far are all masked accumulates exp(0) = 1 terms; its first visible
      # key (its own, which every mask keeps) rescales them by exp(-1e30).
      j = key_block(c)
      m, l, acc = carry
      s = tiles.logits(i, j)[0]
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      correction = jnp.exp(m - m_new)
      l = l * correction + p.sum(-1)
      pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), _block(v, j, block, axis=2),
                      preferred_element_type=jnp.float32)
      return m_new, l, acc * correction[..., None] + pv

    init = (jnp.full((b, kh, g, block), _MASKED, jnp.float32),
            jnp.zeros((b, kh, g, block), jnp.float32),
            jnp.zeros((b, kh, g, block, width), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, count, visit, init)
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

  out_blocks, lse_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(out_blocks, like.astype(v.dtype)), lse_blocks


_STATIC = (6, 7, 8, 9)  # block, scale, score_mod, mask


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _attention(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask):
  return _forward(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask)[0]


def _attention_fwd(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask):
  out, lse = _forward(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask)
  return out, (q, k, v, inputs, segments, score_params, out, lse)


def _attention_bwd(block, scale, score_mod, mask, residuals, d_out):
  q_like, k_like, v_like, inputs, segments, score_params, out, lse = residuals
  num_blocks = q_like.shape[1] // block
  q, k, v, d_out = (_heads_first(x) for x in (q_like, k_like, v_like, d_out))
  tiles = _Tiles(q, k, inputs, segments, score_mod, score_params, block, scale, mask)
  # delta_i = rowsum(dO_i * O_i), [B, K, G, T]
  delta = jnp.einsum("bkgqh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def key_block(carry, j):
    """dK_j and dV_j sum over the query blocks i that see key block j; each tile (i, j) also
    adds its share to dQ_i, to d(score params) and to d(score inputs) of blocks i and j, so
    every tile's logits and score modification are recomputed once."""
    k_j, v_j = _block(k, j, block, axis=2), _block(v, j, block, axis=2)
    count, query_block = tiles.query_blocks(j)

    def visit(c, inner):
      i = query_block(c)
      dk, dv, dq, d_params, d_inputs = inner
      s, pullback = tiles.logits(i, j, with_pullback=True)
      q_i, do_i = _block(q, i, block, axis=3), _block(d_out, i, block, axis=3)
      p = jnp.exp(s - lse[i][..., None])
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
      ds = p * (dp - delta_i[..., None])
      if pullback is not None:
        ds, dp_params, dq_inputs, dk_inputs = pullback(ds)
        d_params = jax.tree.map(jnp.add, d_params, dp_params)
        d_inputs = [_add_to_block(_add_to_block(d, dq_in, i, block), dk_in, j, block)
                    for d, dq_in, dk_in in zip(d_inputs, dq_inputs, dk_inputs)]
      dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p, do_i.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i.astype(jnp.float32)) * scale
      dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j.astype(jnp.float32)) * scale
      dq = _add_to_block(dq, dq_i, i, block, axis=3)
      return dk, dv, dq, d_params, d_inputs

    dk, dv, *carry = jax.lax.fori_loop(
        0, count, visit, (jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32),
                          *carry))
    return tuple(carry), (dk, dv)

  init = (jnp.zeros(q.shape, jnp.float32), jax.tree.map(jnp.zeros_like, score_params),
          [jnp.zeros(x.shape, jnp.float32) for x in _floats(inputs)])
  (dq, d_params, d_inputs), (dk, dv) = jax.lax.scan(key_block, init, jnp.arange(num_blocks))
  d_inputs = _with_floats(inputs, [d.astype(x.dtype) for d, x in zip(d_inputs, _floats(inputs))],
                          integers=lambda x: None)
  return (_length_second(dq).astype(q.dtype), _unblock(dk, k_like), _unblock(dv, v_like),
          d_inputs, None, d_params)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, inputs, score_mod, score_params, *, block_size,
              scale, mask, segments_BxT=None):
  """softmax(score_mod(scale q k^T), mask) v of a sequence to itself, in blocks of block_size;
  see research.attention.core.attend for the arguments."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  block = min(block_size, t)
  padded = -(-t // block) * block
  # Padding sits after every real position, so causality already hides it from real queries.
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  q = jnp.pad(q_BxTxNxH, pad).reshape(b, padded, kv_heads, n // kv_heads, h)
  k, v = jnp.pad(k_BxTxKxH, pad), jnp.pad(v_BxTxKxV, pad)
  inputs = jax.tree.map(
      lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2), mode="edge"),
      inputs)
  segments = (None if segments_BxT is None
              else jnp.pad(segments_BxT, [(0, 0), (0, padded - t)], mode="edge"))
  out = _attention(q, k, v, inputs, segments, score_params, block, float(scale), score_mod, mask)
  return out.reshape(b, padded, n, v.shape[-1])[:, :t]

