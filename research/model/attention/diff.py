"""Differential attention (Ye, Dong, Xia, Sun, Zhu, Huang & Wei, arXiv:2410.05258; the DIFF
Transformer's mixer): per head, the difference of two softmax attention maps, the second scaled
by a learned lambda, weights the values.

With N heads and d = d_model / N / 2: queries are 2N heads of d, keys 2N heads of d, values N
heads of 2d (as many value heads as heads, MHA), and for head n
  [A1, A2] = softmax(q_{2n+j} k_{2n+j}^T / sqrt(d) + bias, causal),    j = 0, 1
  lambda   = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
  head_n   = (1 - lambda_init) RMSNorm((A1 - lambda A2) v_n)           (over 2d, eps 1e-5)
  out      = [head_1, ..., head_N] W_O                                 (N 2d -> d_model)
  lambda_init = 0.8 - 0.6 exp(-0.3 depth),  depth the layer index from 0
with the position scheme's query/key hooks on q and k before the scores: the scheme is told a
geometry of 2N heads of d (`position_geometry`), so RoPE rotates each d-wide query and key head
(the model's usual d_model / num_heads would be the values' 2d).

Checked against the authors' code, microsoft/unilm@768a3c8
(768a3c873f598bb9b4d4dfb9267b099e35f8fe56), Diff-Transformer/multihead_diffattn.py,
MultiheadDiffAttn and lambda_init_fn, and rms_norm.py (and multihead_flashdiff_1.py, the same
forward through two FlashAttention calls):
  * head layout: q viewed as [2N, d], k as [2K, d], v as [K, 2d] straight from the projections;
    the maps of query heads 2n and 2n + 1 are the pair (A1, A2) of head n (their
    attn_weights.view(bsz, N, 2, T, S)), and head n reads value head n. Here K = N, so their
    repeat_kv is the identity; reads_num_kv_heads is False (model.num_kv_heads is ignored).
  * scaling 1 / sqrt(d) of the d-wide heads (`self.scaling = head_dim ** -0.5`), softmax in
    float32, masked entries -inf (here the core's large negative: the same probabilities).
  * lambda: one scalar per layer, shared by all heads; the four vectors of d are drawn
    N(0, 0.1) (`normal_(mean=0, std=0.1)`), float32; the dot products and exp in float32.
  * lambda_init_fn(depth) = 0.8 - 0.6 exp(-0.3 depth) with depth "the current layer index",
    from 0 (their example.py builds a first layer with depth=0; the paper's l - 1 for l in
    [1, L]): here `layer_index`, which the model counts from 0.
  * subln: RMSNorm(2d, eps=1e-5, elementwise_affine=True) on each head's output, a learned
    gain of 2d shared by the heads, initialised to 1, the normalisation in float32; then times
    the constant (1 - lambda_init); no gate.
  * rotary positions interleaved (apply_rotary_emb(..., interleaved=True): channels (2i, 2i+1)
    rotate together), as the lab's rope scheme pairs them.
Deviations: the projections are the lab's (LeCun normal, fan-in d_model, no biases as theirs;
theirs nn.Linear's default uniform init); lambda's vectors and the norm's gain take no weight
decay (the lab's rule for gains and biases; their optimiser set-up is not in the file). Their
num_heads is half a baseline's (a baseline of 2N heads of d matches N heads here in parameters):
model.num_heads here is their num_heads. Their GQA option (num_kv_heads < num_heads) is not
offered (read, not run: there multihead_diffattn.py and multihead_flashdiff_1.py pair query and
key heads differently once n_rep > 1).

The score path is the lab's core (research.model.attention.core.attend), once per layer: the 2N
query heads against the 2N key heads, with the values repeated per pair (head i reads value head
i // 2, [B, T, 2N, 2d], a transient), then out = o[:, :, 0::2] - lambda o[:, :, 1::2] in float32.
So every softmax setting applies (model.softmax: windows, sinks and their positions, blockwise
block size), packed documents, any qk or bias scheme (a bias scheme biases the 2N maps), the
backends xla and blockwise; cudnn is refused (values 2d wide, keys d). The decode cache holds
each head's keys as one key of 2d, [k_{2n}, k_{2n+1}], beside its value of 2d: 2N d + N 2d
values per token and layer, nothing repeated; new queries attend to it as query heads of 2d,
q_{2n} in the first half and q_{2n+1} in the second (zeros elsewhere), two query heads per
key/value head, so the logits are the sequence path's (research.model.attention.kv_cache unchanged,
its rolling layout included). `attention_weights` is the differential map A1 - lambda A2
[B, N, L, L] (its rows sum to 1 - lambda, and may be negative); `with_edited_weights` edits
that map, then takes the values, the norm, the scale and the output projection.
"""

import math

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import core
from research.model.attention import masks
from research.model.attention import modules
from research.model.attention import softmax
from research.model.attention.kv_cache import KVCache

LAMBDA_INIT_STD = 0.1  # the lambda vectors' N(0, 0.1)
SUBLN_EPSILON = 1e-5  # their subln's eps


def lambda_init(depth):
  """Their lambda_init_fn: 0.8 - 0.6 exp(-0.3 depth), depth the layer index from 0."""
  return 0.8 - 0.6 * math.exp(-0.3 * depth)


def differential_heads(o_BxTx2NxV, lambda_full):
  """o_{2n} - lambda o_{2n+1} per head n, float32 [B, T, N, V], from the outputs of the 2N maps."""
  o = o_BxTx2NxV.astype(jnp.float32)
  return o[:, :, 0::2] - lambda_full * o[:, :, 1::2]


def differential_map(probs_Bx2NxTxS, lambda_full):
  """A1 - lambda A2 per head n, [B, N, T, S], from the 2N maps (pairs 2n, 2n + 1)."""
  return probs_Bx2NxTxS[:, 0::2] - lambda_full * probs_Bx2NxTxS[:, 1::2]


def paired_queries(q_BxTx2NxH):
  """Queries of 2H for keys stored in pairs [k_{2n}, k_{2n+1}]: q_{2n} in the first half and
  q_{2n+1} in the second, zeros elsewhere, [B, T, 2N, 2H]; (q_i | 0) . (k_{2n} | k_{2n+1}) =
  q_i . k_i."""
  b, t, heads, h = q_BxTx2NxH.shape
  q_BxTxNx2xH = q_BxTx2NxH.reshape(b, t, heads // 2, 2, h)
  place_2x2 = jnp.eye(2, dtype=q_BxTx2NxH.dtype)  # query j of the pair into half j
  return (q_BxTxNx2xH[:, :, :, :, None, :] * place_2x2[:, :, None]).reshape(b, t, heads, 2 * h)


def paired_keys(k_BxTx2NxH):
  """The keys of each pair side by side, [B, T, N, 2H]: [k_{2n}, k_{2n+1}]."""
  b, t, heads, h = k_BxTx2NxH.shape
  return k_BxTx2NxH.reshape(b, t, heads // 2, 2 * h)


class DifferentialAttention(softmax.SoftmaxAttention):
  """Differential attention on SoftmaxAttention's projection, score and mask hooks: 2N query
  and key heads of d (query_heads, key_dim: what the position scheme acts on), N value heads of
  2d (kv_heads, value_dim). num_heads / num_kv_heads of an instance are N (its heads)."""
  backends = ("auto", "xla", "blockwise")

  @classmethod
  def kv_heads(cls, model_config):
    return model_config.num_heads  # value heads; the keys are 2N heads of d

  @classmethod
  def query_heads(cls, model_config):
    return 2 * model_config.num_heads

  @classmethod
  def key_dim(cls, model_config):
    return model_config.d_model // (2 * model_config.num_heads)

  @classmethod
  def value_dim(cls, model_config):
    return 2 * cls.key_dim(model_config)

  @classmethod
  def validate(cls, settings, model_config):
    d, n = model_config.d_model, model_config.num_heads
    if d % (2 * n):
      valid = [h for h in range(1, d // 2 + 1) if d % (2 * h) == 0]
      raise ValueError(f"attention 'diff' splits d_model into 2 * num_heads query and key heads: "
                       f"d_model={d} is not divisible by 2 * num_heads = {2 * n}; valid "
                       f"num_heads: {valid}")
    if model_config.attention_backend == "cudnn":
      raise ValueError("attention 'diff' does not run on attention_backend 'cudnn': its values "
                       "are twice as wide as its queries and keys (2d vs d), which "
                       "jax.nn.dot_product_attention's cuDNN path refuses; use 'blockwise', "
                       "'xla' or 'auto'")
    if settings.get("projection_bias", "none") != "none":
      raise ValueError(f"attention 'diff' has no projection biases (its reference code's "
                       f"projections have none); set model.softmax.projection_bias='none', got "
                       f"{settings.projection_bias!r}")
    super().validate(settings, model_config)

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    d_model, n, h = model_config.d_model, model_config.num_heads, self.key_dim(model_config)
    self.position = position
    self.layer_index = layer_index
    self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim = n, n, h, 2 * h
    self.backend = model_config.attention_backend
    self.block_size = int(settings.block_size)
    self.mask = masks.MaskSpec(window=int(settings.window), sinks=int(settings.sinks))
    self.sink_positions = str(settings.sink_positions)
    # Decoding: N key/value heads, each key the pair [k_{2n}, k_{2n+1}] (see paired_keys).
    self.kv_cache = KVCache(n, self.mask)
    self.dtype = dtype = nn.compute_dtype(model_config)
    self.query = base.head_projection(d_model, 2 * n, h, "heads", rngs=rngs, dtype=dtype)
    self.key = base.head_projection(d_model, 2 * n, h, "kv_heads", rngs=rngs, dtype=dtype)
    self.value = base.head_projection(d_model, n, 2 * h, "kv_heads", rngs=rngs, dtype=dtype)
    self.out = base.output_projection(n, 2 * h, d_model, rngs=rngs, dtype=dtype)
    self.lambda_init = lambda_init(layer_index)
    draw = lambda: nn.param(LAMBDA_INIT_STD * jax.random.normal(rngs.params(), (h,)),
                            ("head_dim",), weight_decay=False)
    self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (draw() for _ in range(4))
    self.subln_scale = nn.param(jnp.ones((2 * h,)), ("head_dim",), weight_decay=False)

  def lambda_full(self):
    """lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init, float32."""
    return (jnp.exp(jnp.sum(self.lambda_q1[...] * self.lambda_k1[...]))
            - jnp.exp(jnp.sum(self.lambda_q2[...] * self.lambda_k2[...])) + self.lambda_init)

  def head_outputs(self, o_BxTxNxV):
    """(1 - lambda_init) RMSNorm(o) per head (their subln), in the compute dtype."""
    normalised = modules.rms_norm(o_BxTxNxV.astype(jnp.float32), self.subln_scale[...],
                                  eps=SUBLN_EPSILON)
    return (normalised * (1 - self.lambda_init)).astype(self.dtype)

  def attend(self, q_BxLx2NxH, tokens, positions_BxL, segments_BxL=None, other_queries=None):
    """The heads [B, L, N, 2d] before the output projection: the core's attention of the 2N
    query heads to the 2N key heads with the values repeated per pair, their difference, the
    norm and the scale."""
    values = jnp.repeat(tokens["value"], 2, axis=2)  # [B, L, 2N, 2d]: head i reads v_{i // 2}
    o_BxLx2NxV = super().attend(q_BxLx2NxH, {**tokens, "value": values}, positions_BxL,
                                segments_BxL, other_queries)
    return self.head_outputs(differential_heads(o_BxLx2NxV, self.lambda_full()))

  def _differential_weights(self, x_BxLxD, positions_BxL, segments_BxL):
    probs_Bx2NxLxL, visible, tokens = self._probabilities(x_BxLxD, positions_BxL, segments_BxL)
    return differential_map(probs_Bx2NxLxL, self.lambda_full()), visible, tokens

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The differential map A1 - lambda A2 of each head, float32 [B, N, L, L] (the core's two
    materialised maps of its query heads 2n and 2n + 1)."""
    return self._differential_weights(x_BxLxD, positions_BxL, segments_BxL)[0]

  def with_edited_weights(self, x_BxLxD, positions_BxL, segments_BxL, edit):
    """`__call__` with the differential map W replaced by edit(W, mask): sum_s W'[n, t, s] v[s, n]
    through the norm, the scale and the output projection; edit = lambda w, m: w gives
    `__call__`."""
    weights_BxNxLxL, visible, tokens = self._differential_weights(x_BxLxD, positions_BxL,
                                                                  segments_BxL)
    o_BxLxNxV = core.grouped_values(edit(weights_BxNxLxL, visible).astype(jnp.float32),
                                    tokens["value"].astype(jnp.float32))
    return self.out(self.head_outputs(o_BxLxNxV))

  def init_cache(self, batch_size, max_length):
    return self.kv_cache.init(batch_size, max_length, key_dim=2 * self.head_dim,
                              value_dim=self.value_head_dim, dtype=self.dtype)

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens against the cache and each other: the sequence path into an empty cache,
    else the cache's attention with the keys in pairs and the queries padded to match
    (paired_keys, paired_queries), the same logits; `documents` as SoftmaxAttention.decode."""
    index_1xT, positions_BxT, segments_BxT, q, tokens, sinks = self.decode_inputs(
        x_BxTxD, cache, index, documents)
    stored = {"key": paired_keys(tokens["key"]), "value": tokens["value"]}
    score_mod, params = self.score_mod()
    lambda_full = self.lambda_full()

    def from_cache(q, tokens, stored, cache):
      del tokens
      paired_sinks = None if sinks is None else core.OtherQueries(
          None if sinks.q is None else paired_queries(sinks.q), sinks.inputs)
      o_BxTx2NxV, cache = self.kv_cache.attend(
          paired_queries(q), stored, cache, index_1xT, scale=self.scale(),
          score_mod=score_mod, score_params=params, score_inputs=self.score_inputs,
          other_queries=paired_sinks, documents=documents)
      return self.head_outputs(differential_heads(o_BxTx2NxV, lambda_full)), cache

    def prefill_empty(q, tokens, stored, cache):
      tokens = {name: x.astype(cache[name].dtype) for name, x in tokens.items()}
      stored = {name: x.astype(cache[name].dtype) for name, x in stored.items()}
      return (self.attend(q, tokens, positions_BxT, segments_BxT, other_queries=sinks),
              self.kv_cache.write(stored, cache, index_1xT[0], documents))

    if x_BxTxD.shape[1] == 1:
      y, cache = from_cache(q, tokens, stored, cache)
    else:
      y, cache = jax.lax.cond(index == 0, prefill_empty, from_cache, q, tokens, stored, cache)
    return self.out(y), cache

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """2N keys of d and N values of 2d per token and layer: 4 N d = 2 d_model values."""
    itemsize = jnp.dtype(nn.compute_dtype(model_config)).itemsize
    return model_config.num_heads * 4 * cls.key_dim(model_config) * itemsize

  def mixing_flops_per_token(self, context_length):
    # The core runs 2N maps of d-wide scores and 2d-wide values (the values repeated per pair):
    # twice what SoftmaxAttention counts for N heads of d and 2d (its sink queries' logits too);
    # then per value channel of the N heads the difference (2 FLOPs) and the norm and its two
    # scales (5).
    return (2 * super().mixing_flops_per_token(context_length)
            + 7 * self.num_heads * self.value_head_dim)
