"""Multi-scale retention, the token mixer of RetNet (Sun et al., arXiv:2307.08621, eqs. 5-8).

Per head h, with q = X W_Q, k = X W_K / sqrt(d), v = X W_V (d the head dim) and the position
scheme's query/key hooks on q and k (RetNet rotates them: `rope` or `xpos` here, with RetNet's
angles by default, below):
  parallel:    Retention(X) = (Q K^T * D) V,  D[n, m] = gamma^(n - m) for n >= m, else 0
  recurrent:   S_n = gamma S_{n-1} + k_n^T v_n,  o_n = q_n S_n
  chunkwise:   (eq. 7) inside a chunk of C tokens the parallel form, across chunks the state:
               o_n = (q_n k_m^T gamma^(n-m))_{m<=n in chunk} v + gamma^(n+1) q_n S_prev,
               S = gamma^C S_prev + sum_m gamma^(C-1-m) k_m^T v_m     (n, m within the chunk)
  MSR(X) = (swish(X W_G) * GroupNorm(o_1, ..., o_N)) W_O                        (eq. 8)
with one decay per head, gamma_h = 1 - 2^(-5 - h), and GroupNorm one group per head: each head's
output is normalised on its own, as the authors' code (microsoft/torchscale, MultiScaleRetention)
does it, by an RMSNorm over the head dim without affine parameters, eps 1e-6 (their first
release used LayerNorm per head). The normalisation is what keeps a slow-decay head bounded: its
o_n sums up to 1 / (1 - gamma) terms (2^(5 + h)) and grows with the context, the normalised
output does not. Initialisation as theirs (microsoft/torchscale@
4d1e0e82e5adf86dd424f1463192635b73fc8efc, torchscale/component/multiscale_retention.py,
MultiScaleRetention.reset_parameters): W_Q, W_K, W_V, W_G Xavier-uniform with gain 2^-2.5, W_O
Xavier-uniform with gain 2^-1 (`xavier_uniform_(self.out_proj.weight, gain=2 ** -1)`: bound
2^-1 sqrt(6 / (d_model + d_model))), no biases.

Rotation (model.retention.rotary_frequencies; only with a rotary scheme, rope / xpos / prope):
"retnet" (the default) rotates pair i of each head by position * theta_i with
theta_i = base^(-i / (d/2 - 1)), i < d / 2 (torchscale@4d1e0e8, torchscale/architecture/
retnet.py, RetNetRelPos.__init__: angle = 1 / 10000 ** torch.linspace(0, 1, head_dim // 2),
repeat-interleaved over the pair), so the slowest pair turns at 1 / base; "rope" is RoPE's
theta_i = base^(-2i/d) (what this mixer used before the setting existed). The mixer hands it to
the scheme in its geometry (`position_geometry`); the pairing of channels, adjacent (2i, 2i+1),
is torchscale's `rotate_every_two` in both (research/model/positions/rope.py).

Deviations from torchscale, none of which changes the output beyond the norm's eps: their
parallel and chunkwise forms divide D's rows by sqrt(sum_m D[n, m]) and the scores by
max(|sum_m (Q K^T * D)[n, m]|, 1) (their recurrent form keeps a matching running scale), all
positive per (token, head) factors that the per-head norm removes (paper, section 2.2); here the
retention is computed unscaled in float32. W_V and W_G are d_model x d_model as in eq. 8 (their
configurations widen them, e.g. 768 -> 1280, and narrow the FFN instead).

Training, evaluation and decoding (any number of new tokens: prefill is one pass) all run the
chunkwise form from a state, so memory grows as [length, C] and never [length, length]; packed
documents restart the state at each segment start. This file is also the worked example of
adding a variant (the mixer example in docs/architecture.md).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import masks
from research.model.attention import modules
from research.model.positions import QK
from research.model.positions.rope import FREQUENCIES


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
  """Retention of q, k (scaled by the caller), v [B, L, N, H] from `state` [B, N, H, H]
  in chunks of chunk_size; segments [B, L] restart the state at each segment start (the state
  passed in belongs to the first token's segment). Returns (outputs [B, L, N, H], final state)."""
  b, length = q.shape[:2]
  chunk = min(chunk_size, length)
  if segments is None:
    segments = jnp.zeros((b, length), jnp.int32)
  time_major = lambda x: x.swapaxes(0, 1)  # noqa: E731  [B, Z, C, ...] -> [Z, B, C, ...]
  # Segment ids padded with the last one (padding joins the last segment); the padding tokens
  # neither decay nor add (valid 0).
  valid = chunked.split_chunks(jnp.ones((length,), jnp.float32), chunk, axis=0)
  chunks = (time_major(chunked.split_chunks(segments, chunk, mode="edge")), valid,
            *(time_major(chunked.split_chunks(x, chunk)) for x in (q, k, v)))
  log_gamma = jnp.log(jnp.asarray(gamma_N, jnp.float32))
  body = jax.checkpoint(lambda carry, c: _chunk(log_gamma, carry, c))
  (state, _), out = jax.lax.scan(body, (state, segments[:, 0]), chunks)
  return chunked.merge_chunks(time_major(out), length), state


NORM_EPSILON = 1e-6  # torchscale's layernorm_eps for RetNet


def _xavier_uniform(gain, in_axis, out_axis):
  return nnx.initializers.variance_scaling(gain ** 2, "fan_avg", "uniform", in_axis=in_axis,
                                           out_axis=out_axis)


class Retention(chunked.ChunkedRecurrentMixer):
  hyperparameters = {"chunk_size": 64, "rotary_frequencies": "retnet"}
  test_settings = {"chunk_size": 8}
  position_hooks = frozenset({QK})
  # The queries and keys rotate with the scheme (qk), so the mixer reads positions; the decay
  # counts tokens, not positions (which may be randomized or restart per document).
  reads_positions = True
  recurrent = False

  @classmethod
  def validate(cls, settings, model_config):
    if settings.chunk_size < 1:
      raise ValueError(f"model.retention.chunk_size must be >= 1, got {settings.chunk_size}")
    if settings.rotary_frequencies not in FREQUENCIES:
      raise ValueError(f"model.retention.rotary_frequencies={settings.rotary_frequencies!r}; "
                       f"valid: {', '.join(FREQUENCIES)}")

  @classmethod
  def position_geometry(cls, settings, model_config, layer_index=0):
    """The usual geometry, rotating at RetNet's frequencies unless the settings say RoPE's."""
    return dataclasses.replace(super().position_geometry(settings, model_config, layer_index),
                               rotary_frequencies=settings.rotary_frequencies)

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    self.position, self.num_heads, self.head_dim = position, n, h
    self.chunk_size = int(settings.chunk_size)
    # A tuple, not an array: a constant of the architecture, not part of the module's state.
    self.gamma = tuple(float(g) for g in 1.0 - 2.0 ** (-5.0 - np.arange(n)))
    self.dtype = dtype = nn.compute_dtype(model_config)
    init = _xavier_uniform(2 ** -2.5, in_axis=0, out_axis=(1, 2))
    self.query, self.key, self.value, self.gate = (
        base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype, init=init)
        for _ in range(4))
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype,
                                      init=_xavier_uniform(2 ** -1, in_axis=(0, 1), out_axis=2))

  def _mix(self, x_BxTxD, state, segments_BxT=None, *, positions_BxT):
    q, k, v = (f(x_BxTxD).astype(jnp.float32) for f in (self.query, self.key, self.value))
    q = self.position.queries(q, positions_BxT)
    k = self.position.keys(k / np.sqrt(self.head_dim), positions_BxT)
    y_BxTxNxH, state = chunked_retention(q, k, v, self.gamma, state, chunk_size=self.chunk_size,
                                         segments=segments_BxT)
    # swish(X W_G) * GroupNorm(o): each head RMS-normalised, no affine parameters.
    gated = modules.gated_rms_norm(y_BxTxNxH, self.gate(x_BxTxD), eps=NORM_EPSILON,
                                   dtype=self.dtype)
    return self.out(gated), state

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    h = self.head_dim
    return jnp.zeros((batch_size, self.num_heads, h, h), jnp.float32)

  def mixing_flops_per_token(self, context_length):
    # Within a chunk: q k^T and scores @ v (2 FLOPs per multiply-add) over (C + 1) / 2 keys on
    # average, plus the decay; across chunks: q S and the state update; the per-head norm
    # (square, sum, scale) and the swish gate (about 5 per element).
    n, h, c = self.num_heads, self.head_dim, min(self.chunk_size, context_length)
    return 2 * 2 * n * h * (c + 1) / 2 + n * (c + 1) / 2 + 2 * 2 * n * h * h + 8 * n * h
