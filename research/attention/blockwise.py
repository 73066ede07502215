"""Exact causal attention in blocks with an online softmax (FlashAttention, arXiv:2205.14135;
Rabe & Staats, arXiv:2112.05682), in pure JAX.

For each block of queries, keys are visited block by block keeping a running max m, running sum
l and unnormalised output acc:
  s = scale * q k^T + bias,   m' = max(m, rowmax s),   p = exp(s - m'),
  l' = l exp(m - m') + rowsum p,   acc' = acc exp(m - m') + p v,   out = acc / l.
Key blocks entirely in the future are skipped. The forward pass keeps only out and the row
log-sum-exp (O(length) memory); the custom VJP recomputes each [block, block] tile, so no
[length, length] matrix is ever stored. ALiBi biases, -slope_h (i - j), are computed per tile
from positions. Grouped-query attention groups the query heads over the shared key/value heads
(no repeat of K or V in memory).
"""

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30


def _tile_logits(q_BxQxKxGxH, k_BxSxKxH, slopes_KxG, q_start, k_start, scale):
  """Biased, causally masked logits of one tile, [B, K, G, Q, S], in float32."""
  s = jnp.einsum("bqkgh,bskh->bkgqs", q_BxQxKxGxH, k_BxSxKxH,
                 preferred_element_type=jnp.float32) * scale
  q_pos = q_start + jnp.arange(q_BxQxKxGxH.shape[1])
  k_pos = k_start + jnp.arange(k_BxSxKxH.shape[1])
  distance_QxS = (q_pos[:, None] - k_pos[None, :]).astype(jnp.float32)
  s = s - slopes_KxG[None, :, :, None, None] * distance_QxS
  return jnp.where(distance_QxS >= 0, s, _MASKED)


def _block(x, index, size):
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _unblock(blocks, like):
  """[num_blocks, B, block, ...] -> like's [B, num_blocks * block, ...] and dtype."""
  return blocks.swapaxes(0, 1).reshape(like.shape).astype(like.dtype)


def _forward(q, k, v, slopes, block, scale):
  num_blocks = q.shape[1] // block

  def query_block(i):
    q_i = _block(q, i, block)
    b, _, kh, g, h = q_i.shape

    def visit(j, carry):
      m, l, acc = carry
      s = _tile_logits(q_i, _block(k, j, block), slopes, i * block, j * block, scale)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, slopes, block, scale):
  return _forward(q, k, v, slopes, block, scale)[0]


def _attention_fwd(q, k, v, slopes, block, scale):
  out, lse = _forward(q, k, v, slopes, block, scale)
  return out, (q, k, v, slopes, out, lse)


def _attention_bwd(block, scale, residuals, d_out):
  q, k, v, slopes, out, lse = residuals
  num_blocks = q.shape[1] // block
  # delta_i = rowsum(dO_i * O_i), [B, K, G, T]
  delta = jnp.einsum("bqkgh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def probabilities_and_dlogits(i, j, k_j, v_j):
    q_i, do_i = _block(q, i, block), _block(d_out, i, block)
    s = _tile_logits(q_i, k_j, slopes, i * block, j * block, scale)
    p = jnp.exp(s - lse[i][..., None])
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
    delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
    return q_i, do_i, p, p * (dp - delta_i[..., None])

  def key_block(j):  # dK_j, dV_j sum over query blocks i >= j
    k_j, v_j = _block(k, j, block), _block(v, j, block)

    def visit(i, carry):
      dk, dv = carry
      q_i, do_i, p, ds = probabilities_and_dlogits(i, j, k_j, v_j)
      dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p, do_i.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, q_i.astype(jnp.float32)) * scale
      return dk, dv

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    return jax.lax.fori_loop(j, num_blocks, visit, (zeros, zeros))

  def query_block(i):  # dQ_i sums over key blocks j <= i
    def visit(j, dq):
      k_j = _block(k, j, block)
      _, _, _, ds = probabilities_and_dlogits(i, j, k_j, _block(v, j, block))
      return dq + jnp.einsum("bkgqs,bskh->bqkgh", ds, k_j.astype(jnp.float32)) * scale

    return jax.lax.fori_loop(0, i + 1, visit, jnp.zeros(_block(q, i, block).shape, jnp.float32))

  dk, dv = jax.lax.map(key_block, jnp.arange(num_blocks))
  dq = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(dq, q), _unblock(dk, k), _unblock(dv, v), jnp.zeros_like(slopes)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, slopes_N=None, *, block_size=128):
  """Causal softmax(q k^T / sqrt(H) - slope (i - j)) v over positions 0..T-1, in blocks.

  num_kv_heads K must divide num_heads N; query head n uses key/value head n // (N / K).
  """
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  block = min(block_size, t)
  padded = -(-t // block) * block
  # Padding sits after every real position, so causality already hides it from real queries.
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  q = jnp.pad(q_BxTxNxH, pad).reshape(b, padded, kv_heads, n // kv_heads, h)
  k, v = jnp.pad(k_BxTxKxH, pad), jnp.pad(v_BxTxKxH, pad)
  if slopes_N is None:
    slopes_N = jnp.zeros((n,), jnp.float32)
  slopes = jnp.asarray(slopes_N, jnp.float32).reshape(kv_heads, n // kv_heads)
  out = _attention(q, k, v, slopes, block, 1.0 / h ** 0.5)
  return out.reshape(b, padded, n, h)[:, :t]
