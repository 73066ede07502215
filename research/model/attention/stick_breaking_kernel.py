"""Stick-breaking attention's normaliser (Tan, Yang, Courville, Panda & Shen, arXiv:2410.17980):
the weights that research.model.attention.core.attend and core.probabilities compute with
normaliser="stickbreaking", materialised and in blocks.

For query i and its visible keys j (j < i; j <= i with attend_current), with z_ij the score
(scale q_i . k_j, after the core's score_mod):
  beta_ij = sigmoid(z_ij),   A_ij = beta_ij prod_{j < l, l visible} (1 - beta_il)
  log A_ij = log sigmoid(z_ij) - sum_{l > j, l visible} softplus(z_il)
  o_i = sum_j A_ij v_j,   1 - sum_j A_ij = prod_j (1 - beta_ij)  (the weight left over)
The nearest key breaks the stick first: each key takes the fraction beta of what the keys between
it and the query left. log A <= 0, so no running maximum is needed. Keys that are not visible
(causality, another document of a packed row, a block-sparse pattern) take neither weight nor a
share of the softplus sum. The weights do not sum to 1; the remainder is the caller's
(research/model/attention/stickbreaking.py).

Forms:
  materialised  `weights`: [.., T, S] float32 from the logits and the visible keys, a reverse
                cumulative sum along the keys (the core's xla backend and `probabilities`; the
                decode path over a KV cache).
  blockwise     `blockwise_attention`: per query block, the key blocks of MaskSpec.schedule from
                the diagonal backwards (nearest first), carrying per query the softplus sum of
                the keys already visited and the output; each tile's logits, mask and score
                modification are research.model.attention.blockwise's (_Tiles), with the query's own
                key masked unless attend_current. A custom VJP keeps only q, k, v and the output
                (O(length) memory) and recomputes each tile in the backward pass, again nearest
                first per query block, with
                  g_ij = A_ij (do_i . v_j),   dz_ij = g_ij - beta_ij (delta_i - sum_{l > j} g_il)
                where delta_i = do_i . o_i = sum_j g_ij; dK and dV are added into their blocks.

Checked against the authors' code, shawntan/stickbreaking-attention@3147a38:
  * stickbreaking_attention/sb_ref.py, `stickbreaking` (their float32 reference): log sigmoid(z)
    + sum over the later visible keys of log sigmoid(-z) (= -softplus(z)) via a strictly lower
    triangular matrix, masked keys at log weight -1e5 and log(1 - beta) 0, weights exp(.), and
    the remainder 1 - sum A; the same here, masked keys at logit -1e30 (blockwise) or selected
    out (materialised), the reverse sum a cumulative sum.
  * stickbreaking_attention/sb_attn/__init__.py, `sb_attn`: inv_temp defaults to 1/sqrt(head
    dim) (the core's default scale); attend_current False by default (the query's own key is not
    visible: the first token of a document has no keys and keeps the whole stick).
  * stickbreaking_attention/sb_varlen/sb_varlen_fwd.py, `_forward_one_row` / `compute_block`:
    key blocks from the diagonal backwards carrying the sum of log(1 - beta) (`neg_log_acc`),
    the in-tile reverse sum with a triangular matrix (here a cumulative sum), remainder
    exp(neg_log_acc); base-2 logarithms there, natural ones here (the same weights).
  * sb_varlen_bwd.py: their backward visits key blocks from the start towards the diagonal,
    subtracting each tile's log(1 - beta) from the forward total, and takes dz = g - beta *
    (inclusive prefix sum of g); here nearest first with the forward's exact running sum and
    the same prefix as delta_i - (suffix of g). Their varlen kernels are packed documents with
    cu_seqlens; here segment ids, which mask keys of other documents per tile.
Sliding windows and sinks are refused (`resolve`): the stick runs over every earlier key.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from research.model.attention import blockwise as blockwise_lib
from research.model.attention import masks
from research.model.attention import normalisers

NAME = "stickbreaking"


@dataclasses.dataclass(frozen=True)
class StickBreaking(normalisers.Normaliser):
  """The stick-breaking normaliser (research.model.attention.normalisers' interface, with a
  blockwise kernel of its own); attend_current: the query's own key is visible (breaks the
  stick first), as the authors' kernels' attend_current=True."""
  attend_current: bool = False
  name = "stick-breaking"
  order_dependent = True  # the nearest key breaks the stick first

  def weights(self, logits, visible):
    return weights(logits, visible)

  def keys_taking_weight(self, visible, q_index_T, k_index_S):
    return visible_keys(visible, q_index_T, k_index_S, self.attend_current)

  def blockwise_kernel(self):
    def kernel(q, k, v, inputs, score_mod, score_params, *, block_size, scale, mask,
               segments_BxT=None, other_queries=None):
      del other_queries  # no window: no requeried pairs
      return blockwise_attention(q, k, v, inputs, score_mod, score_params,
                                 block_size=block_size, scale=scale, mask=mask,
                                 segments_BxT=segments_BxT, attend_current=self.attend_current)
    return kernel


def visible_keys(visible, q_index_T, k_index_S, attend_current):
  """`visible` ([.., T, S] bool) without each query's own key (and any key at or after the
  query's index) unless attend_current."""
  if attend_current:
    return visible
  return visible & (k_index_S[None, :] < q_index_T[:, None])


def _exclusive_reverse_cumsum(x):
  """sum over the later entries of the last axis, x[..., l] for l > j."""
  inclusive = jax.lax.cumsum(x, axis=x.ndim - 1, reverse=True)
  return jnp.concatenate([inclusive[..., 1:], jnp.zeros_like(inclusive[..., :1])], axis=-1)


def weights(logits, visible):
  """The stick-breaking weights A [.., T, S] float32 of the logits over the visible keys (both
  broadcastable to [.., T, S]); 0 where a key is not visible."""
  z = jnp.where(visible, logits.astype(jnp.float32), 0.0)
  softplus = jnp.where(visible, jax.nn.softplus(z), 0.0)
  log_a = jax.nn.log_sigmoid(z) - _exclusive_reverse_cumsum(softplus)
  return jnp.where(visible, jnp.exp(log_a), 0.0)


# Blockwise.

def _tile(tiles, i, j, attend_current, with_pullback=False):
  """Tile (i, j)'s modified, masked logits [B, K, G, Q, S] (masked: -1e30, whose softplus and
  weight are 0) and their pullback (blockwise._Tiles.logits), the own key masked unless
  attend_current."""
  s, pullback = tiles.logits(i, j, with_pullback=with_pullback)
  if not attend_current:
    index = jnp.arange(tiles.block)
    own = (i == j) & (index[:, None] == index[None, :])
    s = jnp.where(own, blockwise_lib._MASKED, s)
  return s, pullback


def _tile_weights(s, nearer_BxKxGxQ):
  """(A of a tile, its softplus row sums) given the softplus sum of the nearer keys of earlier
  (nearer) tiles."""
  softplus = jax.nn.softplus(s)
  log_a = (jax.nn.log_sigmoid(s) - _exclusive_reverse_cumsum(softplus)
           - nearer_BxKxGxQ[..., None])
  return jnp.exp(log_a), softplus.sum(-1)


def _forward(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask,
             attend_current):
  """out [B, T, K, G, V] of q [B, T, K, G, H], k [B, T, K, H], v [B, T, K, V]."""
  num_blocks = q.shape[1] // block
  like = q
  q, k, v = (blockwise_lib._heads_first(x) for x in (q, k, v))
  tiles = blockwise_lib._Tiles(q, k, inputs, segments, score_mod, score_params, block, scale,
                               mask)
  b, kv_heads, group = q.shape[:3]

  def query_block(i):
    count, key_block, _ = tiles.key_blocks(i)

    def visit(c, carry):
      acc, nearer = carry
      j = key_block(count - 1 - c)  # the diagonal first, then backwards
      a, softplus_sum = _tile_weights(_tile(tiles, i, j, attend_current)[0], nearer)
      v_j = blockwise_lib._block(v, j, block, axis=2)
      acc = acc + jnp.einsum("bkgqs,bksh->bkgqh", a.astype(v.dtype), v_j,
                             preferred_element_type=jnp.float32)
      return acc, nearer + softplus_sum

    init = (jnp.zeros((b, kv_heads, group, block, v.shape[-1]), jnp.float32),
            jnp.zeros((b, kv_heads, group, block), jnp.float32))
    return jax.lax.fori_loop(0, count, visit, init)[0]

  out_blocks = jax.lax.map(query_block, jnp.arange(num_blocks))
  return blockwise_lib._unblock(out_blocks, like.astype(v.dtype))


_STATIC = (6, 7, 8, 9, 10)  # block, scale, score_mod, mask, attend_current


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _attention(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask,
               attend_current):
  return _forward(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask,
                  attend_current)


def _attention_fwd(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask,
                   attend_current):
  out = _forward(q, k, v, inputs, segments, score_params, block, scale, score_mod, mask,
                 attend_current)
  return out, (q, k, v, inputs, segments, score_params, out)


def _attention_bwd(block, scale, score_mod, mask, attend_current, residuals, d_out):
  q_like, k_like, v_like, inputs, segments, score_params, out = residuals
  num_blocks = q_like.shape[1] // block
  q, k, v, d_out = (blockwise_lib._heads_first(x) for x in (q_like, k_like, v_like, d_out))
  tiles = blockwise_lib._Tiles(q, k, inputs, segments, score_mod, score_params, block, scale,
                               mask)
  # delta_i = do_i . o_i = sum_j g_ij, [B, K, G, T]
  delta = jnp.einsum("bkgqh,bqkgh->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
  cut = lambda x, index, axis: blockwise_lib._block(x, index, block, axis=axis)  # noqa: E731

  def query_block(carry, i):
    """dQ of query block i; its tiles add to dK, dV, d(score params) and d(score inputs)."""
    count, key_block, _ = tiles.key_blocks(i)
    q_i, do_i = cut(q, i, 3), cut(d_out, i, 3)
    delta_i = cut(delta, i, 3)

    def visit(c, inner):
      dq_i, dk, dv, d_params, d_inputs, nearer, nearer_g = inner
      j = key_block(count - 1 - c)
      s, pullback = _tile(tiles, i, j, attend_current, with_pullback=True)
      a, softplus_sum = _tile_weights(s, nearer)
      k_j, v_j = cut(k, j, 2), cut(v, j, 2)
      g = a * jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
      # sum_{l <= j} g_il (j and the keys farther than it): delta minus the nearer keys'.
      up_to_j = delta_i[..., None] - _exclusive_reverse_cumsum(g) - nearer_g[..., None]
      ds = g - jax.nn.sigmoid(s) * up_to_j
      if pullback is not None:
        ds, _, dp_params, dq_inputs, _, dk_inputs = pullback(ds)
        d_params = jax.tree.map(jnp.add, d_params, dp_params)
        d_inputs = [blockwise_lib._add_to_block(blockwise_lib._add_to_block(d, dq_in, i, block),
                                                dk_in, j, block)
                    for d, dq_in, dk_in in zip(d_inputs, dq_inputs, dk_inputs)]
      dv_j = jnp.einsum("bkgqs,bkgqh->bksh", a, do_i.astype(jnp.float32))
      dk_j = jnp.einsum("bkgqs,bkgqh->bksh", ds, q_i.astype(jnp.float32)) * scale
      dq_i = dq_i + jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j.astype(jnp.float32)) * scale
      dk = blockwise_lib._add_to_block(dk, dk_j, j, block, axis=2)
      dv = blockwise_lib._add_to_block(dv, dv_j, j, block, axis=2)
      return dq_i, dk, dv, d_params, d_inputs, nearer + softplus_sum, nearer_g + g.sum(-1)

    rows = delta_i.shape
    dq_i, *carry, _, _ = jax.lax.fori_loop(
        0, count, visit, (jnp.zeros(q_i.shape, jnp.float32), *carry,
                          jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.float32)))
    return tuple(carry), dq_i

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32),
          jax.tree.map(jnp.zeros_like, score_params),
          [jnp.zeros(x.shape, jnp.float32) for x in blockwise_lib._floats(inputs)])
  (dk, dv, d_params, d_inputs), dq_blocks = jax.lax.scan(query_block, init,
                                                         jnp.arange(num_blocks))
  d_inputs = blockwise_lib._with_floats(
      inputs, [d.astype(x.dtype) for d, x in zip(d_inputs, blockwise_lib._floats(inputs))],
      integers=lambda x: None)
  return (blockwise_lib._unblock(dq_blocks, q_like),
          blockwise_lib._length_second(dk).astype(k_like.dtype),
          blockwise_lib._length_second(dv).astype(v_like.dtype), d_inputs, None, d_params)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, inputs, score_mod, score_params, *,
                        block_size, scale, mask=masks.CAUSAL, segments_BxT=None,
                        attend_current=False):
  """sum_j A_ij v_j [B, T, N, V] of a sequence to itself, in blocks of block_size (see the
  module docstring; the arguments as research.model.attention.core.attend's)."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxTxKxH.shape[2]
  block = min(block_size, t)
  padded = -(-t // block) * block
  # Padding follows every real token: causality hides it from the real queries.
  pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
  q = jnp.pad(q_BxTxNxH, pad).reshape(b, padded, kv_heads, n // kv_heads, h)
  k, v = jnp.pad(k_BxTxKxH, pad), jnp.pad(v_BxTxKxV, pad)
  inputs = jax.tree.map(
      lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2), mode="edge"),
      inputs)
  segments = (None if segments_BxT is None
              else jnp.pad(segments_BxT, [(0, 0), (0, padded - t)], mode="edge"))
  out = _attention(q, k, v, inputs, segments, score_params, block, float(scale), score_mod, mask,
                   bool(attend_current))
  return out.reshape(b, padded, n, v.shape[-1])[:, :t]
