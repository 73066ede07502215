"""RWKV-7 (research/model/attention/rwkv7.py, research/model/feed_forward/rwkv7_channel_mix.py)
against fp32 ports of the authors' code (BlinkDL/RWKV-LM@524481d, RWKV-v7/train_temp/src/model.py:
the "slow pytorch version" of RWKV_Tmix_x070 and RWKV_CMix_x070; RWKV-v7/rwkv_v7_demo.py: RWKV7_OP,
the recurrence token by token in the reference's orientation, state [values, keys]): outputs and
gradients w.r.t. the input and every parameter, on packed documents. The conformance suite
covers causality, decode, packed documents and sharding for the mixer as for every mixer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model.attention import rwkv7
from research.model.feed_forward.rwkv7_channel_mix import RWKV7ChannelMix
from tests.conftest import tiny_model_config
from tests.test_kernels import _normal, _outputs_and_gradients

SEGMENTS_21 = jnp.array([[0] * 6 + [1] * 9 + [2] * 6, [0] * 3 + [1] * 18])
SEGMENTS_37 = jnp.array([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34])


def _starts(segments_BxL):
  """[B, L] bool: a token that begins a document after the row's first."""
  return jnp.pad(segments_BxL[:, 1:] != segments_BxL[:, :-1], [(0, 0), (1, 0)])


def _reference_op(r, w, k, v, a, b, state_BxNxExH, segments_BxL):
  """RWKV7_OP: S = S diag(w) + (S a) b^T + v k^T, y = S r, one token at a time (a scan over
  tokens, so that it compiles fast), with the decay exp(-exp(w)) of the reference's w; S
  restarts at each document start."""

  def step(state, token):
    r, w, k, v, a, b, start = token
    state = jnp.where(start[:, None, None, None], 0.0, state)
    sa = jnp.einsum("bnij,bnj->bni", state, a)
    state = (state * jnp.exp(-jnp.exp(w))[:, :, None, :] + sa[..., None] * b[:, :, None, :]
             + v[..., None] * k[:, :, None, :])
    return state, jnp.einsum("bnij,bnj->bni", state, r)

  tokens = tuple(jnp.moveaxis(y, 1, 0) for y in (r, w, k, v, a, b, _starts(segments_BxL)))
  state, outputs = jax.lax.scan(step, state_BxNxExH, tokens)
  return jnp.moveaxis(outputs, 0, 1), state


def _shift(x_BxLxD, segments_BxL):
  """time_shift(x): the previous token, 0 at each document's start."""
  previous = jnp.pad(x_BxLxD, [(0, 0), (1, 0), (0, 0)])[:, :-1]
  return jnp.where(_starts(segments_BxL)[..., None], 0.0, previous)


def _reference_time_mix(mixer, x, segments, v_first=None):
  """RWKV_Tmix_x070.forward, written out: (output, v_first). With v_first None it is the
  reference's layer 0 (which returns its v as v_first), else a later layer's value residual."""
  b, length, d = x.shape
  n, h = mixer.num_heads, mixer.head_dim
  flat = lambda p: p[...].reshape(p.shape[0], -1) if p[...].ndim == 3 else p[...].reshape(-1)
  xx = _shift(x, segments) - x
  xr, xw, xk, xv, xa, xg = (x + xx * mixer.mix[name][...] for name in "rwkvag")
  r, k, v = (xs @ flat(p.kernel) for xs, p in ((xr, mixer.receptance), (xk, mixer.key),
                                                (xv, mixer.value)))
  if v_first is None:
    v_first = v
  else:
    v = v + (v_first - v) * jax.nn.sigmoid(flat(mixer.value_residual_base) + (
        xv @ mixer.lora_down["value"][...]) @ flat(mixer.lora_up["value"]))
  w1, w2 = mixer.lora_down["decay"][...], flat(mixer.lora_up["decay"])
  w = -jax.nn.softplus(-(flat(mixer.decay_base) + jnp.tanh(xw @ w1) @ w2)) - 0.5
  a = jax.nn.sigmoid(flat(mixer.a_base) + (xa @ mixer.lora_down["a"][...])
                     @ flat(mixer.lora_up["a"]))
  g = jax.nn.sigmoid(xg @ mixer.lora_down["gate"][...]) @ flat(mixer.lora_up["gate"])
  heads = lambda y: y.reshape(b, length, n, h)  # noqa: E731
  kk = heads(k * flat(mixer.key_normaliser))
  kk = kk / jnp.maximum(jnp.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
  k = k * (1 + (a - 1) * flat(mixer.key_a_mix))
  y, _ = _reference_op(heads(r), heads(w), heads(k), heads(v), -kk, kk * heads(a),
                       jnp.zeros((b, n, h, h)), segments)
  y = (y - y.mean(-1, keepdims=True)) / jnp.sqrt(y.var(-1, keepdims=True) + 64e-5)
  y = y * mixer.norm_scale[...] + mixer.norm_bias[...]  # GroupNorm(H, C, eps=64e-5)
  y = y + (heads(r) * heads(k) * mixer.bonus[...]).sum(-1, keepdims=True) * heads(v)
  return (y.reshape(b, length, d) * g) @ flat(mixer.out.kernel).reshape(d, d), v_first


def _mixer(layer_index, num_layers, **settings):
  config = tiny_model_config(attention="rwkv7", num_layers=num_layers, rwkv7=settings)
  return rwkv7.RWKV7(config.rwkv7, config, None, rngs=nnx.Rngs(0), layer_index=layer_index)


def test_rwkv7_mixer_equals_the_reference_with_gradients_on_packed_documents():
  """Layer 1 of 3, chunks of 4 over 21 tokens (resets inside chunks): outputs and the gradients
  w.r.t. the input and every parameter. The low-rank maps' first halves start at 0 (the
  reference's initialisation): they get values, so that every gradient is tested."""
  mixer = _mixer(1, 3)
  for i, name in enumerate(rwkv7.LORA_SCALES):
    mixer.lora_down[name][...] = _normal(10 + i, mixer.lora_down[name].shape, 0.3)
  x = _normal(0, (2, 21, 32))
  got, want, unpacked = jax.jit(lambda x: (
      _outputs_and_gradients(lambda m, x: m(x, None, SEGMENTS_21), mixer, x),
      _outputs_and_gradients(lambda m, x: _reference_time_mix(m, x, SEGMENTS_21)[0], mixer, x),
      mixer(x, None)))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(unpacked[0, 6:] - got[0][0, 6:]).max()) > 1e-3  # the resets mattered


def test_value_residual_of_a_later_layer_equals_the_reference_with_gradients():
  """Layers 0 and 1 of 3 in a row, as the model runs them (the carry from one to the other):
  layer 1 mixes its values towards layer 0's, v + (v_first - v) sigmoid(v0 + (x_v A_v) B_v),
  as RWKV_Tmix_x070.forward; outputs and the gradients w.r.t. both inputs and every parameter of
  both layers (A_v given values, as the other low-rank maps above). The first layer alone has no
  value-residual parameters, and value_residual=False builds none."""
  first, later = _mixer(0, 3), _mixer(1, 3)
  assert not first.value_residual and "value" not in first.lora_down and later.value_residual
  assert not _mixer(1, 3, value_residual=False).value_residual
  for i, name in enumerate((*rwkv7.LORA_SCALES, "value")):
    for mixer in (first, later):
      if name in mixer.lora_down:
        mixer.lora_down[name][...] = _normal(10 + i, mixer.lora_down[name].shape, 0.3)
  pair = nnx.List([first, later])
  x = _normal(0, (2, 2, 21, 32))  # [layer, batch, length, d_model]

  def model_pair(pair, x):
    y0, carry = pair[0].call_with_carry(x[0], None, SEGMENTS_21, {})
    y1, _ = pair[1].call_with_carry(x[1], None, SEGMENTS_21, carry)
    return jnp.stack([y0, y1])

  def reference_pair(pair, x):
    y0, v_first = _reference_time_mix(pair[0], x[0], SEGMENTS_21)
    return jnp.stack([y0, _reference_time_mix(pair[1], x[1], SEGMENTS_21, v_first)[0]])

  got, want, alone = jax.jit(lambda x: (_outputs_and_gradients(model_pair, pair, x),
                                        _outputs_and_gradients(reference_pair, pair, x),
                                        later(x[1], None, SEGMENTS_21)))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(alone - got[0][1]).max()) > 1e-3  # the residual changed layer 1


def test_chunked_form_and_recurrence_equal_the_reference_op_with_gradients():
  """chunked_rwkv7 (chunks of 8 over 37 tokens: the last padded) and rwkv7_recurrence against
  RWKV7_OP, from a state on packed documents whose first continues it: outputs, final state and
  the gradients of every input. Then one chunk of MAX_CHUNK tokens at the strongest decay the
  mixer makes (log w = -e^{-1/2}: e^{-38.8} across the chunk), whose factors stay finite."""
  b, n, h, e, length = 2, 2, 4, 6, 37

  def inputs(length, decay_logit):
    kk = _normal(4, (b, length, n, h))
    return (_normal(0, (b, length, n, h)), -rwkv7.LOG_DECAY_SCALE * jax.nn.sigmoid(decay_logit),
            _normal(1, (b, length, n, h)), _normal(2, (b, length, n, e)),
            kk / jnp.linalg.norm(kk, axis=-1, keepdims=True),
            jax.nn.sigmoid(_normal(5, (b, length, n, h), 2.0)), _normal(6, (b, n, h, e)))

  def reference(r, log_decay, k, v, kk, a, state, segments=SEGMENTS_37):
    w = jnp.log(-log_decay)  # the reference's w: decay exp(-exp(w))
    out, final = _reference_op(r, w, k, v, -kk, kk * a, jnp.swapaxes(state, -1, -2), segments)
    return out, jnp.swapaxes(final, -1, -2)

  packed = inputs(length, _normal(3, (b, length, n, h), 2.0))
  cotangents = (_normal(7, (b, length, n, e)), _normal(8, (b, n, h, e)))

  def vjp(f):
    out, pullback = jax.vjp(f, *packed)
    return out, pullback(cotangents)

  strongest = inputs(rwkv7.MAX_CHUNK, jnp.full((b, rwkv7.MAX_CHUNK, n, h), 30.0))
  one_document = jnp.zeros((b, rwkv7.MAX_CHUNK), jnp.int32)
  chunked = lambda *a: rwkv7.chunked_rwkv7(*a, chunk_size=8, segments=SEGMENTS_37)  # noqa: E731
  recurrence = lambda *a: rwkv7.rwkv7_recurrence(*a, segments=SEGMENTS_37)  # noqa: E731
  want, *got, (strong_got, strong_want) = jax.jit(lambda: (
      vjp(reference), vjp(chunked), vjp(recurrence),
      (rwkv7.chunked_rwkv7(*strongest, chunk_size=rwkv7.MAX_CHUNK),
       reference(*strongest, one_document))))()
  for name, form_got in zip(("chunked", "recurrence"), got):
    for g, w in zip(jax.tree.leaves(form_got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, atol=2e-4, rtol=2e-4, err_msg=name)
  for g, w in zip(strong_got, strong_want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_initialisation_follows_the_reference_at_each_depth():
  """The depth-dependent values of RWKV_Tmix_x070.__init__ (and generate_init_weight's
  GroupNorm gain) at layer 2 of 4 (d_model 32, 4 heads of 8), and the low-rank sizing rule."""
  mixer = _mixer(2, 4)
  d, rho0, rho1 = 32, 2 / 3, 1 - 2 / 4
  i = np.arange(d)
  np.testing.assert_allclose(mixer.mix["r"][...], 1 - (i / d) ** (0.2 * rho1), atol=1e-6)
  np.testing.assert_allclose(mixer.mix["w"][...], 1 - (i / d) ** (0.9 * rho1), atol=1e-6)
  zigzag = ((i % 8) - 3.5) / 3.5
  zigzag = zigzag * np.abs(zigzag)
  np.testing.assert_allclose(mixer.decay_base[...].reshape(-1), -6 + 6 * (i / 31) ** (
      1 + rho0 ** 0.3) + 0.5 + 2.5 * zigzag, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mixer.a_base[...].reshape(-1),
                             -0.19 + 0.3 * zigzag + 0.4 * (i / 31 - 0.5), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mixer.norm_scale[...], (3 / 4) ** 0.7, rtol=1e-6)
  assert float(jnp.abs(mixer.lora_down["decay"][...]).max()) == 0.0
  up = mixer.lora_up["decay"][...].reshape(mixer.lora_up["decay"].shape[0], -1)
  np.testing.assert_allclose(up @ up.T, 0.01 * np.eye(up.shape[0]), atol=1e-6)  # gain 0.1
  assert [rwkv7.lora_rank(0, 768, s) for s in rwkv7.LORA_SCALES.values()] == [64, 64, 128]
  assert rwkv7.lora_rank(0, 32, 2.5) == 32 and rwkv7.lora_rank(8, 4096, 2.5) == 8
  assert _mixer(0, 1).norm_scale[...].max() == 1.0  # one layer: the reference divides by 0
  with pytest.raises(ValueError, match="chunk_size must be in"):
    rwkv7.RWKV7.validate(tiny_model_config(rwkv7=dict(chunk_size=65)).rwkv7, None)


def _reference_channel_mix(block, x, segments):
  """RWKV_CMix_x070.forward: k = relu((x + (x' - x) x_k) W_k)^2, out = k W_v."""
  xk = x + (_shift(x, segments) - x) * block.mix_k[...]
  return jax.nn.relu(xk @ block.key.kernel[...]) ** 2 @ block.value.kernel[...]


def test_channel_mix_equals_the_reference_with_gradients_and_decodes_as_the_forward():
  config = tiny_model_config()
  block = RWKV7ChannelMix(config, {"hidden": 0}, rngs=nnx.Rngs(0))
  assert block.key.kernel.shape == (32, 64) and not hasattr(block, "receptance")
  np.testing.assert_allclose(block.mix_k[...], 1 - (np.arange(32) / 32) ** (1 / 16), atol=1e-6)
  x = _normal(0, (2, 21, 32))
  got = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: m(x, SEGMENTS_21), block, x))(x)
  want = jax.jit(lambda x: _outputs_and_gradients(
      lambda m, x: _reference_channel_mix(m, x, SEGMENTS_21), block, x))(x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
  whole = jax.jit(block.__call__)(x)
  decode = jax.jit(block.decode)
  first, cache = decode(x[:, :5], block.init_cache(2, 21), 0)
  steps = [first]
  for t in range(5, 21):
    y, cache = decode(x[:, t:t + 1], cache, t)
    steps.append(y)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), whole, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="hidden must be >= 1"):
    RWKV7ChannelMix.validate({"hidden": -1}, config)


def test_a_model_with_the_value_residual_decodes_as_its_forward_pass():
  """Three RWKV-7 layers (the carry from layer 0 to 1 and 2): token-by-token decoding and a
  prefill then decode give the logits of the full forward; in a hybrid the first RWKV-7 layer
  plays layer 0."""
  from research.model import transformer as model_lib  # noqa: PLC0415
  config = tiny_model_config(attention="rwkv7", position="none", num_layers=3)
  model = model_lib.build_model(config, rngs=nnx.Rngs(0))
  assert [block.mixer.value_residual for block in model.blocks] == [False, True, True]
  tokens = jax.random.randint(jax.random.key(0), (2, 11), 0, config.vocab_size)

  @jax.jit
  def forward_and_decodes(tokens):
    full = model(tokens)

    def step(cache, token_B):  # one compiled step, scanned over the tokens
      logits, cache = model.decode(token_B[:, None], cache)
      return cache, logits[:, 0]

    _, steps = jax.lax.scan(step, model.init_cache(2, 11), tokens.T)
    head, cache = model.prefill(tokens[:, :6], model.init_cache(2, 11))
    tail, _ = model.decode(tokens[:, 6:], cache)
    return full, steps.swapaxes(0, 1), jnp.concatenate([head, tail], 1)

  full, stepped, chunked = forward_and_decodes(tokens)
  np.testing.assert_allclose(stepped, full, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(chunked, full, atol=1e-5, rtol=1e-5)
  hybrid = model_lib.build_model(tiny_model_config(
      attention="rwkv7", position="none", num_layers=4, layer_pattern=("mha", "rwkv7")),
      rngs=nnx.Rngs(0))
  assert [getattr(b.mixer, "value_residual", None) for b in hybrid.blocks] == [
      None, False, None, True]
