"""The `splash` attention backend (research.model.attention.splash_backend: the TPU's Splash
attention kernel) against `xla`, in Pallas' interpret mode on the CPU: forward and backward on
every mask kind it accepts (causal, a sliding window, a window with sinks, a block-sparse
pattern, packed documents with and without a window), grouped heads, values wider than keys, a
length its blocks do not divide; under a mesh of 8 devices (shard_map); and what it refuses, by
name, before any work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import sharding
from research.model import transformer as model_lib
from research.model.attention import core
from research.model.attention import masks
from research.model.attention import reference
from tests.conftest import tiny_model_config

LENGTH = 150  # padded to 256: two of the kernel's 128-token blocks, the second part padding


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _every_third_block(q, k):
  """A block-sparse pattern: the query's own 16-token block, and every third block before it."""
  return ((q // 16) == (k // 16)) | ((k // 16) % 3 == 0)


SEGMENTS = np.array([[0] * 40 + [1] * 70 + [2] * 40, [0] * LENGTH], np.int32)
CASES = {
    "causal": (masks.MaskSpec(), None),
    "window": (masks.MaskSpec(window=33), None),
    "window and sinks": (masks.MaskSpec(window=33, sinks=4), None),
    "block-sparse": (masks.MaskSpec(keep=_every_third_block), None),
    "documents": (masks.MaskSpec(), SEGMENTS),
    "documents and a window": (masks.MaskSpec(window=33), SEGMENTS),
}


def _vjp(backend, q, k, v, mask, segments):
  return jax.jit(lambda q, k, v: jax.vjp(
      lambda q, k, v: core.attend(q, k, v, backend=backend, mask=mask, segments_BxT=segments),
      q, k, v))(q, k, v)


@pytest.mark.parametrize("case", CASES)
def test_splash_equals_xla_forward_and_backward(case):
  mask, segments = CASES[case]
  # GQA: 4 query heads on 2 key/value heads; values wider than keys (12 > 8).
  q, k = _normal(0, (2, LENGTH, 4, 8)), _normal(1, (2, LENGTH, 2, 8))
  v = _normal(2, (2, LENGTH, 2, 12))
  d_out = _normal(3, (2, LENGTH, 4, 12))
  (splash, splash_pullback), (xla, xla_pullback) = (
      _vjp(backend, q, k, v, mask, segments) for backend in ("splash", "xla"))
  visible = mask.allowed(jnp.arange(LENGTH), jnp.arange(LENGTH),
                         None if segments is None else jnp.asarray(segments),
                         None if segments is None else jnp.asarray(segments))
  naive = reference.softmax_attention(q, k, v, mask_BxTxS=visible[:, 0])
  np.testing.assert_allclose(splash, naive, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(splash, xla, atol=2e-5, rtol=2e-5)
  for got, want in zip(splash_pullback(d_out), xla_pullback(d_out), strict=True):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_splash_under_a_mesh_of_8_devices_equals_one_device():
  """Batch over data x fsdp and heads over tensor, each device's part through shard_map."""
  q, k, v = (_normal(seed, (4, LENGTH, heads, 8)) for seed, heads in ((0, 4), (1, 2), (2, 2)))
  mask = masks.MaskSpec(window=33)
  single = core.attend(q, k, v, backend="splash", mask=mask)
  mesh = sharding.make_mesh((2, 2, 2))
  with jax.set_mesh(mesh):
    placed = [jax.device_put(x, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor"))) for x in (q, k, v)]
    sharded = jax.jit(lambda q, k, v: core.attend(q, k, v, backend="splash", mask=mask))(*placed)
  np.testing.assert_allclose(sharded, single, atol=2e-6, rtol=2e-6)


def test_a_model_on_splash_gives_the_logits_of_xla():
  """GQA with RoPE (a rotation before the core: no score modification) and a window."""
  tokens = jax.random.randint(jax.random.key(0), (2, 19), 0, 61)
  logits = {}
  for backend in ("splash", "xla"):
    config = tiny_model_config(attention="gqa", position="rope", attention_backend=backend,
                               softmax=dict(window=8))
    model_lib.validate(config)
    logits[backend] = research.build_model(config, rngs=nnx.Rngs(0))(tokens)
  np.testing.assert_allclose(logits["splash"], logits["xla"], atol=2e-5, rtol=2e-5)


def test_auto_picks_splash_on_a_tpu_where_it_can_run_the_call():
  with core.compiling_for("tpu"):
    assert core.auto_backend(2048) == "splash"
    assert core.auto_backend(2048, mask=masks.MaskSpec(window=8, sinks=2)) == "splash"
    bias = core.ScoreMod(bias=lambda p, qi, ki: None)
    assert core.auto_backend(2048, score_mod=bias) == "blockwise"  # refused: a bias scheme
    assert core.auto_backend(2048, mask=masks.MaskSpec(window=8, sinks=2),
                             segments=True) == "blockwise"
  assert core.auto_backend(2048) == "blockwise"  # on this CPU


@pytest.mark.parametrize("settings,phrase", [
    (dict(position="alibi"), "'splash' takes no score modification"),
    (dict(softmax=dict(window=8, sinks=2, sink_positions="cache")),
     "the sink queries of StreamingLLM"),
    (dict(attention="fox", position="none"), "unknown model.attention_backend 'splash'"),
])
def test_what_the_kernel_cannot_express_is_refused_when_the_model_is_validated(settings, phrase):
  config = tiny_model_config(attention_backend="splash", **settings)
  with pytest.raises(ValueError, match=phrase):
    model_lib.validate(config)


def test_the_core_refuses_sinks_in_packed_documents_and_a_bias_by_name():
  q = _normal(0, (1, 8, 2, 4))
  with pytest.raises(ValueError, match="cannot place sinks in packed documents"):
    core.attend(q, q, q, backend="splash", mask=masks.MaskSpec(window=4, sinks=1),
                segments_BxT=jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="'splash' takes no score modification"):
    core.attend(q, q, q, backend="splash",
                score_mod=core.ScoreMod(bias=lambda p, qi, ki: jnp.zeros((1, 1, 8, 8))))


def test_half_precision_under_a_float32_matmul_precision_is_refused_by_name():
  """The suite runs with jax_default_matmul_precision='highest' (tests/conftest.py): Mosaic
  cannot give bfloat16 blocks float32 passes, so splash says so instead of failing to compile."""
  with jax.default_matmul_precision("highest"):
    reasons = core.refusals("splash", dtype=jnp.bfloat16, platform="tpu")
    assert any("cannot take the float32 matmul passes" in reason for reason in reasons), reasons
    assert not core.refusals("splash", dtype=jnp.float32, platform="tpu")
  with jax.default_matmul_precision("default"):
    assert not core.refusals("splash", dtype=jnp.bfloat16, platform="tpu")
