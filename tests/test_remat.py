"""model.remat (research.model.transformer.REMAT_POLICIES): rematerialising each block changes what
the backward pass keeps, not what it computes: the objective, the auxiliary losses a mixture of
experts sows and every gradient equal those without it; an unknown policy is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import transformer as model_lib
from research.training import loop
from tests.conftest import tiny_model_config


def _loss_and_grads(remat, **settings):
  config = tiny_model_config(remat=remat, **settings)
  graphdef, params = nnx.split(research.build_model(config, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, config.vocab_size)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1),
           "loss_mask": jnp.ones(tokens.shape, jnp.float32)}
  objective = jax.jit(jax.value_and_grad(
      lambda p: loop.loss_sum(nnx.merge(graphdef, p), batch), has_aux=True))
  return objective(params)


@pytest.mark.parametrize("policy", [p for p in model_lib.REMAT_POLICIES if p != "none"])
@pytest.mark.parametrize("settings", [dict(attention="gqa", feed_forward="moe"),
                                      dict(attention="mamba2", position="none")],
                         ids=["gqa+moe", "mamba2"])
def test_remat_computes_what_no_remat_computes(policy, settings):
  (loss, (nll, auxiliary)), grads = _loss_and_grads(policy, **settings)
  (want_loss, (want_nll, want_auxiliary)), want_grads = _loss_and_grads("none", **settings)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(nll, want_nll, rtol=1e-6)
  assert auxiliary.keys() == want_auxiliary.keys()
  if settings.get("feed_forward") == "moe":
    assert auxiliary, "the mixture of experts' load-balancing loss is sown through remat"
  for name in auxiliary:
    np.testing.assert_allclose(auxiliary[name], want_auxiliary[name], rtol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def test_an_unknown_policy_is_refused_with_the_valid_ones():
  with pytest.raises(ValueError, match="unknown model.remat 'some'; valid: none, full, dots"):
    model_lib.validate(tiny_model_config(remat="some"))
