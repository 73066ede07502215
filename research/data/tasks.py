"""Synthetic length-generalization tasks, one example at a time.

A task writes an example as one token sequence `seq` and a boolean `scored` per position that
marks the tokens the model must predict. The model trains by next-token prediction on
inputs = seq[:-1], targets = seq[1:], loss_mask = scored[1:], so the decoder LM loss trains every
task, and accuracy is exact match over the scored positions. An example's `size` is its number
of symbols n, except for mqar where it is the number of inputs L.

- copy, reverse, sort (arXiv:2305.16843): x_1..x_n SEP y_1..y_n with y = x, x reversed or x
  sorted; scored: y. 2n inputs.
- induction (repeated random tokens, arXiv:2209.11895): P P, P a random prefix of n >= 2 symbols
  whose first symbol does not recur in P, so that symbol announces the second occurrence;
  scored: the rest of the second occurrence, which must continue as the first did. 2n - 1 inputs.
- mqar (Zoology, arXiv:2312.04927): k_1 v_1 .. k_m v_m, then every key queried once: key i at
  offset 2 g_i after the pairs, followed by its value, with the gaps g_i drawn without replacement
  from p(g) ∝ g^(a - 1), a = 0.01, and PAD elsewhere; scored: the values after the queries. Keys
  are distinct symbols from the first half of the symbols, values distinct from the second half.
  L inputs, which needs 4m <= L.
- the algorithmic suite of arXiv:2207.02098 (research.data.algorithmic): x_1..x_n SEP y, and a
  final SEP after answers of variable length; scored: y and that SEP.
- MAD's six tasks (arXiv:2403.17844, research.data.mad: mad_in_context_recall, ...): size is
  mad-lab's seq_len; their generators give inputs, targets and scored explicitly (Task.mad), as
  some answer at blank or insert tokens rather than at the next input, and read data.mad_*.
"""

import dataclasses
from typing import Callable

import numpy as np

from research.data import algorithmic
from research.data import mad
from research.data import vocab as vocab_lib

MQAR_POWER = 0.01


@dataclasses.dataclass(frozen=True)
class Task:
  """How a task draws an example and how its size relates to a length in input tokens."""

  generate: Callable  # (rng, size, TaskVocab, num_kv_pairs) -> (seq, scored)
  inputs_for_size: Callable[[int], int]  # input tokens of an example of that size
  size_for_length: Callable[[int], int]  # largest size that fits in that many inputs
  min_size: int
  min_symbols: int = 2  # data.task_vocab_size must be at least this
  # MAD tasks: generate is (rng, size, TaskVocab, mad.Settings, train) -> (inputs, targets,
  # scored), one length each, and examples always have the size of train.seq_len
  mad: bool = False


def _answer_after_separator(transform):
  def generate(rng, n, vocab, num_kv_pairs):
    del num_kv_pairs
    x = rng.integers(0, vocab.num_symbols, n)
    seq = np.concatenate([x, [vocab.sep], transform(x)])
    return seq, np.arange(seq.size) > n

  return generate


def _induction(rng, n, vocab, num_kv_pairs):
  del num_kv_pairs
  first = rng.integers(0, vocab.num_symbols)
  rest = rng.integers(0, vocab.num_symbols - 1, n - 1)
  prefix = np.concatenate([[first], rest + (rest >= first)])  # skips `first`
  seq = np.concatenate([prefix, prefix])
  return seq, np.arange(seq.size) > n


def _mqar(rng, length, vocab, num_kv_pairs):
  half = vocab.num_symbols // 2
  keys = rng.choice(half, num_kv_pairs, replace=False)
  values = half + rng.choice(vocab.num_symbols - half, num_kv_pairs, replace=False)
  context = 2 * num_kv_pairs
  slots = (length - context) // 2
  p = np.arange(1, slots + 1, dtype=np.float64) ** (MQAR_POWER - 1)
  gaps = rng.choice(slots, num_kv_pairs, replace=False, p=p / p.sum())
  seq = np.full(length + 1, vocab.pad)
  seq[0:context:2], seq[1:context:2] = keys, values
  queries = context + 2 * gaps
  seq[queries], seq[queries + 1] = keys, values
  scored = np.zeros(length + 1, bool)
  scored[queries + 1] = True
  return seq, scored


def _algorithm_task(algorithm):
  def generate(rng, n, vocab, num_kv_pairs):
    del num_kv_pairs
    x = algorithm.sample(rng, n)
    end = [vocab.sep] if algorithm.variable_length else []
    seq = np.concatenate([x, [vocab.sep], algorithm.solve(x), end])
    return seq, np.arange(seq.size) > len(x)

  def inputs_for_size(n):
    return n + algorithm.answer_tokens(n)

  def size_for_length(length):
    """The largest n >= 1 with inputs_for_size(n) <= length (inputs_for_size increases)."""
    low, high = 1, max(length, 1)
    while low < high:
      middle = (low + high + 1) // 2
      low, high = (middle, high) if inputs_for_size(middle) <= length else (low, middle - 1)
    return low

  return Task(generate, inputs_for_size, size_for_length, algorithm.min_size, algorithm.alphabet)


TASKS = {
    "copy": Task(_answer_after_separator(lambda x: x), lambda n: 2 * n, lambda l: l // 2, 1),
    "reverse": Task(
        _answer_after_separator(lambda x: x[::-1]), lambda n: 2 * n, lambda l: l // 2, 1),
    "sort": Task(_answer_after_separator(np.sort), lambda n: 2 * n, lambda l: l // 2, 1),
    "induction": Task(_induction, lambda n: 2 * n - 1, lambda l: (l + 1) // 2, 2),
    "mqar": Task(_mqar, lambda l: l, lambda l: l, 1),
    **{name: _algorithm_task(algorithm) for name, algorithm in algorithmic.SUITE.items()},
    **{name: Task(t.generate, t.inputs_for_size, t.size_for_length, 2, 2, mad=True)
       for name, t in mad.TASKS.items()},
}


def example(task, rng, size, num_symbols, num_kv_pairs, length, mad_settings=None, train=False):
  """One example of `size` as inputs, targets (int32 [length]) and loss_mask (float32 [length]).

  The sequence is right-padded with PAD to length + 1 tokens; padding has loss mask 0. MAD tasks
  also take their mad.Settings and whether the example is for training (their recall tasks
  score every next token in training, the recalled values otherwise).
  """
  vocab = vocab_lib.TaskVocab(num_symbols)
  if TASKS[task].mad:
    inputs, targets, scored = TASKS[task].generate(rng, size, vocab, mad_settings, train)
    return explicit_example(inputs, targets, scored, length, vocab.pad)
  seq, scored = TASKS[task].generate(rng, size, vocab, num_kv_pairs)
  return next_token_example(seq, scored, length, vocab.pad)


def explicit_example(inputs, targets, scored, length: int, pad: int) -> dict:
  """inputs, targets, loss_mask = scored, right-padded with `pad` (loss mask 0) to `length`."""
  padded = np.full((2, length), pad, np.int32)
  padded[0, :inputs.size], padded[1, :targets.size] = inputs, targets
  mask = np.zeros(length, np.float32)
  mask[:scored.size] = scored
  return {"inputs": padded[0], "targets": padded[1], "loss_mask": mask}


def next_token_example(seq: np.ndarray, scored: np.ndarray, length: int, pad: int) -> dict:
  """inputs = seq[:-1], targets = seq[1:], loss_mask = scored[1:], right-padded with `pad` (loss
  mask 0) to `length` positions."""
  padded = np.full(length + 1, pad, np.int32)
  padded[:seq.size] = seq
  mask = np.zeros(length + 1, np.float32)
  mask[:seq.size] = scored
  return {"inputs": padded[:-1], "targets": padded[1:], "loss_mask": mask[1:]}


def train_size(task, rng, min_length, max_length, seq_len):
  """Size of one training example: U(min_length, max_length) symbols, at least the task's
  minimum; mqar examples always have seq_len inputs (Zoology trains at one length), MAD's the
  size of seq_len inputs."""
  if task == "mqar":
    return seq_len
  if TASKS[task].mad:
    return TASKS[task].size_for_length(seq_len)
  return int(rng.integers(max(min_length, TASKS[task].min_size), max_length + 1))
