"""The normaliser interface (research/model/attention/normalisers.py) with a pointwise normaliser,
and sigmoid attention (research/model/attention/sigmoid.py, arXiv:2409.04431) against the
authors' forward pass written out (apple/ml-sigmoid-attention@9273b49, Attention.forward with
unnormalized_sigmoid_attention): xla and blockwise, forward and gradients, windows, sinks and
packed documents; the conformance suite runs decoding from the full and rolling caches."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model.attention import core
from research.model.attention import normalisers
from research.model.attention import sigmoid
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _normal, _visible

LENGTH, HEADS, KV_HEADS, DIM = 37, 4, 2, 8


def _naive(q, k, v, visible_BxTxS, bias, score_bias=0.0):
  """sum_j sigmoid(q k / sqrt(H) + score_bias + b) v_j over the visible keys, element by
  element's mask; masked logits at -inf as the authors' masking (weight 0)."""
  heads, kv = q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, heads // kv, axis=2), jnp.repeat(v, heads // kv, axis=2)
  z = jnp.einsum("btnh,bsnh->bnts", q, k) / q.shape[-1] ** 0.5 + score_bias
  z = jnp.where(visible_BxTxS[:, None], z, -jnp.inf)
  return jnp.einsum("bnts,bsnv->btnv", jax.nn.sigmoid(z + bias), v)


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
@pytest.mark.parametrize("window,sinks,packed", [(0, 0, False), (6, 2, True), (5, 0, False)])
def test_a_pointwise_normaliser_equals_its_equation_with_gradients(backend, window, sinks,
                                                                   packed):
  """Through the core: every mask, a T5-style bias with parameters (to check its gradient goes
  through the pointwise tiles), blockwise skipping whole tiles of 8."""
  q = _normal(0, (2, LENGTH, HEADS, DIM))
  k, v = _normal(1, (2, LENGTH, KV_HEADS, DIM)), _normal(2, (2, LENGTH, KV_HEADS, DIM))
  slope = jnp.asarray([0.1, 0.3, 0.05, 0.2])
  positions = jnp.arange(LENGTH)
  distance = (positions[:, None] - positions[None, :]).astype(jnp.float32)
  bias_fn = lambda p, qi, ki: -p[:, None, None] * (qi[:, None, :, None] - ki[:, None, None, :])  # noqa: E731
  normaliser = sigmoid.BiasedSigmoid(-math.log(16))
  segments = SEGMENTS_37 if packed else None
  visible = jnp.asarray(_visible(SEGMENTS_37 if packed else jnp.zeros((2, LENGTH), jnp.int32),
                                 window, sinks))
  d_out = _normal(3, q.shape)

  def vjp(f):
    out, pullback = jax.vjp(f, q, k, v, slope)
    return out, pullback(d_out)

  fast = jax.jit(lambda: vjp(lambda q, k, v, p: core.attend(
      q, k, v, score_mod=core.ScoreMod(bias=bias_fn), score_params=p,
      mask=core.MaskSpec(window=window, sinks=sinks), segments_BxT=segments, backend=backend,
      block_size=8, normaliser=normaliser)))()
  naive = jax.jit(lambda: vjp(lambda q, k, v, p: _naive(
      q, k, v, visible, -math.log(16), -p[None, :, None, None] * distance)))()
  for g, w in zip(jax.tree.leaves(fast), jax.tree.leaves(naive)):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


def test_a_new_pointwise_normaliser_is_one_class():
  """ReLU attention in three lines gets the blockwise kernel and the materialised form."""

  @dataclasses.dataclass(frozen=True)
  class Relu(normalisers.Pointwise):
    name = "relu"

    def activation(self, z):
      return jax.nn.relu(z) / 8.0

  q, k, v = (_normal(i, (1, 20, 2, DIM)) for i in range(3))
  outs = [core.attend(q, k, v, backend=b, block_size=8, normaliser=Relu())
          for b in ("xla", "blockwise")]
  causal = jnp.tril(jnp.ones((20, 20), bool))
  z = jnp.einsum("btnh,bsnh->bnts", q, k) / DIM ** 0.5
  expected = jnp.einsum("bnts,bsnv->btnv", jnp.where(causal, jax.nn.relu(z) / 8.0, 0.0), v)
  for out in outs:
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_sigmoid_attention_is_the_authors_forward_pass_on_rope(qk_norm):
  """The mixer == Attention.forward of the authors' code: q, k LayerNorm-ed per head (qk_norm),
  rotated, sigmoid(q k / sqrt(H) - log n) over the causal keys, through the output projection."""
  config = tiny_model_config(attention="sigmoid", position="rope",
                             sigmoid=dict(bias_length=64, qk_norm=qk_norm))
  mixer = research.build_model(config, rngs=nnx.Rngs(0)).blocks[0].mixer
  x = _normal(5, (2, 19, config.d_model))
  positions_1xT = jnp.arange(19)[None]

  def layer_norm(y):
    centred = y - y.mean(-1, keepdims=True)
    return centred / jnp.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-6)

  q, k = mixer.query(x), mixer.key(x)
  if qk_norm:
    q, k = layer_norm(q), layer_norm(k)  # scale 1, bias 0 at initialisation
  q = mixer.position.queries(q, positions_1xT)
  k = mixer.position.keys(k, positions_1xT)
  visible = jnp.broadcast_to(jnp.tril(jnp.ones((19, 19), bool)), (2, 19, 19))
  expected = mixer.out(_naive(q, k, mixer.value(x), visible, -math.log(64)))
  np.testing.assert_allclose(mixer(x, positions_1xT), expected, atol=2e-5, rtol=2e-5)
  assert mixer.normaliser() == sigmoid.BiasedSigmoid(-math.log(64))


def test_sigmoid_attention_refuses_the_softmax_kernels_and_a_negative_length():
  with pytest.raises(ValueError, match="unknown model.attention_backend 'cudnn'"):
    research.build_model(tiny_model_config(attention="sigmoid", attention_backend="cudnn"),
                         rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="model.sigmoid.bias_length must be >= 0"):
    research.build_model(tiny_model_config(attention="sigmoid", sigmoid=dict(bias_length=-1)),
                         rngs=nnx.Rngs(0))
  q = _normal(0, (1, 8, 2, DIM))
  with pytest.raises(ValueError, match="cannot run sigmoid attention"):
    core.attend(q, q, q, backend="cudnn", normaliser=sigmoid.BiasedSigmoid())
