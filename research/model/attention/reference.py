"""Naive reference forms of the mixers' kernels, for tests and as benchmark baselines.

They materialise what the fast paths avoid: the [T, S] attention matrix, the
[batch, length, heads, d, d] cumulative linear-attention state, the [batch, length, d_inner, N]
SSM states; the recurrences (retention, Mamba-2, the gated delta rule, RWKV-6) step one token
at a time. Written for clarity, in float32.
"""

import jax
import jax.numpy as jnp


def softmax_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, bias_BxNxTxS=None, scale=None,
                      mask_BxTxS=None):
  """softmax(scale q k^T + bias, mask) v with K/V heads repeated to N; scale 1/sqrt(H); the mask
  (True: visible) defaults to causal."""
  n, h = q_BxTxNxH.shape[2:]
  group = n // k_BxSxKxH.shape[2]
  k = jnp.repeat(k_BxSxKxH, group, axis=2)
  v = jnp.repeat(v_BxSxKxH, group, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k) * (h ** -0.5 if scale is None else scale)
  if bias_BxNxTxS is not None:
    logits = logits + bias_BxNxTxS
  t, s = logits.shape[-2:]
  mask = (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]) if mask_BxTxS is None else mask_BxTxS
  logits = jnp.where(mask if mask.ndim == 2 else mask[:, None], logits, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v)


def forget_bias(log_forget_BxTxN):
  """The Forgetting Transformer's D[b, n, i, j] = sum_{l=j+1..i} log f_l for j <= i (0 above the
  diagonal), summed term by term, [B, N, T, T]."""
  index = jnp.arange(log_forget_BxTxN.shape[1])
  i, j, l = index[:, None, None], index[None, :, None], index[None, None, :]
  between_IxJxL = ((j < l) & (l <= i)).astype(jnp.float32)
  return jnp.einsum("ijl,bln->bnij", between_IxJxL, log_forget_BxTxN)


def linear_attention(phi_q, phi_k, v, rotated_q=None, rotated_k=None, eps=1e-6):
  """o_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps) with S_i, z_i as materialised cumulative sums.

  Inputs are feature-mapped [B, L, N, H]; with RoPE the numerator uses the rotated features.
  """
  rotated_q = phi_q if rotated_q is None else rotated_q
  rotated_k = phi_k if rotated_k is None else rotated_k
  state = jnp.cumsum(jnp.einsum("blnh,blne->blnhe", rotated_k, v), axis=1)  # [B, L, N, H, H]
  normalizer = jnp.cumsum(phi_k, axis=1)
  numerator = jnp.einsum("blnh,blnhe->blne", rotated_q, state)
  denominator = jnp.einsum("blnh,blnh->bln", phi_q, normalizer)
  return numerator / (denominator[..., None] + eps)


def retention(q, k, v, gamma_N, state):
  """S_n = gamma S_{n-1} + k_n^T v_n, o_n = q_n S_n, one token at a time; q, k, v [B, L, N, H]."""
  gamma = jnp.asarray(gamma_N, jnp.float32)[None, :, None, None]

  def step(state, qkv):
    q_t, k_t, v_t = qkv
    state = gamma * state + jnp.einsum("bnh,bne->bnhe", k_t, v_t)
    return state, jnp.einsum("bnh,bnhe->bne", q_t, state)

  state, out = jax.lax.scan(step, state, tuple(t.swapaxes(0, 1) for t in (q, k, v)))
  return out.swapaxes(0, 1), state


def sequential_selective_scan(x, delta, A, B, C, h0):
  """h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t, y_t = C_t h_t, one step at a time."""

  def step(h, inputs):
    x_t, delta_t, B_t, C_t = inputs
    h = jnp.exp(delta_t[..., None] * A) * h + (delta_t * x_t)[..., None] * B_t[:, None, :]
    return h, jnp.einsum("ben,bn->be", h, C_t)

  h, y = jax.lax.scan(step, h0, tuple(t.swapaxes(0, 1) for t in (x, delta, B, C)))
  return y.swapaxes(0, 1), h


def associative_selective_scan(x, delta, A, B, C, h0):
  """The same recurrence as one associative scan over the whole length (all states stored)."""
  decay = jnp.exp(delta[..., None] * A)  # [b, L, E, N]
  drive = (delta * x)[..., None] * B[:, :, None, :]
  drive = drive.at[:, 0].add(decay[:, 0] * h0)

  def combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]

  _, h = jax.lax.associative_scan(combine, (decay, drive), axis=1)
  return jnp.einsum("blen,bln->ble", h, C), h[:, -1]


def ssd_recurrence(x, dt, A, B, C, h0):
  """Mamba-2 per head, one token at a time: h_t = exp(dt_t A) h_t-1 + dt_t x_t B_t^T,
  y_t = h_t C_t; x [b, L, H, P], dt [b, L, H], A [H], B, C [b, L, N], h0 [b, H, P, N]."""

  def step(h, inputs):
    x_t, dt_t, B_t, C_t = inputs
    h = (jnp.exp(dt_t * A)[:, :, None, None] * h
         + jnp.einsum("bh,bhp,bn->bhpn", dt_t, x_t, B_t))
    return h, jnp.einsum("bhpn,bn->bhp", h, C_t)

  h, y = jax.lax.scan(step, h0, tuple(t.swapaxes(0, 1) for t in (x, dt, B, C)))
  return y.swapaxes(0, 1), h


def gated_delta_rule(q, k, v, log_decay, beta, state):
  """S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t, one token
  at a time with the [H, H] transition built explicitly; q, k [B, L, N, H], v [B, L, N, E],
  log_decay g and beta [B, L, N], state [B, N, H, E]."""
  eye = jnp.eye(q.shape[-1], dtype=jnp.float32)

  def step(state, inputs):
    q_t, k_t, v_t, g_t, beta_t = inputs
    transition = jnp.exp(g_t)[..., None, None] * (
        eye - beta_t[..., None, None] * jnp.einsum("bnh,bni->bnhi", k_t, k_t))
    state = (jnp.einsum("bnhi,bnie->bnhe", transition, state)
             + beta_t[..., None, None] * jnp.einsum("bnh,bne->bnhe", k_t, v_t))
    return state, jnp.einsum("bnh,bnhe->bne", q_t, state)

  state, out = jax.lax.scan(step, state, tuple(t.swapaxes(0, 1)
                                               for t in (q, k, v, log_decay, beta)))
  return out.swapaxes(0, 1), state


def rwkv6_recurrence(r, k, v, log_decay, bonus, state):
  """RWKV-6 per head, one token at a time: o_t = r_t^T (S_{t-1} + diag(u) k_t v_t^T),
  S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_t^T; r, k, log_decay [B, L, N, H],
  v [B, L, N, E], bonus u [N, H], state [B, N, H, E]."""

  def step(state, inputs):
    r_t, k_t, v_t, log_decay_t = inputs
    kv = jnp.einsum("bnh,bne->bnhe", k_t, v_t)
    out = jnp.einsum("bnh,bnhe->bne", r_t, state + bonus[None, :, :, None] * kv)
    return jnp.exp(log_decay_t)[..., None] * state + kv, out

  state, out = jax.lax.scan(step, state, tuple(t.swapaxes(0, 1)
                                               for t in (r, k, v, log_decay)))
  return out.swapaxes(0, 1), state


def gated_delta_product(q, k, v, log_decay, beta, state):
  """Gated DeltaProduct per head, one token at a time, its S Householder steps in turn:
  S <- e^{g_t} S, then for j = 1..S: S <- (I - beta_tj k_tj k_tj^T) S + beta_tj k_tj v_tj^T;
  o_t = S^T q_t. q [B, L, N, H], k [B, L, N, S, H], v [B, L, N, S, E], log_decay g [B, L, N],
  beta [B, L, N, S], state [B, N, H, E]."""
  eye = jnp.eye(q.shape[-1], dtype=jnp.float32)

  def step(state, inputs):
    q_t, k_t, v_t, g_t, beta_t = inputs
    state = jnp.exp(g_t)[..., None, None] * state
    for j in range(k_t.shape[2]):
      k_j, b_j = k_t[:, :, j], beta_t[:, :, j][..., None, None]
      transition = eye - b_j * jnp.einsum("bnh,bni->bnhi", k_j, k_j)
      state = (jnp.einsum("bnhi,bnie->bnhe", transition, state)
               + b_j * jnp.einsum("bnh,bne->bnhe", k_j, v_t[:, :, j]))
    return state, jnp.einsum("bnh,bnhe->bne", q_t, state)

  state, out = jax.lax.scan(step, state, tuple(t.swapaxes(0, 1)
                                               for t in (q, k, v, log_decay, beta)))
  return out.swapaxes(0, 1), state


def gla_recurrence(q, k, v, log_decay, state):
  """Gated linear attention per head, one token at a time: S_t = diag(exp(log_decay_t)) S_{t-1}
  + k_t v_t^T, o_t = S_t^T q_t; q, k, log_decay [B, L, N, H], v [B, L, N, E], state
  [B, N, H, E]."""

  def step(state, inputs):
    q_t, k_t, v_t, log_decay_t = inputs
    state = jnp.exp(log_decay_t)[..., None] * state + jnp.einsum("bnh,bne->bnhe", k_t, v_t)
    return state, jnp.einsum("bnh,bnhe->bne", q_t, state)

  state, out = jax.lax.scan(step, state, tuple(t.swapaxes(0, 1) for t in (q, k, v, log_decay)))
  return out.swapaxes(0, 1), state
