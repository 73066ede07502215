"""What the chunked recurrent mixers share: cutting a sequence into chunks, and the plumbing of a
mixer whose one computation `_mix(x, cache, segments) -> (y, cache)` serves the training
forward pass (from an empty cache), decoding (from the cache, any number of new tokens) and
packed documents (the state restarts at each document's first token).

A chunked form cuts the length axis into Z chunks of C tokens (the last one padded) and
computes within each chunk in parallel, carrying the state from chunk to chunk
(flash-linear-attention's chunk kernels; Yang et al., arXiv:2312.06635, section 3). The
recurrent mixers keep the op (a function of arrays) apart from the layer (projections, gates,
norms, the cache), as fla does with fla/ops and fla/layers.
"""

import jax
import jax.numpy as jnp

from research.model.attention import base


def num_chunks(length: int, chunk: int) -> int:
  """Chunks of `chunk` tokens that cover `length` (the last one padded)."""
  return -(-length // chunk)


def pad_to_chunks(x, chunk: int, *, axis: int = 1, mode: str = "constant"):
  """x with its `axis` padded at the end to a multiple of `chunk` (`mode` as jnp.pad's: zeros, or
  "edge" to repeat the last value, as segment ids need)."""
  length = x.shape[axis]
  padding = [(0, 0)] * x.ndim
  padding[axis] = (0, num_chunks(length, chunk) * chunk - length)
  return jnp.pad(x, padding, mode=mode)


def split_chunks(x, chunk: int, *, axis: int = 1, mode: str = "constant"):
  """[..., L, ...] -> [..., Z, C, ...]: the `axis` of length L padded (pad_to_chunks) and cut
  into Z = ceil(L / C) chunks of C tokens, the chunk axis at `axis` and the token axis after it."""
  axis = axis % x.ndim
  x = pad_to_chunks(x, chunk, axis=axis, mode=mode)
  return x.reshape(x.shape[:axis] + (x.shape[axis] // chunk, chunk) + x.shape[axis + 1:])


def merge_chunks(x, length: int, *, axis: int = 1):
  """The inverse of split_chunks: [..., Z, C, ...] -> [..., L, ...], the padding cut off (`axis`
  is the chunk axis of x)."""
  axis = axis % x.ndim
  merged = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(merged, 0, length, axis=axis)


class ChunkedRecurrentMixer(base.Mixer):
  """A recurrent mixer whose state has a fixed size: `_mix(x [B, T, D], cache, segments [B, T] |
  None) -> (y [B, T, D], cache)` runs T tokens from `cache` (its chunked form), and this class
  derives `__call__` (from init_cache(batch, 0), positions unused: order comes from the
  recurrence) and `decode` (from the cache; with packed documents, the cache restarted in the
  rows whose first new token starts a document and the state restarted at later starts:
  base.decode_inputs). A subclass implements `_mix`, `init_cache` and
  `mixing_flops_per_token`.

  A mixer that hands the tokens' positions to its position scheme's qk hook (linear attention,
  retention) sets `reads_positions`: its `_mix` then also takes them, as the keyword
  positions_BxT ([B | 1, T]: the token indices, or their indices within their documents), and
  it sets `recurrent = False` (its order may come from the scheme too)."""

  recurrent = True
  reads_positions = False
  document_decode_refusal = classmethod(base.no_refusal)  # the state restarts at each document

  def _mix(self, x_BxTxD, cache, segments_BxT=None):
    raise NotImplementedError

  def _positions(self, positions_BxT):
    return {"positions_BxT": positions_BxT} if self.reads_positions else {}

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    return self._mix(x_BxLxD, self.init_cache(x_BxLxD.shape[0], 0), segments_BxL,
                     **self._positions(positions_BxL))[0]

  def decode(self, x_BxTxD, cache, index, documents=None):
    cache, positions_BxT, segments_BxT = base.decode_inputs(self, x_BxTxD, cache, index,
                                                            documents)
    return self._mix(x_BxTxD, cache, segments_BxT, **self._positions(positions_BxT))
