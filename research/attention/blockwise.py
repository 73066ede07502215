"""Exact causal attention in blocks with an online softmax (FlashAttention, arXiv:2205.14135;
Rabe & Staats, arXiv:2112.05682), in pure JAX, with any position bias evaluated per tile.

For each block of queries, keys are visited block by block keeping a running max m, running sum
l and unnormalised output acc:
  s = scale * q k^T + bias(q positions, k positions),   m' = max(m, rowmax s),
  p = exp(s - m'),   l' = l exp(m - m') + rowsum p,   acc' = acc exp(m - m') + p v,   out = acc / l.
Key blocks whose every key is masked are skipped: those in the future, and with a sliding window
(research.attention.masks) those before the window that hold no sink, so time grows as
O(length x window). The mask is by token index, and by segment (packed documents) when given. The forward pass
keeps only out and the row log-sum-exp (O(length) memory); the custom VJP recomputes each
[block, block] tile, including its bias, so no [length, length] matrix is ever stored; the backward pass visits each tile once (one loop over
key blocks that also accumulates dQ), recomputing its logits and bias once. The bias
is a function `bias_fn(params, q_positions_BxQ, k_positions_BxS) -> [B, N, Q, S]` (or None) of
the position scheme's parameters: the backward pass also returns their gradient, the pullback of
each tile's dlogits through bias_fn. Grouped-query attention groups the query heads over the
shared key/value heads (no repeat of K or V in memory).
"""

import functools

import jax
import jax.numpy as jnp

from research.attention import masks

_MASKED = -1e30


def _block(x, index, size):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _unblock(blocks, like):
  """[num_blocks, B, block, ...] -> like's [B, num_blocks * block, ...] and dtype."""
  return blocks.swapaxes(0, 1).reshape(like.shape).astype(like.dtype)


class _Tiles:
  """The logits of tile (i, j) and, for the backward pass, the pullback of its bias."""

  def __init__(self, q, k, positions, segments, bias_fn, bias_params, block, scale, window, sinks):
    self.q, self.k, self.positions, self.segments = q, k, positions, segments
    self.bias_fn, self.bias_params = bias_fn, bias_params
    self.block, self.scale, self.window, self.sinks = block, scale, window, sinks
    self.num_blocks = q.shape[1] // block
    packed = segments is not None
    # Sinks are the first tokens of each document: the keys' indices within their documents.
    self.document_index = (masks.positions_in_documents(segments) if packed and sinks else None)
    self.packed = packed

  def key_blocks(self, i):
    """(count, j(c)): query block i visits key blocks j(0), ..., j(count - 1): the sink blocks
    before the window, then the window's blocks up to the diagonal."""
    sink_blocks, first = masks.key_blocks(i, self.block, self.window, self.sinks, self.packed)
    return sink_blocks + i - first + 1, lambda c: jnp.where(c < sink_blocks, c,
                                                             first + c - sink_blocks)

  def last_query_block(self, j):
    return masks.last_query_block(j, self.block, self.window, self.sinks, self.num_blocks,
                                  self.packed)

  def bias(self, i, j):
    """(bias [B', K, G, Q, S] or None, pullback from such a cotangent to the parameters)."""
    b, _, kv_heads, group, _ = self.q.shape
    q_pos, k_pos = _block(self.positions, i, self.block), _block(self.positions, j, self.block)
    bias, pullback = jax.vjp(lambda p: self.bias_fn(p, q_pos, k_pos), self.bias_params)
    if bias is None:
      return None, None
    rows = bias.shape[0]
    shape = (rows, kv_heads, group, self.block, self.block)

    def to_params(dlogits_BxKxGxQxS):
      d = dlogits_BxKxGxQxS.sum(0, keepdims=True) if rows == 1 and b > 1 else dlogits_BxKxGxQxS
      return pullback(d.reshape(bias.shape))[0]

    return bias.astype(jnp.float32).reshape(shape), to_params

  def logits(self, q_i, i, j, bias):
    """Biased, causally masked logits of one tile, [B, K, G, Q, S], in float32."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_i, _block(self.k, j, self.block),
                   preferred_element_type=jnp.float32) * self.scale
    if bias is not None:
      s = s + bias
    q_index = i * self.block + jnp.arange(self.block)
    k_index = j * self.block + jnp.arange(self.block)
    document_index = (None if self.document_index is None
                      else _block(self.document_index, j, self.block))
    q_segments, k_segments = ((None, None) if self.segments is None else
                              (_block(self.segments, i, self.block),
                               _block(self.segments, j, self.block)))
    seen = masks.allowed(q_index, k_index, self.window, self.sinks, q_segments, k_segments,
                         document_index)
    return jnp.where(seen[:, :, None], s, _MASKED)  # [B | 1, 1, 1, Q, S] over K and G


def _forward(q, k, v, positions, segments, bias_params, block, scale, bias_fn, window, sinks):
  num_blocks = q.shape[1] // block
  tiles = _Tiles(q, k, positions, segments, bias_fn, bias_params, block, scale, window, sinks)

  def query_block(i):
    q_i = _block(q, i, block)
    b, _, kh, g, h = q_i.shape
    count, key_block = tiles.key_blocks(i)

    def visit(c, carry):
      # A row whose keys so far are all masked accumulates exp(0) = 1 terms; its first visible
      # key (at the latest its own, on the diagonal, visited last) rescales them by exp(-1e30).
      j = key_block(c)
      m, l, acc = carry
      s = tiles.logits(q_i, i, j, tiles.bias(i, j)[0])
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      correction = jnp.exp(m - m_new)
      l = l * correction + p.sum(-1)
      pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), _block(v, j, block),
                      preferred_element_type=jnp.float32)
      return m_new, l, acc * correction[..., None] + pv

    init = (jnp.full((b, kh, g, block), _MASKED, jnp.float32),
            jnp.zeros((b, kh, g, block), jnp.float32),
            jnp.zeros((b, kh, g, block, h), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, count, visit, init)
    out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B, Q, K, G, H]
    return out.astype(q.dtype), m + jnp.log(l)

  out_blocks, lse_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(out_blocks, q), lse_blocks  # lse: [num_blocks, B, K, G, block]


_STATIC = (6, 7, 8, 9, 10)  # block, scale, bias_fn, window, sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _attention(q, k, v, positions, segments, bias_params, block, scale, bias_fn, window, sinks):
  return _forward(q, k, v, positions, segments, bias_params, block, scale, bias_fn, window,
                  sinks)[0]


def _attention_fwd(q, k, v, positions, segments, bias_params, block, scale, bias_fn, window,
                   sinks):
  out, lse = _forward(q, k, v, positions, segments, bias_params, block, scale, bias_fn, window,
                      sinks)
  return out, (q, k, v, positions, segments, bias_params, out, lse)


def _attention_bwd(block, scale, bias_fn, window, sinks, residuals, d_out):
  q, k, v, positions, segments, bias_params, out, lse = residuals
  num_blocks = q.shape[1] // block
  tiles = _Tiles(q, k, positions, segments, bias_fn, bias_params, block, scale, window, sinks)
  # delta_i = rowsum(dO_i * O_i), [B, K, G, T]
  delta = jnp.einsum("bqkgh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def probabilities_and_dlogits(i, j, bias):
    q_i, do_i = _block(q, i, block), _block(d_out, i, block)
    p = jnp.exp(tiles.logits(q_i, i, j, bias) - lse[i][..., None])
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_i, _block(v, j, block),
                    preferred_element_type=jnp.float32)
    delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
    return q_i, do_i, p, p * (dp - delta_i[..., None])

  def key_block(carry, j):
    """dK_j and dV_j sum over the query blocks i >= j that see key block j; each tile (i, j) also adds its share to dQ_i
    and to d(bias params), so every tile's logits and bias are recomputed once."""
    k_j, v_j = _block(k, j, block), _block(v, j, block)

    def visit(i, inner):
      dk, dv, dq, d_params = inner
      bias, to_params = tiles.bias(i, j)
      q_i, do_i, p, ds = probabilities_and_dlogits(i, j, bias)
      dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, do_i.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, q_i.astype(jnp.float32)) * scale
      dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds, k_j.astype(jnp.float32)) * scale
      dq = jax.lax.dynamic_update_slice_in_dim(dq, _block(dq, i, block) + dq_i, i * block, axis=1)
      if to_params is not None:
        d_params = jax.tree.map(jnp.add, d_params, to_params(ds))
      return dk, dv, dq, d_params

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    dk, dv, dq, d_params = jax.lax.fori_loop(j, tiles.last_query_block(j) + 1, visit,
                                             (zeros, zeros, *carry))
    return (dq, d_params), (dk, dv)

  init = (jnp.zeros(q.shape, jnp.float32), jax.tree.map(jnp.zeros_like, bias_params))
  (dq, d_params), (dk, dv) = jax.lax.scan(key_block, init, jnp.arange(num_blocks))
  return dq.astype(q.dtype), _unblock(dk, k), _unblock(dv, v), None, None, d_params


_attention.defvjp(_attention_fwd, _attention_bwd)


def _no_bias(params, q_positions, k_positions):
  del params, q_positions, k_positions
  return None


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, positions_BxT=None, bias_fn=None,
                        bias_params=(), *, block_size=128, scale=None, window=0, sinks=0,
                        segments_BxT=None):
  """softmax(scale q k^T + bias_fn(bias_params, positions, positions), visible) v, in blocks.

  visible: causal, within the last `window` tokens or one of the first `sinks` (window 0: all
  past tokens), and in the same segment when segments_BxT (packed documents) are given; see
  research.attention.masks. num_kv_heads K must divide num_heads N; query head n uses key/value
  head n // (N / K). positions_BxT (B may be 1; default 0..T-1) feed only the bias; scale
  defaults to 1/sqrt(H).
  """
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  block = min(block_size, t)
  padded = -(-t // block) * block
  # Padding sits after every real position, so causality already hides it from real queries.
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  q = jnp.pad(q_BxTxNxH, pad).reshape(b, padded, kv_heads, n // kv_heads, h)
  k, v = jnp.pad(k_BxTxKxH, pad), jnp.pad(v_BxTxKxH, pad)
  if positions_BxT is None:
    positions_BxT = jnp.arange(t)[None]
  positions = jnp.pad(positions_BxT, [(0, 0), (0, padded - t)], mode="edge")
  segments = (None if segments_BxT is None
              else jnp.pad(segments_BxT, [(0, 0), (0, padded - t)], mode="edge"))
  scale = h ** -0.5 if scale is None else scale
  out = _attention(q, k, v, positions, segments, bias_params, block, scale, bias_fn or _no_bias,
                   int(window), int(sinks))
  return out.reshape(b, padded, n, h)[:, :t]
