"""Decoding packed documents (LanguageModel.init_cache(..., documents=True)): what is refused
and how. That a document cache decodes what the packed forward pass computes is checked for
every mixer that takes one by the conformance suite (tests/test_conformance.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention
from research.model.attention import base
from research.model.attention import masks
from tests.conftest import tiny_model_config


def _model(**overrides):
  return research.build_model(tiny_model_config(**overrides), rngs=nnx.Rngs(0))


class _NoDocumentDecode(attention.REGISTRY["mha"]):
  """mha declaring that its decode cannot take packed documents (the base class's default)."""
  document_decode_refusal = classmethod(base.Mixer.document_decode_refusal.__func__)


@pytest.fixture
def refusing_mixer():
  attention.REGISTRY.register("no_document_decode", _NoDocumentDecode, settings="softmax")
  yield "no_document_decode"
  attention.REGISTRY.unregister("no_document_decode")


def test_a_mixer_that_cannot_decode_documents_is_refused_by_name(refusing_mixer):
  """Every registered mixer decodes documents (the conformance suite); one that cannot is
  refused before any cache is built, naming it, its reason and the mixers that can."""
  model = _model(attention=refusing_mixer, position="none")
  with pytest.raises(ValueError, match=f"cannot decode packed documents: {refusing_mixer}: its "
                                       "decode has no document boundaries.*mixers that can .*mha"):
    model.init_cache(2, 8, documents=True)
  model.init_cache(2, 8)  # the plain cache still builds


def test_segment_ids_and_the_cache_must_agree():
  model = _model(attention="mha", position="rope")
  tokens = jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="cache made without documents"):
    model.decode(tokens, model.init_cache(2, 8), jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="pass the new tokens' segment ids"):
    model.decode(tokens, model.init_cache(2, 8, documents=True))
  with pytest.raises(ValueError, match="one id per new token"):
    model.decode(tokens, model.init_cache(2, 8, documents=True), jnp.zeros((2, 2), jnp.int32))
  logits, _ = model.decode(tokens, model.init_cache(2, 8, documents=True), [[0, 0, 1], [2, 2, 2]])
  assert logits.shape == (2, 3, 61)  # ids as a list
  with pytest.raises(ValueError, match="non-decreasing"):
    model.decode(tokens, model.init_cache(2, 8, documents=True),
                 jnp.asarray([[0, 1, 0], [0, 0, 0]], jnp.int32))


def test_decode_documents_positions_and_starts():
  """The second call continues row 0's document 1 and starts document 2 in row 1 at its first
  token; positions restart at each start."""
  segments = jnp.asarray([[1, 1, 2], [0, 0, 0]], jnp.int32)
  documents = masks.decode_documents(segments, jnp.int32(5), open_segment_B=jnp.asarray([1, 0]),
                                     open_start_B=jnp.asarray([3, 0]))
  np.testing.assert_array_equal(documents.starts_BxT, [[3, 3, 7], [0, 0, 0]])
  np.testing.assert_array_equal(documents.positions_BxT, [[2, 3, 0], [5, 6, 7]])
  np.testing.assert_array_equal(documents.restart_B, [False, False])
  documents = masks.decode_documents(jnp.asarray([[2], [1]], jnp.int32), jnp.int32(5),
                                     open_segment_B=jnp.asarray([1, 1]),
                                     open_start_B=jnp.asarray([3, 2]))
  np.testing.assert_array_equal(documents.starts_BxT, [[5], [2]])
  np.testing.assert_array_equal(documents.restart_B, [True, False])


# Settings the conformance suite does not run (it builds each mixer at its test settings).
SETTINGS = {
    # strided's pattern is one of distances; local_global's global tokens are the rolling
    # cache's sinks, each document's own (the suite runs sparse's fixed pattern).
    "sparse-strided": dict(attention="sparse", position="rope",
                           sparse=dict(pattern="strided", stride=4, summary=128)),
    "sparse-local_global": dict(attention="sparse", position="rope",
                                sparse=dict(pattern="local_global", window=5, global_tokens=2,
                                            stride=1024, summary=128)),
    # The long convolution, from its history buffer (the suite's one layer is a short one).
    "baseconv-long": dict(attention="baseconv", position="none",
                          baseconv=dict(kernel_size=-1, implicit_long_conv=False)),
}


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_other_settings_decode_documents_as_the_packed_forward(settings):
  model = _model(**settings)
  # Row 1's second document starts at the last token of a call and goes on in the next.
  segments = jnp.asarray([[0] * 5 + [1] * 11, [0] * 8 + [1] * 8], jnp.int32)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 61)
  expected = model(tokens, segments_BxL=segments)
  cache = model.init_cache(2, 16, documents=True)
  logits = []
  for start, end in ((0, 4), (4, 9), (9, 10), (10, 11), (11, 16)):
    out, cache = model.decode(tokens[:, start:end], cache, segments[:, start:end])
    logits.append(out)
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), expected, atol=2e-4, rtol=2e-4)
  unpacked = model(tokens, segments_BxL=jnp.zeros_like(segments))
  assert float(jnp.abs(unpacked[0, 5:] - expected[0, 5:]).max()) > 1e-4


@pytest.mark.parametrize("name", ["moba", "nsa", "sparse"])
def test_block_routed_mixers_count_blocks_from_each_document_start(name):
  """MoBA's and NSA's blocks (4 tokens at their test settings) and sparse's fixed stride blocks
  count from each document's start in decoding too: a document starting inside a call with two
  complete blocks before its last token there (row 0, call 2..16) routes among the new tokens;
  one going on from the cache routes over its blocks there, counted from its start (row 1,
  document 1 from token 8, calls 16.. with two complete blocks before)."""
  model = _model(attention=name, position="rope")
  segments = jnp.asarray([[0] * 5 + [1] * 11 + [2] * 4, [0] * 8 + [1] * 12], jnp.int32)
  tokens = jax.random.randint(jax.random.key(0), (2, 20), 0, 61)
  expected = model(tokens, segments_BxL=segments)
  cache = model.init_cache(2, 20, documents=True)
  logits = []
  for start, end in ((0, 2), (2, 16), (16, 17), (17, 20)):
    out, cache = model.decode(tokens[:, start:end], cache, segments[:, start:end])
    logits.append(out)
  np.testing.assert_allclose(jnp.concatenate(logits, axis=1), expected, atol=2e-4, rtol=2e-4)


def test_fox_restarts_its_cumulative_forget_gate_at_each_document():
  """FoX's cached c (the cumulative log forget gate) is 0 at each document's first token, as in
  the packed forward pass, rather than continuing over the stream: documents started inside a
  call (row 0, token 4), at its first token (row 1, token 6) and at a single token (row 0, 9)."""
  model = _model(attention="fox", position="none")
  segments = jnp.asarray([[0] * 4 + [1] * 5 + [2] * 3, [0] * 6 + [1] * 6], jnp.int32)
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 61)
  cache = model.init_cache(2, 12, documents=True)
  for start, end in ((0, 6), (6, 9), (9, 10), (10, 12)):
    _, cache = model.decode(tokens[:, start:end], cache, segments[:, start:end])
  c = cache["layers"][0]["mixer"]["log_forget"]
  for row, first in ((0, 0), (0, 4), (0, 9), (1, 0), (1, 6)):
    np.testing.assert_array_equal(c[row, first], 0.0)
  assert bool((c[0, 5:9] < 0).all())  # log sigmoid < 0: c falls within a document
