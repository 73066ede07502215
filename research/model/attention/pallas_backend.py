"""The `pallas` backend of research.model.attention.core.attend: the fused FlashAttention-2 kernel
that JAX ships in Pallas for GPUs (jax.experimental.pallas.ops.gpu.attention.mha, compiled by
Triton; Dao, arXiv:2307.08691), forward and backward (its own custom VJP). On a CPU it runs in
Pallas' interpret mode: the same kernel program evaluated by XLA, exact and slow, which is how the
tests check it against `xla` without a GPU.

What the kernel expresses, and so what this backend runs: causal attention, optionally within
packed documents (its segment ids), with queries, keys and values of one width. A score
modification (a bias scheme, FoX's gates, CoPE), a sliding window, sinks and block-sparse
patterns are refused by name (core.refusals). The kernel reads one key/value head per query head,
so grouped-query attention repeats each key/value head for its query heads (G times the K/V
memory of the call; the gradients sum back over the repeats). Sequences are padded at the end to
the kernel's block multiple; causality hides the padding from every real query.
"""

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

# The kernel's defaults: 128-token blocks forward, 32 in the backward pass.
BLOCKS = pallas_attention.BlockSizes.get_default()


def _padded_length(length):
  """A length every block of BLOCKS divides (the kernel takes min(block, length) per block)."""
  if length <= BLOCKS.block_q:  # one forward block: a power of two the backward blocks divide
    return max(BLOCKS.block_q_dkv, 1 << (length - 1).bit_length())
  return -(-length // BLOCKS.block_q) * BLOCKS.block_q


def attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *, scale, segments_BxT=None, interpret=False):
  """softmax(scale q k^T, causal, within documents) v: [B, T, N, H] in q's dtype; `interpret`:
  in Pallas' interpret mode (on a CPU)."""
  b, t, n, h = q_BxTxNxH.shape
  group = n // k_BxTxKxH.shape[2]
  k_BxTxNxH, v_BxTxNxH = (jnp.repeat(x, group, axis=2) for x in (k_BxTxKxH, v_BxTxKxH))
  padded = _padded_length(t)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  segments = (None if segments_BxT is None else
              jnp.pad(segments_BxT.astype(jnp.int32), [(0, 0), (0, padded - t)], mode="edge"))
  out = pallas_attention.mha(pad(q_BxTxNxH), pad(k_BxTxNxH), pad(v_BxTxNxH), segments,
                             sm_scale=float(scale), causal=True, block_sizes=BLOCKS,
                             interpret=interpret)
  return out[:, :t]
