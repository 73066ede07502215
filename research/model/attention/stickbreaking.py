"""Stick-breaking attention (Tan, Yang, Courville, Panda & Shen, arXiv:2410.17980): attention
whose weights break a stick from the nearest key backwards, a sigmoid per key instead of a
softmax, with no position scheme.

  z_ij = q_i . k_j / sqrt(H),   beta_ij = sigmoid(z_ij)        keys j < i (j <= i: attend_current)
  A_ij = beta_ij prod_{j < l < i} (1 - beta_il),   r_i = 1 - sum_j A_ij   (the stick left over)
  o_i = GroupNorm_per_head(sum_j A_ij v_j + r_i u_i),   y_i = W_O o_i
The remainder r_i takes u_i = b, a learned vector per head (model.stickbreaking.remainder
"bias", the authors' layer; 0 at initialisation), u_i = v_i, the query's own value ("value",
the authors' kernel tests), or nothing ("none"). GroupNorm: per head, mean and variance over
the head dim, eps 1e-5, a per-channel scale (1) and shift (0). The weights come from the core
(research.model.attention.core.attend with normaliser="stickbreaking"; research/model/attention/
stick_breaking_kernel.py): `xla` materialises them, `blockwise` visits key blocks from the
diagonal backwards in O(length) memory; r_i is read off a column of ones appended to the values
(sum_j A_ij * 1). The decode cache is a KV cache (research.model.attention.kv_cache.KVCache, the
full layout): new tokens are written, then their weights over every cached key are taken in one
reverse cumulative sum (`cached_stick_breaking`); a prompt into an empty cache takes the sequence
path. Packed documents: keys of other documents take neither weight nor a share of the stick,
so each document's first token keeps the whole stick (r = 1).

No position scheme: the stick itself orders the keys (the authors' layer ignores the RoPE it is
handed), so position_hooks is empty and the model refuses qk and bias schemes; embedding
schemes are the model's and combine. No sliding window or sinks: every earlier key holds part of
the stick. `cudnn` is refused (no such kernel).

Checked against the authors' code:
  * shawntan/stickbreaking-attention@3147a38: stickbreaking_attention/sb_ref.py `stickbreaking`
    (weights, remainder 1 - sum A), sb_attn/__init__.py `sb_attn` (inv_temp 1/sqrt(head dim),
    attend_current False), tests/test_attn.py `ref_fwd` (o + rem * v: the "value" remainder);
    details in stick_breaking_kernel.py.
  * IBM/dolomite-engine@d0ee186 (now lm_engine), lm_engine/hf_models/modeling_utils/
    sequence_mixer_blocks/stickbreaking_attention.py, `SBAttention.forward`: sb_attn with the
    softmax scale (attention_multiplier, else 1/sqrt(head dim)) and attend_current False,
    rem[..., None] * head_bias ([heads, head dim], zeros), torch.nn.GroupNorm(num_heads,
    hidden_size) (eps 1e-5, weight 1, bias 0) over each head, then c_proj; the rope_cos_sin
    argument is not used; `decoding_stickbreaking`: one query against the cached keys except
    its own (k[..., :-1]), the reverse cumulative sum of log(1 - beta) less its own term, the
    same weights as the sequence path.
Deviations: projections are this lab's (separate q, k, v and output kernels, LeCun normal, no
biases: as mha here) rather than dolomite's fused c_attn with normal(0, initializer_range) and
c_proj scaled by 1/sqrt(2 layers); as many key/value heads as heads (their layer also runs GQA,
where its padded path pairs query head n with key head n mod K, the padding-free one n // G; the
core supports n // G, the mixer uses K = N); no dropout; the remainder in the compute dtype
(1 - sum A as read off the ones column; their kernel returns exp(sum log(1 - beta)) in q's
dtype).
"""

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import core
from research.model.attention import stick_breaking_kernel
from research.model.attention.kv_cache import KVCache

BACKENDS = ("auto", "xla", "blockwise")
# model.stickbreaking.remainder: what the weight left over (1 - sum_j A_ij) multiplies.
REMAINDERS = ("bias", "value", "none")
NORM_EPSILON = 1e-5  # torch.nn.GroupNorm's default, as the authors' layer


def cached_stick_breaking(q_BxTxNxH, cache, new_index_T, scale, attend_current, documents=None):
  """(sum_j A_ij v_j [B, T, N, V] float32, the remainders 1 - sum_j A_ij [B, T, N]) of T new
  queries at token indices new_index_T against a full KV cache (kv_cache.KVCache's layout:
  keys [B K, S, H], values [B K, S, V], token s in slot s) that already holds them: the
  weights over every slot before the query (or up to it) and, with `documents`
  (masks.DecodeDocuments), in its document, materialised in float32."""
  b, t, n, h = q_BxTxNxH.shape
  keys, values = cache["key"], cache["value"]
  rows, slots = keys.shape[:2]
  kv_heads = rows // b
  group = n // kv_heads
  q_XxGxTxH = (q_BxTxNxH.reshape(b, t, kv_heads, group, h).transpose(0, 2, 3, 1, 4)
               .reshape(rows, group, t, h))
  logits = jnp.einsum("XGTH,XSH->XGTS", q_XxGxTxH, keys, preferred_element_type=jnp.float32)
  slot_S = jnp.arange(slots)
  visible = stick_breaking_kernel.visible_keys(slot_S[None, :] <= new_index_T[:, None],
                                               new_index_T, slot_S, attend_current)
  if documents is not None:  # [B K, 1, T, S]: rows are batch-major
    visible = visible & jnp.repeat(documents.keys_in_documents(slot_S), kv_heads, axis=0)
  a_XxGxTxS = stick_breaking_kernel.weights(logits * scale, visible)
  out = jnp.einsum("XGTS,XSV->XGTV", a_XxGxTxS.astype(values.dtype), values,
                   preferred_element_type=jnp.float32)
  out_BxTxNxV = out.reshape(b, kv_heads, group, t, -1).transpose(0, 3, 1, 2, 4).reshape(
      b, t, n, -1)
  remainder = (1.0 - a_XxGxTxS.sum(-1)).reshape(b, n, t).transpose(0, 2, 1)
  return out_BxTxNxV, remainder


class StickBreakingAttention(base.Mixer):
  hyperparameters = {"block_size": 128,  # blockwise backend: query and key block length
                     "attend_current": False,  # the query's own key takes part of the stick
                     # what the weight left over multiplies: "bias" (a learned vector per head,
                     # the authors' layer), "value" (the query's own value) or "none"
                     "remainder": "bias"}
  test_settings = {"block_size": 8}
  position_hooks = frozenset()
  backends = BACKENDS
  has_attention_weights = True

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads

  @classmethod
  def chunk_length(cls, settings):
    return int(settings.block_size)  # the blockwise backend's tiles

  @classmethod
  def validate(cls, settings, model_config):
    backend = model_config.attention_backend
    if backend not in cls.backends:
      raise ValueError(f"attention 'stickbreaking' does not run on attention_backend {backend!r}; "
                       f"valid: {', '.join(cls.backends)} (no cuDNN kernel computes its weights)")
    if settings.block_size < 1:
      raise ValueError(f"model.stickbreaking.block_size must be >= 1, got {settings.block_size}")
    if not isinstance(settings.attend_current, bool):
      raise ValueError("model.stickbreaking.attend_current must be True or False, got "
                       f"{settings.attend_current!r}")
    if settings.remainder not in REMAINDERS:
      raise ValueError(f"unknown model.stickbreaking.remainder {settings.remainder!r}; valid: "
                       f"{', '.join(map(repr, REMAINDERS))}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    self.position = position
    self.layer_index = layer_index
    self.num_heads, self.head_dim = n, h
    self.backend = model_config.attention_backend
    self.block_size = int(settings.block_size)
    self.attend_current = bool(settings.attend_current)
    self.remainder = str(settings.remainder)
    self.normaliser = stick_breaking_kernel.StickBreaking(self.attend_current)
    self.kv_cache = KVCache(n)
    self.dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d, n, h, "heads", rngs=rngs, dtype=self.dtype)
    self.key = base.head_projection(d, n, h, "kv_heads", rngs=rngs, dtype=self.dtype)
    self.value = base.head_projection(d, n, h, "kv_heads", rngs=rngs, dtype=self.dtype)
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=self.dtype)
    if self.remainder == "bias":
      self.head_bias = nn.param(jnp.zeros((n, h)), ("heads", "head_dim"), weight_decay=False)
    self.norm_scale = nn.param(jnp.ones((n, h)), ("heads", "head_dim"), weight_decay=False)
    self.norm_bias = nn.param(jnp.zeros((n, h)), ("heads", "head_dim"), weight_decay=False)

  def scale(self):
    return self.head_dim ** -0.5

  def project(self, x_BxTxD, positions_BxT):
    """(queries [B, T, N, H], {"key": [B, T, N, H], "value": [B, T, N, H]}); the scheme's
    query and key hooks are no-ops for the schemes the model pairs with this mixer."""
    q = self.position.queries(self.query(x_BxTxD), positions_BxT)
    k = self.position.keys(self.key(x_BxTxD), positions_BxT)
    return q, {"key": k, "value": self.value(x_BxTxD)}

  def finish(self, o_BxTxNxH, remainder_BxTxN, v_BxTxNxH):
    """The layer after the weights: the remainder's term, the per-head GroupNorm, the output
    projection."""
    o = o_BxTxNxH.astype(jnp.float32)
    if self.remainder == "bias":
      o = o + remainder_BxTxN[..., None] * self.head_bias[...]
    elif self.remainder == "value":
      o = o + remainder_BxTxN[..., None] * v_BxTxNxH.astype(jnp.float32)
    centred = o - o.mean(-1, keepdims=True)
    normed = centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + NORM_EPSILON)
    return self.out((normed * self.norm_scale[...] + self.norm_bias[...]).astype(self.dtype))

  def attend(self, q_BxLxNxH, tokens, segments_BxL=None):
    """(sum_j A_ij v_j [B, L, N, H], the remainders [B, L, N]) of a whole sequence through the
    configured backend: the remainder is 1 - the output of a column of ones."""
    v = tokens["value"]
    ones = jnp.ones(v.shape[:-1] + (1,), v.dtype)
    out = core.attend(q_BxLxNxH, tokens["key"], jnp.concatenate([v, ones], axis=-1),
                      scale=self.scale(), segments_BxT=segments_BxL, backend=self.backend,
                      block_size=self.block_size, backends=self.backends,
                      normaliser=self.normaliser)
    return out[..., :-1], 1.0 - out[..., -1].astype(jnp.float32)

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    q, tokens = self.project(x_BxLxD, positions_BxL)
    return self.finish(*self.attend(q, tokens, segments_BxL), tokens["value"])

  def _weights(self, x_BxLxD, positions_BxL, segments_BxL):
    q, tokens = self.project(x_BxLxD, positions_BxL)
    weights, visible = core.probabilities(q, tokens["key"], scale=self.scale(),
                                          segments_BxT=segments_BxL, normaliser=self.normaliser)
    return weights, visible, tokens

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The stick-breaking weights A of `__call__`, float32 [B, N, L (query), L (key)],
    materialised (rows sum to 1 - the remainder)."""
    return self._weights(x_BxLxD, positions_BxL, segments_BxL)[0]

  def with_edited_weights(self, x_BxLxD, positions_BxL, segments_BxL, edit):
    """`__call__` with the weights A replaced by edit(A, visible) (visible [B | 1, 1, L, L]: the
    keys that may take weight), the remainder kept from A; edit = lambda a, m: a gives
    `__call__` (materialised)."""
    weights, visible, tokens = self._weights(x_BxLxD, positions_BxL, segments_BxL)
    values = tokens["value"]
    o = core.grouped_values(edit(weights, visible), values)
    return self.finish(o, (1.0 - weights.sum(-1)).transpose(0, 2, 1), values)

  def init_cache(self, batch_size, max_length):
    return self.kv_cache.init(batch_size, max_length, key_dim=self.head_dim,
                              value_dim=self.head_dim, dtype=self.dtype)

  document_decode_refusal = classmethod(base.no_refusal)  # the full cache's document mask

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens at indices index..index + T - 1 against the cache and each other: written,
    then weighted over every cached key (`cached_stick_breaking`); a prompt into an empty cache
    takes the sequence path (blockwise skips masked tiles). `documents`: packed documents
    (masks.DecodeDocuments)."""
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, x_BxTxD.shape[1],
                                                                   documents)
    q, tokens = self.project(x_BxTxD, positions_BxT)
    tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
    cache = self.kv_cache.write(tokens, cache, index_1xT[0])

    def from_cache(q, tokens, cache):
      o, remainder = cached_stick_breaking(q, cache, index_1xT[0], self.scale(),
                                           self.attend_current, documents)
      # Past the cache's end the write clamped and overwrote the last slots: NaN, not wrong.
      fits = index + q.shape[1] <= cache["key"].shape[1]
      return jnp.where(fits, o, jnp.nan), remainder

    def prefill_empty(q, tokens, cache):
      del cache
      o, remainder = self.attend(q, tokens, segments_BxT)
      return o.astype(jnp.float32), remainder

    if x_BxTxD.shape[1] == 1:
      o, remainder = from_cache(q, tokens, cache)
    else:
      o, remainder = jax.lax.cond(index == 0, prefill_empty, from_cache, q, tokens, cache)
    return self.finish(o, remainder, tokens["value"]), cache

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """Decode-cache bytes per token and layer: keys and values, 2 N head_dim bytes per value."""
    itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
    return 2 * model_config.d_model * itemsize

  def mixing_flops_per_token(self, context_length):
    # q k^T and A [v, 1] (the remainder's column of ones), 2 FLOPs per multiply-add, over the
    # (context - 1) / 2 earlier keys of a query on average ((context + 1) / 2 with its own).
    keys = (context_length + (1 if self.attend_current else -1)) / 2
    return 2 * self.num_heads * (2 * self.head_dim + 1) * keys
