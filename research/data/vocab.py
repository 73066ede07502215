"""Token ids.

Byte-level language modeling: tokens 0..255 are the bytes of the text, END_OF_DOCUMENT (EOD)
separates documents in the packed stream and PAD fills evaluation windows past the end of the
text (always with loss mask 0).

Synthetic tasks: tokens 0..num_symbols-1 are the task's symbols, followed by SEP (between a
task's input and its answer) and PAD (no content: padding, and filler between MQAR queries).
"""

import dataclasses

EOD = 256
PAD = 257
BYTE_VOCAB_SIZE = 258


@dataclasses.dataclass(frozen=True)
class TaskVocab:
  """Token ids of a synthetic task with `num_symbols` symbol tokens."""

  num_symbols: int

  @property
  def sep(self):
    return self.num_symbols

  @property
  def pad(self):
    return self.num_symbols + 1

  @property
  def size(self):
    return self.num_symbols + 2
