"""The delta-rule family (DeltaNet, Gated DeltaNet, Gated DeltaProduct) and gated linear
attention against token-by-token fp32 references written from the authors' code
(flash-linear-attention@bc3b101: ops/delta_rule/naive.py, ops/gla/naive.py and the layers'
forward passes): outputs and gradients w.r.t. the input and every parameter. The conformance
suite covers causality, decode, packed documents and sharding for them as for every mixer."""

import jax
import jax.numpy as jnp
import pytest

from research.model.attention import reference
from research.model.attention import vector_decay
from tests.test_kernels import (SEGMENTS_37, _assert_mixer_equals_naive,
                                _assert_same_outputs_and_input_gradients, _mixer, _normal,
                                _recurrence_per_document)


def test_chunked_gla_equals_the_recurrence_with_gradients():
  """Without a bonus the chunked form is GLA's (the current token inside the state): chunks of 8
  in sub-chunks of 4 over 37 tokens of packed documents, from a state, with decays of up to
  ~e^-100 per token in some channels (no factoring relative to a chunk's start survives those)."""
  b, length, n, h, e = 2, 37, 2, 4, 6
  log_decay = -jnp.exp(_normal(3, (b, length, n, h), 1.5))
  assert float(jnp.cumsum(log_decay[:, :8], axis=1).min()) < -88
  inputs = (_normal(0, (b, length, n, h)), _normal(1, (b, length, n, h)),
            _normal(2, (b, length, n, e)), log_decay, _normal(5, (b, n, h, e)))
  _assert_same_outputs_and_input_gradients(
      lambda *a: vector_decay.chunked_vector_decay(*a, chunk_size=8, sub_chunk_size=4,
                                                   segments=SEGMENTS_37),
      lambda *a: _recurrence_per_document(reference.gla_recurrence, *a), inputs,
      (_normal(6, (b, length, n, e)), _normal(7, (b, n, h, e))))


def _causal_conv_silu(kernel_WxNxF, x_BxTxNxF):
  """fla's ShortConvolution with SiLU, written out: y_t = silu(sum_i w_i x_{t-W+1+i})."""
  w, t = kernel_WxNxF.shape[0], x_BxTxNxF.shape[1]
  padded = jnp.pad(x_BxTxNxF, [(0, 0), (w - 1, 0), (0, 0), (0, 0)])
  return jax.nn.silu(sum(kernel_WxNxF[i] * padded[:, i:i + t] for i in range(w)))


def _naive_delta_rule_mixer(mixer, x_BxLxD):
  """fla's DeltaNet / GatedDeltaNet / GatedDeltaProduct forward: projections, short convolutions,
  L2-normalised q and k (q scaled by H^-1/2), beta (doubled with allow_neg_eigval), the decay,
  the recurrence one token and one Householder step at a time, RMSNorm (gated)."""
  b, length, _ = x_BxLxD.shape
  n, h, e, s = mixer.num_heads, mixer.head_dim, mixer.value_dim, mixer.num_steps
  l2 = lambda y: y / jnp.sqrt((y * y).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
  q = l2(_causal_conv_silu(mixer.q_conv[...], mixer.query(x_BxLxD))) * h ** -0.5
  k = l2(_causal_conv_silu(mixer.k_conv[...], mixer.key(x_BxLxD)).reshape(b, length, n, s, h))
  v = _causal_conv_silu(mixer.v_conv[...], mixer.value(x_BxLxD)).reshape(b, length, n, s, e)
  beta = mixer.beta_scale * jax.nn.sigmoid(mixer.beta_proj(x_BxLxD)).reshape(b, length, n, s)
  if mixer.forget_gate:
    log_decay = -jnp.exp(mixer.A_log[...]) * jax.nn.softplus(mixer.decay_proj(x_BxLxD)
                                                             + mixer.dt_bias[...])
  else:
    log_decay = jnp.zeros((b, length, n))
  o, _ = reference.gated_delta_product(q, k, v, log_decay, beta, jnp.zeros((b, n, h, e)))
  o = o / jnp.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-5) * mixer.norm_scale[...]
  if mixer.output_gate:
    o = o * jax.nn.silu(mixer.gate(x_BxLxD))
  return mixer.out(o)


@pytest.mark.parametrize("name,settings", [
    ("deltanet", dict(chunk_size=4, allow_neg_eigval=True)),
    ("gated_deltanet", dict(chunk_size=4)),
    ("gated_deltaproduct", dict(chunk_size=4, num_householder=3))])
def test_delta_rule_mixers_equal_the_token_by_token_reference_with_gradients(name, settings):
  """Chunks of 4 tokens over 21: the state crosses five chunk boundaries (12 delta-rule steps
  per chunk for the product of 3). DeltaNet without gates and with beta in (0, 2); Gated DeltaNet
  as registered (both gates, one step); the product with both gates and 3 steps."""
  mixer = _mixer(name, position="none", **{name: settings})
  assert mixer.num_steps == settings.get("num_householder", 1)
  assert mixer.forget_gate == mixer.output_gate == (name != "deltanet")
  _assert_mixer_equals_naive(mixer, _naive_delta_rule_mixer)


def test_deltanet_and_gated_deltaproduct_are_fla_s_members_of_the_family():
  """DeltaNet: no forget gate, no output gate, key and value heads d_model / num_heads, beta in
  (0, 1); Gated DeltaProduct: two steps per token with beta in (0, 2), 3/4-wide keys."""
  deltanet = _mixer("deltanet", position="none")
  assert not (deltanet.forget_gate or deltanet.output_gate)
  assert not any(hasattr(deltanet, p) for p in ("A_log", "dt_bias", "decay_proj", "gate"))
  assert (deltanet.head_dim, deltanet.value_dim, deltanet.num_steps, deltanet.beta_scale) == (
      8, 8, 1, 1.0)  # tiny config: d_model 32, 4 heads
  product = _mixer("gated_deltaproduct", position="none")
  assert (product.head_dim, product.value_dim, product.num_steps, product.beta_scale) == (
      6, 12, 2, 2.0)
  assert product.key.kernel.shape == (32, 4, 2 * 6)  # a key per step and head


def _naive_gla_mixer(mixer, x_BxLxD):
  """fla's GatedLinearAttention forward with naive_recurrent_gla: q scaled by K^-1/2, the
  low-rank decay logsigmoid(.) / 16, RMSNorm(o) * swish(g)."""
  b = x_BxLxD.shape[0]
  n, h, e = mixer.num_heads, mixer.head_dim, mixer.value_dim
  log_decay = jax.nn.log_sigmoid(mixer.decay_up(mixer.decay_down(x_BxLxD))) / 16.0
  o, _ = reference.gla_recurrence(mixer.query(x_BxLxD) * h ** -0.5, mixer.key(x_BxLxD),
                                  mixer.value(x_BxLxD), log_decay, jnp.zeros((b, n, h, e)))
  o = o / jnp.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-5) * mixer.norm_scale[...]
  return mixer.out(o * jax.nn.silu(mixer.gate(x_BxLxD)))


def test_gla_mixer_equals_the_token_by_token_reference_with_gradients():
  mixer = _mixer("gla", position="none", gla=dict(chunk_size=8, sub_chunk_size=4))
  assert (mixer.head_dim, mixer.value_dim) == (4, 8)  # expand_k 1/2, expand_v 1 at d_model 32
  # The decay's bias starts at 0 (fla): give it values so that its gradient is tested apart.
  mixer.decay_up.bias[...] = _normal(12, mixer.decay_up.bias.shape)
  _assert_mixer_equals_naive(mixer, _naive_gla_mixer)
