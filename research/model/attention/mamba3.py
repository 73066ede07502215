"""Mamba-3, a state space layer with an exponential-trapezoidal discretisation and data-dependent
rotary (complex-valued) transitions (Mamba-3: Improved Sequence Modeling using State Space
Principles, arXiv:2603.15569). This is its single-input single-output (SISO) form: Mamba-2's
selective SSM without the short convolution, with normalised and biased B and C, a two-term
(trapezoidal) update and a data-dependent rotation of B and C.

Reference: fla-org/flash-linear-attention@bc3b101, fla/layers/mamba3.py (Mamba3: __init__,
_project_and_split, _compute_a, cuda_kernels_forward) with the defaults of
fla/models/mamba3/configuration_mamba3.py (Mamba3Config). fla computes the layer only with the
authors' kernels (mamba_ssm's mamba3_siso_combined); the recurrence is that of the authors' torch
references, state-spaces/mamba@e9594ce, tests/ops/triton/test_mamba3_siso.py
(mamba3_siso_step_ref, token by token; mamba3_siso_fwd_ref, the parallel form).

Per token, with E = expand * d_model inner units in H heads of P = head_dim, N = state_size, G
groups of B and C (n_groups) and R = floor_even(N rope_fraction) / 2 rotated channel pairs:
  z, x, B, C, dd_dt, dd_A, trap, angle = in_proj(u)     (z, x: [H, P]; B, C: [G, N];
                                                          dd_dt, dd_A, trap: [H]; angle: [R])
  dt = softplus(dd_dt + dt_bias),   A = min(-softplus(dd_A), -A_floor)     (data-dependent A)
  lam = sigmoid(trap)                                  (the trapezoid's weight on the new end)
  k = RMSNorm(B) + B_bias,  q = RMSNorm(C) + C_bias    (head h reads group h // (H / G);
                                                        one norm gain [N], biases [H, N])
  theta_t = (theta_{t-1} + dt_t pi tanh(angle_t)) mod 2 pi               (per head, [R])
  k~_t = R(theta_t) k_t,  q~_t = R(theta_t) q_t        (channel pairs (2i, 2i + 1), i < R, turn)
  h_t = a_t h_{t-1} + (1 - lam_t) dt_t a_t x_{t-1} k~_{t-1}^T + lam_t dt_t x_t k~_t^T,
        a_t = exp(dt_t A_t)                            (h: [P, N] per head)
  y_t = h_t q~_t + D x_t
  out = out_proj(y * silu(z))        (is_outproj_norm: out_proj(RMSNorm_per_head(y) w * silu(z)))
The trapezoid weighs the drive at both ends of the step, lam on the new token and 1 - lam on the
previous one (decayed over the step): lam = 1 is Mamba-2's exponential-Euler rule (zero-order
hold), lam = 1/2 the trapezoid. The rotation is a complex diagonal transition
exp(dt (A + i omega)), omega = pi tanh(angle), applied to B and C instead of the state ("the RoPE
trick"): q~_t . k~_s depends on theta_t - theta_s only. Defaults as fla's: N = 128, P = 64,
expand 2, G = 1, rope_fraction 1/2, dt ~ logU[1e-3, 1e-1] floored at 1e-4 in dt_bias =
softplus^-1(dt), A_floor 1e-4, B_bias = C_bias = 1, D = 1, norm gains 1, eps 1e-5, no projection
biases, chunks of 64. dt_bias and D take no weight decay (fla's _no_weight_decay), nor do B_bias,
C_bias and the norm gains (this lab's rule for biases and gains). model.num_heads is not used.

The chunked form folds the pending previous-token term into the state:
  H_t = h_t + (1 - lam_{t+1}) dt_{t+1} x_t k~_t^T
      = a_t H_{t-1} + s_t x_t k~_t^T,         s_t = lam_t dt_t + (1 - lam_{t+1}) dt_{t+1}
  y_t = H_t q~_t - (1 - lam_{t+1}) dt_{t+1} (q~_t . k~_t) x_t + D x_t
(mamba3_siso_fwd_ref's scale and shifted gamma), so that H follows Mamba-2's SSD recurrence with
per-head, rotated keys and queries; within a chunk a masked [C, C] matmul per head, across chunks
the [H, P, N] state (research/model/attention/mamba2.py's form, whose chunked_ssd shares one B
and C among the heads and takes a constant A per head, so is not reused). The rotation angles
are a cumulative sum in the same chunks (a triangular matmul within, a scan across, mod 2 pi as
the authors' angle_dt kernel). Memory grows as [length, C] per head, never [length, length] or
[length, P, N]. The decode cache is (theta, h, k~ and x of the last token), fla's
(angle, ssm, k, v) state; decoding runs the same form on any number of new tokens. Packed
documents: a document's first token restarts the angle, the state and the pending term
(mamba_ssm's varlen path, one sequence per document).

Differences from fla, by choice: the projections run in model.compute_dtype and everything
after them in float32, the cached k~ and x too (fla's kernels round q, k, x, trap, the angles and
z to bfloat16, use approximate tanh, sigmoid, cos and sin, and cache k and x in the model's
dtype); fla decodes one token per call (its step kernels), here any number; fla's step path
expands B and C to the heads with `expand`, which holds only for n_groups = 1, while its chunked
kernel has head h read group h // (H / G), as here. The projections are separate per stream
(the column blocks of fla's in_proj) and initialised like the lab's other dense layers (LeCun
normal, fan-in d_model) rather than by fla's _init_weights (normal(0.02); out_proj
Kaiming-uniform / sqrt(layers)). fla's A is -softplus(dd_A) (the authors' newer mamba_ssm
Mamba3 uses a heavy-tailed activation instead); this follows fla. The multi-input
multi-output (MIMO) variant, is_mimo, is not implemented (refused).
"""

import math

import jax
import jax.numpy as jnp

from research.model import nn
from research.model.attention import base
from research.model.attention import chunked
from research.model.attention import masks
from research.model.attention import modules

HIGHEST = jax.lax.Precision.HIGHEST
TWO_PI = 2 * math.pi


def rotated_pairs(state_size, rope_fraction):
  """Channel pairs of B and C that rotate (fla's num_rope_angles): state_size * rope_fraction
  rounded down to an even number, halved."""
  split = int(state_size * rope_fraction)
  return (split - split % 2) // 2


def wrap_angle(theta):
  """theta mod 2 pi, in [0, 2 pi); the floor's gradient is 0, so the gradient is theta's."""
  return theta - TWO_PI * jnp.floor(theta / TWO_PI)


def rotate_pairs(x_xN, theta_xR):
  """x [..., N] with its channel pairs (2i, 2i + 1), i < R, rotated by theta [..., R]; the last
  N - 2R channels unrotated (the pairwise rotation of mamba_ssm's SISO kernel)."""
  r = theta_xR.shape[-1]
  pairs = x_xN[..., :2 * r].reshape(*x_xN.shape[:-1], r, 2)
  first, second = pairs[..., 0], pairs[..., 1]
  cos, sin = jnp.cos(theta_xR), jnp.sin(theta_xR)
  rotated = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
  return jnp.concatenate([rotated.reshape(*x_xN.shape[:-1], 2 * r), x_xN[..., 2 * r:]], -1)


def _cumulative_angles(increments_BxLxHxR, angle0_BxHxR, chunk, segment_masks):
  """theta_t = (theta_{t-1} + increment_t) mod 2 pi from angle0, restarting at 0 at segment
  starts: within each chunk a triangular matmul, across chunks a scan of the [H, R] angles,
  wrapped at every chunk so that they stay small. Returns theta [B, L, H, R]."""
  length = increments_BxLxHxR.shape[1]
  same, sees_state, keeps_state, adds = (m.astype(jnp.float32) for m in segment_masks)
  increments = chunked.split_chunks(increments_BxLxHxR, chunk)  # [B, Z, C, H, R]
  within = jnp.einsum("bzls,bzshr->bzlhr", same, increments, precision=HIGHEST)
  chunk_sums = jnp.einsum("bzs,bzshr->bzhr", adds, increments, precision=HIGHEST)

  def step(theta_BxHxR, keep_and_sum):
    keep_B, sum_BxHxR = keep_and_sum
    return wrap_angle(keep_B[:, None, None] * theta_BxHxR + sum_BxHxR), theta_BxHxR

  _, entering = jax.lax.scan(step, angle0_BxHxR, (keeps_state.swapaxes(0, 1),
                                                 jnp.moveaxis(chunk_sums, 1, 0)))
  entering_BxZxHxR = jnp.moveaxis(entering, 0, 1)
  theta = wrap_angle(within + sees_state[..., None, None] * entering_BxZxHxR[:, :, None])
  return chunked.merge_chunks(theta, length)


def chunked_mamba3(q, k, v, log_decay, dt, trap, angles, state, *, chunk_size=64,
                   segments=None):
  """Mamba-3's SISO recurrence (module docstring) in chunks of chunk_size tokens, from `state`.

  q, k [B, L, H, N] (normalised and biased, not yet rotated), v [B, L, H, P] (the layer's x);
  log_decay = dt A (< 0), dt (> 0) and trap (the trapezoid's logit, lam = sigmoid(trap))
  [B, L, H]; angles [B, L, H, R] (raw: the angle grows by dt pi tanh(angles)); state {"angle"
  [B, H, R], "ssm" [B, H, P, N], "k" [B, H, N] (the last token's rotated key), "v" [B, H, P]}
  (zeros: none). segments [B, L] (packed documents, non-decreasing) restart the angle, the state
  and the pending term at each segment start; `state` belongs to the first token's segment.
  mamba_ssm's mamba3_siso_combined without its D, Z and bias terms (the layer's).
  Returns (y [B, L, H, P], the state after the last token), float32.
  """
  q, k, v, log_decay, dt, trap, angles = (
      t.astype(jnp.float32) for t in (q, k, v, log_decay, dt, trap, angles))
  b, length, heads, n = q.shape
  p = v.shape[-1]
  chunk = min(chunk_size, length)
  padded = chunked.num_chunks(length, chunk) * chunk
  segment_masks = masks.all_chunk_segments(segments, padded, chunk, b)
  same, sees_state, keeps_state, adds = segment_masks

  theta = _cumulative_angles(jnp.pi * jnp.tanh(angles) * dt[..., None], state["angle"], chunk,
                             segment_masks)
  q, k = rotate_pairs(q, theta), rotate_pairs(k, theta)

  lam = jax.nn.sigmoid(trap)
  previous_weight = (1 - lam) * dt  # times a_t: the previous token's drive entering at t
  # The next token's weight, 0 after the last token (that term is the state's pending k and v).
  # At a document's last token it is the next document's, which is harmless: the correction
  # below removes it from the token's own output and no later token of the document reads it.
  next_previous_weight = jnp.pad(previous_weight[:, 1:], [(0, 0), (0, 1), (0, 0)])
  scale = lam * dt + next_previous_weight  # s_t: the weight of x_t k~_t^T in H
  # H entering the first token: the state and the last token's pending term (its own decay
  # a_1 is applied with the chunk's).
  h0 = state["ssm"] + (previous_weight[:, 0, :, None, None] * state["v"][..., :, None]
                       * state["k"][..., None, :])

  def to_chunks(t):  # [B, L, H, ...] -> [B, Z, H, C, ...]; zero padding keeps the state
    return jnp.moveaxis(chunked.split_chunks(t, chunk), 2, 3)

  q_BxZxHxCxN, k_BxZxHxCxN = to_chunks(q), to_chunks(k)
  xs_BxZxHxCxP = to_chunks(v * scale[..., None])
  # Cumulative log decay within each chunk as a matmul with a triangular matrix, in full float32
  # precision (it is exponentiated).
  inclusive_CxC = jnp.tril(jnp.ones((chunk, chunk), jnp.float32))
  cum_BxZxHxC = jnp.einsum("bzhc,lc->bzhl", to_chunks(log_decay), inclusive_CxC,
                           precision=HIGHEST)
  # exp(cum_l - cum_s) for s <= l in one segment; masked before exp, so never exp of a positive.
  exponents = cum_BxZxHxC[..., :, None] - cum_BxZxHxC[..., None, :]
  decay_BxZxHxCxC = jnp.exp(jnp.where(same[:, :, None], exponents, -jnp.inf))
  scores = jnp.einsum("bzhln,bzhsn->bzhls", q_BxZxHxCxN, k_BxZxHxCxN) * decay_BxZxHxCxC
  y_BxZxHxCxP = jnp.einsum("bzhls,bzhsp->bzhlp", scores, xs_BxZxHxCxP)
  to_end_BxZxHxC = jnp.exp(cum_BxZxHxC[..., -1:] - cum_BxZxHxC) * adds[:, :, None]
  states_BxZxHxPxN = jnp.einsum("bzhcp,bzhcn->bzhpn", xs_BxZxHxCxP * to_end_BxZxHxC[..., None],
                                k_BxZxHxCxN)
  chunk_decay_BxZxH = jnp.exp(cum_BxZxHxC[..., -1]) * keeps_state[:, :, None]
  starts, h = base.states_entering_chunks(h0, chunk_decay_BxZxH[..., None, None],
                                          states_BxZxHxPxN, axis=1)
  from_start = jnp.exp(cum_BxZxHxC) * sees_state[:, :, None]
  y_BxZxHxCxP += from_start[..., None] * jnp.einsum("bzhln,bzhpn->bzhlp", q_BxZxHxCxN, starts)
  y = chunked.merge_chunks(jnp.moveaxis(y_BxZxHxCxP, 3, 2), length)
  # H_t q~_t counts x_t k~_t^T with s_t; h_t, what the output reads, with lam_t dt_t only.
  y -= (next_previous_weight * jnp.sum(q * k, axis=-1))[..., None] * v
  assert y.shape == (b, length, heads, p) and h.shape == (b, heads, p, n)
  return y, {"angle": theta[:, -1], "ssm": h, "k": k[:, -1], "v": v[:, -1]}


def dt_bias_init(key, heads, dt_min, dt_max, floor):
  """softplus^-1(dt), dt ~ logU[dt_min, dt_max] floored at `floor` (fla's Mamba3.__init__;
  modules.dt_bias_init with the range a setting here)."""
  u = jax.random.uniform(key, (heads,), jnp.float32)
  dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), floor)
  return dt + jnp.log(-jnp.expm1(-dt))


class Mamba3(chunked.ChunkedRecurrentMixer):
  hyperparameters = {"state_size": 128, "head_dim": 64, "expand": 2,
                     "n_groups": 1,  # groups of B and C, shared by consecutive heads
                     "rope_fraction": 0.5,  # of B and C's channels that rotate: 0.5 or 1.0
                     "dt_min": 0.001, "dt_max": 0.1, "dt_init_floor": 1e-4,  # dt_bias init
                     "A_floor": 1e-4,  # A <= -A_floor
                     "is_outproj_norm": False,  # RMSNorm per head before the gate
                     "is_mimo": False,  # only False: the MIMO variant is not implemented
                     "chunk_size": 64,
                     "use_bias": False,  # biases on the input and output projections
                     "norm_eps": 1e-5}
  test_settings = {"chunk_size": 8, "state_size": 8, "head_dim": 16}

  @classmethod
  def validate(cls, settings, model_config):
    name = "model.mamba3"
    for field in ("state_size", "head_dim", "expand", "n_groups", "chunk_size"):
      if settings[field] < 1:
        raise ValueError(f"{name}.{field} must be >= 1, got {settings[field]}")
    if settings.is_mimo:
      raise ValueError(f"{name}.is_mimo={settings.is_mimo}: the MIMO variant is not "
                       f"implemented; valid: False")
    if settings.rope_fraction not in (0.5, 1.0):
      raise ValueError(f"{name}.rope_fraction={settings.rope_fraction}; valid: 0.5, 1.0")
    if rotated_pairs(settings.state_size, settings.rope_fraction) < 1:
      raise ValueError(f"{name}.state_size={settings.state_size} rotates no channel pair at "
                       f"rope_fraction={settings.rope_fraction}; valid: state_size >= "
                       f"{math.ceil(2 / settings.rope_fraction)}")
    inner = int(settings.expand * model_config.d_model)
    if inner % settings.head_dim:
      divisors = [p for p in range(1, inner + 1) if inner % p == 0]
      raise ValueError(f"{name}.head_dim={settings.head_dim} does not divide the inner width "
                       f"expand * d_model = {inner}; valid head_dim: {divisors}")
    heads = inner // settings.head_dim
    if heads % settings.n_groups:
      raise ValueError(f"{name}.n_groups={settings.n_groups} does not divide the {heads} heads; "
                       f"valid: {[g for g in range(1, heads + 1) if heads % g == 0]}")
    for field in ("dt_min", "dt_init_floor", "A_floor", "norm_eps"):
      if not settings[field] > 0:
        raise ValueError(f"{name}.{field} must be > 0, got {settings[field]}")
    if not settings.dt_max >= settings.dt_min:
      raise ValueError(f"{name}.dt_max={settings.dt_max} must be >= dt_min={settings.dt_min}")

  def __init__(self, settings, model_config, position, *, rngs, layer_index=0):
    del layer_index  # the same computation at every depth
    del position  # order comes from the recurrence; the embedding hook is the model's
    d = model_config.d_model
    self.d_inner = e = int(settings.expand * d)
    self.head_dim = p = int(settings.head_dim)
    self.num_heads = h = e // p
    self.state_size = n = int(settings.state_size)
    self.num_groups = g = int(settings.n_groups)
    self.num_angles = r = rotated_pairs(n, settings.rope_fraction)
    self.chunk_size = int(settings.chunk_size)
    self.A_floor = float(settings.A_floor)
    self.norm_eps = float(settings.norm_eps)
    self.outproj_norm = bool(settings.is_outproj_norm)
    self.dtype = dtype = nn.compute_dtype(model_config)
    bias = bool(settings.use_bias)

    # fla's in_proj, [z, x, B, C, dd_dt, dd_A, trap, angles], one projection per block.
    def projection(width, axis):
      return nn.dense("...D,DF->...F", (d, width), ("embed", axis), rngs=rngs, dtype=dtype,
                      bias_shape=(width,) if bias else None, bias_axes=(axis,) if bias else None)

    self.z_proj = base.head_projection(d, h, p, "heads", rngs=rngs, dtype=dtype, bias=bias)
    self.x_proj = base.head_projection(d, h, p, "heads", rngs=rngs, dtype=dtype, bias=bias)
    self.B_proj, self.C_proj = projection(g * n, "state"), projection(g * n, "state")
    self.dt_proj, self.A_proj = projection(h, "heads"), projection(h, "heads")
    self.trap_proj = projection(h, "heads")
    self.angle_proj = projection(r, "state")
    # Time steps, gains and biases, not weights: no weight decay.
    self.dt_bias = nn.param(
        dt_bias_init(rngs.params(), h, settings.dt_min, settings.dt_max, settings.dt_init_floor),
        ("heads",), weight_decay=False)
    self.B_bias = nn.param(jnp.ones((h, n)), ("heads", "state"), weight_decay=False)
    self.C_bias = nn.param(jnp.ones((h, n)), ("heads", "state"), weight_decay=False)
    self.B_norm_scale = nn.param(jnp.ones((n,)), ("state",), weight_decay=False)
    self.C_norm_scale = nn.param(jnp.ones((n,)), ("state",), weight_decay=False)
    self.D = nn.param(jnp.ones((h,)), ("heads",), weight_decay=False)
    if self.outproj_norm:
      self.norm_scale = nn.param(jnp.ones((h, p)), ("heads", "head_dim"), weight_decay=False)
    self.out = base.output_projection(h, p, d, rngs=rngs, dtype=dtype, bias=bias)

  def _keys_or_queries(self, projected_BxTxGN, norm_scale_N, bias_HxN):
    """RMSNorm over each group's N channels, each group read by H / G consecutive heads, plus
    the per-head bias -> [B, T, H, N]."""
    b, t = projected_BxTxGN.shape[:2]
    grouped = projected_BxTxGN.astype(jnp.float32).reshape(b, t, self.num_groups, self.state_size)
    normed = modules.rms_norm(grouped, jnp.broadcast_to(norm_scale_N, grouped.shape),
                              eps=self.norm_eps)
    per_head = jnp.repeat(normed, self.num_heads // self.num_groups, axis=2)
    return per_head + jnp.broadcast_to(bias_HxN, per_head.shape)

  def _mix(self, u_BxTxD, cache, segments_BxT=None):
    b, t, _ = u_BxTxD.shape
    f32 = lambda y: y.astype(jnp.float32)  # noqa: E731
    x_BxTxHxP, z_BxTxHxP = f32(self.x_proj(u_BxTxD)), f32(self.z_proj(u_BxTxD))
    k_BxTxHxN = self._keys_or_queries(self.B_proj(u_BxTxD), self.B_norm_scale[...],
                                      self.B_bias[...])
    q_BxTxHxN = self._keys_or_queries(self.C_proj(u_BxTxD), self.C_norm_scale[...],
                                      self.C_bias[...])
    dd_dt_BxTxH = f32(self.dt_proj(u_BxTxD))
    dt_BxTxH = jax.nn.softplus(dd_dt_BxTxH + jnp.broadcast_to(self.dt_bias[...], dd_dt_BxTxH.shape))
    A_BxTxH = jnp.minimum(-jax.nn.softplus(f32(self.A_proj(u_BxTxD))), -self.A_floor)
    angles_BxTxR = f32(self.angle_proj(u_BxTxD))
    angles_BxTxHxR = jnp.broadcast_to(angles_BxTxR[:, :, None],
                                      (b, t, self.num_heads, self.num_angles))
    y_BxTxHxP, state = chunked_mamba3(
        q_BxTxHxN, k_BxTxHxN, x_BxTxHxP, A_BxTxH * dt_BxTxH, dt_BxTxH,
        f32(self.trap_proj(u_BxTxD)), angles_BxTxHxR, cache, chunk_size=self.chunk_size,
        segments=segments_BxT)
    y_BxTxHxP += jnp.broadcast_to(self.D[...][:, None], x_BxTxHxP.shape) * x_BxTxHxP
    if self.outproj_norm:  # fla's RMSNormGated(norm_before_gate=True, group_size=head_dim)
      y_BxTxHxP = modules.gated_rms_norm(
          y_BxTxHxP, z_BxTxHxP, jnp.broadcast_to(self.norm_scale[...], y_BxTxHxP.shape),
          eps=self.norm_eps)
    else:
      y_BxTxHxP *= jax.nn.silu(z_BxTxHxP)
    return self.out(y_BxTxHxP.astype(self.dtype)), state

  def init_cache(self, batch_size, max_length):
    del max_length  # the state has a fixed size
    zeros = lambda *shape: jnp.zeros((batch_size, self.num_heads) + shape, jnp.float32)  # noqa
    return {"angle": zeros(self.num_angles), "ssm": zeros(self.head_dim, self.state_size),
            "k": zeros(self.state_size), "v": zeros(self.head_dim)}

  def mixing_flops_per_token(self, context_length):
    h, p, n, g, r = (self.num_heads, self.head_dim, self.state_size, self.num_groups,
                     self.num_angles)
    c = min(self.chunk_size, context_length)
    # Within a chunk, over (C + 1) / 2 keys on average: q~ . k~ per head, the decay and
    # scores @ x; across chunks: the chunk state and h q~; per token: B and C's norms and
    # biases, the angles (sum and rotation of q and k), q~ . k~ for the correction, the skip,
    # the gate (and norm).
    intra = (c + 1) / 2 * (2 * h * n + 2 * h + 2 * h * p)
    inter = 2 * 2 * h * p * n
    per_token = 2 * 4 * g * n + 2 * h * n + h * r * (4 + 2 * 6) + 2 * h * n + 10 * h * p
    return intra + inter + per_token
