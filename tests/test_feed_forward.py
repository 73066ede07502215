"""Feed-forwards: the mixture of experts against a token-by-token loop over its chosen experts,
its load-balancing loss against the definition, the loss reaching the training objective, and
the parameters a token uses. (The conformance suite runs every feed-forward in a model.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import feed_forward
from research.training import loop as train
from research.model.feed_forward import moe
from tests.conftest import tiny_model_config

EXPERTS, TOP_K = 4, 2


def _layer(**settings):
  config = tiny_model_config(feed_forward="moe", moe=settings)
  return moe.MixtureOfExperts(config, feed_forward.REGISTRY.settings("moe", config),
                              rngs=nnx.Rngs(0))


def _kernels(params):
  return (params[k]["kernel"][...] for k in ("router", "up", "down"))


def _experts_loop(params, x_TxD, chosen, renormalize):
  """Naive fp32: per token, the softmax of the router and the weighted sum of its `chosen`
  experts' MLPs, each run alone."""
  router, up, down = _kernels(params)
  rows = []
  for token, experts in zip(x_TxD, chosen):
    probs = jax.nn.softmax(token @ router)[jnp.array(experts)]
    weights = probs / probs.sum() if renormalize else probs
    rows.append(sum(w * (jax.nn.gelu(token @ up[e]) @ down[e]) for w, e in zip(weights, experts)))
  return jnp.stack(rows)


@pytest.mark.parametrize("dispatch,renormalize", [("dense", False), ("sorted", True)])
def test_moe_matches_each_token_run_through_its_top_k_experts(dispatch, renormalize):
  """Outputs and gradients (router and experts) of either dispatch == the per-token loop over
  each token's top_k experts (numpy's argsort of the router probabilities)."""
  graphdef, params = nnx.split(_layer(renormalize=renormalize, dispatch=dispatch))
  x_BxLxD = jax.random.normal(jax.random.key(1), (2, 3, 32))
  x_TxD = x_BxLxD.reshape(6, 32)
  router = next(_kernels(params))
  chosen = [[int(e) for e in np.argsort(-np.asarray(logits), kind="stable")[:TOP_K]]
            for logits in x_TxD @ router]
  layer = lambda p: nnx.merge(graphdef, p)(x_BxLxD).reshape(6, 32)
  naive = lambda p: _experts_loop(p, x_TxD, chosen, renormalize)
  squared_and_outputs = lambda fn: jax.jit(jax.grad(
      lambda p: (jnp.sum(fn(p) ** 2), fn(p)), has_aux=True))(params)
  (layer_grads, layer_y), (naive_grads, naive_y) = map(squared_and_outputs, (layer, naive))
  np.testing.assert_allclose(layer_y, naive_y, atol=1e-5, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(layer_grads), jax.tree.leaves(naive_grads), strict=True):
    assert bool(jnp.isfinite(got).all()) and float(jnp.abs(got).max()) > 0
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_routing_to_every_expert_is_the_softmax_weighted_sum_of_all():
  graphdef, params = nnx.split(_layer(top_k=EXPERTS, renormalize=True))
  x = jax.random.normal(jax.random.key(2), (2, 3, 32))
  router, up, down = _kernels(params)
  probs = jax.nn.softmax(x @ router)
  every_expert = jnp.einsum("blx,blxd->bld", probs, jnp.einsum(
      "blxf,xfd->blxd", jax.nn.gelu(jnp.einsum("bld,xdf->blxf", x, up)), down))
  np.testing.assert_allclose(nnx.merge(graphdef, params)(x), every_expert, atol=1e-5, rtol=1e-5)


def test_load_balancing_loss_is_its_definition_and_top_k_when_uniform():
  probs = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]], np.float32)
  chosen = np.array([[1, 0, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]], np.float32)  # top-2
  f, p = chosen.mean(0), probs.mean(0)
  np.testing.assert_allclose(moe.load_balancing_loss(probs, chosen), 4 * np.sum(f * p), rtol=1e-6)
  # Uniform probabilities, or routing that fills every expert alike: top_k, the balanced value.
  uniform = np.full((3, 4), 0.25, np.float32)
  np.testing.assert_allclose(moe.load_balancing_loss(uniform, chosen), TOP_K, rtol=1e-6)
  balanced = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], np.float32)
  np.testing.assert_allclose(moe.load_balancing_loss(probs[:2], balanced), TOP_K, rtol=1e-6)
  # Every token on the same two experts, with all its probability there: num_experts.
  collapsed = np.array([[0.5, 0.5, 0.0, 0.0]] * 3, np.float32)
  np.testing.assert_allclose(moe.load_balancing_loss(collapsed, chosen[1:2].repeat(3, 0)),
                             EXPERTS, rtol=1e-6)


def test_auxiliary_losses_reach_the_training_objective_and_dense_models_have_none():
  """train.loss_sum adds load_balancing_weight x the balance loss per scored token."""
  batch = {"inputs": jax.random.randint(jax.random.key(3), (2, 6), 0, 61),
           "targets": jax.random.randint(jax.random.key(4), (2, 6), 0, 61),
           "loss_mask": jnp.ones((2, 6)).at[0, :2].set(0.0)}
  config = tiny_model_config(feed_forward="moe", moe=dict(load_balancing_weight=0.5,
                                                          router_z_loss_weight=0.25))
  model = research.build_model(config, rngs=nnx.Rngs(0))
  objective, (nll_sum, auxiliary) = jax.jit(train.loss_sum)(model, batch)
  assert set(auxiliary) == {"auxiliary_loss", "load_balancing_loss", "router_z_loss"}
  balance, z_loss = auxiliary["load_balancing_loss"], auxiliary["router_z_loss"]
  assert TOP_K <= float(balance) <= EXPERTS and float(z_loss) > 0
  np.testing.assert_allclose(objective - nll_sum, (0.5 * balance + 0.25 * z_loss) * 10, rtol=1e-4)
  assert not nnx.state(model, nnx.Intermediate)  # nothing sown stays on the model
  dense = research.build_model(tiny_model_config(), rngs=nnx.Rngs(0))
  assert jax.eval_shape(train.loss_sum, dense, batch)[1][1] == {}


def test_a_token_uses_its_top_k_experts_parameters():
  """count_params(embeddings=False), the FLOPs' parameters, counts top_k experts of each MoE."""
  config = tiny_model_config(num_layers=2, feed_forward_pattern=("mlp", "moe"))
  model = nnx.eval_shape(lambda: research.build_model(config, rngs=nnx.Rngs(0)))
  assert [type(block.mlp).__name__ for block in model.blocks] == ["MLP", "MixtureOfExperts"]
  dense = nnx.eval_shape(lambda: research.build_model(tiny_model_config(num_layers=2),
                                                      rngs=nnx.Rngs(0)))
  d, f = 32, 64
  expert, router = 2 * d * f, d * EXPERTS
  assert research.count_params(model) == research.count_params(dense) + (EXPERTS - 1) * expert + router
  assert (research.count_params(model, embeddings=False)
          == research.count_params(dense, embeddings=False) + (TOP_K - 1) * expert + router)


def test_swiglu_is_the_gated_mlp_of_mad_lab_with_its_width_rule():
  """y = W_down (silu(x W_gate) * x W_up), checked in numpy; hidden 0 gives mad-lab's
  int(2 * 4 * D / 3) rounded up to 16 (352 at D = 128), an explicit hidden is kept."""
  from research.model.feed_forward import swiglu  # noqa: PLC0415
  rule = lambda d, **s: swiglu.SwiGLU.hidden_width(
      {"hidden": 0, "multiple_of": 16, **s}, tiny_model_config(d_model=d, mlp_ratio=4))
  assert (rule(128), rule(64), rule(32, hidden=50)) == (352, 176, 50)
  config = tiny_model_config(feed_forward="swiglu")
  layer = swiglu.SwiGLU(config, feed_forward.REGISTRY.settings("swiglu", config), rngs=nnx.Rngs(0))
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 3, config.d_model)))
  gate, up, down = (np.asarray(getattr(layer, name).kernel[...]) for name in ("gate", "up", "down"))
  silu = lambda a: a / (1 + np.exp(-a))
  np.testing.assert_allclose(layer(jnp.asarray(x)), (silu(x @ gate) * (x @ up)) @ down,
                             atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="multiple_of must be >= 1"):
    swiglu.SwiGLU.validate({"hidden": 0, "multiple_of": 0}, config)
