"""RWKV-6 ("Finch") time mixing (Peng et al., arXiv:2404.05892), as the authors' RWKV-LM computes
it (RWKV-v5/src/model.py, RWKV_Tmix_x060, trained with --my_testing x060).

Token shift with data-dependent linear interpolation (ddlerp); x' is the previous token (0 at a
document's start), mu_* learned vectors, A [D, 5 R], B [5, R, D] one low-rank map (rank R = 32):
  dx = x' - x,   (m_w, m_k, m_v, m_r, m_g) = tanh((x + dx * mu_x) A) B
  x_* = x + dx * (mu_* + m_*)                                  for * in w, k, v, r, g
  r, k, v = x_r W_r, x_k W_k, x_v W_v,   g = silu(x_g W_g)
  w_t = exp(-exp(d + tanh(x_w A_d) B_d))                       per channel, in (0, 1); rank 64
Per head, a matrix state S [H, E] (keys x values) that decays per key channel, and the bonus u
("time_first") for the current token:
  o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T),   S_t = diag(w_t) S_{t-1} + k_t v_t^T
  out = (GroupNorm(o) * g) W_o          one group per head, eps 64e-5, affine (the reference's
                                        1e-5 * head_size_divisor^2 with its default divisor 8)
The head dim is d_model / model.num_heads (the reference's head_size 64 at d_model 64 * heads).

Initialisation as the reference's, which depends on the layer's depth l / n_layer: a mixer here
does not know its depth, so the depth ratio is taken as 1/2 (a middle layer). With i / D the
channel's fraction: mu_x, mu_w, mu_k = 1 - (i/D)^(1/2), mu_v = 1 - ((i/D)^(1/2) + 0.15),
mu_r, mu_g = 1 - (i/D)^(1/4); d_n = -6 + 5 (n / (D-1))^(0.7 + 1.3/2); u_n = (1 - n / (D-1)) / 2
plus a zigzag ((n + 1) mod 3 - 1) / 10; A, A_d zero, B, B_d ~ U[-0.01, 0.01]; W_r, W_v
orthogonal, W_k, W_g orthogonal with gain 0.1; the GroupNorm gain (1/2)^0.7, bias 0. Simplified:
W_o takes the lab's LeCun normal, not the reference's zeros (which, with its embedding and head
initialisation, make a fresh layer the identity, and would leave this layer's output blind to
its input in the lab's checks), and the reference's per-group learning rates (2x on d) are not
reproduced. The mu, d, u, LoRA and norm parameters take no weight decay (the reference's
optimizer groups); W_r, W_k, W_v, W_g, W_o do.

Training, evaluation and decoding run one chunked form, shared with GLA
(research/model/attention/vector_decay.py: chunks cut into sub-chunks so that every decay factor is
<= 1 however strong the decay), with the bonus u on the diagonal.

Packed documents: the state and the token shift restart at each segment start (the scores keep
to the segment, the carried state reaches only its own segment's tokens); a state passed in
belongs to the first token's segment. The decode state is the last token (for the shift) and S.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import masks
from research.model.attention import modules
from research.model.attention import vector_decay

NORM_EPSILON = 64e-5  # the GroupNorm's (RWKV-7's too)
DEPTH_RATIO = 0.5  # the reference's layer_id / n_layer, which a mixer here does not know
STREAMS = ("w", "k", "v", "r", "g")  # the ddlerp outputs, in the reference's order


def token_shift(x_BxTxD, last_BxD, segments_BxT=None):
  """(x' [B, T, D]: the token before each one, `last_BxD` before the first and 0 at a segment
  start; the new last token [B, D])."""
  previous = jnp.concatenate([last_BxD[:, None].astype(x_BxTxD.dtype), x_BxTxD[:, :-1]], axis=1)
  if segments_BxT is not None:
    previous = jnp.where(masks.document_starts(segments_BxT)[..., None], 0, previous)
  return previous, x_BxTxD[:, -1]


def chunked_rwkv6(r, k, v, log_decay, bonus, state, *, chunk_size=32, sub_chunk_size=8,
                  segments=None):
  """The RWKV-6 recurrence in the chunked form: o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T),
  S_t = diag(w_t) S_{t-1} + k_t v_t^T (vector_decay.chunked_vector_decay with the bonus u)."""
  return vector_decay.chunked_vector_decay(r, k, v, log_decay, state, bonus=bonus,
                                           chunk_size=chunk_size, sub_chunk_size=sub_chunk_size,
                                           segments=segments)


def _orthogonal(gain):
  """PyTorch's orthogonal_ with `gain` on the kernel flattened to [D, everything else]."""
  init = nnx.initializers.orthogonal(gain)
  return lambda key, shape, dtype=jnp.float32: init(
      key, (shape[0], math.prod(shape[1:])), dtype).reshape(shape)


def _uniform(key, shape, bound=0.01):
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def mix_coefficients(d_model, power):
  """1 - (i / D)^power for channel i: the reference's token-shift mixing vectors."""
  return 1.0 - (jnp.arange(d_model, dtype=jnp.float32) / d_model) ** power


class ShiftAndMatrixState(chunked.ChunkedRecurrentMixer):
  """The cache of the RWKV time mixes: a decode state of the last token (the token shift) and a
  [H, H] matrix per head, both carried by `_mix(x, cache, segments) -> (y, cache)`, which a
  subclass defines (with num_heads, head_dim, dtype)."""

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    n, h = self.num_heads, self.head_dim
    return {"shift": jnp.zeros((batch_size, n * h), self.dtype),
            "state": jnp.zeros((batch_size, n, h, h), jnp.float32)}


class RWKV6(ShiftAndMatrixState):
  # Chunks of 32 in sub-chunks of 8: fwd+bwd at 4096 tokens (d_model 512, 8 heads) on a 2-core
  # CPU took the same time as 16 / 4 and 32 / 4 and 25% less than flash-linear-attention's
  # 64 / 16; the elementwise work per token and head grows as (c + C / c) H.
  hyperparameters = {"chunk_size": 32,
                     "sub_chunk_size": 8,  # pairs within a sub-chunk are computed one by one
                     "mix_lora_rank": 32,
                     "decay_lora_rank": 64}
  test_settings = {"chunk_size": 8, "sub_chunk_size": 4}

  @classmethod
  def validate(cls, settings, model_config):
    del model_config
    for field in cls.hyperparameters:
      if settings[field] < 1:
        raise ValueError(f"model.rwkv6.{field} must be >= 1, got {settings[field]}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d, n = model_config.d_model, model_config.num_heads
    h = d // n
    self.num_heads, self.head_dim = n, h
    self.chunk_size = int(settings.chunk_size)
    self.sub_chunk_size = int(settings.sub_chunk_size)
    self.dtype = dtype = nn.compute_dtype(model_config)
    depth = DEPTH_RATIO
    decaying = 1.0 - depth  # the reference's ratio_1_to_almost0
    mu = {"x": decaying, "w": decaying, "k": decaying, "v": decaying, "r": decaying / 2,
          "g": decaying / 2}
    self.mix = nnx.Dict({
        name: nn.param(mix_coefficients(d, power) - (0.3 * depth if name == "v" else 0.0),
                       ("embed",), weight_decay=False)
        for name, power in mu.items()})
    rank, decay_rank = int(settings.mix_lora_rank), int(settings.decay_lora_rank)
    self.mix_down = nn.param(jnp.zeros((d, len(STREAMS), rank)), ("embed", None, "ssm_proj"),
                             weight_decay=False)
    self.mix_up = nn.param(_uniform(rngs.params(), (len(STREAMS), rank, d)),
                           (None, "ssm_proj", "embed"), weight_decay=False)
    channel = jnp.arange(d, dtype=jnp.float32) / max(d - 1, 1)
    self.decay = nn.param((-6.0 + 5.0 * channel ** (0.7 + 1.3 * depth)).reshape(n, h),
                          ("heads", "head_dim"), weight_decay=False)
    self.decay_down = nn.param(jnp.zeros((d, decay_rank)), ("embed", "ssm_proj"),
                               weight_decay=False)
    self.decay_up = nn.param(_uniform(rngs.params(), (decay_rank, n, h)),
                             ("ssm_proj", "heads", "head_dim"), weight_decay=False)
    zigzag = ((jnp.arange(d) + 1) % 3 - 1) * 0.1
    self.bonus = nn.param((depth * (1.0 - channel) + zigzag).reshape(n, h),
                          ("heads", "head_dim"), weight_decay=False)
    self.receptance, self.key, self.value, self.gate = (
        base.head_projection(d, n, h, "heads", rngs=rngs, dtype=dtype, init=_orthogonal(gain))
        for gain in (1.0, 0.1, 1.0, 0.1))
    self.norm_scale = nn.param(jnp.full((n, h), depth ** 0.7), ("heads", "head_dim"),
                               weight_decay=False)
    self.norm_bias = nn.param(jnp.zeros((n, h)), ("heads", "head_dim"), weight_decay=False)
    self.out = base.output_projection(n, h, d, rngs=rngs, dtype=dtype)

  def _mix(self, x_BxTxD, cache, segments_BxT=None):
    previous, last = token_shift(x_BxTxD, cache["shift"], segments_BxT)
    x = x_BxTxD.astype(jnp.float32)
    dx = previous.astype(jnp.float32) - x
    # The five streams' low-rank maps with the stream axis first: between the batch and feature
    # axes it made XLA:CPU transpose (2-3x slower fwd+bwd); five separate matmuls slowed decoding.
    hidden_5xBxTxR = jnp.tanh(jnp.einsum("btd,dfr->fbtr", x + dx * self.mix["x"][...],
                                         self.mix_down[...]))
    offsets_5xBxTxD = jnp.einsum("fbtr,frd->fbtd", hidden_5xBxTxR, self.mix_up[...])
    shifted = {name: x + dx * (self.mix[name][...] + offsets_5xBxTxD[i])
               for i, name in enumerate(STREAMS)}
    r_BxTxNxH = self.receptance(shifted["r"]).astype(jnp.float32)
    k_BxTxNxH = self.key(shifted["k"]).astype(jnp.float32)
    v_BxTxNxH = self.value(shifted["v"]).astype(jnp.float32)
    g_BxTxNxH = jax.nn.silu(self.gate(shifted["g"]).astype(jnp.float32))
    decay_hidden_BxTxR = jnp.tanh(jnp.einsum("btd,dr->btr", shifted["w"], self.decay_down[...]))
    log_decay_BxTxNxH = -jnp.exp(self.decay[...] + jnp.einsum("btr,rnh->btnh", decay_hidden_BxTxR,
                                                              self.decay_up[...]))
    o_BxTxNxH, state = chunked_rwkv6(
        r_BxTxNxH, k_BxTxNxH, v_BxTxNxH, log_decay_BxTxNxH, self.bonus[...], cache["state"],
        chunk_size=self.chunk_size, sub_chunk_size=self.sub_chunk_size, segments=segments_BxT)
    normalised = modules.group_norm(o_BxTxNxH, self.norm_scale[...], self.norm_bias[...],
                                    eps=NORM_EPSILON)
    return (self.out((normalised * g_BxTxNxH).astype(self.dtype)),
            {"shift": last, "state": state})

  def mixing_flops_per_token(self, context_length):
    n, h = self.num_heads, self.head_dim
    c = min(self.chunk_size, context_length)
    sub = vector_decay.sub_chunk_length(c, self.sub_chunk_size)
    # Within a chunk: r.k scores over the chunk's (C + 1) / 2 earlier tokens on average and
    # scores @ v; the per-pair decay factors of a sub-chunk (exp, r * factor * k); across
    # chunks: r S_0 and the state update. The token shift's five interpolations and the norm.
    within = 2 * (c + 1) / 2 * 2 * h + 4 * sub * h
    across = 3 * 2 * h * h
    return n * (within + across) + 5 * 3 * n * h + 10 * n * h
