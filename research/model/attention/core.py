"""The attention core: one function for every softmax-family mixer, with the contract of
FlexAttention (Dong et al., arXiv:2412.05496; PyTorch's `flex_attention(q, k, v, score_mod,
block_mask)`):

  attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, V], *, scale, score_mod, score_params,
         inputs, mask, segments_BxT, backend, block_size) -> [B, T, N, V]
  out_i = sum_j softmax_j(score_mod(scale q_i . k_j) where mask(i, j) else -inf) v_j

a sequence attending to itself, causally (decoding against a cache goes through the same score
function in research.model.attention.kv_cache). Query head n reads key/value head n // (N / K)
(grouped-query attention, never repeated in memory); values may be wider than queries and keys
(V != H).

* `score_mod` (a `ScoreMod`) changes the float32 logits of each (query, key) pair: an additive
  bias `bias(params, q_inputs, k_inputs) -> [B' | 1, N | 1, T, S]` (position schemes: ALiBi, T5,
  KERPLE, FIRE; FoX's forget gates) and/or any `modify(logits_BxNxTxS, params, q_inputs,
  k_inputs) -> logits`. `inputs` is a pytree of per-token arrays [B | 1, T, ...] (by default
  the positions 0..T-1, [1, T]); the core cuts it into the query and key rows of each tile, and
  the gradients reach `score_params` and the floating-point leaves of `inputs`. A `contextual`
  change sees each query's whole row of masked logits and the query vector (CoPE,
  arXiv:2405.18719: positions counted by gates over the row); it needs whole rows, so xla and
  the decode cache run it and blockwise refuses it.
* A `query_scale(params, context) -> [B | 1, N | 1, T]` multiplies each query's logits (after
  the bias, before `modify`) by a function of its `QueryContext`: how many keys it sees (under
  causality, the window, the sinks and packed documents) and its index within its document. A
  length-aware temperature (SSMax, arXiv:2501.19399: s log n) is one; every backend but the
  fused kernels runs it, and so do both decode caches (research.model.attention.kv_cache), which
  count the keys a new token sees in the cache.
* `mask` (research.model.attention.masks.MaskSpec) declares the visible keys: causal, a sliding
  window with sinks, a block-sparse pattern `keep(i, j)`; `segments_BxT` (packed documents) keeps
  attention within a document.
* `other_queries` (`OtherQueries`: other queries and their score inputs) give the pairs the mask
  spec requeries (MaskSpec.requeried_pairs) their logits: score_mod(scale q_other . k) with the
  other score inputs. StreamingLLM's positions in its rolling cache are the one user: a sink W or
  more tokens back is seen from the query at its cache position
  (research.model.attention.streaming; the core itself never reads the sinks). xla writes the logits out (the requeried keys' columns
  twice), blockwise computes the other queries' logits only in the tiles that may hold a
  requeried pair (MaskSpec.requeried_tiles), forward and backward; cudnn and splash refuse them.

Backends (what each can express, and which `auto` picks):
  xla        jax.nn.dot_product_attention(implementation="xla") with the bias and mask
             materialised, [B, N, T, T]; a `modify` or values wider than keys take the same
             float32 computation written out (jax.nn.dot_product_attention needs V == H)
  blockwise  research.model.attention.blockwise: exact, online softmax, O(length) memory; the score
             modification and the mask evaluated per tile, forward and backward, and only the
             tiles the mask spec allows are visited (window, sinks and block-sparse patterns
             shorten the schedule)
  cudnn      jax.nn.dot_product_attention(implementation="cudnn"), GPU, half precision; takes
             an additive bias and a mask, refuses `modify` and V != H by name
  pallas     research.model.attention.pallas_backend: the FlashAttention-2 kernel JAX ships in
             Pallas (Triton on a GPU, interpret mode on a CPU): causal, packed documents,
             V == H; refuses a score modification, a window, sinks and block-sparse patterns by
             name
  splash     research.model.attention.splash_backend: the TPU's Splash attention kernel (Pallas /
             Mosaic; interpret mode on a CPU): causal, windows, sinks, block-sparse patterns and
             packed documents as Splash masks; refuses a score modification, sinks in packed
             documents and other queries by name
  auto       cudnn where it can run the call (a GPU, bfloat16 / float16, nothing it refuses);
             splash on a TPU where it can run the call;
             on a CPU (and on a TPU where splash refuses) blockwise from AUTO_BLOCKWISE_FROM (1024) tokens on, or where the
             batch's float32 scores would exceed AUTO_BLOCKWISE_SCORES_BYTES (16 MiB: they no
             longer stay in the cache), xla below (the crossovers of the two measured fwd+bwd
             on a 2-core CPU); xla otherwise.
             It never picks pallas: no GPU has run it in this project yet (`make
             accelerator-check` times it where one is lent).
`probabilities` returns the materialised attention weights of the same computation (the
analyses read them from here).

`normaliser` turns the logits into weights (research.model.attention.normalisers: the
interface): "softmax" (the default, everything above); any Normaliser instance, e.g. a
normalisers.Pointwise subclass (sigmoid attention), which runs on xla (materialised, float32)
and blockwise (the same tiles, tile skipping, score modifications, masks, windows and sinks,
with its per-tile form) and decodes from both caches; or "stickbreaking" (stick-breaking
attention, Tan et al., arXiv:2410.17980; research.model.attention.stick_breaking_kernel):
A_ij = sigmoid(z_ij) prod_{l in (j, i)} (1 - sigmoid(z_il)) over the visible keys before the
query (or up to it: StickBreaking(attend_current=True)), not summing to 1, on xla and its own
blockwise kernel (nearest key block first); its weights depend on the keys' order, so sliding
windows and sinks are refused. cudnn, pallas and splash run softmax only; `auto` picks between
xla and blockwise for the others as for softmax.
"""

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from research.model.attention import masks
from research.model.attention import normalisers
from research.model.attention import pallas_backend
from research.model.attention import splash_backend
from research.model.attention import stick_breaking_kernel
from research.model.attention.blockwise import blockwise
from research.model.attention.masks import CAUSAL, MaskSpec  # noqa: F401 (re-exported)

BACKENDS = ("auto", "xla", "blockwise", "cudnn", "pallas", "splash")
# The backends that run a contextual score (ScoreMod.contextual: whole rows of logits).
CONTEXTUAL_BACKENDS = ("auto", "xla")
# The normalisers named by a string (`normaliser` of attend and probabilities; any
# normalisers.Normaliser instance also serves).
NORMALISERS = ("softmax", stick_breaking_kernel.NAME)
# `auto`: blockwise from this length on. Measured fwd+bwd on a 2-core CPU (mixers suite: batch 1,
# 8 heads, head_dim 64, block 128, fp32), xla / blockwise in ms: 256: 13.4 / 12.6, 512: 34.0 /
# 29.6, 768: 82.3 / 82.5, 1024: 190 / 123, 2048: 764 / 460. Below 1024 the two are within the
# machine's noise, and xla is one fused op without the loop overheads; from 1024 blockwise is
# ahead (1.5x) and the gap grows with the length, as does xla's O(length^2) memory.
AUTO_BLOCKWISE_FROM = 1024
# `auto`: blockwise also where the [batch, heads, length, length] float32 scores reach this size.
# xla's fwd+bwd grows faster than the batch once they outgrow the cache: measured on a 2-core
# Xeon (2026-12-04, head_dim 64, block 128, fp32), xla / blockwise in ms at 512 tokens, 8 heads:
# batch 1 (8 MiB) 18.4 / 20.7, batch 2 (16 MiB) 55.2 / 31.2, batch 8 (64 MiB) 242 / 138; at 256
# tokens: batch 2 (4 MiB) 13.5 / 15.2, batch 8 (16 MiB) 51.3 / 49.7, batch 16 with head_dim 16
# (32 MiB) 78.1 / 57.0; at 128 tokens, 4 heads, head_dim 32: batch 16 (4 MiB) 11.6 / 12.3,
# batch 64 (16 MiB) 40.7 / 39.4. The training step of 4 layers, d_model 512, 8 x 512 tokens
# runs in 1.71 s with blockwise against 2.28 s with xla.
AUTO_BLOCKWISE_SCORES_BYTES = 16 * 2**20
LARGE_NEGATIVE = -0.7 * float(jnp.finfo(jnp.float32).max)  # as jax.nn.dot_product_attention
# The platform the program being traced is compiled for: JAX's default backend, except inside
# `compiling_for` (research.training.aot compiles for a TPU slice on a CPU host).
_TARGET_PLATFORM = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def compiling_for(platform: str):
  """Backend choices and refusals inside this context are made for `platform` ("tpu", "gpu",
  "cpu"), whatever JAX runs on."""
  token = _TARGET_PLATFORM.set(platform)
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)


def target_platform() -> str:
  """The platform the traced program is for (see `compiling_for`)."""
  return _TARGET_PLATFORM.get() or jax.default_backend()


@dataclasses.dataclass(frozen=True)
class ScoreMod:
  """A change of the attention logits, differentiable in its parameters and float inputs.

  bias(params, q_inputs, k_inputs) -> [B' | 1, N | 1, T, S] (or None), added to the logits;
  modify(logits [B, N, T, S] float32, params, q_inputs, k_inputs) -> logits, applied after the
  bias. q_inputs / k_inputs are the rows of the per-token inputs for the queries / keys at hand
  (a tile, the whole sequence, or a cache). Either may be None.
  """
  bias: Optional[Callable] = None
  modify: Optional[Callable] = None
  # contextual(logits [B, N, T, S] float32, the invisible keys at finfo.min, params,
  # q [B, T, N, H]) -> logits: a function of each query's whole row of visible logits, in key
  # order, and of the query itself (CoPE's contextual positions, arXiv:2405.18719), applied after
  # bias and modify. It needs whole rows: xla and the decode cache run it, blockwise (a row tile
  # by tile) and cudnn refuse it.
  contextual: Optional[Callable] = None
  # query_scale(params, QueryContext) -> [B | 1, N | 1, T] float32: each query's logits times
  # it, after the bias and before `modify` (a length-aware temperature).
  query_scale: Optional[Callable] = None

  @property
  def additive(self) -> bool:
    return self.modify is None and self.contextual is None and self.query_scale is None

  @property
  def rowwise(self) -> bool:
    return self.contextual is not None

  def apply(self, logits_BxNxTxS, params, q_inputs, k_inputs, context=None):
    """bias, then query_scale (given the queries' `context`, a QueryContext), then modify."""
    if self.bias is not None:
      bias = self.bias(params, q_inputs, k_inputs)
      if bias is not None:
        logits_BxNxTxS = logits_BxNxTxS + bias.astype(logits_BxNxTxS.dtype)
    if self.query_scale is not None:
      scale = self.query_scale(params, context)
      logits_BxNxTxS = logits_BxNxTxS * scale[..., None].astype(logits_BxNxTxS.dtype)
    if self.modify is not None:
      logits_BxNxTxS = self.modify(logits_BxNxTxS, params, q_inputs, k_inputs)
    return logits_BxNxTxS


class QueryContext(NamedTuple):
  """What a query knows of its row besides its logits: keys_seen, int32 [B | 1, T], the number
  of keys it sees (causality, window, sinks, packed documents; in a decode cache, the cached and
  new keys it sees), and document_index, int32 [B | 1, T], its index within its document (its
  token index in a single document)."""
  keys_seen: Any
  document_index: Any


def query_context(mask, length, segments_BxT=None, block=256):
  """The QueryContext of a sequence of `length` tokens attending to itself under `mask` (and
  packed documents): keys_seen in closed form (MaskSpec.keys_seen), or, for a block-sparse
  pattern, the visible keys counted block of keys by block (O(length x block) memory)."""
  index = jnp.arange(length)
  document_index = masks.indices_in_documents(length, segments_BxT)
  seen = mask.keys_seen(document_index)
  if seen is None:
    def count(start):
      keys = start + jnp.arange(block)
      k_segments = None if segments_BxT is None else jnp.take(segments_BxT, keys, axis=1,
                                                              mode="clip")
      k_document = (None if segments_BxT is None or not mask.reads_key_documents
                    else jnp.take(document_index, keys, axis=1, mode="clip"))
      allowed = mask.allowed(index, keys, segments_BxT, k_segments, k_document)
      return (allowed & (keys < length)).sum(-1)[:, 0]  # [B | 1, T]
    seen = sum(count(start) for start in range(0, length, block)).astype(jnp.int32)
  return QueryContext(seen, document_index.astype(jnp.int32))


def _context_in_inputs(score_mod, inputs, other_queries, context):
  """(score_mod, inputs, other_queries) for a backend that cuts the score inputs into tiles
  (blockwise): the queries' context rides in the inputs, (inputs, context), and query_scale
  becomes the start of a `modify` that reads it from the query rows; unchanged without a
  query_scale."""
  if score_mod is None or score_mod.query_scale is None:
    return score_mod, inputs, other_queries
  inner = score_mod

  def bias(params, q_inputs, k_inputs):
    return inner.bias(params, q_inputs[0], k_inputs[0])

  def modify(logits, params, q_inputs, k_inputs):
    scale = inner.query_scale(params, QueryContext(*q_inputs[1]))
    logits = logits * scale[..., None].astype(logits.dtype)
    return logits if inner.modify is None else inner.modify(logits, params, q_inputs[0],
                                                            k_inputs[0])

  context = tuple(context)
  if other_queries is not None:
    other_queries = other_queries._replace(inputs=(other_queries.inputs, context))
  return (ScoreMod(bias=None if inner.bias is None else bias, modify=modify),
          (inputs, context), other_queries)


class OtherQueries(NamedTuple):
  """The queries of the pairs the mask spec requeries (MaskSpec.requeried_pairs): every such
  pair's logit is score_mod(scale q_other . k) with the score inputs `inputs` on the query side,
  every other pair's score_mod(scale q . k) with the usual inputs. q: [B, T, N, H], or None for
  the queries themselves (only the score inputs differ); inputs: a pytree as `inputs`.
  StreamingLLM's cache positions (research.model.attention.streaming.SinkPositions.sink_queries)
  are these: the queries and score inputs at each query's position in the rolling cache, for
  the pairs whose key is seen only as a sink."""
  q: Any
  inputs: Any


def _with_other_queries(other_queries, mask):
  """other_queries, or None where the mask requeries no pair."""
  return other_queries if mask.requeries else None


def resolve_normaliser(normaliser, mask=CAUSAL):
  """The normalisers.Normaliser that `normaliser` names ("softmax", "stickbreaking", or an
  instance); a ValueError for any other name, and for a normaliser whose weights depend on the
  keys' order with a sliding window or sinks."""
  if isinstance(normaliser, normalisers.Normaliser):
    resolved = normaliser
  elif normaliser == "softmax":
    resolved = normalisers.SOFTMAX
  elif normaliser == stick_breaking_kernel.NAME:
    resolved = stick_breaking_kernel.StickBreaking()
  else:
    raise ValueError(f"unknown attention normaliser {normaliser!r}; valid: "
                     f"{', '.join(map(repr, NORMALISERS))} or a "
                     "research.model.attention.normalisers.Normaliser instance")
  if resolved.order_dependent and mask.window:  # sinks come with a window only
    raise ValueError(f"{resolved.name} attention takes no sliding window or sinks (got window="
                     f"{mask.window}): its weights depend on the order of all "
                     "earlier keys; use window=0")
  return resolved


def refusals(backend, *, score_mod=None, head_dim=None, value_dim=None, dtype=None,
             platform=None, other_queries=False, mask=None, segments=False):
  """Why `backend` cannot run a call with these properties ([] when it can); `segments`: the
  call is in packed documents."""
  platform = platform or target_platform()
  reasons = []
  if backend == "splash":
    if platform not in ("tpu", "cpu"):
      reasons.append(f"'splash' is the TPU's kernel (Mosaic), run in interpret mode on a CPU; "
                     f"JAX runs on {platform!r}")
    reasons += splash_backend.refusals(score_mod=score_mod, mask=mask, segments=segments,
                                       other_queries=other_queries, dtype=dtype)
  if backend == "pallas":
    if platform not in ("gpu", "cpu"):
      reasons.append(f"'pallas' is JAX's GPU (Triton) kernel, run in interpret mode on a CPU; "
                     f"JAX runs on {platform!r}")
    if score_mod is not None:
      reasons.append("'pallas' takes no score modification (a bias scheme, gates, CoPE): use "
                     "'blockwise' or 'xla'")
    if mask is not None and (mask.window or mask.keep is not None):
      reasons.append("'pallas' runs causal attention (within packed documents) only, not a "
                     "sliding window, sinks or a block-sparse pattern: use 'blockwise'")
    if value_dim is not None and head_dim is not None and value_dim != head_dim:
      reasons.append(f"'pallas' needs values as wide as keys, got {value_dim} != {head_dim}")
  if backend == "cudnn":
    if other_queries:
      reasons.append("'cudnn' takes one query per token, not other queries for some pairs (the "
                     "sink queries of StreamingLLM's cache positions, "
                     "model.softmax.sink_positions='cache')")
    if platform != "gpu":
      reasons.append(f"'cudnn' needs a GPU, but JAX runs on {platform!r}")
    if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
      reasons.append(f"'cudnn' needs bfloat16 or float16 compute, got {jnp.dtype(dtype).name}")
    if score_mod is not None and not score_mod.additive:
      reasons.append("'cudnn' takes an additive bias only, not a score `modify` function")
    if value_dim is not None and head_dim is not None and value_dim != head_dim:
      reasons.append(f"'cudnn' needs values as wide as keys, got {value_dim} != {head_dim}")
  elif backend == "blockwise":
    if score_mod is not None and score_mod.rowwise:
      reasons.append("'blockwise' visits each query's keys tile by tile, but a contextual score "
                     "(CoPE) needs the whole row at once: use 'xla' (or 'auto')")
  elif backend not in BACKENDS:
    reasons.append(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
  return reasons


def auto_backend(length, backends=BACKENDS, compute_dtype=jnp.float32, platform=None, *,
                 score_mod=None, head_dim=None, value_dim=None, other_queries=False,
                 batch_heads=1, mask=None, segments=False):
  """The backend that `auto` runs for `batch_heads` (sequence, head) pairs of `length` tokens:
  cudnn where it may run (among `backends`, and nothing in the call it refuses); splash on a TPU
  where it may run; on a CPU xla for short sequences and small batches, blockwise from
  AUTO_BLOCKWISE_FROM tokens on or where the float32 scores, batch_heads * length^2 * 4 bytes,
  reach AUTO_BLOCKWISE_SCORES_BYTES: there skipping masked tiles and never writing the scores
  outweighs the loop's overheads. On a TPU where splash refuses the call the same rule keeps the
  scores out of memory (not timed there); xla on GPUs where cudnn refuses (set blockwise there
  explicitly for O(length) memory)."""
  platform = platform or target_platform()
  if score_mod is not None and score_mod.rowwise:
    return "xla"  # the only backend with whole rows
  if "cudnn" in backends and not refusals("cudnn", score_mod=score_mod, head_dim=head_dim,
                                          value_dim=value_dim, dtype=compute_dtype,
                                          platform=platform, other_queries=other_queries):
    return "cudnn"
  if platform == "tpu" and "splash" in backends and not refusals(
      "splash", score_mod=score_mod, platform=platform, other_queries=other_queries, mask=mask,
      segments=segments, dtype=compute_dtype):
    return "splash"
  if platform not in ("cpu", "tpu"):
    return "xla"
  scores_bytes = batch_heads * length * length * 4
  long = length >= AUTO_BLOCKWISE_FROM or scores_bytes >= AUTO_BLOCKWISE_SCORES_BYTES
  return "blockwise" if long else "xla"


def _visible(mask, length, segments_BxT):
  """[B | 1, 1, T, T] bool: the keys each query of a sequence sees."""
  index = jnp.arange(length)
  document_index = (None if segments_BxT is None or not mask.reads_key_documents
                    else masks.positions_in_documents(segments_BxT))
  return mask.allowed(index, index, segments_BxT, segments_BxT, document_index)


def _sequence_mask(mask, length, segments_BxT):
  """_visible, or None for plain causal attention (the fused backends' own causal path)."""
  if not mask.window and mask.keep is None and segments_BxT is None:
    return None
  return _visible(mask, length, segments_BxT)


def grouped_logits(q_BxTxNxH, k_BxSxKxH, scale):
  """scale q k^T, float32 [B, N, T, S], query head n against key head n // (N / K)."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads = k_BxSxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv_heads, n // kv_heads, h)
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k_BxSxKxH,
                      preferred_element_type=jnp.float32)
  return logits.reshape(b, n, t, k_BxSxKxH.shape[1]) * scale


def grouped_values(probs_BxNxTxS, v_BxSxKxV):
  """sum_s p[b, n, t, s] v[b, s, n // G], [B, T, N, V] in float32."""
  b, n, t, s = probs_BxNxTxS.shape
  kv_heads = v_BxSxKxV.shape[2]
  p = probs_BxNxTxS.reshape(b, kv_heads, n // kv_heads, t, s).astype(v_BxSxKxV.dtype)
  out = jnp.einsum("BKGTS,BSKV->BTKGV", p, v_BxSxKxV, preferred_element_type=jnp.float32)
  return out.reshape(b, t, n, v_BxSxKxV.shape[-1])


def _default_inputs(inputs, length):
  return jnp.arange(length)[None] if inputs is None else inputs


def _requeried_logits(logits, raw, q_BxTxNxH, k_BxTxKxH, scale, score_mod, score_params, inputs,
                      other_queries, mask, segments_BxT, context=None):
  """`logits` [B, N, T, T] with the requeried pairs' logits from the other queries, over the
  leading keys that may be in one (MaskSpec.requeried_keys)."""
  t = q_BxTxNxH.shape[1]
  columns = mask.requeried_keys(t, packed=segments_BxT is not None)
  k_inputs = jax.tree.map(lambda x: x[:, :columns], inputs)
  other = (raw[..., :columns] if other_queries.q is None
           else grouped_logits(other_queries.q, k_BxTxKxH[:, :columns], scale))
  if score_mod is not None:
    other = score_mod.apply(other, score_params, other_queries.inputs, k_inputs, context)
  index = jnp.arange(t)
  document_index = (None if segments_BxT is None
                    else masks.positions_in_documents(segments_BxT)[:, :columns])
  pairs = mask.requeried_pairs(index, index[:columns], document_index)
  pairs = pairs[None, None] if pairs.ndim == 2 else pairs[:, None]
  head = jnp.where(pairs, other.astype(logits.dtype), logits[..., :columns])
  return jnp.concatenate([head, logits[..., columns:]], axis=-1)


def probabilities(q_BxTxNxH, k_BxTxKxH, *, scale=None, score_mod=None, score_params=(),
                  inputs=None, mask=CAUSAL, segments_BxT=None, other_queries=None,
                  normaliser="softmax"):
  """(float32 attention probabilities [B, N, T, T], the visible keys [B | 1, 1, T, T]) of
  `attend` with the same arguments, materialised: for analyses and interventions (with
  a normaliser other than softmax: its weights, and the keys that may take weight)."""
  normaliser = resolve_normaliser(normaliser, mask)
  t, h = q_BxTxNxH.shape[1], q_BxTxNxH.shape[-1]
  scale = h ** -0.5 if scale is None else scale
  inputs = _default_inputs(inputs, t)
  other_queries = _with_other_queries(other_queries, mask)
  context = (None if score_mod is None or score_mod.query_scale is None
             else query_context(mask, t, segments_BxT))
  raw = logits = grouped_logits(q_BxTxNxH, k_BxTxKxH, scale)
  if score_mod is not None:
    logits = score_mod.apply(logits, score_params, inputs, inputs, context)
  if other_queries is not None:
    logits = _requeried_logits(logits, raw, q_BxTxNxH, k_BxTxKxH, scale, score_mod,
                               score_params, inputs, other_queries, mask, segments_BxT, context)
  index = jnp.arange(t)
  visible = normaliser.keys_taking_weight(_visible(mask, t, segments_BxT), index, index)
  if score_mod is not None and score_mod.rowwise and normaliser != normalisers.SOFTMAX:
    raise ValueError(f"a contextual score (CoPE) takes the softmax normaliser, not "
                     f"{normaliser.name}")
  logits = masked_logits(logits, visible, score_mod, score_params, q_BxTxNxH)
  return normaliser.weights(logits, visible), visible


def masked_logits(logits_BxNxTxS, visible, score_mod, score_params, q_BxTxNxH,
                  masked=jnp.finfo(jnp.float32).min):
  """The logits with the invisible keys at `masked`, and score_mod's contextual change (if any)
  of each query's row; the rows are whole and their keys in order."""
  logits_BxNxTxS = jnp.where(visible, logits_BxNxTxS, masked)
  if score_mod is None or score_mod.contextual is None:
    return logits_BxNxTxS
  changed = score_mod.contextual(logits_BxNxTxS, score_params, q_BxTxNxH)
  return jnp.where(visible, changed.astype(jnp.float32), masked)


def attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, *, scale=None, score_mod=None, score_params=(),
           inputs=None, mask=CAUSAL, segments_BxT=None, backend="auto", block_size=128,
           backends=BACKENDS, other_queries=None, normaliser="softmax"):
  """softmax(score_mod(scale q k^T), mask) v of a sequence to itself; see the module docstring.

  scale defaults to 1/sqrt(H); inputs to the positions 0..T-1; `backends` are those the caller
  allows `auto` to pick from; other_queries (`OtherQueries`) give the pairs the mask requeries
  their own queries and score inputs (StreamingLLM's cache positions); normaliser
  "stickbreaking" takes stick-breaking weights instead of the softmax (see the module
  docstring)."""
  b, t, n, h = q_BxTxNxH.shape
  kv_heads, width = k_BxTxKxH.shape[2], v_BxTxKxV.shape[-1]
  if n % kv_heads:
    raise ValueError(f"{kv_heads} key/value heads do not divide {n} query heads")
  scale = h ** -0.5 if scale is None else scale
  inputs = _default_inputs(inputs, t)
  other_queries = _with_other_queries(other_queries, mask)
  requeried = other_queries is not None
  normaliser = resolve_normaliser(normaliser, mask)
  if normaliser != normalisers.SOFTMAX:
    return _attend_normalised(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, normaliser, scale=scale,
                              score_mod=score_mod, score_params=score_params, inputs=inputs,
                              mask=mask, segments_BxT=segments_BxT, backend=backend,
                              block_size=block_size, backends=backends,
                              other_queries=other_queries)
  if backend == "auto":
    if target_platform() == "tpu" and _without_scores(score_mod, score_params, inputs):
      score_mod = None  # RoPE's: none, so that splash may take the call
    backend = auto_backend(t, backends, q_BxTxNxH.dtype, score_mod=score_mod, head_dim=h,
                           value_dim=width, other_queries=requeried, batch_heads=b * n,
                           mask=mask, segments=segments_BxT is not None)
  if backend in ("pallas", "splash") and _without_scores(score_mod, score_params, inputs):
    score_mod = None
  reasons = refusals(backend, score_mod=score_mod, head_dim=h, value_dim=width,
                     other_queries=requeried, mask=mask, segments=segments_BxT is not None,
                     dtype=q_BxTxNxH.dtype if backend == "splash" else None)
  if reasons:
    raise ValueError(f"attention backend {backend!r} cannot run this call: {'; '.join(reasons)}")
  if backend == "pallas":
    return pallas_backend.attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, scale=scale,
                                    segments_BxT=segments_BxT,
                                    interpret=target_platform() == "cpu")
  if backend == "splash":
    return splash_backend.attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, scale=scale, mask=mask,
                                    segments_BxT=segments_BxT,
                                    interpret=target_platform() == "cpu")
  if backend == "blockwise":
    if score_mod is not None and score_mod.query_scale is not None:
      score_mod, inputs, other_queries = _context_in_inputs(
          score_mod, inputs, other_queries, query_context(mask, t, segments_BxT))
    return blockwise(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, inputs, score_mod, score_params,
                     block_size=block_size, scale=scale, mask=mask, segments_BxT=segments_BxT,
                     other_queries=other_queries)
  visible = _sequence_mask(mask, t, segments_BxT)
  if (score_mod is None or score_mod.additive) and width == h and not requeried:
    bias = None if score_mod is None else score_mod.bias(score_params, inputs, inputs)
    bias = None if bias is None else bias.astype(q_BxTxNxH.dtype)
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, bias=bias, mask=visible,
                                        is_causal=visible is None, scale=scale,
                                        implementation=backend)
  # A `modify`, values wider than keys or other queries: the same float32 computation written out.
  probs, _ = probabilities(q_BxTxNxH, k_BxTxKxH, scale=scale, score_mod=score_mod,
                           score_params=score_params, inputs=inputs, mask=mask,
                           segments_BxT=segments_BxT, other_queries=other_queries)
  return grouped_values(probs, v_BxTxKxV).astype(v_BxTxKxV.dtype)


def _without_scores(score_mod, score_params, inputs):
  """Whether `score_mod` changes no logit: no modify or contextual change, and a bias that is
  None for these inputs (a mixer passes its scheme's bias function whatever the scheme; RoPE's
  gives None)."""
  return score_mod is None or (score_mod.additive and (
      score_mod.bias is None or score_mod.bias(score_params, inputs, inputs) is None))


def _attend_normalised(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, normaliser, *, scale, score_mod,
                       score_params, inputs, mask, segments_BxT, backend, block_size, backends,
                       other_queries):
  """`attend` with a normaliser other than softmax: blockwise (its per-tile form, or its own
  kernel), or xla (materialised); `auto` picks between the two as for softmax."""
  if backend == "auto":
    batch, length, heads, _ = q_BxTxNxH.shape
    backend = auto_backend(length, tuple(b for b in backends if b in ("xla", "blockwise")),
                           q_BxTxNxH.dtype, score_mod=score_mod, batch_heads=batch * heads)
  if backend not in ("xla", "blockwise"):
    raise ValueError(f"attention backend {backend!r} cannot run {normaliser.name} attention; "
                     "valid: 'auto', 'xla' (materialised) or 'blockwise' (cuDNN, Pallas and "
                     "Splash have softmax kernels only)")
  if backend == "blockwise":
    reasons = refusals("blockwise", score_mod=score_mod)
    if reasons:
      raise ValueError(f"attention backend 'blockwise' cannot run this call: {'; '.join(reasons)}")
    if score_mod is not None and score_mod.query_scale is not None:
      score_mod, inputs, other_queries = _context_in_inputs(
          score_mod, inputs, other_queries, query_context(mask, q_BxTxNxH.shape[1], segments_BxT))
    kernel = normaliser.blockwise_kernel() or functools.partial(blockwise, normaliser=normaliser)
    return kernel(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, inputs, score_mod, score_params,
                  block_size=block_size, scale=scale, mask=mask, segments_BxT=segments_BxT,
                  other_queries=other_queries)
  probs, _ = probabilities(q_BxTxNxH, k_BxTxKxH, scale=scale, score_mod=score_mod,
                           score_params=score_params, inputs=inputs, mask=mask,
                           segments_BxT=segments_BxT, other_queries=other_queries,
                           normaliser=normaliser)
  return grouped_values(probs, v_BxTxKxV).astype(v_BxTxKxV.dtype)
