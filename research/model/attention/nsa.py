"""Native Sparse Attention, NSA (Yuan et al., arXiv:2502.11089): compressed, selected and
sliding-window attention branches per query head over the same keys and values, mixed by sigmoid
gates of the token.

  blocks      keys and values in blocks of l tokens (nsa.block_size), counted from the sequence's
              (a packed document's) first token
  compressed  K~_c = mean_{j in c} k_j,  V~_c = mean_{j in c} v_j    (mean pooling, stride l)
              o^cmp_{n,t} = sum_c softmax_c(s q_{n,t} . K~_c) V~_c   over the complete blocks c
              that end at or before t (0 where there is none)
  importance  I_{K,t}(c) = sum_{n in group K} p^cmp_{n,t}(c), the own block (t's) set to 1 per
              head; the own block and the top (n - 1) earlier blocks by I are selected per
              key/value head, shared by its query heads (n = nsa.num_selected)
  selected    o^slc_{n,t} = sum_{j in selected blocks, j <= t} softmax_j(s q_{n,t} . k_j) v_j
  window      o^swa_{n,t} = sum_{t - w < j <= t} softmax_j(s q_{n,t} . k_j) v_j   (w = nsa.window;
              0 drops the branch)
  output      o_t = W_O sum_n [g^cmp o^cmp + g^slc o^slc + g^swa o^swa]_{n,t},
              (g^cmp, g^slc, g^swa)_{n,t} = sigmoid(x_t W_G)_{n, 0..2}
with s = m / sqrt(H) (m: the scheme's logit scale, 1 but for YaRN), q and k after the qk scheme
(RoPE), and K~ pooled from the rotated keys. The selection is discrete: gradients reach q, k, v
through the three softmaxes (and K~, V~), not through the importance. GQA: query head n reads
key/value head n // (N / K) (model.num_kv_heads).

Checked against the authors' code, fla-org/native-sparse-attention@bd67af5
(bd67af59b90afa34b25f61d2922e612d10dba3bd, 2025-03-19):
  * native_sparse_attention/ops/naive.py `naive_nsa_with_compression` (the reference the tests
    port): `compression` mean-pools k and v in blocks of block_size (the last block zero-padded;
    a partial block is never visible); `naive_nsa_compression`: block c visible to query t iff
    (c + 1) block_size - 1 <= t, a query with none gets o_cmp = 0; the softmax probabilities
    with the own block (t // block_size) set to 1.0 summed over the query heads of each
    key/value group, torch.topk of min(block_counts, ceil(T / block_size)) blocks, indices past
    the own block set to -1 (dropped); `naive_nsa`: one softmax over the keys <= t of the
    selected blocks, plus a sliding window of the last window_size keys; one scale
    head_dim^-0.5 for all three branches; o = g_slc o_slc + g_swa o_swa + g_cmp o_cmp.
  * native_sparse_attention/ops/parallel.py `parallel_nsa` (the Triton form): the same function
    (`parallel_nsa_kernel_topk`: the own block 1.0, earlier blocks exp(s - lse), invalid picks -1;
    the window by flash attention, window_size=(w - 1, 0)).
  * native_sparse_attention/modeling_nsa.py `NativeSparseAttention`: q, k, v projections without
    bias, RoPE (theta 10^4) on q and k before the kernel, g_proj: D -> 3 N without bias, sigmoid,
    '(h d)' with d = 3 per head in the order cmp, slc, swa; o_proj without bias. Defaults
    block_size 64, block_counts 16, window_size 512 (configs/nsa_340M.json: 32 heads on 2
    key/value heads).
Deviations: (1) with num_selected = 1 the own block is always the one kept (their top-1 may tie
between the own block's 1.0 and an earlier block with all its group's probability; with more
than one pick both are kept and the two agree); ties between earlier blocks go to the earlier
block (jax.lax.top_k); (2) packed documents (segment ids) are cu_seqlens' sequences, blocks
restarting at each document's start, with the dropped picks of `parallel_nsa_topk` (-1): their
varlen naive form fills them with block 0, which then counts block 0's keys several times;
(3) decoding runs NSA over the whole KV cache, equal to the forward (their layer hands
`parallel_nsa` the new queries with the longer cached keys, and its kernels index the queries by
the keys' length); (4) the count of selected blocks is the naive form's: their Triton top-k
rounds an integer block_counts up to a power of 2 (3 selects 4 there; the default 16 agrees);
(5) parameters initialised as the lab's projections (LeCun normal, fan-in d_model), not their
normal(0.006); (6) block means are kept in float32; (7) the paper's learned MLP compression with
overlapping blocks (l = 32, stride 16) and separate selection blocks (l' = 64), and its always
selected initial block, are not what their code runs: this follows their code.

Backends (model.attention_backend), for the selected branch (the compressed branch is dense over
the L / l block means, [B, N, L, L / l]; the window branch is core.attend's MaskSpec window on the
same backend, auto picking as the core does):
  xla        the selected blocks as a core ScoreMod `modify` (research.model.attention.moba's
             `visible_blocks`: own block by block id, picks by complete-block index) on the
             materialised [B, N, L, L] logits
  blockwise  MoBA's efficient form (moba.sparse_attention in this package): the own block as
             row blocks of l queries against 2l keys, the selected blocks as tiles of
             nsa.tile_size queries sharing one key block, merged by log-sum-exp
  auto       blockwise where it computes fewer logits per query than (L + 1) / 2, else xla.

Decoding: the full KV cache (research.model.attention.kv_cache, keys after RoPE); the block means
are recomputed from the cached keys and values at every step (nothing extra is cached), the new
tokens' compressed attention, importance and picks taken over them, and the selected and window
branches attend to the cache (kv_cache.cached_attention). A prompt into an empty cache runs the
sequence path. Packed documents (a document cache): blocks count from each document's start, as
in the packed forward pass (`_attend_cache`).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model import positions
from research.model.attention import base
from research.model.attention import core
from research.model.attention import kv_cache
from research.model.attention import masks
from research.model.attention import moba
from research.model.positions import QK

BACKENDS = ("auto", "xla", "blockwise")
BRANCHES = 3  # compressed, selected, window: the gate's last axis


def compressed_attention(q_BxTxNxH, k_means_BxCxKxH, v_means_BxCxKxH, visible_PxTxC, scale):
  """(o^cmp float32 [B, T, N, H], its probabilities float32 [B, N, T, C]) of T queries over C
  block means, 0 where a query sees no block."""
  b, t, n, h = q_BxTxNxH.shape
  if k_means_BxCxKxH.shape[1] == 0:
    return jnp.zeros((b, t, n, v_means_BxCxKxH.shape[-1]), jnp.float32), jnp.zeros((b, n, t, 0))
  kv = k_means_BxCxKxH.shape[2]
  q = q_BxTxNxH.astype(jnp.float32).reshape(b, t, kv, n // kv, h)
  logits = jnp.einsum("BTKGH,BCKH->BKGTC", q, k_means_BxCxKxH,
                      precision=jax.lax.Precision.HIGHEST).reshape(b, n, t, -1) * scale
  visible = visible_PxTxC[:, None]
  probs = jnp.where(visible, jax.nn.softmax(jnp.where(visible, logits, moba.MASKED)), 0.0)
  out = jnp.einsum("BKGTC,BCKV->BTKGV", probs.reshape(b, kv, n // kv, t, -1), v_means_BxCxKxH,
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, t, n, -1), probs


def select_blocks(probs_BxNxTxC, candidate_PxTxC, picks, kv_heads):
  """[B, T, N, picks] int32: per key/value head, the top `picks` candidate (earlier, complete)
  blocks by the compressed probabilities summed over its query heads, repeated to those heads;
  -1 where fewer blocks are candidates. No gradient (the selection is discrete)."""
  b, n, t, c = probs_BxNxTxC.shape
  if picks <= 0:
    return jnp.zeros((b, t, n, 0), jnp.int32)
  importance = jax.lax.stop_gradient(probs_BxNxTxC).reshape(b, kv_heads, n // kv_heads, t, c)
  routed_BxTxKxP = moba.select(importance.sum(2), candidate_PxTxC[:, None], picks)
  return jnp.repeat(routed_BxTxKxP, n // kv_heads, axis=2)


class NativeSparseAttention(base.Mixer):
  """NSA with model.num_kv_heads key/value heads (their naive form takes any group size; their
  Triton kernels need groups of a multiple of 16 query heads)."""
  hyperparameters = {"block_size": 64,  # l: compression and selection block (block_size)
                     "num_selected": 16,  # n: blocks per query, its own included (block_counts)
                     "window": 512,  # w: sliding window, the own key included (window_size)
                     "tile_size": 128}  # backends: query / key tile of blockwise
  test_settings = {"block_size": 4, "num_selected": 2, "window": 5, "tile_size": 4}
  position_hooks = frozenset({QK})
  backends = BACKENDS
  reads_num_kv_heads = True

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_kv_heads

  @classmethod
  def chunk_length(cls, settings):
    return int(settings.block_size)

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
    head_dim = model_config.d_model // model_config.num_heads
    return 2 * model_config.num_kv_heads * head_dim * itemsize

  @classmethod
  def position_geometry(cls, settings, model_config, layer_index=0):
    del settings
    h = model_config.d_model // model_config.num_heads
    return positions.Geometry(model_config.d_model, model_config.num_heads, h, h, layer_index)

  @classmethod
  def validate(cls, settings, model_config):
    base.check_kv_heads(model_config.num_heads, model_config.num_kv_heads)
    backend = model_config.attention_backend
    if backend not in cls.backends:
      raise ValueError(f"attention 'nsa' does not run on attention_backend {backend!r} (its block "
                       f"selection is a data-dependent mask); valid: {', '.join(cls.backends)}")
    for name in ("block_size", "num_selected", "tile_size"):
      if int(settings[name]) < 1:
        raise ValueError(f"model.nsa.{name} must be an integer >= 1, got {settings[name]}")
    if int(settings.window) < 0:
      raise ValueError(f"model.nsa.window must be >= 1 (the last w keys), or 0 for no window "
                       f"branch; got {settings.window}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    d, n, k = model_config.d_model, model_config.num_heads, model_config.num_kv_heads
    h = d // n
    self.position, self.layer_index = position, layer_index
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.block, self.num_selected = int(settings.block_size), int(settings.num_selected)
    self.window, self.tile = int(settings.window), int(settings.tile_size)
    self.backend = model_config.attention_backend
    self.kv_cache = kv_cache.KVCache(k)
    self.dtype = dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype)
    self.key = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=dtype)
    self.value = base.head_projection(d, k, h, "kv_heads", rngs=rngs, dtype=dtype)
    self.gate = nn.dense("BLD,DNC->BLNC", (d, n, BRANCHES), ("embed", "heads", "state"),
                         rngs=rngs, dtype=dtype,
                         init=nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)))
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype)

  def kv_group_size(self):
    return self.num_heads // self.num_kv_heads

  def scale(self):
    return self.position.logit_scale() / self.head_dim ** 0.5

  def project(self, x_BxTxD, positions_BxT):
    """(q [B, T, N, H], {"key", "value"} [B, T, K, H], gates float32 [B, T, N, 3])."""
    q = self.position.queries(self.query(x_BxTxD), positions_BxT)
    k = self.position.keys(self.key(x_BxTxD), positions_BxT)
    gates = jax.nn.sigmoid(self.gate(x_BxTxD).astype(jnp.float32))
    return q, {"key": k, "value": self.value(x_BxTxD)}, gates

  def resolved_backend(self, length):
    """The selected branch's backend for `length` tokens (auto: see the module docstring)."""
    if self.backend != "auto":
      return self.backend
    sparse = moba.sparse_logits_per_query(length, self.block, self.num_selected, self.num_heads,
                                          self.tile)
    return "blockwise" if sparse < (length + 1) / 2 else "xla"

  def _combine(self, gates_BxTxNx3, o_cmp, o_slc, o_swa):
    y = gates_BxTxNx3[..., 0, None] * o_cmp + gates_BxTxNx3[..., 1, None] * o_slc
    if o_swa is not None:
      y = y + gates_BxTxNx3[..., 2, None] * o_swa
    return self.out(y.astype(self.dtype))

  def _compressed(self, q, tokens, layout, segments_BxL=None):
    """(o^cmp float32 [B, L, N, H], the selected blocks [B, L, N, P] as indices among the row's
    complete blocks, -1 for none) of a sequence in its `layout` (moba.blocks)."""
    k, v = tokens["key"], tokens["value"]
    length = q.shape[1]
    within = masks.indices_in_documents(length, segments_BxL)
    ends_own = (within % self.block == self.block - 1).astype(jnp.int32)  # own block complete
    c = jnp.arange(layout.starts.shape[1])
    first, before = layout.first[..., None], layout.before[..., None]
    visible = (c >= first) & (c < before + ends_own[..., None])
    if c.shape[0]:
      means = [moba.block_means(x, layout.starts, self.block) for x in (k, v)]
    else:  # shorter than a block: no compressed key
      means = [jnp.zeros((x.shape[0], 0) + x.shape[2:], jnp.float32) for x in (k, v)]
    o_cmp, probs = compressed_attention(q, *means, visible, self.scale())
    picks = min(self.num_selected - 1, layout.starts.shape[1])
    return o_cmp, select_blocks(probs, (c >= first) & (c < before), picks, self.num_kv_heads)

  def attend(self, q, tokens, gates, positions_BxL, segments_BxL=None):
    """The three branches of a sequence attending to itself, gated: [B, L, D]."""
    k, v = tokens["key"], tokens["value"]
    length, scale = q.shape[1], self.scale()
    layout = moba.blocks(length, self.block, segments_BxL)
    o_cmp, routed = self._compressed(q, tokens, layout, segments_BxL)
    if self.resolved_backend(length) == "xla":
      modify = lambda logits, p, q_in, k_in: jnp.where(  # noqa: E731
          moba.visible_blocks(q_in, k_in), logits, moba.MASKED)
      o_slc = core.attend(q, k, v, scale=scale, score_mod=core.ScoreMod(modify=modify),
                          inputs=(positions_BxL, layout.group, layout.complete, routed),
                          segments_BxT=segments_BxL, backend="xla")
    else:
      o_slc = moba.sparse_attention(q, k, v, layout, routed, positions_BxL, scale=scale,
                                    bias_fn=None, chunk=self.block, tile=self.tile)
    o_swa = None
    if self.window:
      o_swa = core.attend(q, k, v, scale=scale, mask=masks.MaskSpec(window=self.window),
                          segments_BxT=segments_BxL, backend=self.backend, block_size=self.tile,
                          backends=self.backends)
    return self._combine(gates, o_cmp, o_slc.astype(jnp.float32),
                         None if o_swa is None else o_swa.astype(jnp.float32))

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    q, tokens, gates = self.project(x_BxLxD, positions_BxL)
    return self.attend(q, tokens, gates, positions_BxL, segments_BxL)

  def init_cache(self, batch_size, max_length):
    return self.kv_cache.init(batch_size, max_length, key_dim=self.head_dim,
                              value_dim=self.head_dim, dtype=self.dtype)

  def _attend_cache(self, q_BxTxNxH, tokens, gates, cache, index, documents=None):
    """The new tokens' three branches against the cache (their own keys written): [B, T, D].
    With `documents` blocks count from each document's start: a token of the cache's open
    document takes that document's blocks in the cache (their means gathered from its first
    slot on), one of a document that starts among the new tokens the sequence path's over them
    (its blocks are all there)."""
    b, t = q_BxTxNxH.shape[:2]
    kv, scale, block = self.num_kv_heads, self.scale(), self.block
    slots = cache["key"].shape[1]
    count = slots // block
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, t, documents)
    start_B = None if documents is None else documents.open_start_B
    means = [moba.cache_block_means(cache[name], block, b, start_B) for name in ("key", "value")]
    p_BxTx1 = positions_BxT[..., None]  # indices within the document
    c = jnp.arange(count)
    o_cmp, probs = compressed_attention(q_BxTxNxH, *means, (c + 1) * block - 1 <= p_BxTx1, scale)
    picks = min(self.num_selected - 1, count)
    routed = select_blocks(probs, c < p_BxTx1 // block, picks, kv)
    if documents is not None:
      layout = moba.blocks(t, block, segments_BxT)
      o_in_call, routed_in_call = self._compressed(q_BxTxNxH, tokens, layout, segments_BxT)
      routed_in_call = moba.in_document_blocks(routed_in_call, layout, picks)
      started = (documents.starts_BxT >= index)[:, :, None, None]  # starts in this call
      o_cmp = jnp.where(started, o_in_call, o_cmp)
      routed = jnp.where(started, routed_in_call, routed)
    mask, k_positions = kv_cache.full_cache_keys(core.CAUSAL, index_1xT, slots, documents)
    k_blocks = k_positions // block
    modify = lambda logits, p, q_in, k_in: jnp.where(  # noqa: E731
        moba.visible_blocks(q_in, k_in), logits, moba.MASKED)
    q_inputs = (positions_BxT, positions_BxT // block, None, routed)
    k_inputs = (k_positions, k_blocks, k_blocks, None)
    o_slc = kv_cache.cached_attention(
        q_BxTxNxH, [(cache["key"], cache["value"], q_inputs, k_inputs, mask)], scale,
        core.ScoreMod(modify=modify))
    o_swa = None
    if self.window:
      near, _ = kv_cache.full_cache_keys(masks.MaskSpec(window=self.window), index_1xT, slots,
                                         documents)
      o_swa = kv_cache.cached_attention(
          q_BxTxNxH, [(cache["key"], cache["value"], None, None, near)], scale)
      o_swa = o_swa.astype(jnp.float32)
    return self._combine(gates, o_cmp, o_slc.astype(jnp.float32), o_swa)

  document_decode_refusal = classmethod(base.no_refusal)  # blocks from each document's start

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens at indices index..index + T - 1: written to the cache, then their three
    branches over it; a prompt into an empty cache runs the sequence path. `documents`
    (masks.DecodeDocuments): packed documents, as `_attend_cache` says."""
    t = x_BxTxD.shape[1]
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, t, documents)
    q, tokens, gates = self.project(x_BxTxD, positions_BxT)
    tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}

    def from_cache(q, tokens, gates, cache):
      cache = self.kv_cache.write(tokens, cache, index_1xT[0])
      y = self._attend_cache(q, tokens, gates, cache, index, documents)
      # Past the cache's end the write would clamp: NaN rather than wrong outputs.
      return jnp.where(index + t <= cache["key"].shape[1], y, jnp.nan), cache

    def prefill_empty(q, tokens, gates, cache):
      return (self.attend(q, tokens, gates, positions_BxT, segments_BxT),
              self.kv_cache.write(tokens, cache, index_1xT[0]))

    if t == 1:
      return from_cache(q, tokens, gates, cache)
    return jax.lax.cond(index == 0, prefill_empty, from_cache, q, tokens, gates, cache)

  def mixing_flops_per_token(self, context_length):
    """q k^T and p v (2 FLOPs per multiply-add, keys and values of H) over: the complete blocks'
    means (L / (2 l) on average, plus the importance), the selected branch's keys (xla: the
    dense (L + 1) / 2, masked afterwards; blockwise: MoBA's count, padding included) and the
    window's (at most w)."""
    length, heads, h = context_length, self.num_heads, self.head_dim
    compressed = (length // self.block) / 2
    if self.resolved_backend(length) == "xla":
      selected = (length + 1) / 2
    else:
      selected = moba.sparse_logits_per_query(length, self.block, self.num_selected, heads,
                                              self.tile)
    window = 0.0
    if self.window:
      w = min(self.window, length)
      window = (w * (w + 1) / 2 + (length - w) * w) / length
    return 2 * heads * 2 * h * (compressed + selected + window) + heads * compressed
