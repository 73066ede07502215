"""PaTH attention (Yang et al., "PaTH Attention: Position Encoding via Accumulating Householder
Transformations", arXiv:2505.16381): softmax attention whose query-key pairs are connected by a
product of data-dependent Householder-like transforms instead of RoPE's fixed rotations, with no
position scheme.

  H_t = I - beta_t w_t w_t^T,  w_t = L2norm(silu(conv(W_w x)_t)),  beta_t = 2 sigmoid(W_b x_t + b_b)
  s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j     (j <= i; s_ii = q_i . k_i: H_j is not applied)
  o_i = sum_j softmax_j(scale (s_ij + c_i - c_j)) v_j,   scale = H^-0.5,   y_i = W_O o_i
c_i = sum_{l<=i} log sigmoid(W_g x_l + b_g) is the optional forget gate (FoX's, but inside the
scale, as the reference: use_forget_gate, off by default). W_w is low rank (D -> 32 -> K H,
w_rank; 0: one D -> K H projection), conv a causal depthwise convolution of width 3 (conv_width;
0: none, and no silu). Queries, keys and values are plain projections (N query heads, K =
model.num_kv_heads key/value heads, GQA: w and beta belong to the key heads), optionally
RMS-normalised per head (use_qk_norm). With beta in (0, 2) and |w| = 1 each H_t has eigenvalues
1 and 1 - beta in (-1, 1]: every product is non-expansive.

The chunked (UT / WY) form. In a chunk of C tokens, with W, K [C, H] its w and k, L = strictly
lower(diag(beta) W W^T) and T = (I + L)^-1 (unit lower; research.model.attention.gated_deltanet's
invert_unit_lower), the chunk's whole product is H_last ... H_first = I - W^T T diag(beta) W,
and with U = T strictly_lower(diag(beta) W K^T) and QW = lower(Q W^T) (diagonal included):
  within the chunk   s_ij = q_i . k_j - (QW U)_ij                  (j <= i)
  key to chunk end   k~_j = k_j - sum_m U_mj w_m     (H_last ... H_{j+1} k_j)
  query to its start q^_i = q_i - (QW T diag(beta) W)_i    (q_i^T H_i ... H_first)
A reverse scan over key chunks carries every query transported back to the end of the current
key chunk (a query joins as q^ when its own chunk is passed; passing chunk z applies x <- x -
(x W_z^T) T_z diag(beta_z) W_z) and reads that chunk's logits as state . k~; with chunk_size 1 it
is the token-by-token scan (each step touches every query, twice the least work, for one
vectorised update). The logits are materialised, [B, N, L, L] (O(L^2) memory, like the
xla backend of softmax attention), masked (causal; packed documents: only keys of the query's
document, whose transforms all lie in that document too), and normalised by a float32 softmax.
Work: O(L^2 H) plus O(L C H) for the chunks, L / C sequential steps.

Decode: the cache holds every key transported to the last cached token, K_j = H_{t-1} ... H_{j+1}
k_j (as the reference's decoding), the values, the convolution window of W_w x and, with the
gate, c. T new tokens (any T) run the chunked form among themselves; their queries, transported
back past all of them (the reverse scan's final state), dot the cached keys; a forward scan over
the new chunks then carries the cached keys and the new ones to the last new token.

Checked against fla-org/flash-linear-attention@bc3b101 (bc3b101dcb713ddc5bd8924b66754eb68b5ccf89):
  * fla/ops/path_attn/naive.py `naive_path_attn`: the chunked WY form above (T_mat, Twbk, q - qw
    Twb, k - Twbk^T w, the inter-chunk loop q <- q - q H_mat), A + g_cumsum_i - g_cumsum_j, then
    (A * scale).softmax; tests/ops/test_path_attn.py (w L2-normalised, beta in (0, 2), g = log
    of a gate, scale = H^-0.5; varlen: one call per document). The kernels
    (parallel_path_fwd.py) scale the gate's term as well.
  * fla/layers/path_attn.py `PaTHAttention.forward`: q, k, v, o projections without bias; w_proj
    Linear(D, 32) then Linear(32, K H) (use_low_rank_w True), ShortConvolution(K H, 3, silu, no
    bias; reset per document through cu_seqlens), l2_norm (eps 1e-6, float32); bt_proj with
    bias, beta = 2 sigmoid; g_proj with bias, g = logsigmoid (use_forget_gate False); optional
    RMSNorm q/k per head (eps 1e-5); decoding: each new token's rank-one update k - beta (k . w)
    w of every cached key, then plain attention with the gate (attn_decoding_one_step).
Deviations: the lab's initialisation (LeCun normal projections, biases 0; the convolution
U[-1/sqrt(W), 1/sqrt(W)] as PyTorch's Conv1d default) where fla's PaTH model re-initialises every
Linear and Conv1d as normal(0, 0.02); transforms, scores and softmax in float32 (the reference's
kernels take w and its WY factor in float16, and its decoding keeps the cached keys in the
compute dtype, rounding each of them at every step: here they are cached in float32); the qk
norm, when on, is applied in decoding too (the reference's prefill/decode branch skips it); no
padding mask (the lab's packed documents instead); decoding takes any number of new tokens (the
reference: one); the sequence path materialises the [B, N, L, L] logits where the reference's
kernel is blockwise (flash-style, O(L) memory).
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import core
from research.model.attention import gated_deltanet
from research.model.attention import masks
from research.model.attention import modules


def chunk_factors(k_BxKxTxH, w_BxKxTxH, beta_BxKxT, chunk):
  """Per chunk (module docstring): the keys k, the keys moved to their chunk's end k~, w,
  T diag(beta) W (w_beta), and U; float32, [B, K, Z, C, H] ([.., C, C] for U). The tokens are
  zero-padded to Z C (zero w and beta: H = I)."""
  k, w = (chunked.split_chunks(x.astype(jnp.float32), chunk, axis=-2)
          for x in (k_BxKxTxH, w_BxKxTxH))
  beta = chunked.split_chunks(beta_BxKxT.astype(jnp.float32)[..., None], chunk,
                              axis=-2)  # [B, K, Z, C, 1]
  below = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
  eye = jnp.eye(chunk, dtype=jnp.float32)
  system = eye + jnp.where(below, beta * jnp.einsum("bkzch,bkzsh->bkzcs", w, w), 0.0)
  inverse = gated_deltanet.invert_unit_lower(system)
  w_beta = jnp.einsum("bkzcs,bkzsh->bkzch", inverse, beta * w)
  coefficients = jnp.einsum(
      "bkzcm,bkzmj->bkzcj", inverse,
      jnp.where(below, beta * jnp.einsum("bkzmh,bkzjh->bkzmj", w, k), 0.0))
  k_end = k - jnp.einsum("bkzmj,bkzmh->bkzjh", coefficients, w)
  return k, k_end, w, w_beta, coefficients


def path_logits(q_BxKxGxTxH, k_BxKxTxH, w_BxKxTxH, beta_BxKxT, chunk_size):
  """(s_ij = q_i^T H_i ... H_{j+1} k_j for every pair, float32 [B, K, G, T, T] (garbage above
  the diagonal: mask it), the queries transported back past every token, q_i^T H_i ... H_0,
  [B, K, G, T, H]): the chunked form, a reverse scan over the key chunks."""
  t = q_BxKxGxTxH.shape[-2]
  chunk = max(1, min(chunk_size, t))
  k, k_end, w, w_beta, coefficients = chunk_factors(k_BxKxTxH, w_BxKxTxH, beta_BxKxT, chunk)
  q = chunked.split_chunks(q_BxKxGxTxH.astype(jnp.float32), chunk, axis=-2)  # [B, K, G, Z, C, H]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  qw = jnp.where(lower, jnp.einsum("bkgzch,bkzsh->bkgzcs", q, w), 0.0)
  local = (jnp.einsum("bkgzch,bkzsh->bkgzcs", q, k)
           - jnp.einsum("bkgzcm,bkzmj->bkgzcj", qw, coefficients))
  q_start = q - jnp.einsum("bkgzcm,bkzmh->bkgzch", qw, w_beta)
  num_chunks = q.shape[3]
  chunk_id = jnp.arange(num_chunks)[:, None, None]  # the queries' chunk, against [Z, C, .]

  def step(state, inputs):  # state: each query moved back to the end of key chunk j
    j, k_end_j, w_j, w_beta_j, local_j, q_start_j = inputs
    logits = jnp.einsum("bkgzch,bksh->bkgzcs", state, k_end_j)
    logits = jnp.where(chunk_id == j, local_j[:, :, :, None], logits)
    moved = state - jnp.einsum("bkgzcm,bkmh->bkgzch",
                               jnp.einsum("bkgzch,bkmh->bkgzcm", state, w_j), w_beta_j)
    return jnp.where(chunk_id == j, q_start_j[:, :, :, None], moved), logits

  to_scan = lambda x, axis: jnp.moveaxis(x, axis, 0)  # noqa: E731
  state, logits = jax.lax.scan(
      step, jnp.zeros_like(q),
      (jnp.arange(num_chunks), to_scan(k_end, 2), to_scan(w, 2), to_scan(w_beta, 2),
       to_scan(local, 3), to_scan(q_start, 3)), reverse=True)
  b, kv, g = q.shape[:3]
  padded = num_chunks * chunk
  logits = jnp.moveaxis(logits, 0, -2).reshape(b, kv, g, padded, padded)[..., :t, :t]
  return logits, state.reshape(b, kv, g, padded, -1)[..., :t, :]


def keys_to_end(k_BxKxTxH, w_BxKxTxH, beta_BxKxT, earlier_BxKxSxH, chunk_size):
  """(each key moved to the last token, H_{T-1} ... H_{j+1} k_j, [B, K, T, H], the earlier keys
  moved through every transform, H_{T-1} ... H_0 k): a forward scan over the chunks."""
  t = k_BxKxTxH.shape[-2]
  chunk = max(1, min(chunk_size, t))
  _, k_end, w, w_beta, _ = chunk_factors(k_BxKxTxH, w_BxKxTxH, beta_BxKxT, chunk)
  b, kv, num_chunks = k_end.shape[:3]
  chunk_of_key = (jnp.arange(num_chunks * chunk) // chunk)[:, None]

  def through(x_BxKxSxH, w_j, w_beta_j):  # x <- x - W^T (T diag(beta) W) x for each key x
    return x_BxKxSxH - jnp.einsum("bksm,bkmh->bksh",
                                  jnp.einsum("bksh,bkmh->bksm", x_BxKxSxH, w_beta_j), w_j)

  def step(carry, inputs):
    keys, earlier = carry
    j, k_end_j, w_j, w_beta_j = inputs
    own = jnp.tile(k_end_j, (1, 1, num_chunks, 1))  # chunk j's keys, at every chunk's place
    keys = jnp.where(chunk_of_key == j, own, through(keys, w_j, w_beta_j))
    return (keys, through(earlier, w_j, w_beta_j)), None

  keys = jnp.zeros((b, kv, num_chunks * chunk, k_end.shape[-1]), jnp.float32)
  (keys, earlier), _ = jax.lax.scan(
      step, (keys, earlier_BxKxSxH.astype(jnp.float32)),
      (jnp.arange(num_chunks),) + tuple(jnp.moveaxis(x, 2, 0) for x in (k_end, w, w_beta)))
  return keys[:, :, :t], earlier


class PaTHAttention(base.Mixer):
  hyperparameters = {"chunk_size": 64,  # tokens per chunk of the WY form (1: token by token)
                     "conv_width": 3,  # short convolution of w (0: none)
                     "w_rank": 32,  # low-rank w projection D -> w_rank -> K H (0: full rank)
                     "use_forget_gate": False,  # c_i - c_j inside the softmax (FoX's gate)
                     "use_qk_norm": False}  # RMSNorm of q and k per head
  test_settings = {"chunk_size": 8, "use_forget_gate": True}
  position_hooks = frozenset()
  has_attention_weights = True
  reads_num_kv_heads = True

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_kv_heads

  @classmethod
  def validate(cls, settings, model_config):
    base.check_kv_heads(model_config.num_heads, model_config.num_kv_heads)
    if settings.chunk_size < 1:
      raise ValueError(f"model.path.chunk_size must be >= 1, got {settings.chunk_size}")
    for field in ("conv_width", "w_rank"):
      if settings[field] < 0:
        raise ValueError(f"model.path.{field} must be >= 0 (0: none), got {settings[field]}")
    for field in ("use_forget_gate", "use_qk_norm"):
      if not isinstance(settings[field], bool):
        raise ValueError(f"model.path.{field} must be True or False, got {settings[field]!r}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index
    d, n, kv = model_config.d_model, model_config.num_heads, model_config.num_kv_heads
    h = d // n
    self.position = position
    self.num_heads, self.num_kv_heads, self.head_dim = n, kv, h
    self.chunk_size = int(settings.chunk_size)
    self.conv_width = int(settings.conv_width)
    self.use_forget_gate = bool(settings.use_forget_gate)
    self.use_qk_norm = bool(settings.use_qk_norm)
    self.w_rank = int(settings.w_rank)
    self.dtype = dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype)
    self.key = base.head_projection(d, kv, h, "kv_heads", rngs=rngs, dtype=dtype)
    self.value = base.head_projection(d, kv, h, "kv_heads", rngs=rngs, dtype=dtype)
    if settings.w_rank:
      self.w_down = nn.dense("BLD,DR->BLR", (d, int(settings.w_rank)), ("embed", "ssm_proj"),
                             rngs=rngs, dtype=dtype)
      self.w_up = nn.dense("BLR,RKH->BLKH", (int(settings.w_rank), kv, h),
                           ("ssm_proj", "kv_heads", "head_dim"), rngs=rngs, dtype=dtype,
                           init=jax.nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)))
    else:
      self.w_proj = base.head_projection(d, kv, h, "kv_heads", rngs=rngs, dtype=dtype)
    if self.conv_width:  # U[-1/sqrt(W), 1/sqrt(W)] as PyTorch's Conv1d
      self.w_conv = modules.short_conv_kernel(rngs, self.conv_width, (kv, h),
                                              ("kv_heads", "head_dim"))
    self.beta_proj = nn.dense("BLD,DK->BLK", (d, kv), ("embed", "kv_heads"), rngs=rngs,
                              dtype=dtype, bias_shape=(kv,), bias_axes=("kv_heads",))
    if self.use_forget_gate:
      self.forget_gate = nn.dense("BLD,DN->BLN", (d, n), ("embed", "heads"), rngs=rngs,
                                  dtype=dtype, bias_shape=(n,), bias_axes=("heads",))
    if self.use_qk_norm:
      self.q_norm_scale = nn.param(jnp.ones((h,)), ("head_dim",), weight_decay=False)
      self.k_norm_scale = nn.param(jnp.ones((h,)), ("head_dim",), weight_decay=False)
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype)

  def kv_group_size(self):
    return self.num_heads // self.num_kv_heads

  def scale(self):
    return self.head_dim ** -0.5

  def _project(self, x_BxTxD, positions_BxT, conv_window, segments_BxT=None,
               continues_cache=False):
    """Per token (heads first, float32 but v): q [B, K, G, T, H], k, w [B, K, T, H], beta
    [B, K, T], v [B, T, K, H], c [B, T, N] (None without the gate; restarting per document, but
    for the first one if it `continues_cache`), and the convolution's next window."""
    b, t, _ = x_BxTxD.shape
    kv, g = self.num_kv_heads, self.kv_group_size()
    q = self.position.queries(self.query(x_BxTxD), positions_BxT).astype(jnp.float32)
    k = self.position.keys(self.key(x_BxTxD), positions_BxT).astype(jnp.float32)
    if self.use_qk_norm:  # fla's RMSNorm, eps 1e-5
      q, k = (modules.rms_norm(q, self.q_norm_scale[...]),
              modules.rms_norm(k, self.k_norm_scale[...]))
    w = self.w_up(self.w_down(x_BxTxD)) if self.w_rank else self.w_proj(x_BxTxD)
    if self.conv_width:
      w, conv_window = modules.causal_depthwise_conv(w, conv_window, self.w_conv[...],
                                                     segments_BxT=segments_BxT)
      w = jax.nn.silu(w)
    w = gated_deltanet.l2_normalize(w.astype(jnp.float32))
    beta = 2.0 * jax.nn.sigmoid(self.beta_proj(x_BxTxD).astype(jnp.float32))
    c = None
    if self.use_forget_gate:
      c = jnp.cumsum(jax.nn.log_sigmoid(self.forget_gate(x_BxTxD).astype(jnp.float32)), axis=1)
      if segments_BxT is not None:  # restart at each document's first token
        first_BxT = jnp.arange(t) - masks.positions_in_documents(segments_BxT)
        shift = jnp.take_along_axis(c, first_BxT[:, :, None], axis=1)
        if continues_cache:  # the first document goes on from the cached c (a constant shift)
          shift = jnp.where((segments_BxT == segments_BxT[:, :1])[..., None], 0.0, shift)
        c = c - shift
    heads_first = lambda x: jnp.moveaxis(x, 1, 2)  # noqa: E731  [B, T, K, ...] -> [B, K, T, ...]
    q = q.reshape(b, t, kv, g, -1).transpose(0, 2, 3, 1, 4)
    return (q, heads_first(k), heads_first(w), heads_first(beta), self.value(x_BxTxD), c,
            conv_window)

  def _empty_window(self, batch_size):
    return jnp.zeros((batch_size, max(self.conv_width - 1, 0), self.num_kv_heads,
                      self.head_dim), self.dtype)

  def _probabilities(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """(probabilities [B, N, L, L] float32, visible [B | 1, 1, L, L], values [B, L, K, H])."""
    b, length, _ = x_BxLxD.shape
    q, k, w, beta, v, c, _ = self._project(x_BxLxD, positions_BxL, self._empty_window(b),
                                           segments_BxL)
    scores = path_logits(q, k, w, beta, self.chunk_size)[0].reshape(b, -1, length, length)
    if c is not None:
      scores = scores + (c.transpose(0, 2, 1)[..., :, None] - c.transpose(0, 2, 1)[..., None, :])
    visible = jnp.tril(jnp.ones((length, length), bool))[None, None]
    if segments_BxL is not None:
      visible = visible & masks.same_segment(segments_BxL, segments_BxL)
    probs = jax.nn.softmax(jnp.where(visible, scores * self.scale(), -jnp.inf), axis=-1)
    return probs, visible, v

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    probs, _, v = self._probabilities(x_BxLxD, positions_BxL, segments_BxL)
    return self.out(core.grouped_values(probs, v).astype(self.dtype))

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The softmax probabilities of `__call__`, float32 [B, N, L (query), L (key)]."""
    return self._probabilities(x_BxLxD, positions_BxL, segments_BxL)[0]

  def with_edited_weights(self, x_BxLxD, positions_BxL, segments_BxL, edit):
    """`__call__` with the probabilities P replaced by edit(P, visible)."""
    probs, visible, v = self._probabilities(x_BxLxD, positions_BxL, segments_BxL)
    return self.out(core.grouped_values(edit(probs, visible), v).astype(self.dtype))

  def init_cache(self, batch_size, max_length):
    kv, h = self.num_kv_heads, self.head_dim
    cache = {"key": jnp.zeros((batch_size, kv, max_length, h), jnp.float32),
             "value": jnp.zeros((batch_size, kv, max_length, h), self.dtype),
             "conv": self._empty_window(batch_size)}
    if self.use_forget_gate:
      cache["log_forget"] = jnp.zeros((batch_size, max_length, self.num_heads), jnp.float32)
    return cache

  # With documents every transform between a query and a key it sees lies in their document; a
  # key moved past a later document's transforms is seen by none of its queries.
  document_decode_refusal = classmethod(base.no_refusal)

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens at indices index..index + T - 1 against the cache and each other (module
    docstring); returns their outputs and the cache with every key moved to the last token.
    `documents` (masks.DecodeDocuments): packed documents, each query sees the keys of its
    own, and the convolution restarts at each."""
    b, t, _ = x_BxTxD.shape
    n, slots = self.num_heads, cache["key"].shape[2]
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, t, documents)
    conv, _ = modules.decode_window(cache["conv"], documents)
    q, k, w, beta, v, c, window = self._project(
        x_BxTxD, positions_BxT, conv, segments_BxT, continues_cache=True)
    new_scores, q_start = path_logits(q, k, w, beta, self.chunk_size)
    cached_scores = jnp.einsum("bkgth,bksh->bkgts", q_start, cache["key"])
    scores = jnp.concatenate([cached_scores, new_scores], axis=-1).reshape(b, n, t, slots + t)
    if c is not None:
      last = jnp.where(index > 0, cache["log_forget"][:, jnp.maximum(index - 1, 0)], 0.0)
      c = c + last[:, None, :]
      c_keys = jnp.concatenate([cache["log_forget"], c], axis=1)  # [B, S + T, N]
      scores = scores + (c.transpose(0, 2, 1)[..., :, None]
                         - c_keys.transpose(0, 2, 1)[..., None, :])
    visible = jnp.concatenate([jnp.broadcast_to(jnp.arange(slots) < index, (t, slots)),
                               jnp.tril(jnp.ones((t, t), bool))], axis=1)
    if documents is not None:  # [B, 1, T, S + T]
      visible = visible & documents.keys_in_documents(
          jnp.concatenate([jnp.arange(slots), index_1xT[0]]))
    probs = jax.nn.softmax(jnp.where(visible, scores * self.scale(), -jnp.inf), axis=-1)
    values = jnp.concatenate([cache["value"], jnp.moveaxis(v, 1, 2).astype(self.dtype)], axis=2)
    o = core.grouped_values(probs, jnp.moveaxis(values, 1, 2))
    # Past the cache's end the writes below clamp and overwrite the last slots: NaN, not wrong.
    o = jnp.where(index + t <= slots, o, jnp.nan)
    new_keys, moved = keys_to_end(k, w, beta, cache["key"], self.chunk_size)
    cache = {**cache, "conv": window.astype(self.dtype),
             "key": jax.lax.dynamic_update_slice(moved, new_keys, (0, 0, index, 0)),
             "value": jax.lax.dynamic_update_slice(cache["value"], values[:, :, slots:],
                                                   (0, 0, index, 0))}
    if c is not None:
      cache["log_forget"] = jax.lax.dynamic_update_slice(cache["log_forget"], c, (0, index, 0))
    return self.out(o.astype(self.dtype)), cache

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """Keys (float32, moved at every step) and values of the K key heads, and c with the
    gate."""
    settings = model_config.get("path") or cls.hyperparameters
    itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
    width = model_config.num_kv_heads * (model_config.d_model // model_config.num_heads)
    gate = 4 * model_config.num_heads if settings.get("use_forget_gate") else 0
    return width * (4 + itemsize) + gate

  def mixing_flops_per_token(self, context_length):
    n, kv, h = self.num_heads, self.num_kv_heads, self.head_dim
    c = min(self.chunk_size, context_length)
    keys = (context_length + 1) / 2  # visible keys per query, on average
    # s = q . k~ and p v; moving each query back through the chunks before it (x W^T, then
    # times T diag(beta) W: 4 H per token passed); within a chunk (C + 1) / 2 tokens on average:
    # W W^T, W K^T, U^T W, T beta W per key head, Q W^T, QW U, QW (T beta W) per query head
    # (the inverse's doubling aside); the convolution of w.
    across = 2 * n * 2 * h * keys + n * 4 * h * keys
    within = 2 * (c + 1) / 2 * (kv * 4 * h + n * 3 * h)
    return across + within + 2 * self.conv_width * kv * h
