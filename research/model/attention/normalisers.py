"""What turns a query's row of attention logits into weights: the normaliser interface of the
attention core (research.model.attention.core.attend and probabilities, the blockwise backend
and the decode caches of research.model.attention.kv_cache).

A normaliser gives its weights in three forms, and the core does the rest (score_mod, masks,
windows, sinks, packed documents, the query context, grouped-query heads):
  weights(logits [.., T, S], visible)   materialised, float32, 0 where a key is not visible: the
                                        xla backend, `probabilities` (the analyses) and decoding
                                        against a cache (one row over the cache's parts)
  per tile                              the blockwise backend's online form: a row accumulator
                                        (tile_init, tile_visit, tile_finish) carried over the key
                                        tiles of a query block, and tile_grads, the weights and
                                        d logits of a tile in the backward pass, given what the
                                        forward pass kept per query (tile_finish's residual)
  blockwise_kernel()                    None, or a kernel of its own for the blockwise backend
  order_dependent                       whether the weights depend on the keys' order (then
                                        neither a sliding window's rolling cache, whose slots are
                                        out of order, nor the default blockwise tile order serve)

`Softmax` is the default: exp(z - lse), the online softmax of FlashAttention (a running max,
sum and output per query; the backward pass from the row log-sum-exp and delta = rowsum(dO O)).
`Pointwise` is any normaliser that weighs each key alone, w = f(z) (sigmoid attention, ReLU
attention): a new one is a subclass with `activation(z)` in the mixer's file; blockwise,
windows, sinks, documents and both decode caches come with it, and its gradient through the
tiles is autodiff of `activation`. Stick-breaking (research.model.attention.stick_breaking_kernel)
depends on the keys' order and brings its own blockwise kernel (nearest key block first).
"""

import dataclasses

import jax
import jax.numpy as jnp

# Logits of keys a tile does not see (research.model.attention.blockwise._MASKED).
MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class Normaliser:
  """The interface (see the module docstring); subclasses are frozen dataclasses, so that an
  instance is a static, hashable argument of the blockwise kernel."""
  name = "normaliser"
  order_dependent = False

  def weights(self, logits, visible):
    """float32 weights [.., T, S] of `logits` over the `visible` keys (both broadcast to
    [.., T, S]); 0 where a key is not visible."""
    raise NotImplementedError

  def keys_taking_weight(self, visible, q_index_T, k_index_S):
    """The keys that may take weight among the visible ones (stick-breaking drops the query's
    own key); `visible` by default."""
    del q_index_T, k_index_S
    return visible

  def blockwise_kernel(self):
    """A blockwise kernel of its own (stick-breaking's), a function of the arguments of
    research.model.attention.blockwise.blockwise; None: that kernel runs the per-tile form."""
    return None

  # The per-tile form: s [B, K, G, Q, S] float32 logits of one tile (MASKED where not seen),
  # v_j [B, K, S, V] its values; the carry and residual are per query of the block.

  def tile_init(self, rows_BxKxGxQ, width, dtype=jnp.float32):
    raise NotImplementedError

  def tile_visit(self, carry, s, v_j):
    raise NotImplementedError

  def tile_finish(self, carry):
    """(output [B, K, G, Q, V] float32, residual [B, K, G, Q] for tile_grads)."""
    raise NotImplementedError

  def tile_grads(self, s, residual_BxKxGxQ, dp, delta_BxKxGxQ):
    """(weights p, d logits) of a tile, given dp = dO . v_j [B, K, G, Q, S] and delta = rowsum(dO
    O) [B, K, G, Q]."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Softmax(Normaliser):
  """softmax_j(z_ij) over the visible keys: FlashAttention's online form per tile."""
  name = "softmax"

  def weights(self, logits, visible):
    logits = jnp.where(visible, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(logits, axis=-1)

  def tile_init(self, rows_BxKxGxQ, width, dtype=jnp.float32):
    return (jnp.full(rows_BxKxGxQ, MASKED, jnp.float32), jnp.zeros(rows_BxKxGxQ, jnp.float32),
            jnp.zeros(rows_BxKxGxQ + (width,), jnp.float32))

  def tile_visit(self, carry, s, v_j):
    # A row whose keys so far are all masked accumulates exp(0) = 1 terms; its first visible key
    # (its own, which every mask keeps) rescales them by exp(-1e30).
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v_j.dtype), v_j,
                    preferred_element_type=jnp.float32)
    return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

  def tile_finish(self, carry):
    m, l, acc = carry
    return acc / l[..., None], m + jnp.log(l)

  def tile_grads(self, s, residual_BxKxGxQ, dp, delta_BxKxGxQ):
    p = jnp.exp(s - residual_BxKxGxQ[..., None])
    return p, p * (dp - delta_BxKxGxQ[..., None])


@dataclasses.dataclass(frozen=True)
class Pointwise(Normaliser):
  """w_ij = activation(z_ij), each key weighed alone (no sum over the row): a subclass gives
  `activation`, a float32 function applied elementwise."""
  name = "pointwise"

  def activation(self, z):
    raise NotImplementedError

  def weights(self, logits, visible):
    return jnp.where(visible, self.activation(logits.astype(jnp.float32)), 0.0)

  def _seen(self, s):
    return s > MASKED / 2

  def tile_init(self, rows_BxKxGxQ, width, dtype=jnp.float32):
    return jnp.zeros(rows_BxKxGxQ + (width,), jnp.float32)

  def tile_visit(self, carry, s, v_j):
    p = jnp.where(self._seen(s), self.activation(s), 0.0)
    return carry + jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v_j.dtype), v_j,
                              preferred_element_type=jnp.float32)

  def tile_finish(self, carry):
    return carry, jnp.zeros(carry.shape[:-1], jnp.float32)

  def tile_grads(self, s, residual_BxKxGxQ, dp, delta_BxKxGxQ):
    del residual_BxKxGxQ, delta_BxKxGxQ
    p, pullback = jax.vjp(self.activation, s)
    seen = self._seen(s)
    return jnp.where(seen, p, 0.0), jnp.where(seen, pullback(dp)[0], 0.0)


SOFTMAX = Softmax()
