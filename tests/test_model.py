"""Model-level identities, cache accounting, hybrids and build-time errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention
from research.model import nn
from tests.conftest import tiny_model_config


def _forward(config, state=None):
  model = research.build_model(config, rngs=nnx.Rngs(0))
  if state is not None:
    nnx.update(model, state)
  tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, config.vocab_size)
  return jax.jit(lambda m, t: m(t))(model, tokens), model


@pytest.mark.parametrize("name,kv_heads", [("mha", 4), ("gqa", 2), ("mqa", 1)])
def test_mha_gqa_and_mqa_share_each_key_value_head_among_a_group_of_query_heads(name, kv_heads):
  """o_n = softmax(q_n k_g(n)^T / sqrt(H)) v_g(n), g(n) = n // (N / K) (arXiv:2305.13245): the
  mixer's output against that formula from its own projections, N = 4 query heads."""
  mixer = research.build_model(tiny_model_config(attention=name, position="none"),
                               rngs=nnx.Rngs(0)).blocks[0].mixer
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 9, 32)))
  project = lambda layer: np.einsum("bld,dnh->blnh", x, np.asarray(layer.kernel[...]))  # noqa: E731
  q, k, v = project(mixer.query), project(mixer.key), project(mixer.value)
  assert k.shape[2] == v.shape[2] == kv_heads
  k, v = (np.repeat(y, 4 // kv_heads, axis=2) for y in (k, v))  # query head n reads n // group
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(8)
  logits = np.where(np.tril(np.ones((9, 9), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  expected = mixer.out(jnp.asarray(np.einsum("bnts,bsnh->btnh", probs, v)))
  np.testing.assert_allclose(mixer(jnp.asarray(x), jnp.arange(9)[None]), expected, atol=1e-5)


@pytest.mark.parametrize("name,kv_heads", [("mha", 8), ("gqa", 2), ("mqa", 1)])
def test_kv_cache_bytes_formula(name, kv_heads):
  """2 * layers * kv_heads * head_dim * bytes_per_value * tokens * batch (arXiv:2305.13245)."""
  config = tiny_model_config(attention=name, num_heads=8, num_kv_heads=2, num_layers=3,
                             compute_dtype="bfloat16")
  model = nnx.eval_shape(lambda: research.build_model(config, rngs=nnx.Rngs(0)))
  head_dim, batch, tokens = 32 // 8, 3, 1000
  assert model.cache_bytes(batch, tokens) == 2 * 3 * kv_heads * head_dim * 2 * tokens * batch


@pytest.mark.parametrize("name", ["linear", "mamba", "mamba2"])
def test_recurrent_state_does_not_grow_with_context(name):
  model = nnx.eval_shape(lambda: research.build_model(
      tiny_model_config(attention=name, position="none"), rngs=nnx.Rngs(0)))
  assert model.cache_bytes(2, 64) == model.cache_bytes(2, 65536) > 0


def test_hybrid_layer_pattern_decodes_like_its_forward():
  """Jamba-style: mamba, mamba, then attention with RoPE (mamba layers run without it), and a
  mixture of experts in the middle layer."""
  config = tiny_model_config(layer_pattern=("mamba", "mamba", "gqa"), num_layers=3,
                             position="rope", feed_forward_pattern=("mlp", "moe", "mlp"))
  model = research.build_model(config, rngs=nnx.Rngs(0))
  assert [type(b.mixer).__name__ for b in model.blocks] == ["Mamba", "Mamba", "GQA"]
  assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MixtureOfExperts", "MLP"]
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, config.vocab_size)
  full = jax.jit(lambda m, t: m(t))(model, tokens)
  decode = jax.jit(lambda m, t, c: m.decode(t, c))
  first, cache = decode(model, tokens[:, :5], model.init_cache(2, 11))
  steps = [first]
  for t in range(5, 11):
    logits, cache = decode(model, tokens[:, t:t + 1], cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=2e-4, rtol=2e-4)


def test_parameter_count_with_and_without_embeddings():
  model = research.build_model(tiny_model_config(attention="mha"), rngs=nnx.Rngs(0))
  d, v, f = 32, 61, 64
  per_layer = 4 * d * d + 2 * d * f + 2 * d  # q, k, v, out; MLP; two norm scales
  assert research.count_params(model) == 2 * v * d + per_layer + d
  assert research.count_params(model, embeddings=False) == v * d + per_layer + d



@pytest.mark.parametrize("position", ["fire", "learned", "t5"])
def test_every_parameter_declares_logical_axes_and_weight_decay(position):
  model = research.build_model(tiny_model_config(attention="mha", position=position),
                               rngs=nnx.Rngs(0))
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = variable.get_metadata().get("logical_axes")
    assert axes is not None and len(axes) == variable[...].ndim, path
    assert variable.get_metadata().get("weight_decay") in (True, False), path


def test_per_layer_schemes_are_built_per_layer_and_shared_ones_once():
  fire = research.build_model(tiny_model_config(position="fire", num_layers=2), rngs=nnx.Rngs(0))
  assert fire.blocks[0].mixer.position is not fire.blocks[1].mixer.position
  t5 = research.build_model(tiny_model_config(position="t5", num_layers=2), rngs=nnx.Rngs(0))
  assert t5.blocks[0].mixer.position is t5.blocks[1].mixer.position is t5.position
  # FLOPs count matmul parameters only: position parameters are not per-token matmuls.
  plain = research.build_model(tiny_model_config(position="none", num_layers=2), rngs=nnx.Rngs(0))
  assert research.count_params(fire, embeddings=False) == research.count_params(plain, embeddings=False)


@pytest.mark.parametrize("overrides,message", [
    (dict(attention="flash"), "unknown attention type 'flash'.*valid: .*gqa, .*linear, .*mamba"),
    (dict(position="t6"), "unknown position scheme 't6'.*valid: alibi, cope, fire, kerple, learned, none, prope, rope, sinusoidal, ssmax, t5, xpos"),
    (dict(attention="gqa", num_kv_heads=3), r"num_kv_heads=3 does not divide num_heads=4; valid: \[1, 2, 4\]"),
    (dict(d_model=30), "d_model=30 is not divisible by num_heads=4"),
    (dict(d_model=12, position="rope"), "rotary positions need an even number of rotary dims.*got 3"),
    (dict(attention="linear", position="alibi"), "'linear' does not support position 'alibi' \\(it needs the bias hook.*compatible positions: none, sinusoidal, rope, learned, xpos, prope"),
    (dict(attention="linear", position="fire"), "'linear' does not support position 'fire'"),
    (dict(attention="mamba", position="rope"), "'mamba' does not support position 'rope'.*compatible positions: none, sinusoidal, learned"),
    (dict(attention_backend="flash"), "unknown model.attention_backend 'flash'; valid: auto, xla, blockwise, cudnn"),
    (dict(attention="mhaa"), r"unknown attention type 'mhaa' in model.attention \(did you mean 'mha'\?\); valid: "),
    (dict(attention_backend="cudnn"), "'cudnn' needs a GPU, but JAX runs on 'cpu'.*use 'xla' or 'blockwise'"),
    (dict(attention="fox", position="none", attention_backend="cudnn"), "'fox' does not run on attention_backend 'cudnn'.*use 'blockwise'"),
    (dict(attention="fox", position="rope"), "'fox' does not support position 'rope'.*compatible positions: none, sinusoidal, learned"),
    (dict(layer_pattern=("mamba", "flash"), num_layers=2), "unknown attention type 'flash' in model.layer_pattern"),
    (dict(layer_pattern=("mamba", "mha"), num_layers=3), "num_layers=3 must be a positive multiple of len"),
    (dict(compute_dtype="fp8"), "unknown model.compute_dtype 'fp8'; valid: float32, bfloat16"),
    (dict(rope=dict(scaling="linear")), "unknown rotary scaling 'linear' \\(the scheme's scaling field, e.g. model.rope.scaling\\); valid: none, pi, static_ntk, dynamic_ntk, yarn"),
    (dict(mlp_ratio=-1), "model.mlp_ratio must be >= 0"),
    (dict(feed_forward="dense"), "unknown feed-forward 'dense' in model.feed_forward; valid: mlp, moe"),
    (dict(feed_forward_pattern=("mlp", "geglu"), num_layers=2), "unknown feed-forward 'geglu' in model.feed_forward_pattern"),
    (dict(feed_forward_pattern=("mlp", "moe"), num_layers=3), r"num_layers=3 must be a positive multiple of len\(model.feed_forward_pattern\)=2"),
    (dict(feed_forward="moe", moe=dict(num_experts=1)), "model.moe.num_experts=1 is below model.moe.top_k=2; valid: an integer >= 2"),
    (dict(feed_forward="moe", moe=dict(top_k=0)), "model.moe.top_k=0 must be an integer >= 1"),
    (dict(feed_forward="moe", moe=dict(capacity=1.25)), "unknown field.*model.moe.capacity.*valid: model.moe.dispatch, model.moe.load_balancing_weight"),
    (dict(feed_forward="moe", mlp_ratio=0), "model.mlp_ratio=0 drops every feed-forward.*use model.mlp_ratio >= 1"),
    (dict(randomize_max_length=-2), "model.randomize_max_length must be >= 0"),
    (dict(softmax=dict(block_size=0)), "model.softmax.block_size must be >= 1"),
    (dict(attention="linear", position="none", linear=dict(chunk_size=0)), "model.linear.chunk_size must be >= 1"),
    (dict(attention="mamba", position="none", mamba=dict(scan="fast")), "unknown model.mamba.scan 'fast'"),
    (dict(attention="mamba2", position="none", mamba2=dict(head_dim=24)), r"model.mamba2.head_dim=24 does not divide the inner width expand \* d_model = 64; valid head_dim: \[1, 2, 4, 8, 16, 32, 64\]"),
    (dict(attention="mamba2", position="none", mamba2=dict(chunk_size=0)), "model.mamba2.chunk_size must be >= 1"),
    (dict(attention="gated_deltanet", position="none", gated_deltanet=dict(expand_v=0.3)), r"model.gated_deltanet.expand_v=0.3 gives a value head dim of head_dim \* expand_v = 6 \* 0.3"),
])
def test_bad_model_config_fails_at_build_time(overrides, message):
  with pytest.raises(ValueError, match=message):
    research.build_model(tiny_model_config(**overrides), rngs=nnx.Rngs(0))


def test_auto_backend_picks_by_length_scores_and_device():
  from research.model.attention.core import AUTO_BLOCKWISE_FROM, AUTO_BLOCKWISE_SCORES_BYTES
  from research.model.attention.core import auto_backend
  mha, fox = attention.MHA.backends, attention.ForgettingAttention.backends
  assert auto_backend(AUTO_BLOCKWISE_FROM - 1, mha, jnp.float32, "cpu") == "xla"
  assert auto_backend(AUTO_BLOCKWISE_FROM, mha, jnp.float32, "cpu") == "blockwise"
  # Shorter, but the batch's float32 scores outgrow the cache: 64 x 512^2 x 4 bytes = 64 MiB.
  assert AUTO_BLOCKWISE_SCORES_BYTES <= 64 * 512 * 512 * 4
  assert auto_backend(512, mha, jnp.float32, "cpu", batch_heads=64) == "blockwise"
  assert auto_backend(512, mha, jnp.float32, "cpu", batch_heads=1) == "xla"
  assert auto_backend(512, mha, jnp.float32, "gpu", batch_heads=64) == "xla"
  assert auto_backend(64, mha, jnp.bfloat16, "gpu") == "cudnn"
  assert auto_backend(64, mha, jnp.float32, "gpu") == "xla"  # cuDNN needs half precision
  assert auto_backend(AUTO_BLOCKWISE_FROM, fox, jnp.bfloat16, "gpu") == "xla"  # no cudnn
  assert auto_backend(64, mha, jnp.float32, "tpu") == "splash"  # the TPU's kernel
  # FoX's gates are a score modification, which Splash refuses: the CPU's rule, for memory.
  assert auto_backend(AUTO_BLOCKWISE_FROM, fox, jnp.float32, "tpu") == "blockwise"
  assert auto_backend(64, fox, jnp.float32, "tpu") == "xla"
  # Long enough for blockwise, not a multiple of its block: the same logits as xla.
  length, config = AUTO_BLOCKWISE_FROM + 3, dict(d_model=8, num_heads=2, num_layers=1)
  tokens = jax.random.randint(jax.random.key(0), (1, length), 0, 32)
  models = [research.build_model(tiny_model_config(attention_backend=backend, **config),
                                 rngs=nnx.Rngs(0)) for backend in ("auto", "xla")]
  assert "while" in str(jax.make_jaxpr(lambda t: models[0](t))(tokens))  # blockwise's loops
  auto, xla = (jax.jit(lambda m, t: m(t))(model, tokens) for model in models)
  np.testing.assert_allclose(auto, xla, atol=2e-5, rtol=2e-5)


def test_hybrid_of_only_attention_still_rejects_incompatible_positions():
  with pytest.raises(ValueError, match="'linear' does not support position 'alibi'"):
    research.build_model(tiny_model_config(layer_pattern=("linear", "mha"), num_layers=2,
                                           position="alibi"),
                         rngs=nnx.Rngs(0))


def test_registry_lists_required_names():
  assert {"mha", "mqa", "gqa", "linear", "mamba"} <= set(attention.REGISTRY)


@pytest.mark.parametrize("name", ["gqa", "linear", "mamba", "mamba2"])
def test_bfloat16_compute_keeps_float32_parameters_and_logits(name):
  config = tiny_model_config(attention=name, position="none", compute_dtype="bfloat16")
  logits, model = _forward(config)
  assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
  full, _ = _forward(tiny_model_config(attention=name, position="none"), nnx.state(model))
  # bf16 rounding only: at most 0.024 off on logits of RMS ~1 (2026-12-04), against fp32.
  np.testing.assert_allclose(logits, full, atol=0.05, rtol=0)


@pytest.mark.parametrize("bias", ["none", "qkv"])
def test_mha_to_gqa_mean_pools_key_and_value_heads(bias):
  from research.model.attention.convert import mha_to_gqa

  softmax = dict(projection_bias=bias)
  mha_config = tiny_model_config(attention="mha", position="rope", softmax=softmax)
  mha_logits, mha = _forward(mha_config)
  same, _ = _forward(tiny_model_config(attention="gqa", position="rope", num_kv_heads=4,
                                       softmax=softmax), mha_to_gqa(nnx.state(mha), 4, 4))
  np.testing.assert_allclose(same, mha_logits, atol=1e-6)
  state = nnx.state(mha)
  keys = iter(jax.random.split(jax.random.key(1), 8))
  for path, variable in nnx.to_flat_state(state):
    if path[-2] in ("key", "value") and path[-1] == "bias":  # zeros at init: drawn, so that
      variable.value = jax.random.normal(next(keys), variable.value.shape)  # pooling them is seen
  # Heads that differ pool to the mean of their group: kernels and biases.
  pooled = dict(nnx.to_flat_state(mha_to_gqa(state, 4, 2)))
  for path, variable in nnx.to_flat_state(state):
    if path[-2] in ("key", "value"):
      heads = np.moveaxis(np.asarray(variable.value), -2, 0)
      assert not np.allclose(heads[0], heads[1])
      np.testing.assert_allclose(np.moveaxis(np.asarray(pooled[path].value), -2, 0),
                                 [(heads[0] + heads[1]) / 2, (heads[2] + heads[3]) / 2],
                                 rtol=1e-6, atol=1e-7)
  # Heads that are already equal within each group pool to themselves: the logits stay.
  for path, variable in nnx.to_flat_state(state):
    if path[-2] in ("key", "value"):
      heads_axis = variable.value.ndim - 2
      variable.value = jnp.repeat(jnp.take(variable.value, jnp.arange(0, 4, 2), axis=heads_axis),
                                  2, axis=heads_axis)
  twin_logits, _ = _forward(mha_config, state)
  pooled = mha_to_gqa(state, 4, 2)
  shapes = [v.value.shape for p, v in nnx.to_flat_state(pooled) if p[-2] == "key"]
  assert sorted(shapes) == sorted([(32, 2, 8)] + [(2, 8)] * (bias != "none"))
  gqa_logits, _ = _forward(tiny_model_config(attention="gqa", position="rope", num_kv_heads=2,
                                             softmax=softmax), pooled)
  np.testing.assert_allclose(gqa_logits, twin_logits, atol=1e-5)


def test_decoding_past_the_cache_gives_nan_not_wrong_logits():
  model = research.build_model(tiny_model_config(attention="mha"), rngs=nnx.Rngs(0))
  decode = jax.jit(lambda m, t, c: m.decode(t, c))
  tokens = jnp.zeros((1, 1), jnp.int32)
  cache = model.init_cache(1, 2)
  for _ in range(2):
    logits, cache = decode(model, tokens, cache)
    assert bool(jnp.isfinite(logits).all())
  logits, _ = decode(model, tokens, cache)
  assert bool(jnp.isnan(logits).all())


@pytest.mark.parametrize("equation, x_shape, kernel_shape", [
    ("BLNH,NHD->BLD", (2, 3, 4, 5), (4, 5, 6)),    # contracted heads and head_dim merged
    ("BLD,DNH->BLNH", (2, 3, 6), (6, 4, 5)),        # one contracted axis, batch and length merged
    ("BLHN,NHD->BLD", (2, 3, 5, 4), (4, 5, 6)),    # contracted axes in different orders: as is
    ("BLNH,NH->BLN", (2, 3, 4, 5), (4, 5)),         # a kept axis also in the kernel
    ("BD,DF->BF", (3, 6), (6, 7)),                  # nothing to merge
])
def test_token_major_einsum_equals_einsum(equation, x_shape, kernel_shape):
  x = jax.random.normal(jax.random.key(0), x_shape)
  kernel = jax.random.normal(jax.random.key(1), kernel_shape)
  np.testing.assert_allclose(nn.token_major_einsum(equation, x, kernel),
                             jnp.einsum(equation, x, kernel), rtol=1e-5, atol=1e-5)
