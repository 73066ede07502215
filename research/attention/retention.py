"""Retention, the token mixer of RetNet (Sun et al., arXiv:2307.08621, eqs. 5-8).

  parallel (training):   Retention(X) = (Q K^T / sqrt(d) * D) V,  D[n, m] = gamma^(n - m) for
                         n >= m and 0 otherwise
  recurrent (decoding):  S_n = gamma S_{n-1} + k_n^T v_n,  o_n = q_n S_n / sqrt(d)
with one decay per head, gamma_h = 1 - 2^(-5 - h) (multi-scale retention). The paper's GroupNorm
and swish gate are left out: this is the mixer alone, like the other entries of the registry.
It is also the worked example of adding a variant (the mixer example in docs/architecture.md).
"""

import jax
import jax.numpy as jnp
import numpy as np

from research import nn
from research.attention import base
from research.positions import QK


class Retention(base.Mixer):
  position_hooks = frozenset({QK})

  def __init__(self, settings, model_config, position, *, rngs):
    del settings  # no hyperparameters
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    self.position, self.num_heads, self.head_dim = position, n, h
    self.gamma = 1.0 - 2.0 ** (-5.0 - np.arange(n))
    dtype = nn.compute_dtype(model_config)
    self.query, self.key, self.value = (
        base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype) for _ in range(3))
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype)

  def _project(self, x_BxTxD, positions_BxT):
    q, k, v = (f(x_BxTxD).astype(jnp.float32) for f in (self.query, self.key, self.value))
    q, k = self.position.queries(q, positions_BxT), self.position.keys(k, positions_BxT)
    return q / np.sqrt(self.head_dim), k, v

  def __call__(self, x_BxLxD, positions_BxL):
    q, k, v = self._project(x_BxLxD, positions_BxL)
    index_L = jnp.arange(x_BxLxD.shape[1])  # the decay counts tokens, not positions
    distance_LxL = index_L[:, None] - index_L[None, :]
    decay_NxLxL = jnp.where(distance_LxL >= 0,
                            self.gamma[:, None, None] ** jnp.maximum(distance_LxL, 0), 0.0)
    scores = jnp.einsum("blnh,bsnh->bnls", q, k) * decay_NxLxL
    return self.out(jnp.einsum("bnls,bsnh->blnh", scores, v).astype(x_BxLxD.dtype))

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    h = self.head_dim
    return jnp.zeros((batch_size, self.num_heads, h, h), jnp.float32)

  def decode(self, x_BxTxD, state_BxNxHxH, index):
    q, k, v = self._project(x_BxTxD, base.new_positions(index, x_BxTxD.shape[1]))
    gamma_N = jnp.asarray(self.gamma, jnp.float32)

    def step(state, qkv):
      q_t, k_t, v_t = qkv
      state = gamma_N[None, :, None, None] * state + jnp.einsum("bnh,bne->bnhe", k_t, v_t)
      return state, jnp.einsum("bnh,bnhe->bne", q_t, state)

    state, y = jax.lax.scan(step, state_BxNxHxH, tuple(t.swapaxes(0, 1) for t in (q, k, v)))
    return self.out(y.swapaxes(0, 1).astype(x_BxTxD.dtype)), state

  def mixing_flops_per_token(self, context_length):
    # q k^T and scores @ v (2 FLOPs per multiply-add) plus the decay, over (context + 1) / 2
    # keys on average (causal).
    keys = (context_length + 1) / 2
    return 2 * 2 * self.num_heads * self.head_dim * keys + self.num_heads * keys
