"""RWKV's channel mixing (research/model/feed_forward/rwkv_channel_mix.py) against a token-by-token
reference, with packed documents, and its decode against the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model.feed_forward.rwkv_channel_mix import RWKVChannelMix
from tests.conftest import tiny_model_config

SEGMENTS = jnp.array([[0] * 4 + [1] * 9, [0] * 13, [0] + [1] * 12])


def _block(**settings):
  config = tiny_model_config()
  return RWKVChannelMix(config, {**RWKVChannelMix.hyperparameters, **settings},
                        rngs=nnx.Rngs(0))


def _naive(block, x_BxLxD, segments_BxL):
  """out_t = sigmoid(x_r W_r) * (relu(x_k W_k)^2 W_v), one token at a time, x' the token before
  in the same document (0 at its start)."""
  outputs = []
  for t in range(x_BxLxD.shape[1]):
    x = x_BxLxD[:, t]
    continues = (segments_BxL[:, t] == segments_BxL[:, t - 1])[:, None] if t else False
    previous = jnp.where(continues, x_BxLxD[:, t - 1], 0.0)
    x_k = x + (previous - x) * block.mix_k[...]
    x_r = x + (previous - x) * block.mix_r[...]
    hidden = jax.nn.relu(x_k @ block.key.kernel[...]) ** 2
    outputs.append(jax.nn.sigmoid(x_r @ block.receptance.kernel[...])
                   * (hidden @ block.value.kernel[...]))
  return jnp.stack(outputs, axis=1)


def test_channel_mix_equals_the_token_by_token_reference_and_decodes_as_the_forward():
  block = _block()
  x = jax.random.normal(jax.random.key(0), (3, 13, 32))
  forward = jax.jit(block.__call__)
  packed = forward(x, SEGMENTS)
  np.testing.assert_allclose(packed, jax.jit(_naive, static_argnums=0)(block, x, SEGMENTS),
                             atol=1e-5, rtol=1e-5)
  whole = forward(x, jnp.zeros_like(SEGMENTS))
  assert float(jnp.abs(whole[0, 4] - packed[0, 4]).max()) > 1e-4  # the reset mattered
  decode = jax.jit(block.decode)
  first, cache = decode(x[:, :5], block.init_cache(3, 13), 0)
  steps = [first]
  for t in range(5, 13):
    y, cache = decode(x[:, t:t + 1], cache, t)
    steps.append(y)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), whole, atol=1e-5, rtol=1e-5)


def test_channel_mix_refuses_a_zero_width():
  with pytest.raises(ValueError, match="hidden must be >= 1"):
    _block(hidden=-1)
  with pytest.raises(ValueError, match="set hidden >= 1 or model.mlp_ratio >= 1"):
    RWKVChannelMix.validate({"hidden": 0}, tiny_model_config(mlp_ratio=0))
