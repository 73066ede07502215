"""Mamba-3 (research/model/attention/mamba3.py) against token-by-token float32 references written
from the authors' code: the chunked op against mamba_ssm's step reference
(state-spaces/mamba@e9594ce, tests/ops/triton/test_mamba3_siso.py, mamba3_siso_step_ref), the
mixer against fla's layer (flash-linear-attention@bc3b101, fla/layers/mamba3.py, Mamba3) run on
that recurrence: outputs and gradients w.r.t. every input, state and parameter. Then fla's
initialisation, defaults and settings. The conformance suite covers causality, decode, packed
documents and sharding as for every mixer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import attention
from research.model.attention import mamba2
from research.model.attention import mamba3
from tests.conftest import tiny_model_config
from tests.test_kernels import (SEGMENTS_37, _assert_mixer_equals_naive,
                                _assert_same_outputs_and_input_gradients, _mixer, _normal)


def _rotate(x_xN, theta_xR):
  """Channel pairs (2i, 2i + 1), i < R, as complex numbers times e^{i theta}; the rest as is."""
  r = theta_xR.shape[-1]
  pairs = x_xN[..., :2 * r].reshape(*x_xN.shape[:-1], r, 2)
  turned = (pairs[..., 0] + 1j * pairs[..., 1]) * jnp.exp(1j * theta_xR)
  rotated = jnp.stack([turned.real, turned.imag], axis=-1).reshape(*x_xN.shape[:-1], 2 * r)
  return jnp.concatenate([rotated, x_xN[..., 2 * r:]], axis=-1)


def _step_reference(q, k, v, log_decay, dt, trap, angles, state):
  """mamba3_siso_step_ref without its bias, D and Z terms (the layer's), one token at a time:
  the angle advances by dt pi tanh(angles) mod 2 pi, q and k turn by it, and
  h_t = a_t h_{t-1} + (1 - lam_t) dt_t a_t v_{t-1} k_{t-1}^T + lam_t dt_t v_t k_t^T,
  y_t = h_t q_t, with a_t = exp(log_decay_t) and lam_t = sigmoid(trap_t)."""

  def step(carry, inputs):
    theta, h, k_previous, v_previous = carry
    q_t, k_t, v_t, log_decay_t, dt_t, trap_t, angles_t = inputs
    theta = theta + jnp.pi * jnp.tanh(angles_t) * dt_t[..., None]
    theta = theta - 2 * jnp.pi * jnp.floor(theta / (2 * jnp.pi))
    q_t, k_t = _rotate(q_t, theta), _rotate(k_t, theta)
    lam, alpha = jax.nn.sigmoid(trap_t), jnp.exp(log_decay_t)
    beta, gamma = (1 - lam) * dt_t * alpha, lam * dt_t
    outer = lambda v, k: v[..., :, None] * k[..., None, :]  # noqa: E731
    h = (alpha[..., None, None] * h + beta[..., None, None] * outer(v_previous, k_previous)
         + gamma[..., None, None] * outer(v_t, k_t))
    return (theta, h, k_t, v_t), jnp.einsum("bhpn,bhn->bhp", h, q_t)

  carry = (state["angle"], state["ssm"], state["k"], state["v"])
  inputs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, log_decay, dt, trap, angles))
  (theta, h, k_last, v_last), y = jax.lax.scan(step, carry, inputs)
  return jnp.moveaxis(y, 0, 1), {"angle": theta, "ssm": h, "k": k_last, "v": v_last}


def _per_document(recurrence, *inputs_and_state):
  """recurrence(*inputs, state) on each document of SEGMENTS_37 alone: a row's first document
  from that row's state, the others from zeros; the final state is the last document's."""
  *inputs, state = inputs_and_state
  outputs, states = [], []
  for row, segment_row in enumerate(np.asarray(SEGMENTS_37)):
    parts, row_state = [], jax.tree.map(lambda s: s[row:row + 1], state)  # noqa: B023
    for i, segment in enumerate(np.unique(segment_row)):
      if i:
        row_state = jax.tree.map(jnp.zeros_like, row_state)
      out, row_state = recurrence(*(a[row:row + 1, segment_row == segment] for a in inputs),
                                  row_state)
      parts.append(out)
    outputs.append(jnp.concatenate(parts, axis=1))
    states.append(row_state)
  return jnp.concatenate(outputs), jax.tree.map(lambda *s: jnp.concatenate(s), *states)


def _op_inputs(b=2, length=37, heads=3, n=6, p=4, r=2):
  """Inputs of chunked_mamba3 and a nonzero state: dt ~ 0.1..3 (the angle turns by up to ~9
  rad per token, so it wraps many times), decays from ~1 to ~e^-10, lam from ~0 to ~1; 2 of
  the 3 channel pairs rotate."""
  dt = jax.nn.softplus(_normal(4, (b, length, heads)))
  state = {"angle": mamba3.wrap_angle(_normal(8, (b, heads, r), 3.0)),
           "ssm": _normal(9, (b, heads, p, n)), "k": _normal(10, (b, heads, n)),
           "v": _normal(11, (b, heads, p))}
  return (_normal(0, (b, length, heads, n)), _normal(1, (b, length, heads, n)),
          _normal(2, (b, length, heads, p)),
          -jax.nn.softplus(_normal(3, (b, length, heads))) * dt, dt,
          _normal(5, (b, length, heads), 2.0), _normal(6, (b, length, heads, r), 2.0), state)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_mamba3_equals_the_step_reference_with_gradients(packed):
  """37 tokens in chunks of 8 from a nonzero state (angle, h, the pending k and v): outputs,
  the final state and the gradients of q, k, v, the log decays, dt, trap, the angles and every
  part of the state; packed documents (SEGMENTS_37) each alone, the later ones from zeros."""
  inputs = _op_inputs()
  segments = SEGMENTS_37 if packed else None
  naive = functools.partial(_per_document, _step_reference) if packed else _step_reference
  y, state = inputs[2], inputs[-1]
  cotangents = (_normal(12, y.shape), jax.tree.map(lambda s: _normal(13, s.shape), state))
  _assert_same_outputs_and_input_gradients(
      lambda *a: mamba3.chunked_mamba3(*a, chunk_size=8, segments=segments), naive, inputs,
      cotangents)


def test_with_lam_1_and_no_rotation_it_is_mamba2_s_ssd():
  """lam = 1 (trap -> inf) and angles 0 leave Mamba-2's exponential-Euler recurrence: the op
  equals mamba2.chunked_ssd with the same B and C for every head and log decay dt A."""
  b, length, heads, n, p = 2, 37, 3, 6, 4
  x = _normal(0, (b, length, heads, p))
  B, C = _normal(1, (b, length, n)), _normal(2, (b, length, n))
  dt = jax.nn.softplus(_normal(3, (b, length, heads)) - 1.0)
  A = -jnp.exp(_normal(4, (heads,)))
  h0 = _normal(5, (b, heads, p, n))
  per_head = lambda t: jnp.broadcast_to(t[:, :, None], (b, length, heads, n))  # noqa: E731
  state = {"angle": jnp.zeros((b, heads, 1)), "ssm": h0, "k": _normal(6, (b, heads, n)),
           "v": _normal(7, (b, heads, p))}  # k and v enter with weight 1 - lam = 0
  y, final = mamba3.chunked_mamba3(
      per_head(C), per_head(B), x, dt * A, dt, jnp.full((b, length, heads), 40.0),
      jnp.zeros((b, length, heads, 1)), state, chunk_size=8)
  want_y, want_h = mamba2.chunked_ssd(x, dt, A, B, C, h0, chunk_size=8)
  np.testing.assert_allclose(y, want_y, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(final["ssm"], want_h, atol=1e-5, rtol=1e-5)


def _naive_mamba3_mixer(mixer, u_BxLxD):
  """fla's Mamba3 forward (cuda_kernels_forward, SISO) with the step reference: in_proj's
  blocks, A = min(-softplus(dd_A), -A_floor), dt = softplus(dd_dt + dt_bias), RMSNorm'd B and C
  (group g for heads g H / G ..), plus their per-head biases, the recurrence, D x, then
  y * silu(z), or with is_outproj_norm RMSNorm(y) w * silu(z) per head; out_proj."""
  b, length, _ = u_BxLxD.shape
  h, n, g = mixer.num_heads, mixer.state_size, mixer.num_groups
  eps = mixer.norm_eps
  rms = lambda y, w: y / jnp.sqrt((y ** 2).mean(-1, keepdims=True) + eps) * w  # noqa: E731
  group_of_head = jnp.arange(h) // (h // g)
  k = rms(mixer.B_proj(u_BxLxD).reshape(b, length, g, n), mixer.B_norm_scale[...])
  q = rms(mixer.C_proj(u_BxLxD).reshape(b, length, g, n), mixer.C_norm_scale[...])
  k, q = k[:, :, group_of_head] + mixer.B_bias[...], q[:, :, group_of_head] + mixer.C_bias[...]
  dt = jax.nn.softplus(mixer.dt_proj(u_BxLxD) + mixer.dt_bias[...])
  A = jnp.minimum(-jax.nn.softplus(mixer.A_proj(u_BxLxD)), -mixer.A_floor)
  angles = jnp.repeat(mixer.angle_proj(u_BxLxD)[:, :, None], h, axis=2)
  x, z = mixer.x_proj(u_BxLxD), mixer.z_proj(u_BxLxD)
  y, _ = _step_reference(q, k, x, A * dt, dt, mixer.trap_proj(u_BxLxD), angles,
                         mixer.init_cache(b, 0))
  y = y + mixer.D[...][:, None] * x
  y = rms(y, mixer.norm_scale[...]) if mixer.outproj_norm else y
  return mixer.out(y * jax.nn.silu(z))


@pytest.mark.parametrize("settings", [
    {}, dict(is_outproj_norm=True, n_groups=2, use_bias=True, rope_fraction=1.0)])
def test_mamba3_mixer_equals_fla_s_layer_on_the_step_reference_with_gradients(settings):
  """21 tokens in chunks of 8; as registered (fla's defaults at the test's sizes), and with the
  other options: the per-head norm before the gate, two groups of B and C, projection biases,
  every channel pair rotating."""
  mixer = _mixer("mamba3", position="none", mamba3=settings)
  assert (mixer.num_heads, mixer.num_groups) == (4, settings.get("n_groups", 1))
  assert mixer.num_angles == (4 if settings else 2)  # of state_size 8
  # Give the biases and gains values away from their init so that their gradients differ.
  for name in ("B_bias", "C_bias", "B_norm_scale", "C_norm_scale", "D"):
    param = getattr(mixer, name)
    param[...] = param[...] + _normal(20, param.shape, 0.3)
  _assert_mixer_equals_naive(mixer, _naive_mamba3_mixer)


def test_defaults_shapes_and_initialisation_are_fla_s():
  """Mamba3Config's defaults; in_proj's width 2 E + 2 G N + 3 H + R (fla's d_in_proj); no
  convolution and no A_log; dt_bias = softplus^-1(logU[1e-3, 1e-1]); B_bias, C_bias, D and the
  norm gains 1; the decode state (angle, ssm, k, v) as fla's allocate_inference_cache."""
  assert mamba3.Mamba3.hyperparameters == dict(
      state_size=128, head_dim=64, expand=2, n_groups=1, rope_fraction=0.5, dt_min=0.001,
      dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False, is_mimo=False,
      chunk_size=64, use_bias=False, norm_eps=1e-5)
  assert [mamba3.rotated_pairs(n, f) for n, f in ((128, 0.5), (128, 1.0), (6, 0.5), (8, 0.5))] == [
      32, 64, 1, 2]
  mixer = _mixer("mamba3", position="none")  # d_model 32, state 8, head dim 16
  e, h, n, r = 64, 4, 8, 2
  widths = [mixer.z_proj.kernel.shape[1] * mixer.z_proj.kernel.shape[2],
            mixer.x_proj.kernel.shape[1] * mixer.x_proj.kernel.shape[2]] + [
                getattr(mixer, name).kernel.shape[1] for name in
                ("B_proj", "C_proj", "dt_proj", "A_proj", "trap_proj", "angle_proj")]
  assert sum(widths) == 2 * e + 2 * n + 3 * h + r
  assert mixer.out.kernel.shape == (h, 16, 32)
  assert not [name for name in vars(mixer) if "conv" in name or "A_log" in name]
  assert mixer.z_proj.bias is None and mixer.out.bias is None  # use_bias=False
  for name in ("B_bias", "C_bias", "D", "B_norm_scale", "C_norm_scale"):
    np.testing.assert_array_equal(getattr(mixer, name)[...], 1.0)
  dt = jax.nn.softplus(mamba3.dt_bias_init(jax.random.key(0), 20000, 1e-3, 1e-1, 1e-4))
  assert 1e-3 * (1 - 1e-5) <= float(dt.min()) and float(dt.max()) <= 1e-1 * (1 + 1e-5)
  assert abs(float(jnp.log(dt).mean()) - np.log(1e-2)) < 0.03  # log-uniform: mean log at 1e-2
  cache = mixer.init_cache(3, 100)
  assert {key: value.shape for key, value in cache.items()} == {
      "angle": (3, h, r), "ssm": (3, h, 16, n), "k": (3, h, n), "v": (3, h, 16)}


@pytest.mark.parametrize("settings,message", [
    (dict(is_mimo=True), "valid: False"),
    (dict(rope_fraction=0.25), "valid: 0.5, 1.0"),
    (dict(state_size=2), "valid: state_size >= 4"),
    (dict(head_dim=24), "valid head_dim"),
    (dict(n_groups=3), r"valid: \[1, 2, 4\]"),
    (dict(A_floor=0.0), "must be > 0"),
    (dict(dt_max=1e-4), "must be >= dt_min")])
def test_settings_fla_refuses_or_that_are_not_implemented_are_refused(settings, message):
  config = tiny_model_config(attention="mamba3", mamba3=settings)
  with pytest.raises(ValueError, match=message):
    mamba3.Mamba3.validate(attention.REGISTRY.settings("mamba3", config), config)
