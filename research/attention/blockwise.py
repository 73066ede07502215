"""Exact causal attention in blocks with an online softmax (FlashAttention, arXiv:2205.14135;
Rabe & Staats, arXiv:2112.05682), in pure JAX, with any position bias evaluated per tile.

For each block of queries, keys are visited block by block keeping a running max m, running sum
l and unnormalised output acc:
  s = scale * q k^T + bias(q positions, k positions),   m' = max(m, rowmax s),
  p = exp(s - m'),   l' = l exp(m - m') + rowsum p,   acc' = acc exp(m - m') + p v,   out = acc / l.
Key blocks entirely in the future are skipped; the causal mask is by token index. The forward pass
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

_MASKED = -1e30


def _block(x, index, size):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _unblock(blocks, like):
  """[num_blocks, B, block, ...] -> like's [B, num_blocks * block, ...] and dtype."""
  return blocks.swapaxes(0, 1).reshape(like.shape).astype(like.dtype)


class _Tiles:
  """The logits of tile (i, j) and, for the backward pass, the pullback of its bias."""

  def __init__(self, q, k, positions, bias_fn, bias_params, block, scale):
    self.q, self.k, self.positions = q, k, positions
    self.bias_fn, self.bias_params = bias_fn, bias_params
    self.block, self.scale = block, scale

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
    return jnp.where(q_index[:, None] >= k_index[None, :], s, _MASKED)


def _forward(q, k, v, positions, bias_params, block, scale, bias_fn):
  num_blocks = q.shape[1] // block
  tiles = _Tiles(q, k, positions, bias_fn, bias_params, block, scale)

  def query_block(i):
    q_i = _block(q, i, block)
    b, _, kh, g, h = q_i.shape

    def visit(j, carry):
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
    m, l, acc = jax.lax.fori_loop(0, i + 1, visit, init)  # causal: key blocks 0..i only
    out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B, Q, K, G, H]
    return out.astype(q.dtype), m + jnp.log(l)

  out_blocks, lse_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(out_blocks, q), lse_blocks  # lse: [num_blocks, B, K, G, block]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, positions, bias_params, block, scale, bias_fn):
  return _forward(q, k, v, positions, bias_params, block, scale, bias_fn)[0]


def _attention_fwd(q, k, v, positions, bias_params, block, scale, bias_fn):
  out, lse = _forward(q, k, v, positions, bias_params, block, scale, bias_fn)
  return out, (q, k, v, positions, bias_params, out, lse)


def _attention_bwd(block, scale, bias_fn, residuals, d_out):
  q, k, v, positions, bias_params, out, lse = residuals
  num_blocks = q.shape[1] // block
  tiles = _Tiles(q, k, positions, bias_fn, bias_params, block, scale)
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
    """dK_j and dV_j sum over query blocks i >= j; each tile (i, j) also adds its share to dQ_i
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
    dk, dv, dq, d_params = jax.lax.fori_loop(j, num_blocks, visit, (zeros, zeros, *carry))
    return (dq, d_params), (dk, dv)

  init = (jnp.zeros(q.shape, jnp.float32), jax.tree.map(jnp.zeros_like, bias_params))
  (dq, d_params), (dk, dv) = jax.lax.scan(key_block, init, jnp.arange(num_blocks))
  return dq.astype(q.dtype), _unblock(dk, k), _unblock(dv, v), None, d_params


_attention.defvjp(_attention_fwd, _attention_bwd)


def _no_bias(params, q_positions, k_positions):
  del params, q_positions, k_positions
  return None


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, positions_BxT=None, bias_fn=None,
                        bias_params=(), *, block_size=128, scale=None):
  """Causal softmax(scale q k^T + bias_fn(bias_params, positions, positions)) v, in blocks.

  num_kv_heads K must divide num_heads N; query head n uses key/value head n // (N / K).
  positions_BxT (B may be 1; default 0..T-1) feed only the bias; scale defaults to 1/sqrt(H).
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
  scale = h ** -0.5 if scale is None else scale
  out = _attention(q, k, v, positions, bias_params, block, scale, bias_fn or _no_bias)
  return out.reshape(b, padded, n, h)[:, :t]
