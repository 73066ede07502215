"""Differential attention (research/model/attention/diff.py) against a naive float32 port of the
authors' forward, microsoft/unilm@768a3c8, Diff-Transformer/multihead_diffattn.py
(MultiheadDiffAttn.forward, repeat_kv, lambda_init_fn): the projections viewed as 2N query and
key heads of d and N value heads of 2d, materialised softmax maps with an explicit mask (their
attn_mask: causal, and here documents and a window), the pairs' difference with lambda, subln
(RMSNorm over 2d, eps 1e-5, a gain) times (1 - lambda_init), the output projection; outputs and
gradients w.r.t. the input and every parameter. Also: lambda_init per layer, the position
geometry (2N heads of d), the differential map and interventions on it, and decoding through
the rolling cache (the conformance suite decodes without a window)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention, positions
from research.model import transformer as model_lib
from research.model.attention import diff, masks
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _normal, _visible


def _build(layer_index=0, **overrides):
  """The diff mixer of the tiny config (d_model 32, 4 heads: 8 query/key heads of 4, 4 value
  heads of 8), its position scheme built for the mixer's own geometry."""
  config = tiny_model_config(attention="diff", **overrides)
  settings = attention.REGISTRY.settings("diff", config)
  geometry = diff.DifferentialAttention.position_geometry(settings, config, layer_index)
  return diff.DifferentialAttention(settings, config,
                                    positions.build(config, geometry, rngs=nnx.Rngs(1)),
                                    rngs=nnx.Rngs(0), layer_index=layer_index)


def repeat_kv(x_BxKxSxH, n_rep):
  """Their repeat_kv: each key/value head n_rep times in a row ([B, K n_rep, S, H])."""
  return jnp.repeat(x_BxKxSxH, n_rep, axis=1)


def naive_diff_attention(mixer, x_BxLxD, positions_BxL, visible_BxLxL, depth):
  """MultiheadDiffAttn.forward in float32 with the mixer's parameters; the rotary embedding is
  the mixer's position scheme (theirs is passed in as rel_pos), lambda_init from the formula."""
  b, length, d_model = x_BxLxD.shape
  num_heads, head_dim = mixer.num_heads, mixer.head_dim
  num_kv_heads = num_heads
  n_rep = num_heads // num_kv_heads
  scaling = head_dim ** -0.5
  w_q = mixer.query.kernel[...].reshape(d_model, -1)
  w_k = mixer.key.kernel[...].reshape(d_model, -1)
  w_v = mixer.value.kernel[...].reshape(d_model, -1)
  w_o = mixer.out.kernel[...].reshape(-1, d_model)
  q = (x_BxLxD @ w_q).reshape(b, length, 2 * num_heads, head_dim)
  k = (x_BxLxD @ w_k).reshape(b, length, 2 * num_kv_heads, head_dim)
  v = (x_BxLxD @ w_v).reshape(b, length, num_kv_heads, 2 * head_dim)
  q = mixer.position.queries(q, positions_BxL)
  k = mixer.position.keys(k, positions_BxL)
  q = q.transpose(0, 2, 1, 3)
  k = repeat_kv(k.transpose(0, 2, 1, 3), n_rep)
  v = repeat_kv(v.transpose(0, 2, 1, 3), n_rep)
  q = q * scaling
  attn_weights = q @ k.swapaxes(-1, -2)
  attn_mask = jnp.where(visible_BxLxL, 0.0, -jnp.inf)[:, None]
  attn_weights = jnp.nan_to_num(attn_weights) + attn_mask
  attn_weights = jax.nn.softmax(attn_weights, axis=-1)
  lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
  lambda_1 = jnp.exp(jnp.sum(mixer.lambda_q1[...] * mixer.lambda_k1[...], axis=-1))
  lambda_2 = jnp.exp(jnp.sum(mixer.lambda_q2[...] * mixer.lambda_k2[...], axis=-1))
  lambda_full = lambda_1 - lambda_2 + lambda_init
  attn_weights = attn_weights.reshape(b, num_heads, 2, length, length)
  attn_weights = attn_weights[:, :, 0] - lambda_full * attn_weights[:, :, 1]
  attn = attn_weights @ v
  attn = attn * jax.lax.rsqrt(jnp.mean(attn ** 2, axis=-1, keepdims=True) + 1e-5)
  attn = attn * mixer.subln_scale[...]
  attn = attn * (1 - lambda_init)
  attn = attn.transpose(0, 2, 1, 3).reshape(b, length, num_heads * 2 * head_dim)
  return attn @ w_o, attn_weights


def _outputs_and_gradients(forward, mixer, x, cotangent):
  graphdef, params = nnx.split(mixer)
  out, pullback = jax.vjp(lambda p, x: forward(nnx.merge(graphdef, p), x), params, x)
  return out, pullback(cotangent)


@pytest.mark.parametrize("backend,window,sinks,packed,depth", [
    ("xla", 0, 0, False, 0),
    ("blockwise", 6, 2, True, 3)])
def test_mixer_equals_the_authors_forward_with_gradients(backend, window, sinks, packed, depth):
  """37 tokens (blocks of 8); the second case with packed documents (positions restarting), a
  window of 6 and 2 sinks at their own positions (their attn_mask), at layer 3. Gradients w.r.t.
  x and every parameter: the projections, the four lambda vectors and subln's gain."""
  mixer = _build(depth, position="rope", attention_backend=backend,
                 softmax=dict(window=window, sinks=sinks, sink_positions="original"))
  length = 37
  segments = SEGMENTS_37 if packed else jnp.zeros((2, length), jnp.int32)
  positions_BxL = masks.positions_in_documents(segments)
  visible = jnp.asarray(_visible(segments, window, sinks))
  x, cotangent = _normal(0, (2, length, 32)), _normal(9, (2, length, 32))
  got = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: m(x, positions_BxL, segments if packed else None), mixer, x, cotangent))(x)
  want = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: naive_diff_attention(m, x, positions_BxL, visible, depth)[0], mixer, x,
      cotangent))(x)
  (_, (param_grads, _)) = got
  names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(param_grads)}
  assert {"lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln_scale"} <= names
  assert {"query/kernel", "key/kernel", "value/kernel", "out/kernel"} <= names
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  lambda_grads = [float(jnp.abs(param_grads[name][...]).max())
                  for name in ("lambda_q1", "lambda_k2")]
  assert min(lambda_grads) > 1e-4  # lambda reaches the output


def test_differential_map_and_edited_weights_reproduce_the_forward():
  """attention_weights is the naive A1 - lambda A2 (rows summing to 1 - lambda), and
  with_edited_weights with the identity edit is __call__; another edit changes the output."""
  mixer = _build(position="rope")
  x, positions_1xL = _normal(1, (2, 12, 32)), jnp.arange(12)[None]
  visible = jnp.tril(jnp.ones((12, 12), bool))[None]

  @jax.jit
  def run(x):
    weights = mixer.attention_weights(x, positions_1xL)
    same = mixer.with_edited_weights(x, positions_1xL, None, lambda w, m: w)
    uniform = mixer.with_edited_weights(x, positions_1xL, None,
                                        lambda w, m: jnp.broadcast_to(m / m.sum(-1, keepdims=True),
                                                                       w.shape))
    return (weights, same, uniform, mixer(x, positions_1xL),
            naive_diff_attention(mixer, x, positions_1xL, visible, 0)[1], mixer.lambda_full())

  weights, same, uniform, out, naive_map, lambda_full = run(x)
  assert weights.shape == (2, 4, 12, 12)
  np.testing.assert_allclose(weights, naive_map, atol=1e-5)
  np.testing.assert_allclose(weights.sum(-1), 1 - lambda_full, atol=1e-5)
  np.testing.assert_allclose(same, out, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(uniform - out).max()) > 1e-2


def test_lambda_init_per_layer_and_the_lambda_vectors_initialisation():
  for depth in (0, 1, 5):
    mixer = _build(depth, position="none")
    assert mixer.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * depth), abs=1e-12)
  assert _build(0, position="none").lambda_init == pytest.approx(0.2)
  assert _build(5, position="none").lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.5))
  wide = _build(position="none", d_model=512, num_heads=2)  # d = 128: four vectors of 128
  vectors = np.concatenate([np.asarray(getattr(wide, name)[...]) for name in
                            ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")])
  assert vectors.shape == (512,) and 0.085 < vectors.std() < 0.115 and abs(vectors.mean()) < 0.02
  assert len({float(getattr(wide, name)[0]) for name in ("lambda_q1", "lambda_k1")}) == 2
  np.testing.assert_array_equal(wide.subln_scale[...], np.ones(256))


def test_subln_is_an_rms_norm_over_2d_with_eps_1e_5_a_gain_and_the_constant_scale():
  """Small head outputs, where the eps dominates the mean square."""
  mixer = _build(4, position="none")
  mixer.subln_scale[...] = 1.0 + _normal(2, (8,), 0.5)
  o = _normal(3, (2, 3, 4, 8), 3e-3)
  want = (o / jnp.sqrt(jnp.mean(o ** 2, axis=-1, keepdims=True) + 1e-5) * mixer.subln_scale[...]
          * (1 - (0.8 - 0.6 * math.exp(-1.2))))
  np.testing.assert_allclose(mixer.head_outputs(o), want, rtol=1e-5, atol=1e-7)


def test_rotary_geometry_is_2n_heads_of_d():
  """RoPE rotates the d-wide query/key heads: a model with d_model 24 and 4 heads (d = 3, odd) is
  refused for rope though mha takes it (d_model / num_heads = 6), and with d_model 32 it builds
  and runs the scheme on 8 heads of 4 (with the model's usual geometry, heads of 8, the rotation
  would not fit the heads)."""
  config = tiny_model_config(attention="diff", position="rope")
  settings = attention.REGISTRY.settings("diff", config)
  assert diff.DifferentialAttention.position_geometry(settings, config, 2) == positions.Geometry(
      32, 8, 4, 4, 2)
  model = research.build_model(config, rngs=nnx.Rngs(0))
  assert model.blocks[0].mixer.position.rotary_dims == 4
  graphdef, state = nnx.split(model)
  logits = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))(
      state, jax.random.randint(jax.random.key(0), (1, 9), 0, 61))
  assert logits.shape == (1, 9, 61) and bool(jnp.isfinite(logits).all())
  model_lib.validate(tiny_model_config(attention="mha", position="rope", d_model=24))
  with pytest.raises(ValueError, match="even number of rotary dims"):
    model_lib.validate(tiny_model_config(attention="diff", position="rope", d_model=24))


def test_settings_the_mixer_refuses_name_what_is_valid():
  valid = r"2 \* num_heads = 8; valid num_heads: \[1, 2, 3, 6, 9, 18\]"
  with pytest.raises(ValueError, match=valid):
    model_lib.validate(tiny_model_config(attention="diff", position="none", d_model=36))
  config = tiny_model_config(attention="diff", attention_backend="cudnn")
  with pytest.raises(ValueError, match="'diff' does not run on attention_backend 'cudnn'"):
    diff.DifferentialAttention.validate(attention.REGISTRY.settings("diff", config), config)


def test_cache_holds_the_keys_and_values_once():
  """2N keys of d and N values of 2d per token: 2 d_model values, as the bytes per token say."""
  mixer = _build(position="none")
  shapes = jax.eval_shape(lambda: mixer.init_cache(3, 10))
  assert {name: x.shape for name, x in shapes.items()} == {"key": (12, 10, 8),
                                                            "value": (12, 10, 8)}
  config = tiny_model_config(attention="diff")
  per_token = diff.DifferentialAttention.cache_bytes_per_token(config)
  assert per_token == (8 * 4 + 4 * 8) * 4
  assert mixer.cache_bytes(3, 10) == per_token * 3 * 10


def test_paired_queries_give_each_query_its_own_key():
  q, k = _normal(0, (1, 2, 6, 4)), _normal(1, (1, 3, 6, 4))
  logits = jnp.einsum("btnh,bsnh->bnts", diff.paired_queries(q),
                      jnp.repeat(diff.paired_keys(k), 2, axis=2))
  np.testing.assert_allclose(logits, jnp.einsum("btnh,bsnh->bnts", q, k), atol=1e-6)


def test_decode_with_a_rolling_cache_window_and_sinks_equals_the_full_forward():
  """Window 5 and 2 sinks at their cache positions (StreamingLLM's, rope): a prompt of 7, a
  chunk of 6 that wraps the rolling cache, then one token at a time, against the forward."""
  config = tiny_model_config(attention="diff", position="rope", attention_backend="blockwise",
                             softmax=dict(window=5, sinks=2))
  graphdef, state = nnx.split(research.build_model(config, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 61)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  decode = jax.jit(lambda state, tokens, cache: nnx.merge(graphdef, state).decode(tokens, cache))
  cache = nnx.merge(graphdef, state).init_cache(2, 16)
  assert cache["layers"][0]["mixer"]["key"].shape == (2 * 4, 7, 8)  # sinks + window slots
  steps = []
  for start, end in [(0, 7), (7, 13)] + [(t, t + 1) for t in range(13, 16)]:
    logits, cache = decode(state, tokens[:, start:end], cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), forward(state, tokens), atol=2e-4,
                             rtol=2e-4)
