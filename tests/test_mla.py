"""Multi-head latent attention (research/model/attention/mla.py) against a naive float32 port of
DeepseekV2Attention.forward (huggingface/transformers@03eac6f, modeling_deepseek_v2.py: their
[nope, pe] head layout, one kv_b_proj, explicit per-head keys and values, the materialised
softmax), outputs and gradients w.r.t. the input and every parameter, with the lab's position
scheme on both sides; the absorbed decode (deepseek-ai/DeepSeek-V3@1ea5a1a, inference/model.py,
attn_impl "absorb") against the expanded forward; the cache's size and contents; the settings.
The conformance suite covers causality, model-level decode, packed documents and sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model import attention, nn, positions
from research.model import transformer as model_lib
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _normal

# Every width different, so that a swapped split or kernel fails: d_n 6, d_r 4, d_v 10, R 12.
DIMS = dict(kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10, block_size=8)


def _mla(position="rope", backend="xla", **settings):
  """The mla mixer of the tiny config (d_model 32, 4 heads) with its scheme built for it, and
  its RMSNorm gains moved off 1 so that their use is tested."""
  config = tiny_model_config(attention="mla", position=position, attention_backend=backend,
                             mla={**DIMS, **settings})
  cls = attention.REGISTRY["mla"]
  settings = attention.REGISTRY.settings("mla", config)
  scheme = positions.build(config, cls.position_geometry(settings, config), rngs=nnx.Rngs(1))
  mixer = cls(settings, config, scheme, rngs=nnx.Rngs(0))
  for i, norm in enumerate(n for n in (mixer.kv_norm, getattr(mixer, "query_norm", None)) if n):
    norm.scale[...] = 1 + _normal(20 + i, norm.scale.shape, 0.3)
  return mixer


def _rms_norm(x, gain):
  """DeepseekV2RMSNorm: in float32, eps 1e-6, times the gain."""
  return gain * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _positions_in_documents(segments_BxL):
  """Each token's index within its document, by a loop."""
  out = np.zeros(segments_BxL.shape, np.int32)
  for row, segments in enumerate(np.asarray(segments_BxL)):
    for t in range(1, len(segments)):
      out[row, t] = 0 if segments[t] != segments[t - 1] else out[row, t - 1] + 1
  return jnp.asarray(out)


def _naive_deepseek_v2_attention(mixer, x_BxLxD, positions_BxL, segments_BxL=None):
  """(output [B, L, D], probabilities [B, N, L, L]) of HF's DeepseekV2Attention.forward with
  the mixer's weights put into their layout: q_proj / q_b_proj columns per head [q_nope,
  q_pe] (the mixer keeps [pe, nope]), kv_a_proj_with_mqa -> [c, k_pe], kv_a_layernorm on c,
  kv_b_proj columns per head [k_nope, v]; eager attention in float32 with the causal (and
  document) mask and the scheme's bias."""
  b, length, d = x_BxLxD.shape
  n, dims = mixer.num_heads, mixer.dims
  nope, rope, value, latent = dims.nope, dims.rope, dims.value, dims.latent

  def their_query_columns(kernel_XxNxH):  # [X, N, pe + nope] -> [X, N (nope + pe)]
    return jnp.concatenate([kernel_XxNxH[..., rope:], kernel_XxNxH[..., :rope]],
                           axis=-1).reshape(kernel_XxNxH.shape[0], -1)

  if dims.query_latent:
    q_a = _rms_norm(x_BxLxD @ mixer.query_down.kernel[...], mixer.query_norm.scale[...])
    q = q_a @ their_query_columns(mixer.query_up.kernel[...])
  else:
    q = x_BxLxD @ their_query_columns(mixer.query.kernel[...])
  q_BxNxLxH = q.reshape(b, length, n, nope + rope).transpose(0, 2, 1, 3)
  q_nope, q_pe = q_BxNxLxH[..., :nope], q_BxNxLxH[..., nope:]
  compressed = x_BxLxD @ mixer.kv_down.kernel[...]
  c, k_pe = compressed[..., :latent], compressed[..., latent:]
  kv_b_proj = jnp.concatenate([mixer.key_up.kernel[...], mixer.value_up.kernel[...]],
                              axis=-1).reshape(latent, -1)
  kv = (_rms_norm(c, mixer.kv_norm.scale[...]) @ kv_b_proj).reshape(b, length, n, nope + value)
  kv = kv.transpose(0, 2, 1, 3)
  k_nope, v = kv[..., :nope], kv[..., nope:]
  # RoPE on q_pe and the single k_pe head (the lab's scheme, [B, L, heads, d_r]).
  q_pe = mixer.position.queries(q_pe.transpose(0, 2, 1, 3), positions_BxL).transpose(0, 2, 1, 3)
  k_pe = mixer.position.keys(k_pe[:, :, None], positions_BxL).transpose(0, 2, 1, 3)
  query = jnp.concatenate([q_nope, q_pe], axis=-1)
  key = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (b, n, length, rope))], axis=-1)
  scores = jnp.einsum("bnth,bnsh->bnts", query, key) * (nope + rope) ** -0.5
  bias = mixer.position.bias(positions_BxL, positions_BxL)
  if bias is not None:
    scores = scores + bias
  mask = jnp.tril(jnp.ones((length, length), bool))[None]
  if segments_BxL is not None:
    mask = mask & (segments_BxL[:, :, None] == segments_BxL[:, None, :])
  probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
  o = jnp.einsum("bnts,bnsv->btnv", probs, v).reshape(b, length, n * value)
  return o @ mixer.out.kernel[...].reshape(n * value, d), probs


def _outputs_and_gradients(forward, mixer, x):
  """forward(mixer, x) and the gradients of <forward, cotangent> w.r.t. the parameters and x."""
  graphdef, params = nnx.split(mixer)
  out, pullback = jax.vjp(lambda p, x: forward(nnx.merge(graphdef, p), x), params, x)
  return out, pullback(_normal(9, out.shape))


@pytest.mark.parametrize("position,q_lora_rank,packed,backend", [
    ("rope", 12, True, "blockwise"),  # the low-rank query, packed documents, tiles of 8
    ("t5", 0, False, "xla"),  # V2-Lite's direct query; a bias scheme with parameters; one document
])
def test_mla_equals_a_naive_port_of_deepseek_v2_attention_with_gradients(position, q_lora_rank,
                                                                        packed, backend):
  mixer = _mla(position, backend, q_lora_rank=q_lora_rank)
  assert bool(mixer.dims.query_latent) == bool(q_lora_rank) == hasattr(mixer, "query_down")
  x = _normal(0, (2, 37, 32))
  segments = SEGMENTS_37 if packed else None
  positions_BxL = (_positions_in_documents(SEGMENTS_37) if packed
                   else jnp.arange(37)[None])
  got = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: m(x, positions_BxL, segments), mixer, x))(x)
  want = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: _naive_deepseek_v2_attention(m, x, positions_BxL, segments)[0], mixer, x))(x)
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  # The output, d(input) and every parameter (the scheme's T5 table included).
  assert len(got_leaves) == 2 + len(jax.tree.leaves(nnx.state(mixer, nnx.Param)))
  for g, w in zip(got_leaves, want_leaves, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  if packed:  # the materialised probabilities of the analyses, and an identity edit
    probs = jax.jit(lambda x: mixer.attention_weights(x, positions_BxL, segments))(x)
    naive = _naive_deepseek_v2_attention(mixer, x, positions_BxL, segments)[1]
    np.testing.assert_allclose(probs, naive, atol=1e-5)
    edited = jax.jit(lambda x: mixer.with_edited_weights(x, positions_BxL, segments,
                                                         lambda p, m: p))(x)
    np.testing.assert_allclose(edited, got[0], atol=1e-5, rtol=1e-5)


def test_the_scheme_rotates_the_decoupled_dims_as_deepseek_v2_s_apply_rotary_emb():
  """The geometry the mixer hands RoPE (N heads of d_r, all rotating) gives HF's rotation of
  q_pe / k_pe: adjacent channels (2i, 2i+1) as a complex number times e^(i m theta_i),
  theta_i = 10000^(-2i / d_r) (DeepseekV2RotaryEmbedding's default inv_freq over d_r)."""
  config = tiny_model_config(attention="mla", position="rope", mla=DIMS)
  scheme = positions.build(config, attention.REGISTRY["mla"].position_geometry(
      attention.REGISTRY.settings("mla", config), config), rngs=nnx.Rngs(0))
  q_pe = np.asarray(_normal(5, (2, 7, 4, 4)))
  positions_BxL = np.arange(3, 10)[None]
  theta = 10000.0 ** -(np.arange(0, 4, 2) / 4)
  turn = np.exp(1j * positions_BxL[..., None] * theta)[:, :, None]  # [1, L, 1, d_r / 2]
  pairs = (q_pe[..., 0::2] + 1j * q_pe[..., 1::2]) * turn
  want = np.stack([pairs.real, pairs.imag], axis=-1).reshape(q_pe.shape)
  np.testing.assert_allclose(scheme.queries(q_pe, positions_BxL), want, atol=1e-5)
  np.testing.assert_allclose(scheme.keys(q_pe[:, :, :1], positions_BxL), want[:, :, :1],
                             atol=1e-5)


def test_absorbed_decode_equals_the_expanded_forward_and_caches_the_latents():
  """A prompt of 6 into the empty cache (the expanded path), a chunk of 5 and then single
  tokens through the absorbed form (W_UK in the query, W_UV on the output, attention over the
  cached [c, k_r]) give the forward's outputs; the cache holds RMSNorm(c) and the rotated
  shared key, (R + d_r) values per token."""
  mixer = _mla("rope", q_lora_rank=12)
  length = 16
  x = _normal(3, (2, length, 32))
  want = jax.jit(lambda x: mixer(x, jnp.arange(length)[None]))(x)
  decode = jax.jit(mixer.decode)
  cache = mixer.init_cache(2, length + 2)
  assert cache["latents"].shape == (2, length + 2, 12 + 4)
  outputs = []
  for start, end in [(0, 6), (6, 11)] + [(t, t + 1) for t in range(11, length)]:
    y, cache = decode(x[:, start:end], cache, jnp.asarray(start))
    outputs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), want, atol=1e-5, rtol=1e-5)
  compressed = x @ mixer.kv_down.kernel[...]
  c = _rms_norm(compressed[..., :12], mixer.kv_norm.scale[...])
  k_pe = mixer.position.keys(compressed[:, :, None, 12:], jnp.arange(length)[None])[:, :, 0]
  np.testing.assert_allclose(cache["latents"][:, :length], jnp.concatenate([c, k_pe], -1),
                             atol=1e-5, rtol=1e-5)
  assert not bool(jnp.any(cache["latents"][:, length:]))


def test_absorbed_attention_from_an_empty_cache_equals_the_expanded_attention():
  """absorbed_attention alone, for a prompt at index 0 (the path decode leaves to the sequence
  form): the same [B, T, N, d_v] as the core's attention over the expanded keys and values."""
  mixer = _mla("rope", q_lora_rank=0)
  x = _normal(4, (2, 9, 32))
  positions_1xT = jnp.arange(9)[None]

  def both(x):
    q, k, v, latents = mixer.project(x, positions_1xT)
    return mixer.attend(q, k, v, positions_1xT), mixer.absorbed_attention(q, latents, positions_1xT)

  expanded, absorbed = jax.jit(both)(x)
  np.testing.assert_allclose(absorbed, expanded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_defaults_follow_deepseek_v2_ratios_and_cache_bytes_match_the_cache(dtype, itemsize):
  """At d_model 128 and 4 heads: d_n = d_v = 32, d_r = 16, R = 128, no query compression; the
  declared bytes per token equal init_cache's shapes."""
  from configs import base  # noqa: PLC0415
  config = base.get_config().model
  config.update(attention="mla", position="rope", compute_dtype=dtype, d_model=128, num_heads=4)
  cls = attention.REGISTRY["mla"]
  settings = attention.REGISTRY.settings("mla", config)
  dims = cls.resolve_dims(settings, config)
  assert (dims.nope, dims.rope, dims.value, dims.latent, dims.query_latent) == (32, 16, 32, 128, 0)
  assert cls.cache_bytes_per_token(config) == (128 + 16) * itemsize
  model_lib.validate(config)
  mixer = nnx.eval_shape(lambda: cls(settings, config, positions.build(
      config, cls.position_geometry(settings, config), rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0)))
  assert nn.tree_bytes(nn.cache_shapes(mixer, 3, 50)) == 3 * 50 * cls.cache_bytes_per_token(config)


@pytest.mark.parametrize("overrides,message", [
    (dict(mla=dict(kv_lora_rank=-1)), "model.mla.kv_lora_rank must be an integer >= 0"),
    (dict(mla=dict(qk_rope_head_dim=3)), "qk_rope_head_dim must be even"),
    (dict(mla=dict(block_size=0)), "block_size must be >= 1"),
    (dict(attention_backend="flash"), "valid: auto, xla, blockwise, cudnn"),
    (dict(attention_backend="cudnn"), "v_head_dim=12"),
])
def test_bad_settings_are_refused_naming_what_is_valid(overrides, message):
  config = tiny_model_config(attention="mla", **overrides)
  with pytest.raises(ValueError, match=message):
    model_lib.validate(config)
