"""Multi-head latent attention, MLA (DeepSeek-AI, arXiv:2405.04434, DeepSeek-V2): softmax
attention over keys and values expanded per head from a cached low-rank latent, with a decoupled
rotary key shared by the heads.

With N heads, x a token's input [D], R = kv_lora_rank, r_q = q_lora_rank, d_n, d_r, d_v the
no-position, rotary and value head dims:
  q_n       = W_Q x  (r_q = 0)   or   W_UQ RMSNorm(W_DQ x)  (r_q > 0: D -> r_q -> N (d_n + d_r))
  [c, k_r]  = W_DKV x                                      D -> R + d_r
  c         = RMSNorm(c)                                   the latent (eps 1e-6, learned gain)
  k_n       = W_UK c,   v_n = W_UV c                       R -> N d_n and R -> N d_v
  q = [P(q_r), q_nope],   k = [P(k_r), k_nope]             k_r one head, shared by all N
  o_n = softmax(m (q_n . k_n) / sqrt(d_n + d_r) + bias, causal) v_n,   out = W_O [o_1 .. o_N]
P(.) is the position scheme's query / key hook (RoPE rotates the d_r decoupled dims only), bias
its score bias and m its logit scale (YaRN's temperature; 1 otherwise).

Training, evaluation and an empty-cache prefill expand k and v per head and run the lab's core
(research.model.attention.core.attend): backends xla, blockwise and auto (cudnn where values are as
wide as keys, d_v = d_n + d_r, which the defaults are not), causal masking, packed documents
and any bias scheme as the core's ScoreMod. Decoding is the absorbed form: the cache keeps per
token only [c, P(k_r)], R + d_r values (DeepSeek-V2's 4 d_h + d_h / 2 = 4.5 d_h against MHA's
2 N d_h), W_UK folds into the query and W_UV into the output,
  q_lat_n = W_UK_n^T q_nope_n  [R],   logits_nj = q_lat_n . c_j + P(q_r)_n . P(k_r)_j,
  o_lat_n = sum_j p_nj c_j  [R],      o_n = W_UV_n o_lat_n,
that is multi-query attention over the latent with one key/value head (keys [c, k_r], values
c), run by research.model.attention.kv_cache.cached_attention (float32 logits and softmax, the same
score function and bias as the sequence path): the cached rows [c, k_r] serve as keys and as
values, and the attention output's last d_r columns are dropped, so c is stored once and the
cache is read as it is stored (d_r / (R + d_r) of the second matmul is wasted instead).

Checked against the authors' code and two ports of it:
  * huggingface/transformers@03eac6f (03eac6f7d2af7e8562113f0b78d3d2d59a7d843d),
    src/transformers/models/deepseek_v2/modeling_deepseek_v2.py, DeepseekV2Attention.forward:
    q_proj (q_lora_rank None) or q_b_proj(q_a_layernorm(q_a_proj(x))); q split per head into
    [q_nope (d_n), q_pe (d_r)]; kv_a_proj_with_mqa -> [c (R), k_pe (d_r)], kv_a_layernorm (an
    RMSNorm, eps 1e-6, gain initialised to 1, normalised in float32) on c only, never on k_pe;
    kv_b_proj(c) split per head into [k_nope (d_n), v (d_v)]; k_pe one head expanded to all N;
    query [q_nope, q_pe], key [k_nope, k_pe]; scaling (d_n + d_r)^-1/2; softmax in float32;
    o_proj N d_v -> D; no biases (attention_bias False). The rotation there is
    apply_rotary_emb: adjacent channels (2i, 2i+1) as one complex number times
    e^(i m theta_i), theta_i = base^(-2i/d_r), the lab's rope pairing and frequencies with
    rotary_dims = d_r. (HF's deepseek_v3, @f5a9ec5 modeling_deepseek_v3.py,
    apply_rotary_pos_emb_interleave, first de-interleaves q_pe / k_pe, (2i, 2i+1) -> (i,
    i + d_r/2), then rotates halves: the same rotation of the same pairs, its output in a
    permuted channel order shared by q and k, so the same logits; the permutation is a matter
    of the checkpoints' weight layout.)
  * AI-Hypercomputer/maxtext@e591f30 (e591f30cbbf217ed67ef71263ec0538239f9c3b8),
    src/maxtext/layers/attention_mla.py, MLA._init_projections, mla_query_projection,
    mla_kv_projection, mla_get_key_value: the same projections (q_lora_rank 0 = a direct
    query projection, as here), RMSNorm on the latent only, k_rope broadcast to every head,
    softmax_scale (d_n + d_r)^-1/2, kernels variance-scaling 1.0, fan-in, normal.
  * deepseek-ai/DeepSeek-V3@1ea5a1a (1ea5a1a7ed7429e25ba2fa2c76fe74fa5968d348),
    inference/model.py, MLA.forward with attn_impl "absorb": the absorbed decode above, its
    cache kv_norm(kv) [R] and the rotated k_pe [d_r] per token, the query folded through
    wkv_b's key rows and the output through its value rows, scores of both parts summed
    before the one softmax_scale.
Deviations and choices:
  * Layout: each query and key head is [rotary part, no-position part] here, theirs [nope,
    pe]; q and k share the order, so the logits are the same (a fixed permutation of a
    projection's output channels). The position scheme acts on the rotary parts alone,
    P(q_r) [B, T, N, d_r] and P(k_r) [B, T, 1, d_r]: `position_geometry` tells it N heads of
    d_r, all of them rotating, so every qk scheme applies (xpos scales the rotary part only).
  * W_UK and W_UV are two kernels [R, N, d_n] and [R, N, d_v] (their kv_b_proj holds both,
    interleaved per head): the same function and initialisation.
  * Initialisation: the lab's LeCun normal (truncated) with fan-in the input width, as
    MaxText's fan-in normal; HF's is normal(0.02). RMSNorm gains start at 1, as theirs.
  * YaRN: with rope_scaling DeepSeek multiplies the softmax scale by mscale^2,
    mscale = 0.1 mscale_all_dim ln s + 1 (DeepSeek-V3's MLA.__init__, MaxText,
    HF's DeepseekV3Attention; HF's V2 port multiplies cos / sin by its rope initialiser's
    attention factor instead). Their mscale / mscale_all_dim settings are left out; the
    scheme's logit_scale() is applied as in every softmax mixer: (0.1 ln s + 1)^2 under
    model.rope.scaling="yarn" (theirs with mscale_all_dim = 1), 1 otherwise.
  * No sliding window (supports_sliding_window is False): the core's mask could take one, the
    absorbed decode would need a rolling latent cache. No key/value groups: every head has its
    own k_n and v_n (model.num_kv_heads is not read).

Defaults (model.mla, 0 = derived from d_h = d_model / num_heads as DeepSeek-V2's ratios: d_c =
4 d_h, d_h^R = d_h / 2, d_v = d_h): qk_nope_head_dim d_h, qk_rope_head_dim d_h / 2 (rounded
down to even), v_head_dim d_n, kv_lora_rank 4 d_n; q_lora_rank 0 (no query compression, as
DeepSeek-V2-Lite: at the lab's widths it would save little). At d_model 256 and 8 heads the
cache is 128 + 16 values per token and layer, MHA's 512.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from research.model import nn
from research.model import positions
from research.model.attention import base
from research.model.attention import core
from research.model.attention import kv_cache
from research.model.positions import BIAS, QK

SETTINGS_KEY = "mla"  # model.mla
NORM_EPSILON = 1e-6  # DeepseekV2RMSNorm's default, used for kv_a_layernorm / q_a_layernorm
# The logical axis of the latents (R, r_q): replicated, as GLA's low-rank gate ("ssm_proj");
# research/model/sharding.py has no "latent" rule.
LATENT_AXIS = "ssm_proj"
DIM_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


@dataclasses.dataclass(frozen=True)
class Dims:
  """The head and latent widths of a layer, derived ones resolved."""
  nope: int  # d_n
  rope: int  # d_r
  value: int  # d_v
  latent: int  # R, kv_lora_rank
  query_latent: int  # r_q, q_lora_rank (0: none)

  @property
  def key(self):
    return self.rope + self.nope


def _latent_norm(width, *, rngs, dtype):
  return nnx.RMSNorm(width, epsilon=NORM_EPSILON, dtype=dtype, param_dtype=jnp.float32,
                     scale_metadata={"logical_axes": (LATENT_AXIS,), "weight_decay": False},
                     rngs=rngs)


def _up_projection(rank, heads, head_dim, *, rngs, dtype):
  """[B, L, rank] -> [B, L, heads, head_dim], LeCun normal with fan-in `rank`."""
  return nn.dense("BLR,RNH->BLNH", (rank, heads, head_dim), (LATENT_AXIS, "heads", "head_dim"),
                  rngs=rngs, dtype=dtype,
                  init=nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)))


class MultiHeadLatentAttention(base.Mixer):
  hyperparameters = {"kv_lora_rank": 0,  # R, the cached latent; 0: 4 * qk_nope_head_dim
                     "q_lora_rank": 0,  # r_q of a low-rank query; 0: a direct projection
                     "qk_nope_head_dim": 0,  # d_n; 0: d_model / num_heads
                     "qk_rope_head_dim": 0,  # d_r, the decoupled rotary key; 0: d_n / 2, even
                     "v_head_dim": 0,  # d_v; 0: qk_nope_head_dim
                     "block_size": 128}  # blockwise backend: query and key block length
  # d_n 8, d_r 4, d_v 8 at the tiny d_model 32 / 4 heads; a latent of 16 (< N d_n = 32) and a
  # low-rank query, so the conformance suite runs that path too.
  test_settings = {"kv_lora_rank": 16, "q_lora_rank": 16, "block_size": 8}
  position_hooks = frozenset({QK, BIAS})
  backends = ("auto", "xla", "blockwise", "cudnn", "splash")  # not pallas: keys wider than values
  has_attention_weights = True
  supports_sliding_window = False

  @classmethod
  def settings_of(cls, model_config):
    """model.mla over the defaults (for the classmethods that receive the model config only)."""
    settings = ml_collections.ConfigDict(dict(cls.hyperparameters))
    settings.update(dict(model_config.get(SETTINGS_KEY) or {}))
    return settings

  @classmethod
  def resolve_dims(cls, settings, model_config):
    nope = int(settings.qk_nope_head_dim) or model_config.d_model // model_config.num_heads
    rope = int(settings.qk_rope_head_dim) or max(2, 2 * (nope // 4))
    return Dims(nope=nope, rope=rope, value=int(settings.v_head_dim) or nope,
                latent=int(settings.kv_lora_rank) or 4 * nope,
                query_latent=int(settings.q_lora_rank))

  @classmethod
  def validate(cls, settings, model_config):
    for field in DIM_FIELDS:
      value = settings[field]
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"model.mla.{field} must be an integer >= 0 (0: "
                         f"{'no low-rank query' if field == 'q_lora_rank' else 'derived'}), got "
                         f"{value!r}")
    dims = cls.resolve_dims(settings, model_config)
    if dims.nope < 1:
      raise ValueError(f"model.mla.qk_nope_head_dim resolves to {dims.nope} (d_model / num_heads "
                       f"= {model_config.d_model} / {model_config.num_heads}); set it >= 1")
    if dims.rope % 2:
      raise ValueError(f"model.mla.qk_rope_head_dim must be even (rotary schemes rotate channel "
                       f"pairs), got {dims.rope}; valid: 2, 4, ... or 0 for d_n / 2 rounded to "
                       "even")
    backend = model_config.attention_backend
    if backend not in cls.backends:
      raise ValueError(f"unknown model.attention_backend {backend!r}; valid: "
                       f"{', '.join(cls.backends)}")
    if backend == "cudnn":
      reasons = core.refusals("cudnn", dtype=model_config.compute_dtype, head_dim=dims.key,
                              value_dim=dims.value)
      if reasons:
        raise ValueError(f"attention 'mla' cannot run on attention_backend 'cudnn': "
                         f"{'; '.join(reasons)} (keys are d_n + d_r = {dims.key} wide: set "
                         f"model.mla.v_head_dim={dims.key}, or use 'xla' or 'blockwise')")
    if settings.block_size < 1:
      raise ValueError(f"model.mla.block_size must be >= 1, got {settings.block_size}")

  @classmethod
  def position_geometry(cls, settings, model_config, layer_index=0):
    """The scheme acts on the decoupled rotary parts only: N heads of d_r, all rotating."""
    rope = cls.resolve_dims(settings, model_config).rope
    return positions.Geometry(model_config.d_model, model_config.num_heads, rope, rope,
                              layer_index)

  @classmethod
  def chunk_length(cls, settings):
    return int(settings.block_size)  # the blockwise backend's tiles

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """(kv_lora_rank + qk_rope_head_dim) values per token and layer in the compute dtype."""
    dims = cls.resolve_dims(cls.settings_of(model_config), model_config)
    return (dims.latent + dims.rope) * jnp.dtype(nn.compute_dtype(model_config)).itemsize

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    d, n = model_config.d_model, model_config.num_heads
    self.dims = dims = self.resolve_dims(settings, model_config)
    self.position = position
    self.layer_index = layer_index
    self.num_heads = n
    self.backend = model_config.attention_backend
    self.block_size = int(settings.block_size)
    self.dtype = dtype = nn.compute_dtype(model_config)
    if dims.query_latent:
      self.query_down = nn.dense("BLD,DR->BLR", (d, dims.query_latent), ("embed", LATENT_AXIS),
                                 rngs=rngs, dtype=dtype)
      self.query_norm = _latent_norm(dims.query_latent, rngs=rngs, dtype=dtype)
      self.query_up = _up_projection(dims.query_latent, n, dims.key, rngs=rngs, dtype=dtype)
    else:
      self.query = base.head_projection(d, n, dims.key, "heads", rngs=rngs, dtype=dtype)
    # W_DKV: [c (R), k_r (d_r)], as kv_a_proj_with_mqa.
    self.kv_down = nn.dense("BLD,DF->BLF", (d, dims.latent + dims.rope), ("embed", LATENT_AXIS),
                            rngs=rngs, dtype=dtype)
    self.kv_norm = _latent_norm(dims.latent, rngs=rngs, dtype=dtype)
    self.key_up = _up_projection(dims.latent, n, dims.nope, rngs=rngs, dtype=dtype)
    self.value_up = _up_projection(dims.latent, n, dims.value, rngs=rngs, dtype=dtype)
    self.out = base.output_projection(n, dims.value, d, rngs=rngs, dtype=dtype)

  # Projections.

  def queries(self, x_BxTxD, positions_BxT):
    """Queries [B, T, N, d_r + d_n]: the rotary part after the scheme's hook, then the rest."""
    if self.dims.query_latent:
      q = self.query_up(self.query_norm(self.query_down(x_BxTxD)))
    else:
      q = self.query(x_BxTxD)
    rope = self.dims.rope
    return jnp.concatenate([self.position.queries(q[..., :rope], positions_BxT), q[..., rope:]],
                           axis=-1)

  def latents(self, x_BxTxD, positions_BxT):
    """What the cache keeps per token, [B, T, R + d_r]: the normalised latent c and the shared
    rotary key after the scheme's hook."""
    kv_BxTxF = self.kv_down(x_BxTxD)
    latent = self.dims.latent
    c_BxTxR = self.kv_norm(kv_BxTxF[..., :latent])
    k_rope = self.position.keys(kv_BxTxF[:, :, None, latent:], positions_BxT)[:, :, 0]
    return jnp.concatenate([c_BxTxR, k_rope.astype(c_BxTxR.dtype)], axis=-1)

  def keys_and_values(self, latents_BxTxF):
    """The expanded keys [B, T, N, d_r + d_n] (the shared rotary key, then W_UK c) and values
    [B, T, N, d_v] (W_UV c) of the cached rows."""
    c_BxTxR, k_rope_BxTxR = jnp.split(latents_BxTxF, [self.dims.latent], axis=-1)
    k_nope = self.key_up(c_BxTxR)
    k_rope = jnp.broadcast_to(k_rope_BxTxR[:, :, None], k_nope.shape[:3] + (self.dims.rope,))
    return jnp.concatenate([k_rope, k_nope], axis=-1), self.value_up(c_BxTxR)

  def project(self, x_BxTxD, positions_BxT):
    """(queries, keys, values) of the expanded form, and the latents."""
    latents = self.latents(x_BxTxD, positions_BxT)
    k, v = self.keys_and_values(latents)
    return self.queries(x_BxTxD, positions_BxT), k, v, latents

  def score_mod(self):
    """(core.ScoreMod, its parameters): the scheme's bias as a function of its parameters."""
    graphdef, params = nnx.split(self.position)
    bias = lambda p, q_positions, k_positions: nnx.merge(graphdef, p).bias(q_positions,
                                                                           k_positions)
    return core.ScoreMod(bias=bias), params

  def scale(self):
    return self.position.logit_scale() / self.dims.key ** 0.5

  # The sequence path and the analyses, through the core.

  def attend(self, q_BxTxNxH, k_BxTxNxH, v_BxTxNxV, positions_BxT, segments_BxT=None):
    score_mod, params = self.score_mod()
    return core.attend(q_BxTxNxH, k_BxTxNxH, v_BxTxNxV, scale=self.scale(), score_mod=score_mod,
                       score_params=params, inputs=positions_BxT, segments_BxT=segments_BxT,
                       backend=self.backend, block_size=self.block_size, backends=self.backends)

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    q, k, v, _ = self.project(x_BxLxD, positions_BxL)
    return self.out(self.attend(q, k, v, positions_BxL, segments_BxL))

  def _probabilities(self, x_BxLxD, positions_BxL, segments_BxL):
    q, k, v, _ = self.project(x_BxLxD, positions_BxL)
    score_mod, params = self.score_mod()
    probs, visible = core.probabilities(q, k, scale=self.scale(), score_mod=score_mod,
                                        score_params=params, inputs=positions_BxL,
                                        segments_BxT=segments_BxL)
    return probs, visible, v

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The attention probabilities of `__call__`, float32 [B, N, L, L], materialised."""
    return self._probabilities(x_BxLxD, positions_BxL, segments_BxL)[0]

  def with_edited_weights(self, x_BxLxD, positions_BxL, segments_BxL, edit):
    """`__call__` with the probabilities P replaced by edit(P, mask) (for interventions)."""
    probs, visible, v = self._probabilities(x_BxLxD, positions_BxL, segments_BxL)
    return self.out(core.grouped_values(edit(probs, visible), v).astype(v.dtype))

  # Decoding: the absorbed form against a cache of latents.

  def init_cache(self, batch_size, max_length):
    """{"latents": [B, max_length, R + d_r]}: c and the rotated shared key of every token."""
    width = self.dims.latent + self.dims.rope
    return {"latents": jnp.zeros((batch_size, max_length, width), self.dtype)}

  def absorbed_attention(self, q_BxTxNxH, latents_BxSxF, positions_1xT, documents=None):
    """Attention of T queries [B, T, N, d_r + d_n] at token indices positions_1xT to the cached
    rows [B, S, R + d_r] (the new tokens' included), W_UK folded into the queries and W_UV into
    the output: [B, T, N, d_v]. Keys beyond the queries' indices (empty slots, the future) are
    masked, and with `documents` (masks.DecodeDocuments) those of other documents."""
    rope, dtype = self.dims.rope, self.dtype
    w_uk_RxNxH = self.key_up.kernel[...].astype(dtype)
    w_uv_RxNxV = self.value_up.kernel[...].astype(dtype)
    q_latent = jnp.einsum("BTNH,RNH->BTNR", q_BxTxNxH[..., rope:], w_uk_RxNxH)
    # In the cached rows' order, [c, k_r]: one key/value head, [B K, S, R + d_r] with K = 1.
    q_rows = jnp.concatenate([q_latent, q_BxTxNxH[..., :rope]], axis=-1)
    mask, key_positions = kv_cache.full_cache_keys(core.CAUSAL, positions_1xT,
                                                   latents_BxSxF.shape[1], documents)
    q_positions = positions_1xT if documents is None else documents.positions_BxT
    score_mod, params = self.score_mod()
    o_rows = kv_cache.cached_attention(
        q_rows, [(latents_BxSxF, latents_BxSxF, q_positions, key_positions, mask)],
        self.scale(), score_mod, params)
    return jnp.einsum("BTNR,RNV->BTNV", o_rows[..., :self.dims.latent], w_uv_RxNxV)

  document_decode_refusal = classmethod(base.no_refusal)  # the full cache's document mask

  def decode(self, x_BxTxD, cache, index, documents=None):
    """T new tokens at indices index..index + T - 1: their latents written into the cache, then
    the absorbed attention to it; a prompt into an empty cache runs the expanded sequence path
    (the cheaper one with T queries to T keys). `documents`: packed documents
    (masks.DecodeDocuments)."""
    t, slots = x_BxTxD.shape[1], cache["latents"].shape[1]
    if t > slots:
      raise ValueError(f"{t} new tokens do not fit in a decode cache of {slots} tokens: "
                       "init_cache with max_length >= the prompt and the tokens to generate")
    index_1xT, positions_BxT, segments_BxT = base.decode_positions(index, t, documents)
    q = self.queries(x_BxTxD, positions_BxT)
    latents = self.latents(x_BxTxD, positions_BxT).astype(cache["latents"].dtype)
    cache = {"latents": jax.lax.dynamic_update_slice_in_dim(cache["latents"], latents, index, 1)}

    def prefill_empty(q, latents, cache):
      return self.attend(q, *self.keys_and_values(latents), positions_BxT, segments_BxT)

    def from_cache(q, latents, cache):
      del latents
      return self.absorbed_attention(q, cache["latents"], index_1xT, documents)

    if t == 1:
      y = from_cache(q, latents, cache)
    else:
      y = jax.lax.cond(index == 0, prefill_empty, from_cache, q, latents, cache)
    # Past the cache's end, dynamic_update_slice would clamp and overwrite the last slots:
    # NaN rather than silently wrong outputs (init_cache with a larger max_length).
    y = jnp.where(index + t <= slots, y, jnp.nan)
    return self.out(y.astype(self.dtype)), cache

  def mixing_flops_per_token(self, context_length):
    # The expanded form: q k^T over d_n + d_r and p v over d_v, 2 FLOPs per multiply-add, each
    # query sees (context + 1) / 2 keys on average (the up-projections are parameter matmuls).
    keys = (context_length + 1) / 2
    return 2 * self.num_heads * (self.dims.key + self.dims.value) * keys
