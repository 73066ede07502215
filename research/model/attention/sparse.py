"""Sparse attention (Child, Gray, Radford & Sutskever, arXiv:1904.10509; Beltagy, Peters & Cohan,
arXiv:2004.05150; Zaheer et al., arXiv:2007.14062): softmax attention over a fixed block-sparse
set of keys, the Sparse Transformer's strided or fixed pattern or a local window with global
tokens.

  o_i = sum_{j in A_i} softmax_j(q_i k_j^T / sqrt(d) + bias) v_j,   A_i = {j <= i : keep(i, j)}
with model.sparse.pattern (l = stride, c = summary, W = window, G = global_tokens, in tokens):
  strided       keep(i, j) = (i - j < l)  or  ((i - j) mod l = 0)
  fixed         keep(i, j) = (floor(j / l) = floor(i / l))  or  (j mod l >= l - c)
  local_global  keep(i, j) = (i - j < W)  or  (j < G)
Each is the union of two sub-patterns in one head (the paper's "merged head", section 4.3), not
the interleaving of one sub-pattern per layer or per head. Every other piece is softmax
attention's (research/model/attention/softmax.py): the projections (as many key/value heads as
heads), the position schemes (qk and bias), the backends (xla, blockwise, cudnn, auto), the
analyses and the decode cache; the pattern lives only in the core's mask spec
(research/model/attention/masks.py): strided and fixed are its `keep(i, j)` predicate, local_global
its window W and sinks S = G.

Tiles. The blockwise backend (research/model/attention/blockwise.py) visits only the (query block I,
key block J) tiles of b = block_size tokens that hold a kept causal pair (MaskSpec.schedule), so
its time falls with the tile density: visited tiles / causal tiles, N (N + 1) / 2 for N = n / b
blocks. The per-token patterns map onto tiles as follows (l = s b, c = v b):
  fixed         exactly block-aligned, as the authors' blocksparse layout: query block I sees the
                I mod s + 1 blocks of its stride block so far and the last v blocks of every
                earlier stride block, all of them whole tiles (the diagonal tile causal).
                Density (s + 1 + v (N / s - 1)) / (N + 1) for N a multiple of s, ~ v / s.
  strided       the local part is the band I - J <= s (s + 1 tiles, the farthest half used); the
                strided part is a diagonal, i - j = m l, so it touches the tiles I - J = m s,
                m >= 2, one kept pair per query in each. Density ~ 2 (s + 1) / N + 1 / s (less
                for small N), but of the 1 / s only 1 / b of each tile's pairs are kept: the
                authors ran the strided part alone on the transposed sequence
                (strided_transpose), where it is block-dense, which a union in one head with a
                causal-by-index core cannot do.
  local_global  the core's sliding window: ceil((W - 1) / b) + 1 tiles per query block, the
                first and last only partly used (W = w b: w + 1 tiles), plus the tile columns
                of the ceil(G / b) = g first blocks beyond it. Density ~ 2 (w + 1 + g) / (N + 1)
                for N >> w + g.
Only the strided part wastes many tiles: for fixed and local_global with sizes that are
multiples of b, the tile density is within about 2 / N of the density of kept pairs (the
diagonal tiles, the window's partial tiles; tests/test_sparse_attention.py).
`tile_density` reads the exact density off the schedule; research/bench/sparse.py times it.
validate refuses a stride (strided, fixed) or a summary (fixed) that is not a multiple of
block_size: a stride of l = 1.5 b puts a kept pair in nearly every tile, so nothing is skipped,
and a summary of c < b visits the same tiles as c = b while keeping fewer keys. The window and
the global tokens of local_global may be any sizes (the skip works at every size, and is
tightest for multiples of b); G <= W as the core's sinks.

Packed documents: attention stays within each document, and a document sees the pattern of its
own token indices, as it would alone (tests/test_conformance.py). Strided depends on i - j only
and local_global's global tokens are the core's per-document sinks, so both come from the mask
spec. Fixed's stride blocks count from the document's start, which the core's keep(i, j) (row
indices) cannot see: in a packed row the fixed pattern is a score bias of the tokens' indices
within their documents (0 where kept, -1e30 elsewhere; per-token score inputs, as FoX's), and
the mask spec is causal, so every causal tile is visited (as the core does for sinks in packed
documents). A core keep of indices within documents would restore the skip there.

Decode: the full KV cache with the pattern applied by token index (strided, fixed; the keys a
strided or fixed query sees reach back to the first token), or the core's rolling cache of
G + W slots (local_global), so its bytes stop growing at G + W tokens. A packed stream decodes
as the packed row does: strided and local_global through the mask spec (the full cache keeps
each query to its document, the rolling one keeps each document's first G tokens), fixed as
the causal cache plus the pattern's bias of the indices within the document, which are the
decode positions of a document cache (`decode_cache`).

Checked against the authors' code, openai/sparse_attention@c53f3bd, attention.py:
  * get_attn_mask: "local" keeps i - j < l (band of l keys, the query's own included), "strided"
    keeps (i - j) mod l = 0 (floormod), both causal; the strided pattern here is their union.
    The paper's text writes the local set as {max(0, i - l), ..., i}, l + 1 keys; the code's l
    keys are followed.
  * get_blocksparse_obj, attn_mode "fixed": layout at block granularity, stride = l / b blocks;
    with num_verts = 1 the summary is the last vertsize blocks of each stride block (columns
    idx::stride), every query block also sees its own stride block, then causal by block and,
    in the diagonal tile (get_callback), by token: in tokens exactly `fixed` above with
    c = vertsize b. Their num_verts > 1 gives head h the (h mod num_verts)-th group of summary
    blocks from the end (the paper's different summary offsets per head); here every head sees
    the last c tokens (the core's mask is shared by all heads).
  * blocksparse_attention_impl / attention_impl: scale 1 / sqrt(head dim), softmax in float32
    (their fp16 path casts the logits up), masked logits at -1e9 (here excluded exactly):
    SoftmaxAttention's scale and float32 softmax. Their q, k, v and output projections live in
    the model that calls them (not in the repository): SoftmaxAttention's projections and
    initialisation (LeCun normal, fan-in d_model) are used.
  * strided_transpose is a layout for their kernel, not part of the pattern (see Tiles).
Local + global (Longformer, BigBird): the window is Longformer's one-sided causal sliding window
of W keys (masks.py's convention, i - j < W); the global tokens are BigBird's ITC globals,
existing tokens that every query sees, in causal form the first G tokens (of each document);
as ordinary tokens they attend causally (the first G see each other through the window, as
G <= W). BigBird's window is at block granularity (google-research/bigbird@5e7d375,
bigbird/core/attention.py, full_bigbird_mask: blocks I - 1..I + 1; the first and last block
global): here it is by token, a superset of tiles I - W / b..I used in part; BigBird's random
blocks, its last global block (not causal) and Longformer's dilation are not implemented.
Longformer's code was not read (its causal LM uses dilated windows): the arXiv paper is the
source for the window.
"""

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_collections
import numpy as np

from research.model.attention import core
from research.model.attention import masks
from research.model.attention import softmax
from research.model.attention.kv_cache import KVCache

PATTERNS = ("strided", "fixed", "local_global")
# The pattern sizes each pattern reads (all read pattern and block_size); the others must stay at
# their defaults, as no setting is silently ignored (research/runs/unread.py).
READS = {"strided": ("stride",), "fixed": ("stride", "summary"),
         "local_global": ("window", "global_tokens")}
# The score bias of a pair that the fixed pattern leaves out in a packed row (blockwise's own
# masked logit).
OUTSIDE = -1e30


@dataclasses.dataclass(frozen=True)
class Strided:
  """The strided pattern: the last l keys, and every l-th key before them. It depends on i - j
  alone, so a packed row keeps it per document."""
  stride: int
  by_document_index = False

  def __call__(self, i, j):
    return (i - j < self.stride) | ((i - j) % self.stride == 0)

  def keys(self, index_L):
    """Visible keys of the queries i (numpy, no documents)."""
    return np.minimum(index_L + 1, self.stride) + index_L // self.stride

  def mask(self):
    return masks.MaskSpec(keep=self)


@dataclasses.dataclass(frozen=True)
class Fixed:
  """The fixed pattern: the query's own stride block of l tokens, and the last c tokens (the
  summary) of every stride block; by index within the document."""
  stride: int
  summary: int
  by_document_index = True

  def __call__(self, i, j):
    return (i // self.stride == j // self.stride) | (j % self.stride >= self.stride - self.summary)

  def keys(self, index_L):
    return index_L % self.stride + 1 + (index_L // self.stride) * self.summary

  def mask(self):
    return masks.MaskSpec(keep=self)


@dataclasses.dataclass(frozen=True)
class LocalGlobal:
  """The last W keys and the first G tokens (of the document): the core's window and sinks."""
  window: int
  global_tokens: int
  by_document_index = False

  def keys(self, index_L):
    return (np.minimum(index_L + 1, self.window)
            + np.clip(index_L + 1 - self.window, 0, self.global_tokens))

  def mask(self):
    return masks.MaskSpec(window=self.window, sinks=self.global_tokens)


def pattern_of(settings):
  """The pattern object of model.sparse settings (validated)."""
  if settings.pattern == "strided":
    return Strided(int(settings.stride))
  if settings.pattern == "fixed":
    return Fixed(int(settings.stride), int(settings.summary))
  return LocalGlobal(int(settings.window), int(settings.global_tokens))


def tile_density(mask, length, block):
  """(tiles the blockwise schedule visits, causal tiles) for a sequence of `length` tokens in
  tiles of `block` (no documents)."""
  num_blocks = -(-length // block)
  (counts, _), _ = mask.schedule(num_blocks, block)
  return int(counts.sum()), num_blocks * (num_blocks + 1) // 2


def _multiples(block, up_to):
  shown = [block * m for m in range(1, 4) if block * m <= up_to]
  return ", ".join(map(str, shown)) + (", ..." if up_to >= 4 * block else "")


def _softmax_settings(settings):
  """The SoftmaxAttention settings under the pattern: its tiles, no window of its own; the
  global tokens are seen at their own positions."""
  return ml_collections.ConfigDict(dict(block_size=settings.block_size, window=0, sinks=0,
                                        sink_positions="original"))


class DocumentInputs(NamedTuple):
  """Score inputs of a packed row under a by-document pattern (fixed)."""
  positions: Any  # [B | 1, T]
  document_index: Any  # [B, T]: each token's index within its document


class SparseAttention(softmax.SoftmaxAttention):
  """Softmax attention with as many key/value heads as heads (the Sparse Transformer's) under one
  of PATTERNS; settings model.sparse."""
  hyperparameters = {"pattern": "fixed",  # strided | fixed | local_global
                     "stride": 1024,  # l, strided and fixed: a multiple of block_size
                     "summary": 128,  # c, fixed: the last c tokens of each stride block
                     "window": 1024,  # W, local_global: the last W keys, the own included
                     "global_tokens": 128,  # G <= W, local_global: the first G tokens
                     "block_size": 128}  # blockwise tiles
  test_settings = {"pattern": "fixed", "stride": 8, "summary": 4, "block_size": 4}
  supports_sliding_window = False  # its window is model.sparse.window, not model.softmax's
  backends = ("auto", "xla", "blockwise", "cudnn", "splash")  # not pallas: causal only

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads

  @classmethod
  def validate(cls, settings, model_config):
    pattern, block = settings.pattern, settings.block_size
    if pattern not in PATTERNS:
      raise ValueError(f"unknown model.sparse.pattern {pattern!r}; valid: "
                       f"{', '.join(map(repr, PATTERNS))}")
    if block < 1:
      raise ValueError(f"model.sparse.block_size must be >= 1, got {block}")
    for field in ("stride", "summary", "window", "global_tokens"):
      default = cls.hyperparameters[field]
      if field not in READS[pattern] and settings[field] != default:
        readers = " and ".join(repr(p) for p in PATTERNS if field in READS[p])
        raise ValueError(f"model.sparse.{field}={settings[field]} is read only by the {readers} "
                         f"pattern(s), not by {pattern!r}: leave it at its default {default}")
    if pattern in ("strided", "fixed"):
      stride = settings.stride
      if stride < block or stride % block:
        raise ValueError(
            f"model.sparse.stride={stride} must be a multiple of model.sparse.block_size="
            f"{block} for the {pattern} pattern to skip whole tiles; valid: "
            f"{_multiples(block, max(stride, 4 * block))}")
    if pattern == "fixed":
      stride, summary = settings.stride, settings.summary
      if summary < block or summary % block or summary > stride:
        raise ValueError(
            f"model.sparse.summary={summary} must be a multiple of model.sparse.block_size="
            f"{block} of at most model.sparse.stride={stride} (whole tiles of summary keys); "
            f"valid: {_multiples(block, stride)}")
    if pattern == "local_global":
      window, global_tokens = settings.window, settings.global_tokens
      if window < 1:
        raise ValueError(f"model.sparse.window must be >= 1 (the last W keys, the query's own "
                         f"included), got {window}")
      if not 0 <= global_tokens <= window:
        raise ValueError(f"model.sparse.global_tokens={global_tokens} must be in 0..{window} "
                         f"(at most model.sparse.window={window})")
    super().validate(_softmax_settings(settings), model_config)

  @classmethod
  def mask_spec(cls, settings):
    return pattern_of(settings).mask()

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    super().__init__(settings, model_config, position, rngs=rngs, layer_index=layer_index)
    self.pattern = pattern_of(settings)
    # A packed stream under a pattern by index within the document: causal, the pattern a bias.
    self.document_cache = KVCache(self.num_kv_heads, core.CAUSAL)

  def sequence_mask(self, segments_BxL=None):
    """The mask spec of a sequence: the pattern's, or in a packed row under a pattern by index
    within the document (fixed) causal alone, the pattern being the score bias."""
    if segments_BxL is not None and self.pattern.by_document_index:
      return core.CAUSAL
    return self.mask

  def _by_document(self, tokens, segments_BxL):
    """The tokens' arrays, with each one's index within its document where a packed row takes
    the pattern as a bias (fixed)."""
    if segments_BxL is None or not self.pattern.by_document_index:
      return tokens
    return {**tokens, "document_index": masks.positions_in_documents(segments_BxL)}

  def project(self, x_BxTxD, positions_BxT, segments_BxT=None, cache=None, index=0,
              documents=None):
    q, tokens = super().project(x_BxTxD, positions_BxT, segments_BxT, cache, index, documents)
    return q, self._by_document(tokens, segments_BxT)

  def attend(self, q_BxLxNxH, tokens, positions_BxL, segments_BxL=None, other_queries=None):
    # A decode's prompt into an empty document cache comes here with tokens projected without
    # segments (the cache keeps no document index).
    if "document_index" not in tokens:
      tokens = self._by_document(tokens, segments_BxL)
    return super().attend(q_BxLxNxH, tokens, positions_BxL, segments_BxL, other_queries)

  def decode_cache(self, documents=None):
    """In a packed stream the fixed pattern counts from each document's start: the causal cache,
    and the pattern's bias of the decode positions, which are the indices within documents (the
    queries' and, kv_cache.full_cache_keys, the cached keys')."""
    if documents is None or not self.pattern.by_document_index:
      return super().decode_cache(documents)
    return self.document_cache, lambda positions, arrays: DocumentInputs(positions, positions)

  def score_inputs(self, positions_BxT, arrays):
    if "document_index" not in arrays:
      return positions_BxT
    return DocumentInputs(positions_BxT, arrays["document_index"])

  def score_bias(self, position, q_inputs, k_inputs):
    if not isinstance(q_inputs, DocumentInputs):
      return super().score_bias(position, q_inputs, k_inputs)
    (q_positions, q_document_BxT), (k_positions, k_document_BxS) = q_inputs, k_inputs
    kept_BxTxS = self.pattern(q_document_BxT[:, :, None], k_document_BxS[:, None, :])
    bias = jnp.where(kept_BxTxS, 0.0, OUTSIDE).astype(jnp.float32)[:, None]
    scheme = super().score_bias(position, q_positions, k_positions)
    return bias if scheme is None else bias + scheme

  def _probabilities(self, x_BxLxD, positions_BxL, segments_BxL):
    probs, visible, tokens = super()._probabilities(x_BxLxD, positions_BxL, segments_BxL)
    if "document_index" in tokens:  # the pattern was the score bias
      document_BxL = tokens["document_index"]
      visible = visible & self.pattern(document_BxL[:, :, None], document_BxL[:, None, :])[:, None]
    return probs, visible, tokens

  def mixing_flops_per_token(self, context_length):
    # q k^T and p v over the kept keys (2 FLOPs per multiply-add), averaged over the queries;
    # the blockwise backend computes the whole visited tiles (see tile_density).
    keys = float(np.mean(self.pattern.keys(np.arange(context_length))))
    return 2 * self.num_heads * (self.head_dim + self.value_head_dim) * keys
