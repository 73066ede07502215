"""The chunking helpers and the chunked-recurrent base (research/model/attention/chunked.py): the
split / merge round trip with its padding, and a toy subclass whose derived __call__ and decode
agree (in pieces, with packed documents, with positions). The registered mixers on the base run
the conformance suite (tests/test_conformance.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model.attention import chunked
from research.model.attention import masks

SEGMENTS = np.array([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34], np.int32)


@pytest.mark.parametrize("length,chunk", [(37, 8), (32, 8), (5, 8), (1, 1)])
def test_split_then_merge_is_the_identity_and_pads_with_zeros(length, chunk):
  x = jax.random.normal(jax.random.key(0), (2, length, 3, 4))
  z = chunked.num_chunks(length, chunk)
  assert z == int(np.ceil(length / chunk))
  # merge_chunks's axis is the chunk axis of its input: a negative one counts one more axis.
  for axis, chunk_axis in ((1, 1), (-3, -4)):
    split = chunked.split_chunks(x, chunk, axis=axis)
    assert split.shape == (2, z, chunk, 3, 4)
    np.testing.assert_array_equal(split.reshape(2, z * chunk, 3, 4)[:, length:], 0.0)
    np.testing.assert_array_equal(chunked.merge_chunks(split, length, axis=chunk_axis), x)
  moved = jnp.moveaxis(x, 1, -2)  # [2, 3, L, 4]: the tokens before the last axis
  split = chunked.split_chunks(moved, chunk, axis=-2)
  assert split.shape == (2, 3, z, chunk, 4)
  np.testing.assert_array_equal(chunked.merge_chunks(split, length, axis=-3), moved)
  assert chunked.pad_to_chunks(x, chunk).shape == (2, z * chunk, 3, 4)


def test_segment_ids_pad_with_the_last_one():
  split = chunked.split_chunks(jnp.asarray(SEGMENTS), 8, mode="edge")
  assert split.shape == (2, 5, 8)
  flat = np.asarray(split).reshape(2, 40)
  np.testing.assert_array_equal(flat[:, :37], SEGMENTS)
  np.testing.assert_array_equal(flat[:, 37:], SEGMENTS[:, -1:].repeat(3, axis=1))


class Decaying(chunked.ChunkedRecurrentMixer):
  """s_t = s_{t-1} / 2 + x_t (restarting at each document), y_t = s_t (+ the position with
  reads_positions): a state of fixed size, run token by token."""

  def __init__(self, reads_positions=False):
    self.reads_positions = reads_positions

  def init_cache(self, batch_size, max_length):
    del max_length
    return {"state": jnp.zeros((batch_size, 3))}

  def _mix(self, x_BxTxD, cache, segments_BxT=None, **positions):
    starts = (jnp.zeros(x_BxTxD.shape[:2], bool) if segments_BxT is None
              else masks.document_starts(segments_BxT))

    def step(s, inputs):
      x, start = inputs
      s = jnp.where(start[:, None], 0.0, s) / 2 + x
      return s, s

    state, y = jax.lax.scan(step, cache["state"], (x_BxTxD.swapaxes(0, 1), starts.T))
    y = y.swapaxes(0, 1)
    if self.reads_positions:
      y = y + positions["positions_BxT"][..., None]
    return y, {"state": state}

  def mixing_flops_per_token(self, context_length):
    return 2


@pytest.mark.parametrize("reads_positions", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_decode_in_pieces_equals_the_forward_pass(reads_positions, packed):
  """__call__ (from an empty cache) == decode of 13 tokens, then 5, then one at a time; with
  packed documents, from a cache restarted where a document starts."""
  mixer = Decaying(reads_positions)
  x = jax.random.normal(jax.random.key(1), (2, 37, 3))
  segments = jnp.asarray(SEGMENTS) if packed else None
  positions = (masks.positions_in_documents(segments) if packed
               else jnp.arange(37)[None])
  expected = mixer(x, positions, segments)
  cache, index, pieces = mixer.init_cache(2, 37), 0, []
  open_segment, open_start = jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32)
  for t in [13, 5] + [1] * 19:
    documents = None
    if packed:
      documents = masks.decode_documents(segments[:, index:index + t], jnp.int32(index),
                                         open_segment, open_start)
      open_segment, open_start = documents.segments_BxT[:, -1], documents.starts_BxT[:, -1]
    y, cache = mixer.decode(x[:, index:index + t], cache, jnp.int32(index), documents)
    pieces.append(y)
    index += t
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), expected, rtol=1e-6, atol=1e-6)
  if packed:  # the documents made a difference
    assert float(jnp.abs(mixer(x, positions) - expected).max()) > 1e-3
  assert mixer.recurrent and mixer.document_decode_refusal({}) is None
