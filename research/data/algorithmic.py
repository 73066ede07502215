"""The algorithmic length-generalization suite of Deletang et al. (arXiv:2207.02098), as used by
Ruoss et al. (arXiv:2305.16843): each task draws an input x of size n and defines its answer y.

research.data.tasks writes an example as x SEP y (then SEP when answers vary in length, marking
where y ends) and scores y and that final SEP only. The papers feed an encoder x followed by
placeholders for y; here a decoder predicts y one token at a time from x and the answer so far
(teacher forcing), and accuracy counts the answer tokens it gets right. Symbols are the token ids
0..alphabet-1 of research.data.vocab.TaskVocab.

- parity_check: x in {0,1}^n; y = (number of 1s) mod 2.
- even_pairs: x in {0,1}^n; y = (number of neighbours 01 or 10) mod 2 (equivalently x_1 != x_n).
- modular_arithmetic: x = d o d o ... d with digits d in 0..4 (ids 0..4) and operators + - *
  (ids 5, 6, 7); n odd (an even n gives n - 1 symbols); y = its value mod 5, * before + and -.
- cycle_navigation: x in {0,1,2}^n, moves -1, 0, +1 on a cycle of 5 places starting at 0;
  y = the final place.
- stack_manipulation: x = a stack of s ~ U{1..n-1} bits, bottom to top, then n - s actions
  POP (2), PUSH 0 (3), PUSH 1 (4), a POP on an empty stack doing nothing; y = the final stack
  top to bottom (n = 1: one bit, its own answer). Variable length.
- duplicate_string: x in {0,1}^n; y = x x.
- missing_duplicate_string: x = w w, w in {0,1}^(n//2), with one position replaced by 2 (and a
  3 appended when n is odd); y = the bit that was replaced. n >= 2.
- odds_first: x in {0,1}^n; y = x_1 x_3 x_5 ... x_2 x_4 ... (odd positions, counting from 1,
  first; the papers' code emits the even ones first, a mirror image of the same difficulty).
- binary_addition: x = a 2 b, little-endian numerals of l ~ U{1..n-2} and n-1-l bits, each a
  uniform value in 1..2^bits - 1; y = a + b little endian without trailing zeros. Variable
  length. n >= 3.
- bucket_sort: x in {0..4}^n; y = x sorted.
"""

import dataclasses
from typing import Callable

import numpy as np

MODULUS = 5
CYCLE = 5
PLUS, MINUS, TIMES = MODULUS, MODULUS + 1, MODULUS + 2  # modular_arithmetic operator ids
POP, PUSH_0, PUSH_1 = 2, 3, 4  # stack_manipulation actions
MISSING, FILL = 2, 3  # missing_duplicate_string: the replaced position, the odd-length filler
ADD = 2  # binary_addition: between the two numerals


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One task of the suite: how to draw an input and what its answer is."""

  sample: Callable[[np.random.Generator, int], np.ndarray]  # an input of size n
  solve: Callable[[np.ndarray], np.ndarray]  # the answer to an input
  alphabet: int  # symbols inputs and answers use
  answer_tokens: Callable[[int], int]  # the most answer tokens (with the end SEP) for size n
  variable_length: bool = False  # answers end with a scored SEP
  min_size: int = 1


def _bits(rng: np.random.Generator, n: int) -> np.ndarray:
  return rng.integers(0, 2, n)


def _symbols(alphabet: int) -> Callable[[np.random.Generator, int], np.ndarray]:
  return lambda rng, n: rng.integers(0, alphabet, n)


def _sample_expression(rng, n):
  size = n if n % 2 else n - 1
  x = np.empty(size, np.int64)
  x[0::2] = rng.integers(0, MODULUS, (size + 1) // 2)
  x[1::2] = rng.integers(PLUS, TIMES + 1, size // 2)
  return x


def _evaluate_expression(x):
  """Sum of products: a product grows until + or - closes it as a term with its sign."""
  total, sign, product = 0, 1, int(x[0])
  for operator, digit in zip(x[1::2].tolist(), x[2::2].tolist()):
    if operator == TIMES:
      product *= digit
    else:
      total += sign * product
      sign, product = (1 if operator == PLUS else -1), digit
  return np.array([(total + sign * product) % MODULUS])


def _sample_stack_program(rng, n):
  if n == 1:
    return _bits(rng, 1)
  stack_size = int(rng.integers(1, n))
  return np.concatenate([_bits(rng, stack_size), rng.integers(POP, PUSH_1 + 1, n - stack_size)])


def _run_stack_program(x):
  start = int(np.argmax(x >= POP)) if (x >= POP).any() else len(x)
  stack = x[:start].tolist()
  for action in x[start:].tolist():
    if action == POP:
      stack = stack[:-1]
    else:
      stack.append(action - PUSH_0)
  return np.array(stack[::-1], np.int64)


def _sample_missing_duplicate(rng, n):
  half = _bits(rng, n // 2)
  x = np.concatenate([half, half, [FILL] * (n % 2)])
  x[rng.integers(0, 2 * (n // 2))] = MISSING
  return x


def _find_missing(x):
  size = len(x) - (x[-1] == FILL)
  i = int(np.flatnonzero(x == MISSING)[0])
  return x[[(i + size // 2) % size]]


def _nonzero_bits(rng, size):
  while True:
    bits = _bits(rng, size)
    if bits.any():
      return bits


def _sample_addition(rng, n):
  first = int(rng.integers(1, n - 1))
  return np.concatenate([_nonzero_bits(rng, first), [ADD], _nonzero_bits(rng, n - 1 - first)])


def _add_little_endian(x):
  """Ripple-carry addition of the numerals around ADD, least significant bit first."""
  split = int(np.flatnonzero(x == ADD)[0])
  a, b = x[:split].tolist(), x[split + 1:].tolist()
  width = max(len(a), len(b))
  a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
  total, carry = [], 0
  for bit_a, bit_b in zip(a, b):
    carry, bit = divmod(bit_a + bit_b + carry, 2)
    total.append(bit)
  total.append(carry)
  while total[-1] == 0:
    total.pop()
  return np.array(total, np.int64)


SUITE = {
    "parity_check": Algorithm(_bits, lambda x: np.array([x.sum() % 2]), 2, lambda n: 1),
    "even_pairs": Algorithm(
        _bits, lambda x: np.array([np.count_nonzero(x[1:] != x[:-1]) % 2]), 2, lambda n: 1),
    "modular_arithmetic": Algorithm(
        _sample_expression, _evaluate_expression, TIMES + 1, lambda n: 1),
    "cycle_navigation": Algorithm(
        _symbols(3), lambda x: np.array([(x - 1).sum() % CYCLE]), 3, lambda n: 1),
    "stack_manipulation": Algorithm(
        _sample_stack_program, _run_stack_program, PUSH_1 + 1, lambda n: n + 1,
        variable_length=True),
    "duplicate_string": Algorithm(_bits, lambda x: np.concatenate([x, x]), 2, lambda n: 2 * n),
    "missing_duplicate_string": Algorithm(
        _sample_missing_duplicate, _find_missing, FILL + 1, lambda n: 1, min_size=2),
    "odds_first": Algorithm(_bits, lambda x: np.concatenate([x[0::2], x[1::2]]), 2, lambda n: n),
    "binary_addition": Algorithm(
        _sample_addition, _add_little_endian, ADD + 1, lambda n: n, variable_length=True,
        min_size=3),
    "bucket_sort": Algorithm(_symbols(5), np.sort, 5, lambda n: n),
}
