"""Retention, the token mixer of RetNet (Sun et al., arXiv:2307.08621, eqs. 5-8).

  parallel:    Retention(X) = (Q K^T / sqrt(d) * D) V,  D[n, m] = gamma^(n - m) for n >= m, else 0
  recurrent:   S_n = gamma S_{n-1} + k_n^T v_n,  o_n = q_n S_n / sqrt(d)
  chunkwise:   (eq. 7) inside a chunk of C tokens the parallel form, across chunks the state:
               o_n = (q_n k_m^T gamma^(n-m))_{m<=n in chunk} v + gamma^(n+1) q_n S_prev,
               S = gamma^C S_prev + sum_m gamma^(C-1-m) k_m^T v_m     (n, m within the chunk)
with one decay per head, gamma_h = 1 - 2^(-5 - h) (multi-scale retention). Training, evaluation
and decoding (any number of new tokens: prefill is one pass) all run the chunkwise form from a
state, so memory grows as [length, C] and never [length, length]; packed documents restart the
state at each segment start. The paper's GroupNorm and swish gate are left out: this is the mixer
alone, like the other entries of the registry. It is also the worked example of adding a variant
(the mixer example in docs/architecture.md).
"""

import jax
import jax.numpy as jnp
import numpy as np

from research import nn
from research.attention import base
from research.attention import masks
from research.positions import QK


def _chunk(log_gamma_N, carry, chunk):
  """One chunk of the chunkwise form; padding tokens (valid 0) neither decay nor add."""
  state_BxNxHxE, carried_segment_B = carry
  segments_BxC, valid_C, q, k, v = chunk
  same, sees_state, keeps_state, adds = masks.chunk_segments(segments_BxC, carried_segment_B)
  # A_n = sum of log decays of tokens 0..n of the chunk: gamma^(n - m) = exp(A_n - A_m).
  log_decay_CxN = jnp.cumsum(valid_C[:, None] * log_gamma_N[None, :], axis=0)
  within_NxCxC = jnp.exp(jnp.minimum(log_decay_CxN.T[:, :, None] - log_decay_CxN.T[:, None, :], 0))
  scores = jnp.where(same, jnp.einsum("bcnh,bsnh->bncs", q, k) * within_NxCxC, 0.0)
  from_state = jnp.einsum("bcnh,bnhe->bcne", q * sees_state, state_BxNxHxE)
  out = (jnp.einsum("bncs,bsne->bcne", scores, v)
         + jnp.exp(log_decay_CxN)[None, :, :, None] * from_state)
  to_end_CxN = jnp.exp(log_decay_CxN[-1][None, :] - log_decay_CxN)
  state_BxNxHxE = (jnp.exp(log_decay_CxN[-1])[None, :, None, None] * state_BxNxHxE * keeps_state
                   + jnp.einsum("bcnh,bcne->bnhe", k * adds * to_end_CxN[None, :, :, None], v))
  return (state_BxNxHxE, segments_BxC[:, -1]), out


def chunked_retention(q, k, v, gamma_N, state, *, chunk_size=64, segments=None):
  """Retention of q (already scaled by 1/sqrt(d)), k, v [B, L, N, H] from `state` [B, N, H, H]
  in chunks of chunk_size; segments [B, L] restart the state at each segment start (the state
  passed in belongs to the first token's segment). Returns (outputs [B, L, N, H], final state)."""
  b, length, n, h = q.shape
  chunk = min(chunk_size, length)
  padded = -(-length // chunk) * chunk
  num_chunks = padded // chunk

  def to_chunks(x):
    x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, num_chunks, chunk, *x.shape[2:]).swapaxes(0, 1)

  if segments is None:
    segments = jnp.zeros((b, length), jnp.int32)
  segments = jnp.pad(segments, [(0, 0), (0, padded - length)], mode="edge")
  valid = (jnp.arange(padded) < length).astype(jnp.float32).reshape(num_chunks, chunk)
  chunks = (segments.reshape(b, num_chunks, chunk).swapaxes(0, 1), valid,
            to_chunks(q), to_chunks(k), to_chunks(v))
  log_gamma = jnp.log(jnp.asarray(gamma_N, jnp.float32))
  body = jax.checkpoint(lambda carry, c: _chunk(log_gamma, carry, c))
  (state, _), out = jax.lax.scan(body, (state, segments[:, 0]), chunks)
  return out.swapaxes(0, 1).reshape(b, padded, n, h)[:, :length], state


class Retention(base.Mixer):
  hyperparameters = {"chunk_size": 64}
  position_hooks = frozenset({QK})

  @classmethod
  def validate(cls, settings, model_config):
    if settings.chunk_size < 1:
      raise ValueError(f"model.retention.chunk_size must be >= 1, got {settings.chunk_size}")

  def __init__(self, settings, model_config, position, *, rngs):
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    self.position, self.num_heads, self.head_dim = position, n, h
    self.chunk_size = int(settings.chunk_size)
    # A tuple, not an array: a constant of the architecture, not part of the module's state.
    self.gamma = tuple(float(g) for g in 1.0 - 2.0 ** (-5.0 - np.arange(n)))
    dtype = nn.compute_dtype(model_config)
    self.query, self.key, self.value = (
        base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype) for _ in range(3))
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype)

  def _mix(self, x_BxTxD, state, positions_BxT, segments_BxT=None):
    q, k, v = (f(x_BxTxD).astype(jnp.float32) for f in (self.query, self.key, self.value))
    q, k = self.position.queries(q, positions_BxT), self.position.keys(k, positions_BxT)
    y, state = chunked_retention(q / np.sqrt(self.head_dim), k, v, self.gamma, state,
                                 chunk_size=self.chunk_size, segments=segments_BxT)
    return self.out(y.astype(x_BxTxD.dtype)), state

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    # The decay counts tokens, not positions (which may be randomized or restart per document).
    return self._mix(x_BxLxD, self.init_cache(x_BxLxD.shape[0], 0), positions_BxL,
                     segments_BxL)[0]

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    h = self.head_dim
    return jnp.zeros((batch_size, self.num_heads, h, h), jnp.float32)

  def decode(self, x_BxTxD, state_BxNxHxH, index):
    return self._mix(x_BxTxD, state_BxNxHxH, base.new_positions(index, x_BxTxD.shape[1]))

  def mixing_flops_per_token(self, context_length):
    # Within a chunk: q k^T and scores @ v (2 FLOPs per multiply-add) over (C + 1) / 2 keys on
    # average, plus the decay; across chunks: q S and the state update.
    n, h, c = self.num_heads, self.head_dim, min(self.chunk_size, context_length)
    return 2 * 2 * n * h * (c + 1) / 2 + n * (c + 1) / 2 + 2 * 2 * n * h * h
