"""Packed documents (data.packing = "documents"): segment ids, positions and the loss mask of
windows cut from a corpus' token stream, in which END_OF_DOCUMENT (EOD) ends every document.

A window is a row of inputs x_0 .. x_{L-1}. Token t starts a segment if t > 0 and x_{t-1} = EOD
(an evaluation window cut short by the end of the text also starts one at its first PAD):

  segments_t  = #{0 < s <= t : s starts a segment}  (= #{s < t : x_s = EOD} without padding)
  positions_t = t - f_t,  f_t = max({0} u {0 < s <= t : s starts a segment})
  loss_mask_t = 0 where x_t = EOD (its target begins the next document), unchanged elsewhere

So EOD belongs to the document it ends, ids start at 0 in every row and never decrease, positions
restart at 0 at each document start, and a window that starts mid-document starts at position 0.
Right-padding is one more segment (the last id + 1) at positions 0, 1, ..., always unscored. The
model lets a token attend to, or carry recurrent state from, only tokens of its own segment: the
per-document causal mask of packed training without cross-document attention (Krell et al.,
arXiv:2107.02027; Zhao et al., arXiv:2402.13991).
"""

import numpy as np

from research.data import vocab

PACKINGS = ("concat", "documents")


def check(packing: str):
  """Raise ValueError for an unknown data.packing, naming the valid ones."""
  if packing not in PACKINGS:
    raise ValueError(f"data.packing={packing!r} is unknown; valid: {', '.join(PACKINGS)} "
                     "(concat: windows run across documents; documents: each token sees only "
                     "its own document)")


def documents(config) -> bool:
  """Whether `config` packs documents (data.packing = "documents")."""
  check(config.data.packing)
  return config.data.packing == "documents"


def annotate(batch: dict, lengths: np.ndarray | None = None, eod: int = vocab.EOD) -> dict:
  """`batch` with int32 `segments` and `positions` [B, L] and the end-of-document token's (`eod`:
  the tokenizer's) loss mask set to 0.

  lengths: the number of real (non-PAD) inputs of each row, for right-padded evaluation windows;
  None when every input is real.
  """
  inputs = batch["inputs"]
  length = inputs.shape[1]
  starts = np.zeros(inputs.shape, bool)
  starts[:, 1:] = inputs[:, :-1] == eod
  if lengths is not None:
    padded = np.flatnonzero((0 < lengths) & (lengths < length))
    starts[padded, lengths[padded]] = True
  index = np.arange(length)
  first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
  return dict(batch, segments=np.cumsum(starts, axis=1, dtype=np.int32),
              positions=(index - first).astype(np.int32),
              loss_mask=batch["loss_mask"] * (inputs != eod).astype(np.float32))
