"""The `pallas` attention backend (research.model.attention.pallas_backend: JAX's Pallas
FlashAttention kernel) against `xla` and the naive float32 reference, in Pallas' interpret mode on
the CPU: forward and backward, grouped heads, packed documents, a length the kernel's blocks do not
divide; and what it refuses, by name, before any work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import transformer as model_lib
from research.model.attention import core
from research.model.attention import reference
from tests.conftest import tiny_model_config


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_pallas_equals_xla_and_the_reference_forward_and_backward_in_packed_documents():
  # GQA (4 query heads on 2 key/value heads), 19 tokens (padded to the kernel's 32), two rows:
  # three documents, and one.
  q, k, v = _normal(0, (2, 19, 4, 8)), _normal(1, (2, 19, 2, 8)), _normal(2, (2, 19, 2, 8))
  segments = jnp.array([[0] * 6 + [1] * 9 + [2] * 4, [0] * 19], jnp.int32)
  d_out = _normal(3, q.shape)

  def vjp(backend):
    return jax.jit(lambda q, k, v: jax.vjp(
        lambda q, k, v: core.attend(q, k, v, backend=backend, segments_BxT=segments),
        q, k, v))(q, k, v)

  (pallas, pallas_pullback), (xla, xla_pullback) = vjp("pallas"), vjp("xla")
  visible = (segments[:, :, None] == segments[:, None, :]) & jnp.tril(
      jnp.ones((19, 19), bool))
  naive = reference.softmax_attention(q, k, v, mask_BxTxS=visible)
  np.testing.assert_allclose(pallas, naive, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(pallas, xla, atol=2e-5, rtol=2e-5)
  for got, want in zip(pallas_pullback(d_out), xla_pullback(d_out), strict=True):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_a_model_on_pallas_gives_the_logits_of_xla():
  """MHA with RoPE (a rotation before the core: no score modification) through the backend."""
  tokens = jax.random.randint(jax.random.key(0), (2, 19), 0, 61)
  logits = {}
  for backend in ("pallas", "xla"):
    config = tiny_model_config(attention="gqa", position="rope", attention_backend=backend)
    model_lib.validate(config)
    logits[backend] = research.build_model(config, rngs=nnx.Rngs(0))(tokens)
  np.testing.assert_allclose(logits["pallas"], logits["xla"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("settings,phrase", [
    (dict(position="alibi"), "takes no score modification"),
    (dict(softmax=dict(window=8)), "not a sliding window"),
    (dict(attention="sparse"), "unknown model.attention_backend 'pallas'"),
    (dict(attention="fox", position="none"), "unknown model.attention_backend 'pallas'"),
])
def test_what_the_kernel_cannot_express_is_refused_when_the_model_is_validated(settings, phrase):
  config = tiny_model_config(attention_backend="pallas", **settings)
  with pytest.raises(ValueError, match=phrase):
    model_lib.validate(config)


def test_the_core_refuses_a_bias_and_wider_values_by_name():
  q = _normal(0, (1, 8, 2, 4))
  with pytest.raises(ValueError, match="'pallas' takes no score modification"):
    core.attend(q, q, q, backend="pallas",
                score_mod=core.ScoreMod(bias=lambda p, qi, ki: jnp.zeros((1, 1, 8, 8))))
  with pytest.raises(ValueError, match="needs values as wide as keys, got 6 != 4"):
    core.attend(q, q, _normal(1, (1, 8, 2, 6)), backend="pallas")
