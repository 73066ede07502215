"""Kimi Delta Attention against token-by-token fp32 references written from the authors' code
(flash-linear-attention@bc3b101: fla/ops/kda/naive.py naive_recurrent_kda, fla/ops/kda/gate.py
naive_kda_gate / naive_kda_lowerbound_gate, and fla/layers/kda.py's forward): the chunked op's
outputs, final state and gradients w.r.t. every input; the whole mixer's outputs and gradients
w.r.t. the input and every parameter; fla's initialisation and options. The conformance suite
covers causality, decode, packed documents and sharding for it as for every mixer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model.attention import REGISTRY, kda
from research.model.attention.gated_deltanet import l2_normalize
from tests.conftest import tiny_model_config
from tests.test_kernels import (SEGMENTS_37, _assert_mixer_equals_naive,
                                _assert_same_outputs_and_input_gradients, _mixer, _normal,
                                _recurrence_per_document)


def _naive_recurrent_kda(q, k, v, log_decay, beta, state):
  """fla's naive_recurrent_kda, one token at a time (q already scaled): the state decays per key
  channel, S <- diag(e^{g_t}) S, then the delta rule S <- S + beta_t k_t (v_t - S^T k_t)^T and
  o_t = S^T q_t. q, k, log_decay [B, L, N, H], v [B, L, N, E], beta [B, L, N], state
  [B, N, H, E]; returns (o, final state)."""

  def step(state, inputs):
    q_t, k_t, v_t, g_t, beta_t = inputs
    state = state * jnp.exp(g_t)[..., None]
    correction = v_t - jnp.einsum("bnh,bnhe->bne", k_t, state)
    state = state + jnp.einsum("bnh,bne->bnhe", beta_t[..., None] * k_t, correction)
    return state, jnp.einsum("bnh,bnhe->bne", q_t, state)

  state, out = jax.lax.scan(step, state, tuple(x.swapaxes(0, 1)
                                               for x in (q, k, v, log_decay, beta)))
  return out.swapaxes(0, 1), state


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_kda_equals_the_recurrence_with_gradients(packed):
  """Chunks of 8 in sub-chunks of 4 over 37 tokens (the chunk does not divide the length), from a
  nonzero state; packed documents (SEGMENTS_37) each alone, the first from the row's state.
  Per-channel decays from ~1 to below e^-100 per token in some channels (a chunk's cumulative
  decay passes e^-88, so no factoring relative to the chunk's start would survive): outputs,
  final state and the gradients of q, k, v, the log decays, beta and the initial state."""
  b, length, n, h, e = 2, 37, 2, 4, 6
  log_decay = -jnp.exp(_normal(3, (b, length, n, h), 1.5))
  assert float(jnp.cumsum(log_decay[:, :8], axis=1).min()) < -88
  inputs = (l2_normalize(_normal(0, (b, length, n, h))) * h ** -0.5,
            l2_normalize(_normal(1, (b, length, n, h))),
            _normal(2, (b, length, n, e)), log_decay,
            jax.nn.sigmoid(_normal(4, (b, length, n), 2.0)),
            _normal(5, (b, n, h, e)))
  naive = (lambda *a: _recurrence_per_document(_naive_recurrent_kda, *a)) if packed else (
      _naive_recurrent_kda)
  _assert_same_outputs_and_input_gradients(
      lambda *a: kda.chunked_kda(*a, chunk_size=8, sub_chunk_size=4,
                                 segments=SEGMENTS_37 if packed else None),
      naive, inputs, (_normal(6, (b, length, n, e)), _normal(7, (b, n, h, e))))


def test_chunked_kda_one_row_of_wide_heads_equals_the_recurrence_with_gradients():
  """One row (B = 1) of key heads 32 wide: an earlier form (queries and keys stacked on one axis
  of the decayed scores) crashed XLA:CPU in this gradient with a segmentation fault, the jaxlib
  0.10.2 YNNPACK bug research/xla_workarounds.py works around."""
  b, length, n, h, e = 1, 37, 2, 32, 8
  inputs = (l2_normalize(_normal(0, (b, length, n, h))) * h ** -0.5,
            l2_normalize(_normal(1, (b, length, n, h))),
            _normal(2, (b, length, n, e)), -jnp.exp(_normal(3, (b, length, n, h))),
            jax.nn.sigmoid(_normal(4, (b, length, n))), _normal(5, (b, n, h, e)))
  _assert_same_outputs_and_input_gradients(
      lambda *a: kda.chunked_kda(*a, chunk_size=8, sub_chunk_size=4), _naive_recurrent_kda,
      inputs, (_normal(6, (b, length, n, e)), _normal(7, (b, n, h, e))))


def test_decayed_pair_scores_equal_the_direct_sum():
  """The sub-chunk factoring gives sum_c a_ic b_jc e^{G_ic - G_jc} (j <= i) exactly, also with
  cumulative decays far below e^-88 where e^{-G_j} alone overflows."""
  c, h = 8, 3
  a, b = _normal(0, (c, h)), _normal(1, (c, h))
  log_decay = -jnp.exp(_normal(2, (c, h), 2.0) + 1.0)
  cumulative = jnp.cumsum(log_decay, axis=0)
  assert float(cumulative.min()) < -88
  exponent = cumulative[:, None, :] - cumulative[None, :, :]
  lower = jnp.tril(jnp.ones((c, c), bool))[..., None]
  want = jnp.einsum("ih,ijh,jh->ij", a, jnp.exp(jnp.where(lower, exponent, -jnp.inf)), b)
  for sub in (1, 2, 4, 8):
    got = kda.decayed_pair_scores(a, b, log_decay, sub)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _causal_conv_silu(kernel_WxNxF, x_BxTxNxF):
  """fla's ShortConvolution (no bias) with SiLU, written out: y_t = silu(sum_i w_i x_{t-W+1+i})."""
  w, t = kernel_WxNxF.shape[0], x_BxTxNxF.shape[1]
  padded = jnp.pad(x_BxTxNxF, [(0, 0), (w - 1, 0), (0, 0), (0, 0)])
  return jax.nn.silu(sum(kernel_WxNxF[i] * padded[:, i:i + t] for i in range(w)))


def _naive_kda_mixer(mixer, x_BxLxD):
  """fla's KimiDeltaAttention.forward written out: q, k, v projections with short convolutions
  and SiLU; q and k L2-normalised inside the kernel (x / sqrt(|x|^2 + 1e-6)) and q scaled by
  K^-1/2; the gate -exp(A_log) softplus(f_proj(x) + dt_bias) (naive_kda_gate) or
  lower_bound sigmoid(exp(A_log) (f_proj(x) + dt_bias)) (naive_kda_lowerbound_gate); beta =
  sigmoid(b_proj(x)), doubled with allow_neg_eigval; naive_recurrent_kda from 0; o_norm =
  RMSNorm(o) * weight * sigmoid(g_proj(x)) (FusedRMSNormGated, activation sigmoid); o_proj."""
  b, length, _ = x_BxLxD.shape
  n, h, e = mixer.num_heads, mixer.head_dim, mixer.value_dim
  l2 = lambda y: y / jnp.sqrt((y * y).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
  q = l2(_causal_conv_silu(mixer.q_conv[...], mixer.query(x_BxLxD))) * h ** -0.5
  k = l2(_causal_conv_silu(mixer.k_conv[...], mixer.key(x_BxLxD)))
  v = _causal_conv_silu(mixer.v_conv[...], mixer.value(x_BxLxD))
  f = mixer.decay_up(mixer.decay_down(x_BxLxD)) + mixer.dt_bias[...]
  a = jnp.exp(mixer.A_log[...])[:, None]
  if mixer.lower_bound:
    log_decay = mixer.lower_bound * jax.nn.sigmoid(a * f)
  else:
    log_decay = -a * jax.nn.softplus(f)
  beta = mixer.beta_scale * jax.nn.sigmoid(mixer.beta_proj(x_BxLxD))
  o, _ = _naive_recurrent_kda(q, k, v, log_decay, beta, jnp.zeros((b, n, h, e)))
  o = o / jnp.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-5) * mixer.norm_scale[...]
  o = o * jax.nn.sigmoid(mixer.gate_up(mixer.gate_down(x_BxLxD)))
  assert o.shape == (b, length, n, e)
  return mixer.out(o)


@pytest.mark.parametrize("settings", [
    dict(chunk_size=4, sub_chunk_size=2),
    dict(chunk_size=8, sub_chunk_size=4, allow_neg_eigval=True, lower_bound=-5.0,
         safe_gate=True, expand_v=2.0)])
def test_kda_mixer_equals_the_token_by_token_reference_with_gradients(settings):
  """21 tokens in chunks of 4 (five chunk boundaries), fla's defaults; then the options: beta in
  (0, 2), the lower-bounded gate, values twice as wide as keys, in chunks of 8."""
  mixer = _mixer("kda", position="none", kda=settings)
  # Give the biases and the norm's gain values, so that their gradients are tested apart.
  mixer.gate_up.bias[...] = _normal(12, mixer.gate_up.bias.shape)
  mixer.norm_scale[...] = 1.0 + _normal(13, mixer.norm_scale.shape, 0.1)
  if settings.get("safe_gate"):
    mixer.A_log[...] = _normal(14, mixer.A_log.shape, 0.5)
  _assert_mixer_equals_naive(mixer, _naive_kda_mixer)


def test_kda_is_built_and_initialised_as_fla_s_layer():
  """Tiny config (d_model 32, 4 heads): key and value head dims d_model / num_heads (fla's
  head_dim 128 at hidden_size 2048 and 16 heads, expand_v 1); the decay and output-gate
  projections of rank head_v_dim; A_log = log U[1, 16] per head (0 with safe_gate); dt_bias
  [heads, head_dim] = softplus^-1(dt0), dt0 in [1e-3, 1e-1]; the output gate's bias 0; the
  decay parameters and gains without weight decay."""
  mixer = _mixer("kda", position="none")
  n, h, e = 4, 8, 8
  assert (mixer.num_heads, mixer.head_dim, mixer.value_dim) == (n, h, e)
  assert mixer.decay_down.kernel.shape == (32, e) and mixer.decay_up.kernel.shape == (e, n, h)
  assert mixer.decay_up.bias is None and mixer.decay_down.bias is None
  assert mixer.gate_down.kernel.shape == (32, e) and mixer.gate_up.kernel.shape == (e, n, e)
  assert float(jnp.abs(mixer.gate_up.bias[...]).max()) == 0.0
  assert mixer.beta_proj.kernel.shape == (32, n)
  assert mixer.q_conv.shape == (4, n, h) and mixer.v_conv.shape == (4, n, e)
  a = np.exp(np.asarray(mixer.A_log[...]))
  assert a.shape == (n,) and np.all((a >= 1.0) & (a <= 16.0))
  dt = np.asarray(jax.nn.softplus(mixer.dt_bias[...]))
  assert dt.shape == (n, h) and np.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5)))
  for param in (mixer.A_log, mixer.dt_bias, mixer.norm_scale, mixer.gate_up.bias):
    assert param.get_metadata()["weight_decay"] is False
  safe = _mixer("kda", position="none", kda=dict(lower_bound=-5.0, safe_gate=True))
  assert float(jnp.abs(safe.A_log[...]).max()) == 0.0


def test_kda_gates():
  """The default gate is fla's -exp(A_log) softplus(f + dt_bias), per head and channel, always
  < 0; the lower-bounded gate stays in [lower_bound, 0) however large the input."""
  f = _normal(0, (1, 5, 2, 3), 30.0)
  a_log, dt_bias = jnp.log(jnp.array([1.0, 16.0])), _normal(1, (2, 3))
  g = kda.kda_gate(f, a_log, dt_bias)
  want = -jnp.exp(a_log)[:, None] * jnp.log1p(jnp.exp(f + dt_bias))
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
  bounded = kda.kda_gate(f, a_log, dt_bias, lower_bound=-5.0)
  assert float(bounded.min()) >= -5.0 and float(bounded.max()) <= 0.0


@pytest.mark.parametrize("overrides,message", [
    (dict(lower_bound=1.0), "lower_bound must be < 0"),
    (dict(safe_gate=True), r"safe_gate needs lower_bound in \[-5, 0\)"),
    (dict(safe_gate=True, lower_bound=-6.0), r"safe_gate needs lower_bound in \[-5, 0\)"),
    (dict(expand_v=0.3), "valid: expand_v > 0 with an integer product"),
    (dict(sub_chunk_size=0), "sub_chunk_size must be >= 1")])
def test_kda_settings_are_validated(overrides, message):
  config = tiny_model_config(attention="kda", kda=overrides)
  with pytest.raises(ValueError, match=message):
    kda.KimiDeltaAttention.validate(REGISTRY.settings("kda", config), config)
