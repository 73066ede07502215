"""PaTH attention (research/model/attention/path.py) against ports of the authors' reference (numpy
float64 for the scores, jnp float32 for the layer),
fla-org/flash-linear-attention@bc3b101: fla/ops/path_attn/naive.py `naive_path_attn` (its
chunked WY logits, ported in numpy, against the explicit products q_i^T H_i ... H_{j+1} k_j and
the lab's chunked form) and fla/layers/path_attn.py `PaTHAttention.forward` (the layer, with the
scores taken token by token). Outputs and gradients; the conformance suite covers causality,
decode, packed documents and sharding as for every mixer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model import transformer as model_lib
from research.model.attention import path
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _assert_mixer_equals_naive, _mixer, _normal


def _householder(w_H, beta):
  return np.eye(len(w_H)) - beta * np.outer(w_H, w_H)


def _product(w_TxH, beta_T):
  """H_{T-1} ... H_1 H_0 of the given tokens (the identity for none)."""
  product = np.eye(w_TxH.shape[1])
  for w_H, beta in zip(w_TxH, beta_T):
    product = _householder(w_H, beta) @ product
  return product


def _explicit_scores(q_TxH, k_TxH, w_TxH, beta_T):
  """s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j for j <= i (0 above the diagonal), float64."""
  t = len(q_TxH)
  scores = np.zeros((t, t))
  for i in range(t):
    for j in range(i + 1):
      scores[i, j] = q_TxH[i] @ _product(w_TxH[j + 1:i + 1], beta_T[j + 1:i + 1]) @ k_TxH[j]
  return scores


def _fla_naive_scores(q_TxH, k_TxH, w_TxH, beta_T, chunk):
  """naive_path_attn's scores A (before the gate, the scale and the softmax) for one head: the
  UT transform T_mat by its row-by-row loop, the intra-chunk A_local, and queries moved back
  chunk by chunk through H_mat."""
  t = len(q_TxH)
  pad = (-t) % chunk
  q, k, w = (np.pad(x, ((0, pad), (0, 0))) for x in (q_TxH, k_TxH, w_TxH))
  beta = np.pad(beta_T, (0, pad))
  chunks = len(q) // chunk
  w_beta = w * beta[:, None]
  q, k, w, w_beta = (x.reshape(chunks, chunk, -1) for x in (q, k, w, w_beta))
  upper = np.triu(np.ones((chunk, chunk), bool))
  t_mat = -np.where(upper, 0.0, w_beta @ w.transpose(0, 2, 1))
  for i in range(1, chunk):
    t_mat[:, i, :i] = t_mat[:, i, :i] + (t_mat[:, i, :, None] * t_mat[:, :, :i]).sum(-2)
  t_mat = t_mat + np.eye(chunk)
  twbk = t_mat @ np.where(upper, 0.0, w_beta @ k.transpose(0, 2, 1))
  qw = np.tril(q @ w.transpose(0, 2, 1))
  twb = t_mat @ w_beta
  local = np.tril(q @ k.transpose(0, 2, 1)) - qw @ twbk
  q = (q - qw @ twb).reshape(chunks * chunk, -1)
  k = (k - twbk.transpose(0, 2, 1) @ w).reshape(chunks * chunk, -1)
  h_mat = w.transpose(0, 2, 1) @ twb
  scores = np.zeros((chunks * chunk,) * 2)
  for i in range(0, chunks * chunk, chunk):
    q_i = q[i:i + chunk].copy()
    for j in range(i - chunk, -chunk, -chunk):
      scores[i:i + chunk, j:j + chunk] = q_i @ k[j:j + chunk].T
      q_i = q_i - q_i @ h_mat[j // chunk]
    scores[i:i + chunk, i:i + chunk] = local[i // chunk]
  return np.tril(scores[:t, :t])


def test_chunked_scores_equal_the_authors_naive_form_and_the_explicit_products():
  """19 tokens, 2 key heads of 2 query heads each: fla's chunked reference (chunks 1, 4, 8)
  equals the explicit products (so H_i is the first applied to the query, H_{j+1} the last);
  path_logits (chunks 1, 8 and one longer than the sequence) equals them, with the
  queries moved back past every token and keys_to_end moving keys to the last token."""
  rng = np.random.default_rng(0)
  b, kv, g, t, h = 1, 2, 2, 19, 6
  q = rng.normal(size=(b, kv, g, t, h))
  k = rng.normal(size=(b, kv, t, h))
  w = rng.normal(size=(b, kv, t, h))
  w /= np.linalg.norm(w, axis=-1, keepdims=True)
  beta = rng.uniform(0.0, 2.0, size=(b, kv, t))
  want = np.array([[[_explicit_scores(q[0, n, m], k[0, n], w[0, n], beta[0, n])
                     for m in range(g)] for n in range(kv)]])
  for chunk in (1, 4, 8):
    fla = np.array([[[_fla_naive_scores(q[0, n, m], k[0, n], w[0, n], beta[0, n], chunk)
                      for m in range(g)] for n in range(kv)]])
    np.testing.assert_allclose(fla, want, atol=1e-9)
  causal = np.tril(np.ones((t, t), bool))
  # H_{t-1} ... H_1 and H_{t-1} ... H_0 per key head.
  after_first = np.array([_product(w[0, n, 1:], beta[0, n, 1:]) for n in range(kv)])
  after_none = np.array([_product(w[0, n], beta[0, n]) for n in range(kv)])
  earlier = rng.normal(size=(b, kv, 3, h))
  chunks = (1, 8, 32)  # token by token; 3 chunks, the last partial; one (clipped to 19)
  results = jax.jit(lambda q, k, w, beta, earlier: [
      (path.path_logits(q, k, w, beta, c), path.keys_to_end(k, w, beta, earlier, c))
      for c in chunks])(*(jnp.asarray(x, jnp.float32) for x in (q, k, w, beta, earlier)))
  for (got, q_start), (keys, moved) in results:
    np.testing.assert_allclose(np.where(causal, got, 0.0), want, atol=2e-5)
    # The last query moved back past every token: q^T H_{t-1} ... H_0.
    np.testing.assert_allclose(q_start[0, :, :, -1], np.einsum(
        "kgh,khe->kge", q[0, :, :, -1], after_none), atol=2e-5)
    np.testing.assert_allclose(keys[0, :, 0], np.einsum("keh,kh->ke", after_first, k[0, :, 0]),
                               atol=2e-5)
    np.testing.assert_allclose(keys[0, :, -1], k[0, :, -1], atol=1e-6)  # no transform after it
    np.testing.assert_allclose(moved[0], np.einsum("keh,ksh->kse", after_none, earlier[0]),
                               atol=2e-5)


def _naive_path_layer(mixer, x_BxLxD):
  """fla's PaTHAttention.forward (training branch) and naive_path_attn's softmax, with the
  scores taken token by token: every key carried forward through each new token's H_t."""
  t = x_BxLxD.shape[1]
  group = mixer.num_heads // mixer.num_kv_heads
  q, k, v = mixer.query(x_BxLxD), mixer.key(x_BxLxD), mixer.value(x_BxLxD)
  if mixer.use_qk_norm:
    rms = lambda x, s: x / jnp.sqrt(jnp.mean(x ** 2, -1, keepdims=True) + 1e-5) * s  # noqa: E731
    q, k = rms(q, mixer.q_norm_scale[...]), rms(k, mixer.k_norm_scale[...])
  w = (mixer.w_up(mixer.w_down(x_BxLxD)) if hasattr(mixer, "w_up") else mixer.w_proj(x_BxLxD))
  if mixer.conv_width:  # PyTorch's Conv1d, padding width - 1, the last tap on the token itself
    width = mixer.conv_width
    padded = jnp.pad(w, [(0, 0), (width - 1, 0), (0, 0), (0, 0)])
    w = jax.nn.silu(sum(mixer.w_conv[...][i] * padded[:, i:i + t] for i in range(width)))
  w = w / jnp.sqrt(jnp.sum(w ** 2, -1, keepdims=True) + 1e-6)
  beta = 2 * jax.nn.sigmoid(mixer.beta_proj(x_BxLxD))
  # Key heads repeated for their query heads (naive_path_attn's expand), heads first.
  k, w, v = (jnp.repeat(x, group, axis=2).transpose(0, 2, 1, 3) for x in (k, w, v))
  beta = jnp.repeat(beta, group, axis=2).transpose(0, 2, 1)
  q = q.transpose(0, 2, 1, 3)
  def step(carried, token):  # apply H_i to the keys before i, then read row i of the scores
    i, q_i, w_i, beta_i = token
    update = beta_i[..., None, None] * jnp.einsum("bnjh,bnh->bnj", carried, w_i)[
        ..., None] * w_i[:, :, None, :]
    carried = jnp.where((jnp.arange(t) < i)[:, None], carried - update, carried)
    return carried, jnp.einsum("bnh,bnjh->bnj", q_i, carried)

  tokens_first = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
  _, rows = jax.lax.scan(step, k, (jnp.arange(t), tokens_first(q), tokens_first(w),
                                   tokens_first(beta)))
  scores = jnp.moveaxis(rows, 0, 2)
  if mixer.use_forget_gate:
    c = jnp.cumsum(jax.nn.log_sigmoid(mixer.forget_gate(x_BxLxD)), axis=1).transpose(0, 2, 1)
    scores = scores + c[..., :, None] - c[..., None, :]
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
  o = jax.nn.softmax(scores * mixer.head_dim ** -0.5, axis=-1) @ v
  return mixer.out(o.transpose(0, 2, 1, 3))


FULL = dict(chunk_size=8, use_forget_gate=True, use_qk_norm=True)  # GQA: 4 heads over 2
PLAIN = dict(chunk_size=5, conv_width=0, w_rank=0, use_forget_gate=False)


@pytest.mark.parametrize("settings,kv_heads", [(FULL, 2), (PLAIN, 4)], ids=["full", "plain"])
def test_mixer_equals_the_authors_layer_with_gradients(settings, kv_heads):
  """21 tokens over chunks of 8 (forget gate, qk norm, low-rank w with its convolution, GQA)
  or 5 (none of them, MHA): outputs and the gradients w.r.t. the input and every parameter."""
  mixer = _mixer("path", position="none", num_kv_heads=kv_heads, path=settings)
  _assert_mixer_equals_naive(mixer, _naive_path_layer)


def test_packed_documents_weights_and_decode():
  """Packed rows equal each document alone through the naive layer; the attention weights sum
  to 1 within the document, 0 outside; decoding 8 tokens into the empty cache, 1, then 28
  (four chunks of new tokens, moving the cached keys) equals the naive layer."""
  mixer = _mixer("path", position="none", path=FULL)
  graphdef, state = nnx.split(mixer)
  x = _normal(0, (2, 37, 32))
  positions = jnp.arange(37)[None]

  @jax.jit
  def run(state, x):
    mixer = nnx.merge(graphdef, state)
    packed = mixer(x, positions, SEGMENTS_37)
    weights = mixer.attention_weights(x, positions, SEGMENTS_37)
    cache, steps = mixer.init_cache(2, 37), []
    for start, stop in ((0, 8), (8, 9), (9, 37)):
      y, cache = mixer.decode(x[:, start:stop], cache, start)
      steps.append(y)
    return packed, weights, jnp.concatenate(steps, axis=1)

  packed, weights, decoded = run(state, x)
  # Each document alone: its tokens rolled to the start of a row (what follows it is causally
  # irrelevant), through the naive layer in one call with the two rows unpacked.
  segments = np.asarray(SEGMENTS_37)
  documents = [(row, int(np.argmax(segments[row] == s)), int((segments[row] == s).sum()))
               for row in range(2) for s in np.unique(segments[row])]
  naive = jax.jit(lambda x: _naive_path_layer(mixer, x))(jnp.concatenate(
      [jnp.stack([jnp.roll(x[row], -start, axis=0) for row, start, _ in documents]), x]))
  for i, (row, start, length) in enumerate(documents):
    np.testing.assert_allclose(packed[row, start:start + length], naive[i, :length],
                               atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(decoded, naive[len(documents):], atol=1e-4, rtol=1e-4)
  same = segments[:, None, :, None] == segments[:, None, None, :]
  np.testing.assert_allclose(np.where(same, weights, 0.0).sum(-1), 1.0, atol=1e-5)
  assert float(np.abs(np.where(same, 0.0, weights)).max()) == 0.0


def test_cache_bytes_settings_and_refusals():
  config = tiny_model_config(attention="path", position="none")
  mixer = _mixer("path", position="none")
  per_token = path.PaTHAttention.cache_bytes_per_token(config)
  assert per_token == 2 * 8 * (4 + 4) + 4 * 4  # float32 keys and values, K = 2, c of N = 4
  assert mixer.cache_bytes(3, 50) - mixer.cache_bytes(3, 10) == 3 * 40 * per_token
  assert path.PaTHAttention.position_hooks == frozenset()
  assert "none" in model_lib.compatible_positions(path.PaTHAttention)
  with pytest.raises(ValueError, match="qk"):
    model_lib.validate(tiny_model_config(attention="path", position="rope"))
  for field, value in (("chunk_size", 0), ("conv_width", -1), ("w_rank", -1)):
    with pytest.raises(ValueError, match=f"model.path.{field}"):
      model_lib.validate(tiny_model_config(attention="path", position="none",
                                           path={field: value}))
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    model_lib.validate(tiny_model_config(attention="path", position="none", num_kv_heads=3))
