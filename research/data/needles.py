"""Needle-in-a-haystack retrieval at byte level: the passkey test and RULER's needle variants.

An example is text of exactly length + 1 bytes, so the model reads `length` inputs:

  filler[:p] "\\n" needle "\\n" filler[p:] "\\n" question answer

The filler repeats FILLER (joined by spaces) and is cut to the F bytes that are left, mid-sentence
if need be, as in the landmark-attention passkey test (arXiv:2305.16300, also YaRN's
arXiv:2309.00071). The needle follows p = round(depth * F) filler bytes: depth 0 puts it first,
depth 1 right before the question. The answer is a space and the value's digits (several values
are separated by ", "); only the digits are scored (loss mask 1), so an example's exact match
means every digit right.

- passkey: needle "The pass key is N. Remember it. N is the pass key.", question
  "What is the pass key? The pass key is", answer " N".
- needle_single (RULER arXiv:2404.06654, S-NIAH on this filler): needle "One of the special magic
  numbers for K is: V.", K a random word of KEY_LETTERS lowercase letters; question "What is the
  special magic number for K? The special magic number for K is", answer " V".
- needle_multikey (MK-NIAH): needle_single plus data.num_distractors needles of other keys, each
  at a uniformly random filler byte; only K is asked.
- needle_multivalue (MV-NIAH): data.num_values needles of K with different values, one sentence
  after another at the depth; question "What are all the special magic numbers for K? The special
  magic numbers for K are", answer " V1, V2, ..." in the order of the text: all must be produced.
  (RULER scatters them and scores recall in any order; adjacent needles keep the depth and the
  order defined.)

Values are numbers of data.needle_value_digits digits without a leading zero, distinct within an
example. Training on the task is allowed: the train split draws lengths uniformly between the
shortest that fits and train.seq_len and depths uniformly in [0, 1], right-padded with PAD.

With a tokenizer (data.tokenizer, research.data.tokenizer: a pretrained model's), the same parts
are rendered and each tokenized on its own ("\\n" needle "\\n", "\\n" question, the answer,
the filler's cycle), and the example is put together in tokens: exactly `length` input tokens,
the filler cut to the tokens that are left, the needle after round(depth * F) of them; the
answer's tokens that hold a digit are scored.
"""

import dataclasses
import functools
from typing import Callable

import numpy as np

from research.data import tasks
from research.data import tokenizer
from research.data import vocab

FILLER = (b"The grass is green. The sky is blue. The sun is yellow. Here we go. "
          b"There and back again.")
KEY_LETTERS = 6
_DIGITS = np.frombuffer(b"0123456789", np.uint8)


@dataclasses.dataclass(frozen=True)
class NeedleParams:
  value_digits: int
  num_distractors: int = 0  # needle_multikey
  num_values: int = 1  # needle_multivalue


@dataclasses.dataclass(frozen=True)
class Layout:
  """The parts of one example before the filler is cut to length."""

  at_depth: bytes  # the needle sentence(s) placed at the depth
  elsewhere: tuple[bytes, ...]  # distractor needles, each at a random filler byte
  question: bytes
  values: tuple[bytes, ...]  # the answer's values, in order


def _numbers(rng, count, digits):
  """`count` distinct numbers of `digits` digits (no leading zero), as bytes."""
  while True:
    numbers = rng.integers(10 ** (digits - 1), 10 ** digits, count)
    if len(set(numbers.tolist())) == count:
      return tuple(str(n).encode() for n in numbers.tolist())


def _keys(rng, count):
  """`count` distinct random words of KEY_LETTERS lowercase letters."""
  while True:
    keys = [bytes(rng.integers(ord("a"), ord("z") + 1, KEY_LETTERS, dtype=np.uint8))
            for _ in range(count)]
    if len(set(keys)) == count:
      return keys


def _magic_number(key, value):
  return b"One of the special magic numbers for %s is: %s." % (key, value)


def _passkey(rng, params):
  (key,) = _numbers(rng, 1, params.value_digits)
  return Layout(b"The pass key is %s. Remember it. %s is the pass key." % (key, key), (),
                b"What is the pass key? The pass key is", (key,))


def _keyed_needles(rng, value_digits, num_distractors):
  """needle_single and needle_multikey: one asked key, num_distractors other keys."""
  key, *others = _keys(rng, 1 + num_distractors)
  value, *other_values = _numbers(rng, 1 + num_distractors, value_digits)
  return Layout(_magic_number(key, value),
                tuple(_magic_number(k, v) for k, v in zip(others, other_values)),
                b"What is the special magic number for %s? The special magic number for %s is"
                % (key, key), (value,))


def _multivalue(rng, params):
  (key,) = _keys(rng, 1)
  values = _numbers(rng, params.num_values, params.value_digits)
  return Layout(b" ".join(_magic_number(key, v) for v in values), (),
                b"What are all the special magic numbers for %s? The special magic numbers for "
                b"%s are" % (key, key), values)


TASKS: dict[str, Callable[[np.random.Generator, NeedleParams], Layout]] = {
    "passkey": _passkey,
    "needle_single": lambda rng, params: _keyed_needles(rng, params.value_digits, 0),
    "needle_multikey": lambda rng, params: _keyed_needles(
        rng, params.value_digits, params.num_distractors),
    "needle_multivalue": _multivalue,
}


def _overhead(layout):
  """Bytes of an example that are not filler."""
  needles = (layout.at_depth,) + layout.elsewhere
  return (sum(len(n) + 2 for n in needles) + 1 + len(layout.question)
          + len(b" " + b", ".join(layout.values)))


@functools.lru_cache(maxsize=64)
def min_length(task: str, params: NeedleParams, tokens=tokenizer.ByteTokenizer()) -> int:
  """The fewest inputs an example of `task` takes (no filler at all), in bytes or `tokens`'s
  tokens."""
  layout = TASKS[task](np.random.default_rng(0), params)
  if not tokens.digest:
    return _overhead(layout) - 1
  return sum(len(part) for part in _tokenized_parts(layout, tokens)) - 1


def _filler(num_bytes):
  cycle = FILLER + b" "
  return (cycle * (num_bytes // len(cycle) + 1))[:num_bytes]


def text(task: str, rng: np.random.Generator, params: NeedleParams, length: int,
         depth: float) -> tuple[bytes, int]:
  """An example's length + 1 bytes, and where its answer starts."""
  layout = TASKS[task](rng, params)
  filler_bytes = length + 1 - _overhead(layout)
  if filler_bytes < 0 or not 0 <= depth <= 1:
    raise ValueError(f"{task} needs length >= {_overhead(layout) - 1} (got {length}) and depth in "
                     f"[0, 1] (got {depth})")
  # Stable sort: at equal offsets the needle at the depth comes first.
  inserts = sorted([(round(depth * filler_bytes), layout.at_depth)]
                   + [(int(rng.integers(0, filler_bytes + 1)), n) for n in layout.elsewhere],
                   key=lambda insert: insert[0])
  filler, parts, start = _filler(filler_bytes), [], 0
  for offset, needle in inserts:
    parts += [filler[start:offset], b"\n", needle, b"\n"]
    start = offset
  answer = b" " + b", ".join(layout.values)
  parts += [filler[start:], b"\n", layout.question, answer]
  result = b"".join(parts)
  return result, len(result) - len(answer)


def _tokenized_parts(layout, tokens):
  """(needle at the depth, *the other needles, question, answer), each tokenized on its own."""
  needles = [tokens.encode(b"\n" + needle + b"\n") for needle in (layout.at_depth,)
             + layout.elsewhere]
  return (*needles, tokens.encode(b"\n" + layout.question),
          tokens.encode(b" " + b", ".join(layout.values)))


def tokenized(task: str, rng: np.random.Generator, params: NeedleParams, length: int,
              depth: float, tokens) -> tuple[np.ndarray, np.ndarray]:
  """An example's length + 1 token ids by `tokens` (a research.data.tokenizer), and which of
  them are scored (the answer's tokens that hold a digit)."""
  layout = TASKS[task](rng, params)
  at_depth, *elsewhere, question, answer = _tokenized_parts(layout, tokens)
  filler_tokens = length + 1 - sum(map(len, (at_depth, *elsewhere, question, answer)))
  if filler_tokens < 0 or not 0 <= depth <= 1:
    raise ValueError(f"{task} needs length >= {length - filler_tokens} tokens (got {length}) "
                     f"and depth in [0, 1] (got {depth})")
  inserts = sorted([(round(depth * filler_tokens), at_depth)]
                   + [(int(rng.integers(0, filler_tokens + 1)), n) for n in elsewhere],
                   key=lambda insert: insert[0])
  filler = np.resize(tokens.encode(FILLER + b" "), filler_tokens)
  parts, start = [], 0
  for offset, needle in inserts:
    parts += [filler[start:offset], needle]
    start = offset
  seq = np.concatenate(parts + [filler[start:], question, answer])
  scored = np.zeros(seq.size, bool)
  scored[seq.size - answer.size:] = [any(c.isdigit() for c in tokens.decode([t]))
                                     for t in answer]
  return seq, scored


def example(task: str, rng: np.random.Generator, params: NeedleParams, length: int,
            depth: float, padded_length: int, tokens=tokenizer.ByteTokenizer()) -> dict:
  """inputs, targets, loss_mask of one example of `length` inputs (bytes, or `tokens`'s
  tokens), padded to padded_length."""
  if tokens.digest:
    seq, scored = tokenized(task, rng, params, length, depth, tokens)
    return tasks.next_token_example(seq.astype(np.int32), scored, padded_length, tokens.pad)
  content, answer_start = text(task, rng, params, length, depth)
  seq = np.frombuffer(content, np.uint8)
  scored = np.isin(seq, _DIGITS) & (np.arange(seq.size) >= answer_start)
  return tasks.next_token_example(seq.astype(np.int32), scored, padded_length, vocab.PAD)


def train_example(task: str, rng: np.random.Generator, params: NeedleParams,
                  seq_len: int, tokens=tokenizer.ByteTokenizer()) -> dict:
  """A training example: length U{min_length..seq_len}, depth U[0, 1], padded to seq_len."""
  length = int(rng.integers(min_length(task, params, tokens), seq_len + 1))
  return example(task, rng, params, length, float(rng.uniform()), seq_len, tokens)
