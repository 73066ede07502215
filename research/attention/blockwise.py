"""Exact causal attention in blocks with an online softmax (FlashAttention, arXiv:2205.14135;
Rabe & Staats, arXiv:2112.05682), in pure JAX, with any score bias evaluated per tile.

For each block of queries, keys are visited block by block keeping a running max m, running sum
l and unnormalised output acc:
  s = scale * q k^T + bias(q inputs, k inputs),   m' = max(m, rowmax s),
  p = exp(s - m'),   l' = l exp(m - m') + rowsum p,   acc' = acc exp(m - m') + p v,   out = acc / l.
Key blocks whose every key is masked are skipped: those in the future, and with a sliding window
(research.attention.masks) those before the window that hold no sink, so time grows as
O(length x window). The mask is by token index, and by segment (packed documents) when given. The forward pass
keeps only out and the row log-sum-exp (O(length) memory); the custom VJP recomputes each
[block, block] tile, including its bias, so no [length, length] matrix is ever stored; the backward pass visits each tile once (one loop over
key blocks that also accumulates dQ), recomputing its logits and bias once. The bias
is a function `bias_fn(params, q_inputs, k_inputs) -> [B, N, Q, S]` (or None) of parameters (a
position scheme's) and of per-token inputs, a pytree of [B, T, ...] arrays cut into the tile's
query and key blocks: the positions, and any data-dependent per-token values (the Forgetting
Transformer's cumulative log forget gates). The backward pass also returns the gradients of the
parameters and of the floating-point inputs, the pullback of each tile's dlogits through
bias_fn. Grouped-query attention groups the query heads over the shared key/value heads (no
repeat of K or V in memory).
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
  """The logits of tile (i, j) and, for the backward pass, the pullback of its bias."""

  def __init__(self, q, k, inputs, segments, bias_fn, bias_params, block, scale, window, sinks):
    # q [B, K, G, T, H], k [B, K, T, H]: heads before length.
    self.q, self.k, self.inputs, self.segments = q, k, inputs, segments
    self.bias_fn, self.bias_params = bias_fn, bias_params
    self.block, self.scale, self.window, self.sinks = block, scale, window, sinks
    self.num_blocks = q.shape[3] // block
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
    """(bias [B', K, G, Q, S] or None, pullback from such a cotangent to (d params, d float
    inputs of query block i, d float inputs of key block j))."""
    b, kv_heads, group, _, _ = self.q.shape
    q_in = jax.tree.map(lambda x: _block(x, i, self.block), self.inputs)
    k_in = jax.tree.map(lambda x: _block(x, j, self.block), self.inputs)

    def bias_of(params, q_floats, k_floats):
      return self.bias_fn(params, _with_floats(q_in, q_floats), _with_floats(k_in, k_floats))

    bias, pullback = jax.vjp(bias_of, self.bias_params, _floats(q_in), _floats(k_in))
    if bias is None:
      return None, None
    rows = bias.shape[0]
    shape = (rows, kv_heads, group, self.block, self.block)

    def cotangents(dlogits_BxKxGxQxS):
      d = dlogits_BxKxGxQxS.sum(0, keepdims=True) if rows == 1 and b > 1 else dlogits_BxKxGxQxS
      return pullback(d.reshape(bias.shape))

    return bias.astype(jnp.float32).reshape(shape), cotangents

  def logits(self, q_i, i, j, bias):
    """Biased, causally masked logits of one tile, [B, K, G, Q, S], in float32."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_i, _block(self.k, j, self.block, axis=2),
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


def _forward(q, k, v, inputs, segments, bias_params, block, scale, bias_fn, window, sinks):
  """(out [B, T, K, G, H], row log-sum-exp [num_blocks, B, K, G, block]) of q [B, T, K, G, H]
  and k, v [B, T, K, H]."""
  num_blocks = q.shape[1] // block
  like = q
  q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
  tiles = _Tiles(q, k, inputs, segments, bias_fn, bias_params, block, scale, window, sinks)

  def query_block(i):
    q_i = _block(q, i, block, axis=3)
    b, kh, g, _, h = q_i.shape
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
      pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), _block(v, j, block, axis=2),
                      preferred_element_type=jnp.float32)
      return m_new, l, acc * correction[..., None] + pv

    init = (jnp.full((b, kh, g, block), _MASKED, jnp.float32),
            jnp.zeros((b, kh, g, block), jnp.float32),
            jnp.zeros((b, kh, g, block, h), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, count, visit, init)
    return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

  out_blocks, lse_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return _unblock(out_blocks, like), lse_blocks


_STATIC = (6, 7, 8, 9, 10)  # block, scale, bias_fn, window, sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _attention(q, k, v, inputs, segments, bias_params, block, scale, bias_fn, window, sinks):
  return _forward(q, k, v, inputs, segments, bias_params, block, scale, bias_fn, window,
                  sinks)[0]


def _attention_fwd(q, k, v, inputs, segments, bias_params, block, scale, bias_fn, window, sinks):
  out, lse = _forward(q, k, v, inputs, segments, bias_params, block, scale, bias_fn, window,
                      sinks)
  return out, (q, k, v, inputs, segments, bias_params, out, lse)


def _attention_bwd(block, scale, bias_fn, window, sinks, residuals, d_out):
  q_like, k_like, v_like, inputs, segments, bias_params, out, lse = residuals
  num_blocks = q_like.shape[1] // block
  q, k, v, d_out = (_heads_first(x) for x in (q_like, k_like, v_like, d_out))
  tiles = _Tiles(q, k, inputs, segments, bias_fn, bias_params, block, scale, window, sinks)
  # delta_i = rowsum(dO_i * O_i), [B, K, G, T]
  delta = jnp.einsum("bkgqh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

  def probabilities_and_dlogits(i, j, bias):
    q_i, do_i = _block(q, i, block, axis=3), _block(d_out, i, block, axis=3)
    p = jnp.exp(tiles.logits(q_i, i, j, bias) - lse[i][..., None])
    dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, _block(v, j, block, axis=2),
                    preferred_element_type=jnp.float32)
    delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
    return q_i, do_i, p, p * (dp - delta_i[..., None])

  def key_block(carry, j):
    """dK_j and dV_j sum over the query blocks i >= j that see key block j; each tile (i, j) also adds its share to dQ_i,
    to d(bias params) and to d(bias inputs) of blocks i and j, so every tile's logits and bias
    are recomputed once."""
    k_j = _block(k, j, block, axis=2)

    def visit(i, inner):
      dk, dv, dq, d_params, d_inputs = inner
      bias, cotangents = tiles.bias(i, j)
      q_i, do_i, p, ds = probabilities_and_dlogits(i, j, bias)
      dv = dv + jnp.einsum("bkgqs,bkgqh->bksh", p, do_i.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i.astype(jnp.float32)) * scale
      dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j.astype(jnp.float32)) * scale
      dq = _add_to_block(dq, dq_i, i, block, axis=3)
      if cotangents is not None:
        dp, dq_inputs, dk_inputs = cotangents(ds)
        d_params = jax.tree.map(jnp.add, d_params, dp)
        d_inputs = [_add_to_block(_add_to_block(d, dq_in, i, block), dk_in, j, block)
                    for d, dq_in, dk_in in zip(d_inputs, dq_inputs, dk_inputs)]
      return dk, dv, dq, d_params, d_inputs

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    dk, dv, *carry = jax.lax.fori_loop(j, tiles.last_query_block(j) + 1, visit,
                                       (zeros, zeros, *carry))
    return tuple(carry), (dk, dv)

  init = (jnp.zeros(q.shape, jnp.float32), jax.tree.map(jnp.zeros_like, bias_params),
          [jnp.zeros(x.shape, jnp.float32) for x in _floats(inputs)])
  (dq, d_params, d_inputs), (dk, dv) = jax.lax.scan(key_block, init, jnp.arange(num_blocks))
  d_inputs = _with_floats(inputs, [d.astype(x.dtype) for d, x in zip(d_inputs, _floats(inputs))],
                          integers=lambda x: None)
  return (_length_second(dq).astype(q.dtype), _unblock(dk, k_like), _unblock(dv, v_like),
          d_inputs, None, d_params)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _no_bias(params, q_inputs, k_inputs):
  del params, q_inputs, k_inputs
  return None


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, bias_inputs_BxT=None, bias_fn=None,
                        bias_params=(), *, block_size=128, scale=None, window=0, sinks=0,
                        segments_BxT=None):
  """softmax(scale q k^T + bias_fn(bias_params, inputs, inputs), visible) v, in blocks.

  visible: causal, within the last `window` tokens or one of the first `sinks` (window 0: all
  past tokens), and in the same segment when segments_BxT (packed documents) are given; see
  research.attention.masks. num_kv_heads K must divide num_heads N; query head n uses key/value
  head n // (N / K). bias_inputs_BxT feed only the bias: positions [B, T] (B may be 1; default
  0..T-1) or any pytree of [B, T, ...] arrays, differentiable where they are floating point;
  scale defaults to 1/sqrt(H).
  """
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  block = min(block_size, t)
  padded = -(-t // block) * block
  # Padding sits after every real position, so causality already hides it from real queries.
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  q = jnp.pad(q_BxTxNxH, pad).reshape(b, padded, kv_heads, n // kv_heads, h)
  k, v = jnp.pad(k_BxTxKxH, pad), jnp.pad(v_BxTxKxH, pad)
  if bias_inputs_BxT is None:
    bias_inputs_BxT = jnp.arange(t)[None]
  inputs = jax.tree.map(
      lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2), mode="edge"),
      bias_inputs_BxT)
  segments = (None if segments_BxT is None
              else jnp.pad(segments_BxT, [(0, 0), (0, padded - t)], mode="edge"))
  scale = h ** -0.5 if scale is None else scale
  out = _attention(q, k, v, inputs, segments, bias_params, block, scale, bias_fn or _no_bias,
                   int(window), int(sinks))
  return out.reshape(b, padded, n, h)[:, :t]
