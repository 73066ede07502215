"""The `splash` backend of research.model.attention.core.attend: the TPU's block-sparse
FlashAttention kernel that JAX ships in Pallas (Mosaic), Splash attention
(jax.experimental.pallas.ops.tpu.splash_attention), forward and backward (its own custom VJP);
on a CPU it runs in Pallas' interpret mode, the same kernel program evaluated by XLA, which is how
the tests check it against `xla` without a TPU.

The core's mask spec (research.model.attention.masks.MaskSpec) maps onto Splash's masks, which
the kernel reads per (query block, key block) to skip the blocks nothing in sees:

  causal                      CausalMask
  sliding window W            LocalMask, window (W - 1, 0): i - W < j <= i
  window + S sinks, or a      NumpyMask of MaskSpec.visible on the padded length (a dense
  block-sparse keep(i, j)     [T, T] bool, built once at trace time)
  packed documents            Splash's SegmentIds, and-ed with the mask above

What it cannot express is refused by name (core.refusals): a score modification (a bias scheme,
gates, CoPE: Splash takes none), sinks in packed documents (the sinks are each document's first
tokens, which a static mask does not know), StreamingLLM's sink queries, and half-precision
inputs under a process-wide float32 matmul precision (Mosaic refuses the kernel: "Bad lhs
type"). Grouped-query
attention is native (query head n reads key/value head n // (N / K)). Sequences are padded at the
end to a multiple of 128 tokens (the kernel's lane width); causality hides the padding from every
real query, and each padded query sees at least itself.

Inside a mesh of several devices the kernel runs per device under jax.shard_map: the batch over
the data axes and the heads over `tensor` where they divide (the kernel is a custom call that
the partitioner cannot split).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec


LANES = 128  # Splash's key blocks are multiples of the TPU's 128 lanes


def refusals(*, score_mod, mask, segments, other_queries, dtype=None):
  """Why splash cannot run a call with these properties ([] when it can)."""
  reasons = []
  precision = str(jax.config.jax_default_matmul_precision or "default").lower()
  if dtype is not None and jnp.dtype(dtype).itemsize < 4 and precision in ("highest",
                                                                          "float32"):
    # Mosaic multiplies half-precision blocks at the MXU's own precision only.
    reasons.append(f"'splash' on {jnp.dtype(dtype).name} cannot take the float32 matmul passes "
                   f"of jax_default_matmul_precision={precision!r}: unset it, or use 'blockwise'")
  if score_mod is not None:
    reasons.append("'splash' takes no score modification (a bias scheme, gates, CoPE): use "
                   "'blockwise' or 'xla'")
  if mask is not None and mask.reads_key_documents and segments:
    reasons.append("'splash' cannot place sinks in packed documents (each document's first "
                   "tokens): use 'blockwise'")
  if other_queries:
    reasons.append("'splash' takes one query per token, not other queries for some pairs (the "
                   "sink queries of StreamingLLM's cache positions, "
                   "model.softmax.sink_positions='cache')")
  return reasons


def _padded_length(length):
  return -(-length // LANES) * LANES


def _block(padded):
  return next(block for block in (512, 256, 128) if padded % block == 0)


@functools.lru_cache(maxsize=64)
def _splash_mask(mask, length, padded):
  """The Splash mask (one head's) of `mask` for `length` tokens padded to `padded`."""
  shape = (padded, padded)
  if not mask.window and mask.keep is None:
    return mask_lib.CausalMask(shape)
  if not mask.sinks and mask.keep is None:
    return mask_lib.LocalMask(shape, window_size=(mask.window - 1, 0), offset=0)
  index = np.arange(padded)
  with jax.ensure_compile_time_eval():
    dense = np.array(mask.visible(index, index))
  dense[length:] = index[None, :] <= index[length:, None]  # padded queries: causal
  return mask_lib.NumpyMask(dense)


def _kernel(mask, length, padded, heads, interpret):
  block = _block(padded)
  sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                block_q_dkv=block, block_kv_dkv=block,
                                block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  head_mask = _splash_mask(mask, length, padded)
  return kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([head_mask] * heads),
                                    block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)


def _local_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, segments_BxT, *, scale, mask, interpret):
  """Splash on one device's rows and heads: [B, T, N, V]."""
  b, t, n, _ = q_BxTxNxH.shape
  padded = _padded_length(t)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  to_heads_first = lambda x: pad(x).transpose(0, 2, 1, 3)  # noqa: E731 ([B, heads, T, dim])
  q = to_heads_first(q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype))
  k, v = to_heads_first(k_BxTxKxH), to_heads_first(v_BxTxKxV)
  kernel = _kernel(mask, t, padded, n, interpret)
  if segments_BxT is None:
    out = jax.vmap(kernel)(q, k, v)
  else:  # the padding is one more document, of its own
    segments = jnp.pad(segments_BxT.astype(jnp.int32), [(0, 0), (0, padded - t)],
                       constant_values=-1)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, kernel_lib.SegmentIds(s, s)))(
        q, k, v, segments)
  return out.transpose(0, 2, 1, 3)[:, :t]


def _axes(mesh, names, size):
  """The mesh axes among `names` (of more than one device) whose product divides `size`."""
  axes = tuple(a for a in names if mesh.shape[a] > 1)
  while axes and size % int(np.prod([mesh.shape[a] for a in axes])):
    axes = axes[:-1]
  return axes or None


def attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, *, scale, mask, segments_BxT=None,
              interpret=False):
  """softmax(scale q k^T, mask, within documents) v: [B, T, N, V] in q's dtype."""
  local = functools.partial(_local_attention, scale=scale, mask=mask, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, segments_BxT)
  b, n, kv_heads = q_BxTxNxH.shape[0], q_BxTxNxH.shape[2], k_BxTxKxH.shape[2]
  batch = _axes(mesh, ("data", "fsdp"), b)
  heads = "tensor" if mesh.shape["tensor"] > 1 and not n % mesh.shape["tensor"] and not (
      kv_heads % mesh.shape["tensor"]) else None
  rows = PartitionSpec(batch, None, heads, None)
  documents = PartitionSpec(batch, None)
  if segments_BxT is None:
    run = jax.shard_map(lambda q, k, v: local(q, k, v, None), in_specs=(rows, rows, rows),
                        out_specs=rows, check_vma=False)
    return run(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV)
  run = jax.shard_map(local, in_specs=(rows, rows, rows, documents), out_specs=rows,
                      check_vma=False)
  return run(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, segments_BxT)
