"""Three places where the lab now computes what its authors' published code computes, each
checked against a small numpy port (written here) of that code:

  KERPLE       chijames/KERPLE@25be3d7, megatron/mpu/layers.py, ParallelKerpleLog.forward: the
               parameters clamped in place at >= 0.01 before the bias, so a parameter below the
               floor gets the gradient at 0.01 (never zero).
  RetNet       microsoft/torchscale@4d1e0e8, torchscale/architecture/retnet.py, RetNetRelPos
               (angles 1 / 10000 ** linspace(0, 1, head_dim // 2)) and component/
               multiscale_retention.py, theta_shift / rotate_every_two; reset_parameters
               (out_proj: xavier_uniform_ with gain 2 ** -1).
  MoE          huggingface/transformers@af3efdd, models/mixtral/modeling_mixtral.py,
               load_balancing_loss_func: one loss on the router logits of all layers
               concatenated (model.moe.pooled_load_balancing).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import feed_forward
from research.model import positions
from research.model.attention import retention
from research.model.feed_forward import base as feed_forward_base
from research.model.feed_forward import moe
from research.model.positions import kerple
from research.training import loop as train
from tests.conftest import tiny_model_config

# ---- KERPLE ---------------------------------------------------------------------------------


def _kerple_port(p, a, length, cotangent):
  """ParallelKerpleLog.forward and its autograd, in numpy: bias_p, bias_a clamped in place at
  eps = 1e-2 (`.data.clamp`, outside autograd), diff = tril(i - j), bias = -p log(1 + a diff).
  Returns (bias [N, L, L], d<cotangent, bias>/dp, d<cotangent, bias>/da) at the clamped values."""
  p, a = np.maximum(p, 1e-2)[:, None, None], np.maximum(a, 1e-2)[:, None, None]
  index = np.arange(length)
  diff = np.tril(index[:, None] - index[None, :]).astype(np.float64)
  bias = -p * np.log1p(a * diff)
  grad_p = np.sum(cotangent * -np.log1p(a * diff), axis=(1, 2))
  grad_a = np.sum(cotangent * -p * diff / (1 + a * diff), axis=(1, 2))
  return bias, grad_p, grad_a


def test_kerple_parameter_below_the_floor_learns_with_the_gradient_at_the_floor():
  """Stored values below 0.01 (r1 of head 1, r2 of head 0): the bias of 0.01 and the gradient
  the authors' code gives there, nonzero, where jnp.maximum gave exactly 0."""
  config = tiny_model_config(position="kerple")
  scheme = research.model.attention.position_scheme(config, rngs=nnx.Rngs(0))
  r1, r2 = np.array([0.5, 0.004, 1.2, 0.01]), np.array([0.003, 0.3, -0.2, 0.7])
  scheme.r1[...], scheme.r2[...] = jnp.asarray(r1, jnp.float32), jnp.asarray(r2, jnp.float32)
  length = 7
  # Causal: only keys j <= i are seen, where |i - j| is the authors' tril(i - j).
  cotangent = np.tril(np.random.default_rng(0).normal(size=(4, length, length)))
  grid = jnp.arange(length)[None]
  graphdef, params = nnx.split(scheme)

  def weighted_bias(params):
    return jnp.sum(nnx.merge(graphdef, params).bias(grid, grid)[0] * cotangent)

  grads = jax.grad(weighted_bias)(params)
  bias, grad_p, grad_a = _kerple_port(r1, r2, length, cotangent)
  got_bias = np.asarray(scheme.bias(grid, grid)[0])
  lower = np.tril(np.ones((length, length), bool))
  np.testing.assert_allclose(got_bias[:, lower], bias[:, lower], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grads["r1"][...], grad_p, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(grads["r2"][...], grad_a, rtol=1e-4, atol=1e-6)
  assert float(grads["r1"][...][1]) != 0 and float(grads["r2"][...][0]) != 0
  assert float(grads["r2"][...][2]) != 0  # a negative stored value too
  # Equal to the gradient of a parameter stored exactly at the floor.
  at_floor = nnx.clone(scheme)
  at_floor.r1[...] = jnp.asarray(np.maximum(r1, 0.01), jnp.float32)
  at_floor.r2[...] = jnp.asarray(np.maximum(r2, 0.01), jnp.float32)
  floor_grads = jax.grad(weighted_bias)(nnx.state(at_floor))
  for name in ("r1", "r2"):
    np.testing.assert_allclose(grads[name][...], floor_grads[name][...], rtol=1e-6)


def test_kerple_initial_draws_are_clamped_as_the_first_forward_clamps_them():
  """U(0, 2) and U(0, 1) draws below 0.01 are stored at 0.01, where the authors' first forward
  puts them before any update (512 heads: some draws fall below the floor)."""
  geometry = positions.Geometry(d_model=512, num_heads=512, head_dim=1, rotary_dims=1)
  rngs = nnx.Rngs(0)
  raw = jax.random.uniform(nnx.Rngs(0).params(), (512,))  # r1's draw / 2
  assert float(raw.min()) < 0.005  # the test has draws below the floor
  scheme = kerple.KerpleLog(None, geometry, rngs=rngs)
  np.testing.assert_allclose(scheme.r1[...], np.maximum(2 * np.asarray(raw), 0.01), rtol=1e-6)
  assert float(scheme.r1[...].min()) == pytest.approx(0.01)
  assert float(scheme.r2[...].min()) >= np.float32(0.01)


# ---- RetNet: rotation angles and the output projection's initialisation ---------------------


def _retnet_angle(head_dim):
  """RetNetRelPos.__init__: 1 / 10000 ** linspace(0, 1, head_dim // 2), each repeated twice."""
  return np.repeat(1.0 / 10000 ** np.linspace(0, 1, head_dim // 2), 2)


def _theta_shift(x_LxH, positions_L, angle_H):
  """multiscale_retention.py: x cos + rotate_every_two(x) sin, rotate_every_two(x) stacking
  (-x[1::2], x[::2]) on a last axis and flattening it."""
  rotated = np.stack((-x_LxH[:, 1::2], x_LxH[:, ::2]), axis=-1).reshape(x_LxH.shape)
  phase = positions_L[:, None] * angle_H[None, :]
  return x_LxH * np.cos(phase) + rotated * np.sin(phase)


def _retention(position="rope", **settings):
  """The first layer's mixer (shapes only: its position scheme has no parameters)."""
  config = tiny_model_config(attention="retention", position=position,
                             **({"retention": settings} if settings else {}))
  return nnx.eval_shape(lambda: research.build_model(config, rngs=nnx.Rngs(0))).blocks[0].mixer


def test_retention_rotates_queries_and_keys_at_retnet_angles_by_default():
  mixer = _retention()
  head_dim = mixer.head_dim  # 8: four pairs
  angle = _retnet_angle(head_dim)
  np.testing.assert_allclose(mixer.position.inverse_frequencies(), angle[::2], rtol=1e-6)
  rope_theta = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
  assert not np.allclose(angle[::2], rope_theta, rtol=1e-3)  # the old schedule differs
  x = np.random.default_rng(1).normal(size=(1, 11, mixer.num_heads, head_dim)).astype(np.float32)
  positions_L = np.arange(3, 14)  # any positions, not only from 0
  got_q = np.asarray(mixer.position.queries(jnp.asarray(x), jnp.asarray(positions_L)[None]))
  got_k = np.asarray(mixer.position.keys(jnp.asarray(x), jnp.asarray(positions_L)[None]))
  for n in range(mixer.num_heads):
    want = _theta_shift(x[0, :, n].astype(np.float64), positions_L, angle)
    np.testing.assert_allclose(got_q[0, :, n], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_k[0, :, n], want, rtol=1e-5, atol=1e-5)


def test_rope_frequencies_are_an_explicit_choice_and_other_mixers_keep_ropes():
  head_dim = 8
  rope_theta = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
  chosen = _retention(rotary_frequencies="rope")
  np.testing.assert_allclose(chosen.position.inverse_frequencies(), rope_theta, rtol=1e-6)
  mha = nnx.eval_shape(lambda: research.build_model(
      tiny_model_config(attention="mha", position="rope"), rngs=nnx.Rngs(0))).blocks[0].mixer
  np.testing.assert_allclose(mha.position.inverse_frequencies(), rope_theta, rtol=1e-6)
  with pytest.raises(ValueError, match="model.retention.rotary_frequencies='xpos'; valid: rope"):
    research.model.transformer.validate(tiny_model_config(attention="retention", position="rope",
                                              retention=dict(rotary_frequencies="xpos")))


def test_retnet_angles_take_the_rope_scalings_at_their_lowest_frequency():
  """NTK divides RetNet's lowest angle (1 / base) by s; PI every angle; YaRN's ramp runs over
  the pairs whose wavelength lies between L / 32 and L."""
  geometry = positions.Geometry(32, 4, 8, 8, rotary_frequencies="retnet")
  config = tiny_model_config(position="rope")

  def theta(**settings):
    config.rope.update({"scaling": "none", "scaling_factor": 1.0, "original_length": 16,
                        **settings})
    scheme = positions.build(config, geometry, rngs=nnx.Rngs(0))
    return np.asarray(scheme.inverse_frequencies())

  plain, s = _retnet_angle(8)[::2], 4.0
  np.testing.assert_allclose(theta(), plain, rtol=1e-6)
  np.testing.assert_allclose(theta(scaling="pi", scaling_factor=s), plain / s, rtol=1e-6)
  ntk = theta(scaling="static_ntk", scaling_factor=s)
  assert ntk[0] == pytest.approx(1.0) and ntk[-1] == pytest.approx(plain[-1] / s, rel=1e-5)
  # Pair i has wavelength 2 pi 10000^(i/3); with L = 4096: d_32 = 3 ln(4096/(64 pi)) / ln(1e4)
  # = 0.99 -> 0, d_1 = 3 ln(4096/(2 pi)) / ln(1e4) = 2.12 -> 3.
  assert positions.rope.yarn_correction_range(8, 10000.0, 4096, "retnet") == (0, 3)
  ramp = np.arange(4) / 3
  np.testing.assert_allclose(theta(scaling="yarn", scaling_factor=s, original_length=4096),
                             plain / s * ramp + plain * (1 - ramp), rtol=1e-6)


def test_retention_output_projection_is_xavier_uniform_with_gain_one_half():
  """reset_parameters: xavier_uniform_(out_proj.weight, gain=2 ** -1), weight [d_model,
  value_dim]: bound = gain sqrt(6 / (fan_in + fan_out)), std = bound / sqrt(3)."""
  config = tiny_model_config(attention="retention", position="none", d_model=64, num_heads=4)
  settings = research.model.attention.REGISTRY.settings("retention", config)
  mixer = retention.Retention(settings, config,
                              research.model.attention.position_scheme(config, rngs=nnx.Rngs(0)),
                              rngs=nnx.Rngs(0))
  kernel = np.asarray(mixer.out.kernel[...])
  assert kernel.shape == (4, 16, 64)
  bound = 2 ** -1 * math.sqrt(6 / (64 + 64))
  assert np.abs(kernel).max() <= bound
  assert np.abs(kernel).max() > 0.98 * bound  # 4096 uniform draws reach the edge
  assert kernel.std() == pytest.approx(bound / math.sqrt(3), rel=0.05)


# ---- MoE: load balancing pooled over the layers ---------------------------------------------


def _hf_load_balancing_loss(logits_per_layer, num_experts, top_k):
  """load_balancing_loss_func without an attention mask, in numpy: the layers' router logits
  concatenated, softmax, top_k, tokens_per_expert = mean one_hot [top_k, X],
  router_prob_per_expert = mean softmax [X], X * sum(tokens_per_expert * router_prob)."""
  logits = np.concatenate([np.reshape(x, (-1, num_experts)) for x in logits_per_layer])
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  selected = np.argsort(-weights, axis=-1, kind="stable")[:, :top_k]
  expert_mask = np.eye(num_experts)[selected]  # [T, top_k, X]
  tokens_per_expert = expert_mask.mean(0)
  router_prob_per_expert = weights.mean(0)
  return num_experts * np.sum(tokens_per_expert * router_prob_per_expert[None])


def _numpy_router_z_loss(logits):
  """ST-MoE's z-loss (arXiv:2202.08906, eq. 5): mean over tokens of (log sum_e exp x_e)^2."""
  peak = logits.max(-1, keepdims=True)
  log_sum_exp = peak[..., 0] + np.log(np.exp(logits - peak).sum(-1))
  return float(np.mean(log_sum_exp ** 2))


class _TwoLayers(nnx.Module):
  """Two MoE layers, each on its own input, as two blocks of a model would be."""

  def __init__(self, config, settings):
    self.layers = nnx.List([moe.MixtureOfExperts(config, settings, rngs=nnx.Rngs(seed))
                            for seed in (0, 1)])

  def __call__(self, xs):
    return [layer(x) for layer, x in zip(self.layers, xs)]


def _two_layer_losses(**settings):
  config = tiny_model_config(feed_forward="moe", moe=dict(load_balancing_weight=0.5,
                                                          router_z_loss_weight=0.25, **settings))
  layers = _TwoLayers(config, feed_forward.REGISTRY.settings("moe", config))
  xs = [jax.random.normal(jax.random.key(k), (2, 5, 32)) for k in (7, 8)]
  logits = [np.asarray(layer.router(x), np.float64) for layer, x in zip(layers.layers, xs)]
  z_losses = [_numpy_router_z_loss(x) for x in logits]
  return layers, xs, jax.jit(_auxiliary_losses)(layers, xs), logits, z_losses


def _auxiliary_losses(layers, xs):
  _, sown = nnx.capture(lambda m, xs: m(xs), feed_forward.AuxiliaryLoss)(layers, xs)
  return feed_forward.auxiliary_losses(sown)


def test_pooled_load_balancing_is_hf_load_balancing_loss_func_over_the_layers():
  experts, top_k = 4, 2
  _, _, pooled, logits, z_losses = _two_layer_losses(pooled_load_balancing=True)
  want = _hf_load_balancing_loss(logits, experts, top_k)
  per_layer = np.mean([_hf_load_balancing_loss([x], experts, top_k) for x in logits])
  assert abs(want - per_layer) > 1e-3  # the two forms differ on these routings
  np.testing.assert_allclose(pooled["load_balancing_loss"], want, rtol=1e-5)
  np.testing.assert_allclose(pooled["router_z_loss"], np.mean(z_losses), rtol=1e-5)
  np.testing.assert_allclose(pooled[feed_forward.OBJECTIVE],
                             0.5 * want + 0.25 * np.mean(z_losses), rtol=1e-5)
  # The default is unchanged: the mean of the layers' own losses.
  _, _, mean, _, _ = _two_layer_losses()
  np.testing.assert_allclose(mean["load_balancing_loss"], per_layer, rtol=1e-5)


def test_pooled_load_balancing_gradient_is_that_of_the_pooled_loss():
  """d objective / d routers = the gradient of 0.5 X sum_e F_e P_e (F constant, as HF's top_k
  indices) + 0.25 mean z, with F and P over the two layers' tokens pooled."""
  layers, xs, _, _, _ = _two_layer_losses(pooled_load_balancing=True)
  graphdef, params = nnx.split(layers)

  def objective(params):
    return _auxiliary_losses(nnx.merge(graphdef, params), xs)[feed_forward.OBJECTIVE]

  def pooled_by_hand(params):
    model = nnx.merge(graphdef, params)
    logits = jnp.concatenate([layer.router(x).reshape(-1, 4)
                              for layer, x in zip(model.layers, xs)])
    probs = jax.nn.softmax(logits)
    chosen = jax.nn.one_hot(jax.lax.top_k(probs, 2)[1], 4).sum(1)
    balance = 4 * jnp.sum(jax.lax.stop_gradient(chosen.mean(0)) * probs.mean(0))
    z = jnp.mean(jnp.stack([moe.router_z_loss(layer.router(x))
                            for layer, x in zip(model.layers, xs)]))
    return 0.5 * balance + 0.25 * z

  got, want = jax.jit(jax.grad(objective))(params), jax.jit(jax.grad(pooled_by_hand))(params)
  for layer in (0, 1):
    g, w = got["layers"][layer]["router"]["kernel"][...], want["layers"][layer]["router"]["kernel"][...]
    assert float(jnp.abs(w).max()) > 0
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)


def test_pooled_load_balancing_reaches_the_training_objective_of_a_two_moe_layer_model():
  batch = {"inputs": jax.random.randint(jax.random.key(3), (2, 6), 0, 61),
           "targets": jax.random.randint(jax.random.key(4), (2, 6), 0, 61),
           "loss_mask": jnp.ones((2, 6))}
  config = tiny_model_config(num_layers=2, feed_forward="moe", moe=dict(
      pooled_load_balancing=True, load_balancing_weight=0.5, router_z_loss_weight=0.25))
  model = research.build_model(config, rngs=nnx.Rngs(0))
  objective, (nll_sum, auxiliary) = jax.jit(train.loss_sum)(model, batch)
  balance, z_loss = auxiliary["load_balancing_loss"], auxiliary["router_z_loss"]
  assert 2 <= float(balance) <= 4
  np.testing.assert_allclose(objective - nll_sum, (0.5 * balance + 0.25 * z_loss) * 12, rtol=1e-4)


def test_auxiliary_losses_combine_scalars_by_their_mean_and_pooled_terms_once():
  """base.auxiliary_losses on hand-made sown values: mean of scalars + sum(mean a * mean b)."""
  pooled = feed_forward_base.Pooled
  a, b = np.array([[1.0, 3.0], [3.0, 1.0]]), np.array([[0.2, 0.8], [0.6, 0.4]])
  combined = a.mean(0) @ b.mean(0)
  assert combined != pytest.approx(np.mean([a[0] @ b[0], a[1] @ b[1]]))
  state = nnx.State({"blocks": {0: {"x": feed_forward.AuxiliaryLoss((pooled(a[0], b[0]), 1.0))},
                                1: {"x": feed_forward.AuxiliaryLoss((pooled(a[1], b[1]), 3.0))}}})
  np.testing.assert_allclose(feed_forward.auxiliary_losses(state)["x"], 2.0 + combined, rtol=1e-6)
