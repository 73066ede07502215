"""The mixture of experts' sorted dispatches (the (token, expert) pairs sorted by expert, through
jax.lax.ragged_dot or the grouped matmul by blocks) against the dense dispatch, the reference:
the same outputs, gradients (w.r.t. the input and every parameter) and auxiliary losses, in
float32. (tests/test_feed_forward.py checks the layer against a per-token loop; the conformance
suite runs the sorted dispatch, the MoE's test_settings, in a model, sharded too.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model import feed_forward
from research.model import sharding
from research.model.feed_forward import base, moe
from tests.conftest import tiny_model_config

EXPERTS, D_MODEL = 4, 32  # tiny_model_config: 4 experts, d_model 32, mlp_ratio 2
STARVED = (1, 3)  # experts that the rigged router of the `starved` case never picks


SORTED = ("sorted", "blocked")


def _layers(sorted_dispatch="sorted", **settings):
  """(graphdef of the dense layer, graphdef of the sorted one, their shared parameters)."""
  graphdefs = []
  for dispatch in ("dense", sorted_dispatch):
    config = tiny_model_config(feed_forward="moe", moe=dict(settings, dispatch=dispatch))
    layer = moe.MixtureOfExperts(config, feed_forward.REGISTRY.settings("moe", config),
                                 rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    graphdefs.append(graphdef)
  return graphdefs[0], graphdefs[1], params


def _inputs(starved):
  x = jax.random.normal(jax.random.key(1), (2, 7, D_MODEL))
  return jnp.abs(x) if starved else x


def _starve(params):
  """Router columns of -10 for the STARVED experts: with positive inputs their logits are the
  lowest, so no token picks them (with top_k <= 2 of 4) and their groups are empty, one between
  non-empty groups, one last."""
  kernel = params["router"]["kernel"]
  kernel[...] = kernel[...].at[:, jnp.array(STARVED)].set(-10.0)
  return params


CASES = [pytest.param(1, False, False, id="top1"), pytest.param(1, True, False, id="top1-renorm"),
         pytest.param(2, False, False, id="top2"), pytest.param(2, True, False, id="top2-renorm"),
         pytest.param(2, False, True, id="top2-empty-experts")]


@pytest.mark.parametrize("dispatch", SORTED)
@pytest.mark.parametrize("top_k,renormalize,starved", CASES)
def test_sorted_dispatch_equals_dense_outputs_and_gradients(top_k, renormalize, starved,
                                                            dispatch):
  dense, sorted_, params = _layers(dispatch, top_k=top_k, renormalize=renormalize)
  if starved:
    params = _starve(params)
  x = _inputs(starved)
  cotangent = jax.random.normal(jax.random.key(2), x.shape)

  @jax.jit
  def both(params, x):
    def loss_and_output(graphdef):
      def loss(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.sum(jnp.sin(y) * cotangent), y  # a cotangent that depends on y too
      return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    chosen = nnx.merge(dense, params).route(x)[3]
    return loss_and_output(dense), loss_and_output(sorted_), chosen.reshape(-1, EXPERTS).sum(0)

  (want_grads, want_y), (got_grads, got_y), tokens_per_expert = both(params, x)
  if starved:
    assert [int(tokens_per_expert[e]) for e in STARVED] == [0, 0]
  assert int(tokens_per_expert.sum()) == x.shape[0] * x.shape[1] * top_k
  assert got_y.dtype == want_y.dtype and got_y.shape == want_y.shape
  np.testing.assert_allclose(got_y, want_y, atol=1e-5, rtol=1e-5)
  want_leaves = jax.tree.leaves_with_path(want_grads)
  got_leaves = jax.tree.leaves(got_grads)
  assert len(got_leaves) == len(want_leaves) == 4  # x, router, up, down
  for (path, want), got in zip(want_leaves, got_leaves, strict=True):
    assert float(jnp.abs(want).max()) > 0, path
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=str(path))
  if starved:  # the experts no token reached get no gradient
    up_grad = want_grads[0]["up"]["kernel"][...]
    for e in STARVED:
      assert float(jnp.abs(got_grads[0]["up"]["kernel"][...][e]).max()) == 0.0
      assert float(jnp.abs(up_grad[e]).max()) == 0.0


@pytest.mark.parametrize("pooled", [False, True])
def test_sorted_dispatch_sows_the_dense_auxiliary_losses(pooled):
  dense, sorted_, params = _layers(pooled_load_balancing=pooled, router_z_loss_weight=0.1)
  x = _inputs(False)

  @jax.jit
  def both(params, x):
    def losses(graphdef):
      layer = nnx.merge(graphdef, params)
      _, sown = nnx.capture(lambda m, x: m(x), base.AuxiliaryLoss)(layer, x)
      return base.auxiliary_losses(sown)
    return losses(dense), losses(sorted_)

  want, got = both(params, x)
  assert set(got) == set(want) == {"auxiliary_loss", "load_balancing_loss", "router_z_loss"}
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("sorted_dispatch", SORTED)
def test_sorted_dispatch_keeps_the_compute_dtype(sorted_dispatch):
  """bfloat16 compute: the same dtype as dense, and close at bfloat16's precision."""
  layers = []
  for dispatch in ("dense", sorted_dispatch):
    config = tiny_model_config(feed_forward="moe", compute_dtype="bfloat16",
                               moe=dict(dispatch=dispatch))
    layers.append(moe.MixtureOfExperts(config, feed_forward.REGISTRY.settings("moe", config),
                                       rngs=nnx.Rngs(0)))
  x = _inputs(False)
  want, got = jax.jit(lambda x: [layer(x) for layer in layers])(x)
  assert want.dtype == got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2,
                             rtol=3e-2)


def test_unknown_dispatch_is_refused_naming_the_valid_ones():
  config = tiny_model_config(feed_forward="moe", moe=dict(dispatch="megablox"))
  with pytest.raises(ValueError, match="model.moe.dispatch='megablox'.*'dense', 'sorted'"):
    moe.MixtureOfExperts.validate(feed_forward.REGISTRY.settings("moe", config), config)


def test_blocked_dispatch_on_a_mesh_equals_unsharded():
  """The blocked layer with its experts split over `tensor` and the batch over the data axes
  (the sharding rules, an 8-device mesh) gives the unsharded outputs and input gradient."""
  _, blocked, params = _layers("blocked", top_k=2)
  x = jax.random.normal(jax.random.key(3), (4, 7, D_MODEL))

  @jax.jit
  def output_and_input_grad(params, x):
    layer = lambda x: nnx.merge(blocked, params)(x)  # noqa: E731
    return layer(x), jax.grad(lambda x: jnp.sum(jnp.sin(layer(x))))(x)

  want = output_and_input_grad(params, x)
  mesh = sharding.make_mesh((2, 2, 2))
  sharded = jax.device_put(params, sharding.state_shardings(params, mesh))
  assert any(any(axis is not None for axis in leaf.sharding.spec)
             for leaf in jax.tree.leaves(sharded)), "nothing was sharded"
  with jax.set_mesh(mesh):
    got = output_and_input_grad(sharded, jax.device_put(x, sharding.batch_sharding(mesh)))
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
