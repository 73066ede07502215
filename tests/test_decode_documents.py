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
from research.model.attention import masks
from tests.conftest import tiny_model_config


def _model(**overrides):
  return research.build_model(tiny_model_config(**overrides), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", [n for n, cls in attention.REGISTRY.items()
                                  if cls.document_decode_refusal(cls.hyperparameters)])
def test_a_mixer_that_cannot_decode_documents_is_refused_by_name(name):
  """Before any cache is built, naming the mixer, its reason and the mixers that can."""
  model = _model(attention=name, position="none")
  with pytest.raises(ValueError, match=f"cannot decode packed documents: {name}: .*mixers that "
                                       "can .*mha"):
    model.init_cache(2, 8, documents=True)
  model.init_cache(2, 8)  # the plain cache still builds


def test_the_fixed_sparse_pattern_is_refused_its_setting_named():
  model = _model(attention="sparse", position="none")  # test settings: the fixed pattern
  with pytest.raises(ValueError, match="'fixed' pattern counts from each document's start"):
    model.init_cache(2, 8, documents=True)


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
    # cache's sinks, each document's own (the suite runs sparse's fixed pattern, refused).
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
