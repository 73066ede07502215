"""Stick-breaking attention (research/model/attention/stickbreaking.py and stick_breaking_kernel.py)
against float32 ports of the authors' references: shawntan/stickbreaking-attention@3147a38,
stickbreaking_attention/sb_ref.py `stickbreaking` (with tests/test_attn.py's masks and
tests/test_varlen.py's one call per document), and IBM/dolomite-engine@d0ee186's
`SBAttention.forward` (lm_engine/hf_models/modeling_utils/sequence_mixer_blocks/
stickbreaking_attention.py). Outputs and gradients; the conformance suite covers causality,
decode, packed documents and sharding as for every mixer (with the remainder's bias at its
initial 0, so decoding with a remainder is checked here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model import attention
from research.model import transformer as model_lib
from research.model.attention import core
from research.model.attention import stick_breaking_kernel
from tests.conftest import tiny_model_config
from tests.test_kernels import (SEGMENTS_37, _assert_mixer_equals_naive, _mixer, _normal,
                                _per_document)


def _reference(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, hidden_TxS, cumulative_SxS):
  """sb_ref.stickbreaking: log sigmoid(z) (-1e5 where hidden) plus the later keys' log
  sigmoid(-z) (0 where hidden) summed by a strictly lower triangular matrix; (A v, 1 - sum A)."""
  logits = q_BxNxTxH @ k_BxNxSxH.swapaxes(-1, -2) / np.sqrt(q_BxNxTxH.shape[-1])
  log_z = jnp.where(hidden_TxS, -1e5, jax.nn.log_sigmoid(logits))
  log_beta = jnp.where(hidden_TxS, 0.0, jax.nn.log_sigmoid(-logits))
  log_att = log_z + jnp.einsum("bhij,jk->bhik", log_beta, cumulative_SxS)
  att = jnp.exp(log_att)
  return att @ v_BxNxSxH, 1 - att.sum(-1), att


def _reference_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxV, attend_current=False):
  """test_attn.ref_fwd's masks (hidden: triu(0), or triu(1) with attend_current; the
  cumulative matrix tril(-1)), keys and values repeated for grouped heads (head n reads key
  head n // G): (A v [B, T, N, V], 1 - sum A [B, N, T], A [B, N, T, T])."""
  t, group = q_BxTxNxH.shape[1], q_BxTxNxH.shape[2] // k_BxTxKxH.shape[2]
  hidden = np.triu(np.ones((t, t), bool), 1 if attend_current else 0)
  cumulative = np.tril(np.ones((t, t), np.float32), -1)
  heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
  o, rem, att = _reference(heads_first(q_BxTxNxH),
                           heads_first(jnp.repeat(k_BxTxKxH, group, axis=2)),
                           heads_first(jnp.repeat(v_BxTxKxV, group, axis=2)), hidden, cumulative)
  return heads_first(o), rem, att


def _assert_all_equal_with_gradients(functions, inputs, cotangent, tolerance=1e-4):
  """Each function's outputs and pullback of `cotangent` w.r.t. `inputs` equal the first's,
  computed in one compiled program."""

  def vjp(f):
    out, pullback = jax.vjp(f, *inputs)
    return out, pullback(cotangent)

  results = jax.jit(lambda: [jax.tree.leaves(vjp(f)) for f in functions])()
  for got in results[1:]:
    for g, w in zip(got, results[0], strict=True):
      np.testing.assert_allclose(g, w, atol=tolerance, rtol=tolerance)


def _qkv(length, heads=4, kv_heads=2, h=8):
  """q, k, v; q and k drawn as the authors' tests draw them (means +1 and -1)."""
  q = 0.5 * (_normal(0, (2, length, heads, h)) + 1)
  k = 0.5 * (_normal(1, (2, length, kv_heads, h)) - 1)
  return q, k, _normal(2, (2, length, kv_heads, h))


def test_core_equals_the_authors_reference_with_gradients():
  """GQA (4 heads over 2), 21 tokens in blocks of 8: xla and blockwise against sb_ref, outputs
  and the gradients of q, k, v; probabilities() are the reference's weights (attend_current:
  the mixer's test below, and blockwise == xla with it below)."""
  inputs = _qkv(21)
  attend = lambda backend: lambda q, k, v: core.attend(  # noqa: E731
      q, k, v, backend=backend, block_size=8, normaliser="stickbreaking")
  _assert_all_equal_with_gradients(
      [lambda q, k, v: _reference_attention(q, k, v)[0], attend("xla"), attend("blockwise")],
      inputs, _normal(3, (2, 21, 4, 8)))
  for attend_current in (False, True):
    weights, visible = core.probabilities(
        *inputs[:2], normaliser=stick_breaking_kernel.StickBreaking(attend_current))
    np.testing.assert_allclose(weights, _reference_attention(*inputs, attend_current)[2],
                               atol=1e-6)
    assert bool(visible[0, 0, 5, 5]) == attend_current and not bool(visible[0, 0, 5, 6])
    assert float(weights.sum(-1).max()) < 1 and float(weights[:, :, 3:].sum(-1).min()) > 0.01


def test_packed_documents_blockwise_equals_xla_equals_the_reference_per_document():
  """37 tokens of packed documents (SEGMENTS_37: starts inside blocks of 8). xla == sb_ref
  called once per document (test_varlen.ref_fwd): keys of other documents take neither weight
  nor stick, so every document's first token keeps the whole stick. blockwise == xla, outputs
  and the gradients of q, k, v, the score inputs and parameter, with the own key taking part
  (attend_current) and a score modification per tile as materialised: a bias from per-token
  float inputs and a parameter, then a soft cap (a `modify`)."""
  q, k, v = _qkv(37)
  # A column of ones among the values: its output is sum_j A_ij = 1 - the remainder.
  v = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,))], -1)
  attend = lambda segments=SEGMENTS_37: lambda q, k, v: core.attend(  # noqa: E731
      q, k, v, segments_BxT=segments, backend="xla", normaliser="stickbreaking")
  packed, alone, unpacked = jax.jit(lambda q, k, v: (
      attend()(q, k, v),
      _per_document(lambda *a: _reference_attention(*a)[0], SEGMENTS_37, q, k, v),
      attend(None)(q, k, v)))(q, k, v)
  np.testing.assert_allclose(packed, alone, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[0, (0, 10, 30), :, -1], 0.0)  # documents' first tokens
  assert float(packed[0, 11:30, :, -1].min()) > 0.01
  assert float(jnp.abs(unpacked[:, 10:] - packed[:, 10:]).max()) > 1e-2

  gate = _normal(4, (2, 37, 4))
  score_mod = core.ScoreMod(
      bias=lambda p, q_in, k_in: p * (q_in.transpose(0, 2, 1)[:, :, :, None]
                                      - k_in.transpose(0, 2, 1)[:, :, None, :]),
      modify=lambda s, p, q_in, k_in: 3.0 * jnp.tanh(s / 3.0))
  modified = lambda backend: lambda q, k, v, gate, p: core.attend(  # noqa: E731
      q, k, v, score_mod=score_mod, score_params=p, inputs=gate, segments_BxT=SEGMENTS_37,
      backend=backend, block_size=8,
      normaliser=stick_breaking_kernel.StickBreaking(attend_current=True))
  _assert_all_equal_with_gradients([modified("xla"), modified("blockwise")],
                                   (q, k, v, gate, jnp.float32(0.3)), _normal(5, (2, 37, 4, 9)))


def test_blockwise_keeps_no_length_squared_residual():
  """The VJP's residuals are O(length): q, k, v and the output."""
  length = 64
  q = k = v = jnp.ones((1, length, 2, 4))
  residuals = jax.eval_shape(lambda q: jax.tree.leaves(jax.vjp(
      lambda q: core.attend(q, k, v, backend="blockwise", block_size=8,
                            normaliser="stickbreaking"), q)[1]), q)
  sizes = [x.size for x in residuals]
  assert max(sizes) <= length * 2 * 4, sizes


def _naive_layer(mixer, x_BxLxD):
  """SBAttention.forward: sb_attn(q, k, v) at the softmax scale 1/sqrt(H), o + rem * u (u: the
  head bias, or the own value as the kernel tests add), torch.nn.GroupNorm(num_heads,
  hidden_size) on [B L, D], c_proj."""
  b, length, d = x_BxLxD.shape
  n, h = mixer.num_heads, mixer.head_dim
  v = mixer.value(x_BxLxD)
  o, rem, _ = _reference_attention(mixer.query(x_BxLxD), mixer.key(x_BxLxD), v,
                                   mixer.attend_current)
  rem = rem.transpose(0, 2, 1)[..., None]
  if mixer.remainder == "bias":
    o = o + rem * mixer.head_bias[...]
  elif mixer.remainder == "value":
    o = o + rem * v
  groups = o.reshape(b * length, n, h)
  mean = groups.mean(-1, keepdims=True)
  variance = ((groups - mean) ** 2).mean(-1, keepdims=True)
  normed = ((groups - mean) / jnp.sqrt(variance + 1e-5)).reshape(b * length, d)
  normed = normed * mixer.norm_scale[...].reshape(d) + mixer.norm_bias[...].reshape(d)
  return mixer.out(normed.reshape(b, length, n, h))


def _stickbreaking_mixer(backend, **settings):
  mixer = _mixer("stickbreaking", position="none", attention_backend=backend,
                 stickbreaking=dict(block_size=8, **settings))
  # Off their initial values (0, 1, 0), so that each takes part and its gradient is tested.
  for i, name in enumerate(("head_bias", "norm_scale", "norm_bias")):
    if hasattr(mixer, name):
      param = getattr(mixer, name)
      param[...] = param[...] + _normal(20 + i, param.shape, 0.5)
  return mixer


@pytest.mark.parametrize("remainder,attend_current", [
    ("bias", False),  # the authors' layer
    ("value", True)])  # the authors' kernel tests' o + rem * v, the own key taking part
def test_mixer_equals_the_authors_layer_with_gradients(remainder, attend_current):
  """Outputs and the gradients w.r.t. x and every parameter (projections, head bias, GroupNorm's
  scale and shift) against the naive layer, 21 tokens (xla: the core's blockwise form equals
  it above, and the conformance suite runs the mixer on both)."""
  mixer = _stickbreaking_mixer("xla", remainder=remainder, attend_current=attend_current)
  assert hasattr(mixer, "head_bias") == (remainder == "bias")
  _assert_mixer_equals_naive(mixer, _naive_layer)


def test_decode_with_a_remainder_and_the_own_key_equals_the_full_forward():
  """Prefill 4 tokens into the empty cache (the sequence path), then one at a time from the
  cache: the same outputs as the forward of all 9, with the remainder's term (the own value)
  and the own key taking part (the conformance suite decodes the default layer, whose head bias
  starts at 0, and prompts from a filled cache)."""
  graphdef, state = nnx.split(
      _stickbreaking_mixer("xla", remainder="value", attend_current=True))
  x = _normal(0, (2, 9, 32))
  forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, jnp.arange(9)[None]))
  decode = jax.jit(lambda state, x, cache, index: nnx.merge(graphdef, state).decode(
      x, cache, index))
  cache = nnx.merge(graphdef, state).init_cache(2, 9)
  steps = []
  for start, end in [(0, 4)] + [(t, t + 1) for t in range(4, 9)]:
    y, cache = decode(state, x[:, start:end], cache, start)
    steps.append(y)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), forward(state, x), atol=1e-4,
                             rtol=1e-4)


def test_attention_weights_and_an_identity_edit_give_the_forward():
  graphdef, state = nnx.split(_stickbreaking_mixer("xla"))
  x = _normal(0, (2, 13, 32))
  positions = jnp.arange(13)[None]

  @jax.jit
  def run(state, x):
    mixer = nnx.merge(graphdef, state)
    return (mixer.attention_weights(x, positions), mixer(x, positions),
            mixer.with_edited_weights(x, positions, None, lambda a, visible: a))

  weights, forward, edited = run(state, x)
  assert weights.shape == (2, 4, 13, 13)
  np.testing.assert_allclose(weights[:, :, 0], 0.0)  # the first token has no earlier key
  assert float(weights[:, :, 1:].sum(-1).min()) > 0.01
  np.testing.assert_allclose(edited, forward, atol=1e-5, rtol=1e-5)


def test_settings_and_refusals():
  cls = attention.REGISTRY["stickbreaking"]
  assert {"none", "sinusoidal"} <= set(model_lib.compatible_positions(cls))
  assert not {"rope", "alibi"} & set(model_lib.compatible_positions(cls))
  for overrides, match in [(dict(attention_backend="cudnn"), "valid: auto, xla, blockwise"),
                           (dict(stickbreaking=dict(remainder="current")), "valid: 'bias'"),
                           (dict(stickbreaking=dict(block_size=0)), "block_size must be"),
                           (dict(position="rope"), "does not support position")]:
    with pytest.raises(ValueError, match=match):
      model_lib.validate(tiny_model_config(**{"attention": "stickbreaking", "position": "none",
                                              **overrides}))
  assert not hasattr(_mixer("stickbreaking", position="none",
                            stickbreaking=dict(remainder="none")), "head_bias")
  q, k, v = _qkv(5)
  with pytest.raises(ValueError, match="no sliding window"):
    core.attend(q, k, v, mask=core.MaskSpec(window=3), normaliser="stickbreaking")
  with pytest.raises(ValueError, match="cannot run stick-breaking"):
    core.attend(q, k, v, backend="cudnn", normaliser="stickbreaking")
  with pytest.raises(ValueError, match="unknown attention normaliser"):
    core.probabilities(q, k, normaliser="sigmoid")
