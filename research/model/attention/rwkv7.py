"""RWKV-7 ("Goose") time mixing (Peng et al., arXiv:2503.14456): the generalised delta rule with
a vector-valued decay and an in-context learning rate, as the authors' RWKV-LM computes it.

Reference: BlinkDL/RWKV-LM@524481d5099b38d9bc8ef1e89209161b86c8011b,
RWKV-v7/train_temp/src/model.py (RWKV_Tmix_x070.__init__ / forward, the commented "slow pytorch
version" of each fused CUDA op; RWKV.generate_init_weight, which overrides the projections'
initialisation), its kernel cuda/rwkv7_clampw.cu (forward_kernel) and the CUDA-free RWKV7_OP of
RWKV-v7/rwkv_v7_demo.py; checked against fla-org/flash-linear-attention@bc3b101,
fla/layers/rwkv7.py (RWKV7Attention) and fla/ops/generalized_delta_rule/dplr/naive.py.

With x' the previous token (0 at a document's start), D = d_model, N heads of H = D / N
channels, mu_* learned vectors and (A_*, B_*) low-rank maps:
  x_* = x + (x' - x) * mu_*                                   for * in r, w, k, v, a, g
  r, k, v = x_r W_r, x_k W_k, x_v W_v
  w_t = exp(-e^{-1/2} sigmoid(w0 + tanh(x_w A_w) B_w))        decay per channel, in (e^{-0.61}, 1)
  a_t = sigmoid(a0 + (x_a A_a) B_a)                           in-context learning rate, in (0, 1)
  g_t = sigmoid(x_g A_g) B_g                                  output gate
  kk_t = normalise_per_head(k_t * k_k)                        (F.normalize: / max(||.||, 1e-12))
  k_t <- k_t * (1 + (a_t - 1) * k_a)
Per head, the reference's state S [H, H] (values x keys), from 0:
  S_t = S_{t-1} (diag(w_t) - kk_t^T (a_t * kk_t)) + v_t^T k_t,    o_t = S_t r_t
  (the reference's w = -softplus(-(.)) - 0.5, decay exp(-exp(w)), is this decay: exp(-softplus(-z)
  - 1/2) = e^{-1/2} sigmoid(z); cuda/rwkv7_clampw.cu computes it so)
  o_t <- GroupNorm(o_t) + (sum_h r_t k_t r_k) v_t             one group per head, eps 64e-5
  out = (o * g) W_o
fla's RWKV7Attention computes the same (its GroupNorm eps, head_dim * 1e-5, is 64e-5 at the
reference's head dim 64; it scales the w and a ranks by head_dim / 64). This file keeps the
transposed state M = S^T [H, E] (keys x values), the lab's orientation:
M_t = (diag(w_t) + b_t alpha_t^T) M_{t-1} + k_t v_t^T with alpha = -kk, b = kk * a, o_t = M_t^T r_t.

Chunked form (training, evaluation, prefill). With u_t = M_{t-1}^T alpha_t (the "sa" of the
kernel), M_t = diag(w_t) M_{t-1} + b_t u_t^T + k_t v_t^T, so inside a chunk from its entering state
M_0, with G_t = sum_{m <= t} log w_m and G'_t = G_{t-1}:
  u_t = M_0^T (alpha_t e^{G'_t}) + sum_{s < t} [(alpha_t e^{G'_t - G_s}) . k_s] v_s
                                               + [(alpha_t e^{G'_t - G_s}) . b_s] u_s
  o_t = M_0^T (r_t e^{G_t}) + sum_{s <= t} [(r_t e^{G_t - G_s}) . k_s] v_s
                                          + [(r_t e^{G_t - G_s}) . b_s] u_s
  M_C = e^{G_C} M_0 + sum_s e^{G_C - G_s} (k_s v_s^T + b_s u_s^T)
The first line is a unit lower triangular system for U, solved by the doubling inverse of
research/model/attention/gated_deltanet.py (fla's DPLR "WY" form); U = U' + W M_0, so only the state
is scanned over chunks. The decay is bounded (log w_t > -e^{-1/2}), so within a chunk of at most
MAX_CHUNK = 64 tokens every e^{+-G} lies within e^{+-38.8}: the pair factors are factored as
(x e^{G_t}) . (y e^{-G_s}) without overflow, with no sub-chunks (fla's chunk_rwkv7 relies on
the same bound: safe_gate, chunks of 64). Decoding one token runs the recurrence itself.

Packed documents: the state and the token shift restart at each segment start; a state passed
in belongs to the first token's segment. The decode state is the last token and M.

Initialisation as the reference's, which depends on the depth l of the layer among L
(layer_index, model.num_layers): rho0 = l / (L - 1) (0 for L = 1, where the reference divides
by 0), rho1 = 1 - l / L; with q_i = i / D and, for channel n, lin = n / (D - 1) - 1/2 and
z = ((n mod H) - (H-1)/2) / ((H-1)/2), zig = z |z| (0 at H = 1):
  mu_r = mu_g = 1 - q^{0.2 rho1}, mu_w = mu_a = 1 - q^{0.9 rho1}, mu_k = mu_v = 1 - q^{0.7 rho1}
  w0 = -6 + 6 (n / (D-1))^{1 + rho0^0.3} + 1/2 + 2.5 zig,   a0 = -0.19 + 0.3 zig + 0.4 lin
  k_k = 0.71 - 0.1 lin, k_a = 1.02, r_k = -0.04, GroupNorm gain ((l + 1) / L)^0.7, bias 0
  A_* zero, B_* orthogonal with gain 0.1 (times sqrt(R / D) if the rank R > D)
  W_r, W_v orthogonal, W_k orthogonal with gain 0.1 (generate_init_weight)
Low-rank ranks: 0 takes the reference's max(32, round(c sqrt(D) / 32) 32), c = 2.5 for w and a,
5 for g. As the reference's optimizer groups, only W_r, W_k, W_v, W_o take weight decay.

Value residual (value_residual, on by default): the first layer's values v_first are passed to
the later layers of the same pass (the model's carry, research/model/attention/base.py), which mix
theirs towards them,
  v <- v + (v_first - v) sigmoid(v0 + (x_v A_v) B_v),   v0 = 0.73 - 0.4 lin, A_v zero,
  B_v orthogonal gain 0.1, rank max(32, round(1.7 sqrt(D) / 32) 32),
before anything else reads v (the state and the bonus term). Layer 0 has no v0, A_v, B_v; in a
hybrid (model.layer_pattern) the first RWKV-7 layer plays the reference's layer 0. Decoding
carries v_first of the new tokens from layer to layer in the same way (no extra cache).
value_residual=False computes every layer as layer 0 (as runs saved before it existed did).

Where this differs from the reference:
  * W_o takes the lab's LeCun normal, not the reference's zeros (with which a fresh layer
    outputs 0 and this layer's checks would see nothing), as research/model/attention/rwkv6.py.
  * The head dim is d_model / model.num_heads (the reference fixes 64); the reference's 2x
    learning rate on w0 is not reproduced; arithmetic is float32 (the kernels take bfloat16).
  * The chunked form computes the recurrence above in another order (exact to rounding); the
    reference's kernels run it token by token.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import gated_deltanet
from research.model.attention import masks
from research.model.attention import modules
from research.model.attention import rwkv6

NORM_EPSILON = rwkv6.NORM_EPSILON  # the GroupNorm's, 64e-5
NORMALIZE_EPSILON = 1e-12
LOG_DECAY_SCALE = math.exp(-0.5)  # log w = -e^{-1/2} sigmoid(.) > -0.61
MAX_CHUNK = 64  # e^{64 e^{-1/2}} = e^{38.8}: factored decay ratios stay finite in float32
STREAMS = ("r", "w", "k", "v", "a", "g")  # the token-shift interpolations, reference's order
MIX_POWERS = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}
LORA_SCALES = {"decay": 2.5, "a": 2.5, "gate": 5.0}  # rank max(32, round(c sqrt(D) / 32) 32)
LORA_ACTIVATIONS = {"decay": jnp.tanh, "a": lambda y: y, "gate": jax.nn.sigmoid,
                    "value": lambda y: y}
VALUE_LORA_SCALE = 1.7  # the value residual's rank: max(32, round(1.7 sqrt(D) / 32) 32)
FIRST_VALUES = "rwkv7_first_values"  # the carry's entry: v of the first RWKV-7 layer
HIGHEST = jax.lax.Precision.HIGHEST


def rwkv7_recurrence(r, log_decay, k, v, kk, a, state, segments=None):
  """The recurrence one token at a time (lax.scan), in the lab's orientation: M_t = (diag(w_t)
  - kk_t (a_t kk_t)^T) M_{t-1} + k_t v_t^T, o_t = M_t^T r_t. r, log_decay, k, kk, a
  [B, T, N, H], v [B, T, N, E], state M [B, N, H, E]; segments [B, T] restart M at each segment
  start. Returns (o [B, T, N, E], final state), float32."""
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  starts = (jnp.zeros(r.shape[:2], bool) if segments is None
            else masks.document_starts(segments))

  def step(m_BxNxHxE, token):
    r, log_decay, k, v, kk, a, start = token
    m_BxNxHxE = jnp.where(start[:, None, None, None], 0.0, m_BxNxHxE)
    read = jnp.einsum("bnh,bnhe->bne", -kk, m_BxNxHxE)  # u_t = M^T alpha_t
    m_BxNxHxE = (jnp.exp(log_decay)[..., None] * m_BxNxHxE
                 + (kk * a)[..., None] * read[:, :, None]
                 + k[..., None] * v[:, :, None])
    return m_BxNxHxE, jnp.einsum("bnh,bnhe->bne", r, m_BxNxHxE)

  state, out = jax.lax.scan(step, state.astype(jnp.float32),
                            (*map(f32, (r, log_decay, k, v, kk, a)), jnp.moveaxis(starts, 1, 0)))
  return jnp.moveaxis(out, 0, 1), state


def chunked_rwkv7(r, log_decay, k, v, kk, a, state, *, chunk_size=32, segments=None):
  """The recurrence of `rwkv7_recurrence` in the chunked form of the module docstring (same
  arguments; log_decay >= -LOG_DECAY_SCALE, chunks of min(chunk_size, T) <= MAX_CHUNK)."""
  b, length, n, h = r.shape
  e = v.shape[-1]
  chunk = min(chunk_size, length)
  assert chunk <= MAX_CHUNK, chunk
  padded = chunked.num_chunks(length, chunk) * chunk
  # [B, L, N, F] -> [B, Z, N, C, F] for Z chunks of C tokens. Zero padding (log w = 0,
  # k = kk = 0) leaves the state as it is.
  r, log_decay, k, v, kk, a = (
      jnp.moveaxis(chunked.split_chunks(x.astype(jnp.float32), chunk), 2, 3)
      for x in (r, log_decay, k, v, kk, a))
  alpha, beta = -kk, kk * a
  same, sees_state, keeps_state, adds = masks.all_chunk_segments(segments, padded, chunk, b)
  inclusive = same[:, :, None].astype(jnp.float32)  # s <= t in one segment [B, Z, 1, C, C]
  strict = inclusive * (1.0 - jnp.eye(chunk))  # s < t
  sees_state, adds = (m[:, :, None, :, None] for m in (sees_state, adds))

  cumulative = jnp.cumsum(log_decay, axis=-2)  # G [B, Z, N, C, H]
  before = cumulative - log_decay  # G' = G_{t-1}
  r_from_start, alpha_from_start = r * jnp.exp(cumulative), alpha * jnp.exp(before)
  k_to_start, beta_to_start = k * jnp.exp(-cumulative), beta * jnp.exp(-cumulative)
  pairs = lambda x, y, mask: jnp.einsum("bznch,bznsh->bzncs", x, y) * mask  # noqa: E731
  r_k = pairs(r_from_start, k_to_start, inclusive)
  r_beta = pairs(r_from_start, beta_to_start, inclusive)
  alpha_k = pairs(alpha_from_start, k_to_start, strict)
  alpha_beta = pairs(alpha_from_start, beta_to_start, strict)
  solve = gated_deltanet.invert_unit_lower(jnp.eye(chunk) - alpha_beta)  # (I - A_ab)^-1
  drives = jnp.concatenate([jnp.einsum("bzncs,bznse->bznce", alpha_k, v),
                            alpha_from_start * sees_state], axis=-1)
  solved = jnp.einsum("bzncs,bznsf->bzncf", solve, drives, precision=HIGHEST)
  free_u, w = solved[..., :e], solved[..., e:]  # U = U' + W M_0
  to_end = jnp.exp(cumulative[..., -1:, :] - cumulative) * adds
  chunk_decay = jnp.exp(cumulative[..., -1, :]) * keeps_state[:, :, None, None]  # [B, Z, N, H]
  kv_to_end = jnp.einsum("bznch,bznce->bznhe", k * to_end, v)

  def step(m_BxNxHxE, chunk_inputs):
    free_u, w, beta_to_end, kv_to_end, chunk_decay = chunk_inputs
    u = free_u + jnp.einsum("bnch,bnhe->bnce", w, m_BxNxHxE)
    new_m = (chunk_decay[..., None] * m_BxNxHxE + kv_to_end
             + jnp.einsum("bnch,bnce->bnhe", beta_to_end, u))
    return new_m, (m_BxNxHxE, u)

  to_scan = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
  state, (starts, u) = jax.lax.scan(
      step, state.astype(jnp.float32),
      tuple(map(to_scan, (free_u, w, beta * to_end, kv_to_end, chunk_decay))))
  starts, u = jnp.moveaxis(starts, 0, 1), jnp.moveaxis(u, 0, 1)
  out = (jnp.einsum("bznch,bznhe->bznce", r_from_start * sees_state, starts)
         + jnp.einsum("bzncs,bznse->bznce", r_k, v)
         + jnp.einsum("bzncs,bznse->bznce", r_beta, u))
  return chunked.merge_chunks(jnp.moveaxis(out, 3, 2), length), state


def orthogonal(gain):
  """PyTorch's orthogonal_ with `gain` on the kernel flattened to [first axis, the others]."""
  init = nnx.initializers.orthogonal(gain)
  return lambda key, shape, dtype=jnp.float32: init(
      key, (shape[0], math.prod(shape[1:])), dtype).reshape(shape)


def _per_channel(heads, head_dim, values):
  """A parameter [N, H] (no weight decay) of one value per channel, or one for all."""
  values = jnp.broadcast_to(jnp.asarray(values, jnp.float32), (heads * head_dim,))
  return nn.param(values.reshape(heads, head_dim), ("heads", "head_dim"), weight_decay=False)


def lora_rank(setting, d_model, scale):
  """The setting, or with 0 the reference's max(32, round(scale sqrt(D) / 32) 32)."""
  return int(setting) or max(32, int(round(scale * d_model ** 0.5 / 32) * 32))


def _first_layer_of_its_kind(model_config, layer_index):
  """The first layer whose mixer is the one of layer `layer_index` (model.layer_pattern tiled
  over the layers, or model.attention in every layer)."""
  pattern = tuple(model_config.layer_pattern) or (model_config.attention,)
  kinds = [pattern[i % len(pattern)] for i in range(layer_index + 1)]
  return kinds.index(kinds[layer_index])


class RWKV7(rwkv6.ShiftAndMatrixState):
  # Chunks of 32: fwd+bwd at 2048 tokens (d_model 256, 4 heads) on a shared 2-core CPU took the
  # time of chunks of 64, ~15% less than 16, ~25% less than rwkv6 at its defaults (noisy).
  hyperparameters = {"chunk_size": 32,  # tokens per chunk, <= 64 (MAX_CHUNK)
                     "decay_lora_rank": 0,  # 0: the reference's sizing (module docstring)
                     "a_lora_rank": 0,
                     "gate_lora_rank": 0,
                     "value_residual": True,  # layers > 0 mix in the first layer's values
                     "value_lora_rank": 0}
  test_settings = {"chunk_size": 4, "decay_lora_rank": 8, "a_lora_rank": 8, "gate_lora_rank": 8,
                   "value_lora_rank": 8}

  @classmethod
  def validate(cls, settings, model_config):
    del model_config
    if not 1 <= settings.chunk_size <= MAX_CHUNK:
      raise ValueError(f"model.rwkv7.chunk_size must be in [1, {MAX_CHUNK}] (larger chunks "
                       f"overflow float32's decay ratios), got {settings.chunk_size}")
    for field in ("decay_lora_rank", "a_lora_rank", "gate_lora_rank", "value_lora_rank"):
      if settings[field] < 0:
        raise ValueError(f"model.rwkv7.{field} must be >= 1, or 0 for the reference's sizing; "
                         f"got {settings[field]}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del position  # order comes from the recurrence; the embedding hook is the model's
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    layers = model_config.num_layers
    self.num_heads, self.head_dim = n, h
    self.chunk_size = int(settings.chunk_size)
    self.dtype = dtype = nn.compute_dtype(model_config)
    rho0 = layer_index / (layers - 1) if layers > 1 else 0.0
    rho1 = 1.0 - layer_index / layers
    channel = jnp.arange(d, dtype=jnp.float32)
    linear = channel / max(d - 1, 1) - 0.5
    centred = ((channel % h) - (h - 1) / 2) / ((h - 1) / 2) if h > 1 else 0.0 * channel
    zigzag = centred * jnp.abs(centred)
    self.mix = nnx.Dict({
        name: nn.param(1.0 - (channel / d) ** (power * rho1), ("embed",), weight_decay=False)
        for name, power in MIX_POWERS.items()})
    self.decay_base = _per_channel(
        n, h, -6.0 + 6.0 * (channel / max(d - 1, 1)) ** (1.0 + rho0 ** 0.3) + 0.5 + 2.5 * zigzag)
    self.a_base = _per_channel(n, h, -0.19 + 0.3 * zigzag + 0.4 * linear)
    self.key_normaliser = _per_channel(n, h, 0.71 - 0.1 * linear)  # the reference's k_k
    self.key_a_mix = _per_channel(n, h, 1.02)  # k_a
    self.bonus = _per_channel(n, h, -0.04)  # r_k
    self.lora_down, self.lora_up = nnx.Dict(), nnx.Dict()
    for name, scale in LORA_SCALES.items():
      self._add_lora(name, lora_rank(settings[f"{name}_lora_rank"], d, scale), d, n, h, rngs)
    # The value residual's parameters, in the RWKV-7 layers after the first (the reference's
    # layer_id > 0).
    self.value_residual = (bool(settings.value_residual)
                           and layer_index > _first_layer_of_its_kind(model_config, layer_index))
    if self.value_residual:
      self.value_residual_base = _per_channel(n, h, 0.73 - 0.4 * linear)  # the reference's v0
      self._add_lora("value", lora_rank(settings.value_lora_rank, d, VALUE_LORA_SCALE), d, n, h,
                     rngs)
    self.receptance, self.key, self.value = (
        base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype, init=orthogonal(gain))
        for gain in (1.0, 0.1, 1.0))
    self.norm_scale = _per_channel(n, h, ((layer_index + 1) / layers) ** 0.7)
    self.norm_bias = _per_channel(n, h, 0.0)
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype)

  def _add_lora(self, name, rank, d, n, h, rngs):
    """A low-rank map D -> R -> [N, H]: A zero, B orthogonal with gain 0.1 (x sqrt(R / D) when
    R > D), no weight decay."""
    self.lora_down[name] = nn.param(jnp.zeros((d, rank)), ("embed", "ssm_proj"),
                                    weight_decay=False)
    gain = 0.1 * (math.sqrt(rank / d) if rank > d else 1.0)
    self.lora_up[name] = nn.param(orthogonal(gain)(rngs.params(), (rank, n, h)),
                                  ("ssm_proj", "heads", "head_dim"), weight_decay=False)

  # __call__ and decode (chunked.ChunkedRecurrentMixer's) run `_mix`, the layer as the first to
  # see the carry; the model runs the carry's versions below.
  def call_with_carry(self, x_BxLxD, positions_BxL, segments_BxL, carry):
    del positions_BxL  # order comes from the recurrence
    y, _, carry = self._mix_with_carry(x_BxLxD, self.init_cache(x_BxLxD.shape[0], 0),
                                       segments_BxL, carry)
    return y, carry

  def decode_with_carry(self, x_BxTxD, cache, index, carry, documents=None):
    cache, _, segments_BxT = base.decode_inputs(self, x_BxTxD, cache, index, documents)
    return self._mix_with_carry(x_BxTxD, cache, segments_BxT, carry)

  def _lora(self, name, x_BxTxD):
    """activation(x A) B [B, T, N, H] of the low-rank map `name`."""
    hidden_BxTxR = LORA_ACTIVATIONS[name](x_BxTxD @ self.lora_down[name][...])
    return jnp.einsum("btr,rnh->btnh", hidden_BxTxR, self.lora_up[name][...])

  def _mix(self, x_BxTxD, cache, segments_BxT=None):
    return self._mix_with_carry(x_BxTxD, cache, segments_BxT, {})[:2]

  def _mix_with_carry(self, x_BxTxD, cache, segments_BxT, carry):
    """(y, cache, carry): the time mix from `cache`; the first layer to see the carry leaves its
    values in it, a later one with the value residual mixes them into its own."""
    previous, last = rwkv6.token_shift(x_BxTxD, cache["shift"], segments_BxT)
    x = x_BxTxD.astype(jnp.float32)
    dx = previous.astype(jnp.float32) - x
    xs = {name: x + dx * self.mix[name][...] for name in STREAMS}
    r = self.receptance(xs["r"]).astype(jnp.float32)
    k = self.key(xs["k"]).astype(jnp.float32)
    v = self.value(xs["v"]).astype(jnp.float32)
    if FIRST_VALUES not in carry:
      carry = {**carry, FIRST_VALUES: v}
    elif self.value_residual:  # v + (v_first - v) sigmoid(v0 + (x_v A_v) B_v)
      v = v + (carry[FIRST_VALUES] - v) * jax.nn.sigmoid(self.value_residual_base[...]
                                                         + self._lora("value", xs["v"]))
    log_decay = -LOG_DECAY_SCALE * jax.nn.sigmoid(self.decay_base[...]
                                                  + self._lora("decay", xs["w"]))
    a = jax.nn.sigmoid(self.a_base[...] + self._lora("a", xs["a"]))
    g = self._lora("gate", xs["g"])
    kk = k * self.key_normaliser[...]
    kk = kk / jnp.maximum(jnp.sqrt(jnp.sum(kk * kk, -1, keepdims=True)), NORMALIZE_EPSILON)
    k = k * (1.0 + (a - 1.0) * self.key_a_mix[...])
    if x_BxTxD.shape[1] == 1:  # one decoded token: the recurrence, no chunk machinery
      o, state = rwkv7_recurrence(r, log_decay, k, v, kk, a, cache["state"], segments_BxT)
    else:
      o, state = chunked_rwkv7(r, log_decay, k, v, kk, a, cache["state"],
                               chunk_size=self.chunk_size, segments=segments_BxT)
    o = modules.group_norm(o, self.norm_scale[...], self.norm_bias[...], eps=NORM_EPSILON)
    o = o + jnp.sum(r * k * self.bonus[...], -1, keepdims=True) * v
    return self.out((o * g).astype(self.dtype)), {"shift": last, "state": state}, carry

  def mixing_flops_per_token(self, context_length):
    n, h = self.num_heads, self.head_dim
    c = min(self.chunk_size, context_length)
    # Within a chunk, over its (C + 1) / 2 earlier tokens on average: the four pair products
    # (r.k, r.b, alpha.k, alpha.b), alpha_k @ V, the solve (I - A)^-1 [U' | W] and the outputs
    # r_k @ V, r_b @ U; across chunks W M_0, r M_0 and the state update (k v^T, b u^T). The
    # token shift's six interpolations, the decay factors, the norm and the bonus.
    within = 2 * (c + 1) / 2 * (4 * h + h + 2 * h + 2 * h)
    across = 4 * 2 * h * h
    return n * (within + across) + 6 * 3 * n * h + 20 * n * h
