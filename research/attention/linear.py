"""Causal linear attention (Katharopoulos et al., "Transformers are RNNs", arXiv:2006.16236).

  phi(x) = elu(x) + 1   (or relu(x))
  S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j),
  o_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps).
The position scheme's query/key hooks (RoPE, xPos, ...) act on phi(q) and phi(k) in the numerator
only, so the denominator stays positive (RoFormer, arXiv:2104.09864, eq. 19). A score bias has no
place in this form: linear attention honours the qk hook only.

Training uses the chunkwise-parallel form: within a chunk of C tokens a masked [C, C] matmul,
across chunks the running state (S, z), so nothing of size [batch, length, heads, d, d] is ever
built; each chunk is rematerialised in the backward pass. Decoding runs the same code on the new
tokens from the cached state (any number of them: prefill is one chunked pass). Packed
documents: the sums restart at each segment start (the intra-chunk mask keeps to the segment;
the carried state reaches only the tokens of the segment it was summed over). The feature map, the state and the denominator are float32: in
bf16, elu(x) + 1 cancels to 0 already at x = -8 and the denominator collapses.
"""

import jax
import jax.numpy as jnp

from research import nn
from research.attention import base
from research.attention import masks
from research.positions import QK


def elu_plus_one(x):
  """elu(x) + 1, written as exp(x) for x <= 0 so that it never cancels to 0 (1 - 1)."""
  return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


FEATURE_MAPS = {"elu": elu_plus_one, "relu": jax.nn.relu}
EPSILON = 1e-6


def _chunk(carry, chunk):
  """One chunk: outputs from the carried state plus the causal intra-chunk part.

  chunk = (segments [B, C], q, k, v) or, with a query/key transform, (..., q_rot, k_rot);
  [B, C, N, H] each, float32. carry = (S, z, the segment S and z were summed over [B]).
  """
  state_BxNxHxH, normalizer_BxNxH, carried_segment_B = carry
  segments_BxC, q, k, v = chunk[:4]
  q_rot, k_rot = chunk[4:] or (q, k)
  same, sees_state, keeps_state, adds = masks.chunk_segments(segments_BxC, carried_segment_B)
  scores = jnp.where(same, jnp.einsum("bcnh,bsnh->bncs", q_rot, k_rot), 0.0)
  numerator = (jnp.einsum("bncs,bsnh->bcnh", scores, v)
               + jnp.einsum("bcnh,bnhe->bcne", q_rot * sees_state, state_BxNxHxH))
  if q_rot is not q:  # rotated numerator, unrotated denominator
    scores = jnp.where(same, jnp.einsum("bcnh,bsnh->bncs", q, k), 0.0)
  denominator = (scores.sum(-1).transpose(0, 2, 1)
                 + jnp.einsum("bcnh,bnh->bcn", q * sees_state, normalizer_BxNxH))
  out = numerator / (denominator[..., None] + EPSILON)
  state_BxNxHxH = (state_BxNxHxH * keeps_state
                   + jnp.einsum("bsnh,bsne->bnhe", k_rot * adds, v))
  normalizer_BxNxH = normalizer_BxNxH * keeps_state[..., 0] + (k * adds).sum(1)
  return (state_BxNxHxH, normalizer_BxNxH, segments_BxC[:, -1]), out


def chunked_linear_attention(q, k, v, state, *, feature_map="elu", chunk_size=64,
                             transform_q=None, transform_k=None, segments=None):
  """Causal linear attention of q, k, v [B, L, N, H] from `state` = (S [B,N,H,H], z [B,N,H]).

  `transform_q(phi_q)` / `transform_k(phi_k)` apply the position scheme to the features of the
  numerator (RoPE rotations, xPos scaling); an identity transform costs nothing. `segments`
  [B, L] (packed documents, non-decreasing) restart the sums at each segment start; `state`
  belongs to the first token's segment. Returns (outputs [B, L, N, H] float32, final state).
  """
  b, length, n, h = q.shape
  phi = FEATURE_MAPS[feature_map]
  q, k, v = (phi(q.astype(jnp.float32)), phi(k.astype(jnp.float32)), v.astype(jnp.float32))
  chunk = min(chunk_size, length)
  padded = -(-length // chunk) * chunk

  def to_chunks(x):  # zero padding adds nothing to the state: phi(k) is masked out below
    x = jnp.pad(x, [(0, 0), (0, padded - length), (0, 0), (0, 0)])
    return x.reshape(b, padded // chunk, chunk, n, h).swapaxes(0, 1)

  valid = (jnp.arange(padded) < length).reshape(padded // chunk, 1, chunk, 1, 1)
  if segments is None:
    segments = jnp.zeros((b, length), jnp.int32)
  segments = jnp.pad(segments, [(0, 0), (0, padded - length)], mode="edge")
  chunks = (segments.reshape(b, padded // chunk, chunk).swapaxes(0, 1),
            to_chunks(q), to_chunks(k) * valid, to_chunks(v))
  q_rot = q if transform_q is None else transform_q(q)
  k_rot = k if transform_k is None else transform_k(k)
  if q_rot is not q or k_rot is not k:
    chunks += (to_chunks(q_rot), to_chunks(k_rot) * valid)
  carry = (*state, segments[:, 0])
  carry, out = jax.lax.scan(jax.checkpoint(_chunk), carry, chunks)
  return out.swapaxes(0, 1).reshape(b, padded, n, h)[:, :length], carry[:2]


class LinearAttention(base.Mixer):
  hyperparameters = {"feature_map": "elu", "chunk_size": 64}
  position_hooks = frozenset({QK})

  @classmethod
  def validate(cls, settings, model_config):
    if settings.feature_map not in FEATURE_MAPS:
      raise ValueError(f"unknown model.linear.feature_map {settings.feature_map!r}; "
                       f"valid: {', '.join(FEATURE_MAPS)}")
    if settings.chunk_size < 1:
      raise ValueError(f"model.linear.chunk_size must be >= 1, got {settings.chunk_size}")

  def __init__(self, settings, model_config, position, *, rngs):
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    self.position = position
    self.num_heads, self.head_dim = n, h
    self.feature_map = settings.feature_map
    self.chunk_size = int(settings.chunk_size)
    self.dtype = nn.compute_dtype(model_config)
    self.query, self.key, self.value = (
        base.head_projection(d, n, h, "heads", rngs=rngs, dtype=self.dtype) for _ in range(3))
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=self.dtype)

  def _mix(self, x_BxTxD, state, positions_BxT, segments_BxT=None):
    y, state = chunked_linear_attention(
        self.query(x_BxTxD), self.key(x_BxTxD), self.value(x_BxTxD), state,
        feature_map=self.feature_map, chunk_size=self.chunk_size,
        transform_q=lambda x: self.position.queries(x, positions_BxT),
        transform_k=lambda x: self.position.keys(x, positions_BxT), segments=segments_BxT)
    return self.out(y.astype(self.dtype)), state

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    return self._mix(x_BxLxD, self.init_cache(x_BxLxD.shape[0], 0), positions_BxL,
                     segments_BxL)[0]

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    n, h = self.num_heads, self.head_dim
    return (jnp.zeros((batch_size, n, h, h), jnp.float32), jnp.zeros((batch_size, n, h), jnp.float32))

  def decode(self, x_BxTxD, cache, index):
    return self._mix(x_BxTxD, cache, base.new_positions(index, x_BxTxD.shape[1]))

  def mixing_flops_per_token(self, context_length):
    n, h, c = self.num_heads, self.head_dim, min(self.chunk_size, context_length)
    intra = 2 * 2 * n * h * (c + 1) / 2  # masked scores and scores @ v within the chunk
    inter = 2 * 2 * n * h * h  # q @ S and the state update k v^T
    return intra + inter
