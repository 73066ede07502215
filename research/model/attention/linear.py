"""Causal linear attention (Katharopoulos et al., "Transformers are RNNs", arXiv:2006.16236).

  phi(x) = elu(x) + 1   (or relu(x))
  S_i = sum_{j<=i} phi(k_j) v_j^T,   z_i = sum_{j<=i} phi(k_j),
  o_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps).
The position scheme's query/key hooks (RoPE, xPos, ...) act on phi(q) and phi(k) in the numerator
only, so the denominator stays positive (RoFormer, arXiv:2104.09864, eq. 19). A score bias has no
place in this form: linear attention honours the qk hook only.

Training uses the chunkwise-parallel form: within a chunk of C tokens a masked [C, C] matmul,
across chunks the running state (S, z), so nothing of size [batch, length, heads, d, d] is ever
built; every chunk is computed at once (batched matmuls, and a scan of the small state alone
for the states entering the chunks), which keeps all cores busy. Decoding runs the same code on
the new tokens from the cached state (any number of them: prefill is one chunked pass). Packed
documents: the sums restart at each segment start (the intra-chunk mask keeps to the segment;
the carried state reaches only the tokens of the segment it was summed over). The feature map, the state and the denominator are float32: in
bf16, elu(x) + 1 cancels to 0 already at x = -8 and the denominator collapses.
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import masks
from research.model.positions import QK


def elu_plus_one(x):
  """elu(x) + 1, written as exp(x) for x <= 0 so that it never cancels to 0 (1 - 1)."""
  return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


FEATURE_MAPS = {"elu": elu_plus_one, "relu": jax.nn.relu}
EPSILON = 1e-6


def chunked_linear_attention(q, k, v, state, *, feature_map="elu", chunk_size=64,
                             transform_q=None, transform_k=None, segments=None):
  """Causal linear attention of q, k, v [B, L, N, H] from `state` = (S [B,N,H,H], z [B,N,H]).

  `transform_q(phi_q)` / `transform_k(phi_k)` apply the position scheme to the features of the
  numerator (RoPE rotations, xPos scaling); an identity transform costs nothing. `segments`
  [B, L] (packed documents, non-decreasing) restart the sums at each segment start; `state`
  belongs to the first token's segment. Returns (outputs [B, L, N, H] float32, final state).

  All chunks are computed at once (batched matmuls over the chunk axis z): the masked intra-chunk
  part, each chunk's additions to the state (dS_z = sum_s phi(k_s) v_s^T over the chunk's last
  segment), the states entering the chunks (a scan over chunks of the state alone), and the
  outputs read from those states. Memory is linear in length: [L, C] scores and one [N, H, H]
  state per chunk.
  """
  b, length, n, h = q.shape
  phi = FEATURE_MAPS[feature_map]
  q, k, v = (phi(q.astype(jnp.float32)), phi(k.astype(jnp.float32)), v.astype(jnp.float32))
  q_rot = q if transform_q is None else transform_q(q)
  k_rot = k if transform_k is None else transform_k(k)
  rotated = q_rot is not q or k_rot is not k
  chunk = min(chunk_size, length)
  padded = chunked.num_chunks(length, chunk) * chunk

  def to_chunks(x):  # [B, L, N, H] -> [B, N, Z, C, H] (heads and chunks before tokens)
    return chunked.split_chunks(x, chunk).transpose(0, 3, 1, 2, 4)  # padding adds nothing

  same, sees_state, keeps, adds = masks.all_chunk_segments(segments, padded, chunk, b)
  same = same[:, None]  # [B, 1, Z, C, C]
  sees_state, adds = sees_state[:, None, :, :, None], adds[:, None, :, :, None]  # [B, 1, Z, C, 1]
  q_c, k_c, v_c = to_chunks(q), to_chunks(k), to_chunks(v)
  q_rot_c, k_rot_c = (to_chunks(q_rot), to_chunks(k_rot)) if rotated else (q_c, k_c)

  keeps = keeps[:, None, :, None].astype(jnp.float32)  # [B, 1, Z, 1]: the same for every head
  state_in, state_out = base.states_entering_chunks(
      state[0], keeps[..., None], jnp.einsum("bnzsh,bnzse->bnzhe", k_rot_c * adds, v_c), axis=2)
  normalizer_in, normalizer_out = base.states_entering_chunks(state[1], keeps,
                                                              (k_c * adds).sum(3), axis=2)

  scores = jnp.where(same, jnp.einsum("bnzch,bnzsh->bnzcs", q_rot_c, k_rot_c), 0.0)
  numerator = (jnp.einsum("bnzcs,bnzsh->bnzch", scores, v_c)
               + jnp.einsum("bnzch,bnzhe->bnzce", q_rot_c * sees_state, state_in))
  if rotated:  # rotated numerator, unrotated denominator
    scores = jnp.where(same, jnp.einsum("bnzch,bnzsh->bnzcs", q_c, k_c), 0.0)
  denominator = (scores.sum(-1)
                 + jnp.einsum("bnzch,bnzh->bnzc", q_c * sees_state, normalizer_in))
  out = numerator / (denominator[..., None] + EPSILON)  # [B, N, Z, C, H]
  return chunked.merge_chunks(out.transpose(0, 2, 3, 1, 4), length), (state_out, normalizer_out)


class LinearAttention(chunked.ChunkedRecurrentMixer):
  hyperparameters = {"feature_map": "elu", "chunk_size": 64}
  test_settings = {"chunk_size": 8}
  position_hooks = frozenset({QK})
  reads_positions = True  # phi(q) and phi(k) rotate with the scheme (qk)
  recurrent = False

  @classmethod
  def validate(cls, settings, model_config):
    if settings.feature_map not in FEATURE_MAPS:
      raise ValueError(f"unknown model.linear.feature_map {settings.feature_map!r}; "
                       f"valid: {', '.join(FEATURE_MAPS)}")
    if settings.chunk_size < 1:
      raise ValueError(f"model.linear.chunk_size must be >= 1, got {settings.chunk_size}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
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

  def _mix(self, x_BxTxD, state, segments_BxT=None, *, positions_BxT):
    y, state = chunked_linear_attention(
        self.query(x_BxTxD), self.key(x_BxTxD), self.value(x_BxTxD), state,
        feature_map=self.feature_map, chunk_size=self.chunk_size,
        transform_q=lambda x: self.position.queries(x, positions_BxT),
        transform_k=lambda x: self.position.keys(x, positions_BxT), segments=segments_BxT)
    return self.out(y.astype(self.dtype)), state

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    n, h = self.num_heads, self.head_dim
    return (jnp.zeros((batch_size, n, h, h), jnp.float32),
            jnp.zeros((batch_size, n, h), jnp.float32))

  def mixing_flops_per_token(self, context_length):
    n, h, c = self.num_heads, self.head_dim, min(self.chunk_size, context_length)
    intra = 2 * 2 * n * h * (c + 1) / 2  # masked scores and scores @ v within the chunk
    inter = 2 * 2 * n * h * h  # q @ S and the state update k v^T
    return intra + inter
