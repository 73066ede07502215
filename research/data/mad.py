"""MAD, the mechanistic architecture design suite (Poli et al., arXiv:2403.17844): its six tasks.

What each task generates follows athms/mad-lab@0f49a452b84ca0d13f8eb9c1ffa649032376fb1b:
mad/data/instances.py (the generators), mad/configs.py (what the benchmark passes them:
multi_query=True, the memorization map's seed 12345, 1,280 test examples) and
configs/tasks/*.yml (each task's baseline and its `changes` grid, BASELINES and CHANGES below).
The code here is this lab's own; where it draws differently from mad-lab (not the same random
stream, and the few deviations named below) the examples still follow mad-lab's distribution.

A task's "size" is mad-lab's `seq_len`; data.task_vocab_size is mad-lab's `vocab_size`, i.e. its
token ids 0..vocab_size-1 *include* MAD's own special tokens (copy/insert/compression/blank/pad
tokens, noise tokens), laid out as mad-lab lays them out. The lab's SEP and PAD
(research.data.vocab.TaskVocab: ids vocab_size, vocab_size + 1) come after them: PAD right-pads
examples (never scored) and fills compression's reconstruction slots; SEP is unused. A generator
is `generate(rng, size, TaskVocab, Settings, train) -> (inputs, targets, scored)`, three arrays of
one length: unlike the lab's other tasks (one sequence, targets = the next input), three of MAD's
tasks have targets that are not the next input (selective copying and compression answer at
blank slots; memorization at insert tokens), so a MAD example is its inputs and targets
explicitly, as mad-lab's instance functions return them, with `scored` for its ignore index.

Which positions are scored (mad-lab trains with cross-entropy ignoring -100 and reports test
accuracy over the same non-ignored positions):
- the three recall tasks train on *every* next token (mad-lab's `is_training` branch returns
  inputs[:-1], inputs[1:]) and are tested on the recalled values only: with multi_query, every
  value whose key already appeared earlier in the sequence, and the final probe's value;
- selective copying, memorization and compression score the same positions in training and test.

The tasks (V = data.task_vocab_size):
- mad_in_context_recall: seq_len / 2 - 1 key-value pairs, keys drawn uniformly (with
  repetition) from ids [0, V/2), each key's value fixed per sequence, drawn uniformly from
  [V/2, V) at its first appearance; then a final probe: a key shown earlier, with its value.
  seq_len - 1 inputs (mad-lab's sequence of seq_len tokens, shifted).
- mad_noisy_in_context_recall: the same, with the last noise_vocab_size ids as noise tokens:
  each pair but one (never noise) is replaced by two noise tokens with probability frac_noise
  (mad-lab draws that one among all seq_len / 2 slots, the probe's included, so that rarely no
  context pair is guaranteed; here it is one of the context pairs).
  Keys/values use the first V - noise_vocab_size ids. Baseline: V = 32 (16 noise), 0.2.
- mad_fuzzy_in_context_recall: keys and values are motifs: k tokens (1 <= k <= k_motif_size,
  uniform; at test always k_motif_size) drawn without repetition from the key ids [0, (V-1)/2),
  values of 1..v_motif_size tokens from [(V-1)/2, V-1), concatenated with no separators; a probe
  pair is inserted at a uniform offset and queried at the end; left-padded with id V-1 to
  exactly seq_len inputs (training scores the padding too, as mad-lab does). mad-lab's quirk is
  kept: its loop can stop before reaching the probe's offset, and then the final query's value
  was never shown (`fuzzy_layout` returns whether it was).
- mad_selective_copying: num_tokens_to_copy tokens drawn from [0, V-2), with
  seq_len - 2 num_tokens_to_copy - 1 blanks (id V-2) inserted before uniformly chosen tokens;
  then the copy token (V-1) and num_tokens_to_copy blanks, at which the tokens are the targets in
  order. seq_len inputs. (mad-lab draws the blank positions from numpy's global random state,
  so its datasets do not follow its seed; these follow the example's generator.)
- mad_memorization: a fixed key -> value map (seeded 12345, as mad-lab's benchmark seeds it):
  keys [0, (V-1)/2), values [(V-1)/2, V-1) shuffled, paired in order (`memorization_map`), id
  V-1 the insert token. Inputs k_1 I k_2 I ...: seq_len / 2 keys drawn uniformly, each followed
  by the insert token, whose target is the key's value. Train and test draw from the same map
  (mad-lab: 256 training sequences of 32; 1,280 test sequences).
- mad_compression: seq_len - 1 tokens uniform from [0, V-1), then the compression token V-1.
  mad-lab scores it with an autoencoder (mad/model/auto_encoder.py): its mixers encode the
  sequence, the last position's vector alone is decoded by a position-wise MLP (no sequence
  mixing) into all seq_len tokens, so every mixer must squeeze the sequence into one
  d_model-wide vector. A decoder-only LM cannot force that bottleneck without a model change;
  the closest decoder-only form, used here: the compression token is followed by seq_len - 1
  PAD slots, and the compression token's position and the slots must output the seq_len tokens
  in order (2 seq_len - 1 inputs; the same seq_len scored targets as mad-lab's, the last being
  the compression token itself). The difference: the slots can read the sequence back through
  the mixer, so for softmax attention (and other mixers that keep the whole context) this is
  copying at distance seq_len, not compression; only fixed-state mixers are bottlenecked, by
  their state rather than by one d_model vector. Scores are not comparable with mad-lab's
  compression column for attention-like mixers.
"""

import dataclasses
import functools
from typing import Callable

import numpy as np

MAD_LAB = "athms/mad-lab@0f49a452b84ca0d13f8eb9c1ffa649032376fb1b"
MEMORIZATION_MAP_SEED = 12345  # mad/configs.py: generate_kv_map(..., seed=self.seed), 12345
NUM_TEST_EXAMPLES = 1280  # mad/configs.py: MADConfig.num_test_examples


@dataclasses.dataclass(frozen=True)
class Settings:
  """The task settings beyond vocabulary, length and training examples (data.mad_<name>); a
  task reads only its own (Task.reads), the others stay at these neutral values."""

  frac_noise: float = 0.0
  noise_vocab_size: int = 0
  k_motif_size: int = 1
  v_motif_size: int = 1
  num_tokens_to_copy: int = 0


def settings(config) -> Settings:
  """The configured task's Settings, reading only the data.mad_* fields that task reads."""
  d = config.data
  return Settings(**{name: d[f"mad_{name}"] for name in TASKS[d.name].reads})


# -- in-context recall, noisy in-context recall -----------------------------------------------


def _recall(rng, size, vocab, s, train):
  num_symbols = vocab.num_symbols - s.noise_vocab_size  # multi_query: no copy prefix
  half = num_symbols // 2
  context = size // 2 - 1  # pairs before the final probe
  noise = np.zeros(context, bool)
  if s.frac_noise > 0:
    noise = rng.random(context) < s.frac_noise
    noise[rng.integers(context)] = False  # at least one pair to probe
  keys = rng.integers(0, half, context)
  value_of = rng.integers(half, num_symbols, half)  # each key's value in this sequence
  pairs = np.stack([keys, value_of[keys]], axis=1)
  pairs[noise] = rng.integers(num_symbols, vocab.num_symbols, (int(noise.sum()), 2))
  probe = rng.choice(np.unique(keys[~noise]))
  seq = np.concatenate([pairs.ravel(), [probe, value_of[probe]]])
  # scored: a pair's value when its key was shown in an earlier (non-noise) pair; the probe's
  shown = np.flatnonzero(~noise)
  _, first = np.unique(keys[shown], return_index=True)
  repeat = np.ones(shown.size, bool)
  repeat[first] = False
  scored = np.zeros(seq.size, bool)
  scored[2 * shown[repeat] + 1] = True
  scored[-1] = True
  if train:
    scored[:] = True
  return seq[:-1], seq[1:], scored[1:]


# -- fuzzy in-context recall -----------------------------------------------------------------


def fuzzy_layout(rng, size, num_symbols, s, train):
  """(padding, pairs, probe_shown): mad-lab's fuzzy sequence before assembly. pairs is a list of
  (key motif, value motif, scored) in order, the final query last; padding the number of pad
  tokens before them; probe_shown whether the final query's key appeared in an earlier pair."""
  symbols = num_symbols - 1  # the last id pads
  half = symbols // 2
  key_sizes = np.arange(1, s.k_motif_size + 1) if train else np.array([s.k_motif_size])

  def motif(low, high, length):
    return tuple(int(t) for t in low + rng.choice(high - low, length, replace=False))

  probe_key = motif(0, half, rng.choice(key_sizes))
  probe_value = motif(half, symbols, rng.integers(1, s.v_motif_size + 1))
  probe_length = len(probe_key) + len(probe_value)
  probe_at = rng.integers(size - 2 * probe_length)
  stop = size - probe_length - (s.k_motif_size + s.v_motif_size)
  pairs, values, length, probe_added = [], {}, 0, False
  while length < stop:
    key_size, value_size = rng.choice(key_sizes), rng.integers(1, s.v_motif_size + 1)
    if length >= probe_at and not probe_added:
      key, value, probe_added = probe_key, probe_value, True
    else:
      key = motif(0, half, key_size)
      if key == probe_key:
        value, probe_added = probe_value, True
      else:
        value = values.get(key) or motif(half, symbols, value_size)
    pairs.append((key, value, key in values))
    values[key] = value
    length += len(key) + len(value)
  pairs.append((probe_key, probe_value, True))
  return size + 1 - length - probe_length, pairs, probe_key in values


def _fuzzy(rng, size, vocab, s, train):
  padding, pairs, _ = fuzzy_layout(rng, size, vocab.num_symbols, s, train)
  seq = [vocab.num_symbols - 1] * padding
  scored = [False] * padding
  for key, value, value_scored in pairs:
    seq += [*key, *value]
    scored += [False] * len(key) + [value_scored] * len(value)
  seq, scored = np.array(seq), np.array(scored)
  if train:
    scored[:] = True
  return seq[:-1], seq[1:], scored[1:]


# -- selective copying -----------------------------------------------------------------------


def _selective_copying(rng, size, vocab, s, train):
  del train  # the same positions are scored in training and test
  n, symbols = s.num_tokens_to_copy, vocab.num_symbols - 2
  blank, copy = vocab.num_symbols - 2, vocab.num_symbols - 1
  tokens = rng.integers(0, symbols, n)
  num_blanks = size - 2 * n - 1
  blanks_before = np.bincount(rng.integers(0, n, num_blanks), minlength=n)
  inputs = np.full(size, blank)
  inputs[np.arange(n) + np.cumsum(blanks_before)] = tokens
  inputs[n + num_blanks] = copy
  targets = np.full(size, vocab.pad)
  targets[n + num_blanks + 1:] = tokens
  scored = np.zeros(size, bool)
  scored[n + num_blanks + 1:] = True
  return inputs, targets, scored


# -- memorization ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def memorization_map(num_symbols: int) -> tuple[np.ndarray, np.ndarray]:
  """(keys, values): the fixed map key i -> value i of a vocabulary of num_symbols ids (the last
  is the insert token): both halves of the other ids shuffled by a generator seeded 12345,
  paired in order; a value left over (odd count) is never used."""
  rng = np.random.default_rng(MEMORIZATION_MAP_SEED)
  symbols = num_symbols - 1
  half = symbols // 2
  keys = rng.permutation(half)
  values = half + rng.permutation(symbols - half)
  count = min(keys.size, values.size)
  keys, values = keys[:count], values[:count]
  keys.flags.writeable = values.flags.writeable = False
  return keys, values


def _memorization(rng, size, vocab, s, train):
  del s, train  # the same positions are scored in training and test
  keys, values = memorization_map(vocab.num_symbols)
  chosen = rng.integers(0, keys.size, size // 2)
  inputs = np.stack([keys[chosen], np.full(chosen.size, vocab.num_symbols - 1)], 1).ravel()
  targets = np.stack([np.full(chosen.size, vocab.pad), values[chosen]], 1).ravel()
  scored = np.arange(inputs.size) % 2 == 1
  return inputs, targets, scored


# -- compression (decoder-only form) ---------------------------------------------------------


def _compression(rng, size, vocab, s, train):
  del s, train  # the same positions are scored in training and test
  compress = vocab.num_symbols - 1
  sequence = np.concatenate([rng.integers(0, compress, size - 1), [compress]])
  inputs = np.concatenate([sequence, np.full(size - 1, vocab.pad)])
  targets = np.full(inputs.size, vocab.pad)
  targets[size - 1:] = sequence
  scored = np.arange(inputs.size) >= size - 1
  return inputs, targets, scored


# -- the suite -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
  generate: Callable  # (rng, size, TaskVocab, Settings, train) -> (inputs, targets, scored)
  inputs_for_size: Callable[[int], int]
  size_for_length: Callable[[int], int]
  reads: tuple[str, ...]  # the Settings fields it reads (config: data.mad_<field>)
  baseline: dict  # configs/tasks/<task>.yml `baseline` (multi_query: True omitted)
  changes: dict  # ... and its `changes`: each axis varied alone from the baseline
  mad_name: str  # mad-lab's task name


_EVEN = lambda length: length // 2 * 2
_RECALL_CHANGES = {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024),
                   "num_train_examples": (6400, 3200, 1600, 800)}

TASKS = {
    "mad_in_context_recall": Task(
        _recall, lambda n: n - 1, lambda l: _EVEN(l + 1), (),
        {"vocab_size": 16, "seq_len": 128, "num_train_examples": 12800}, _RECALL_CHANGES,
        "in-context-recall"),
    "mad_fuzzy_in_context_recall": Task(
        _fuzzy, lambda n: n, lambda l: l, ("k_motif_size", "v_motif_size"),
        {"vocab_size": 16, "seq_len": 128, "num_train_examples": 12800, "k_motif_size": 3,
         "v_motif_size": 3}, _RECALL_CHANGES, "fuzzy-in-context-recall"),
    "mad_noisy_in_context_recall": Task(
        _recall, lambda n: n - 1, lambda l: _EVEN(l + 1), ("frac_noise", "noise_vocab_size"),
        {"vocab_size": 32, "noise_vocab_size": 16, "seq_len": 128, "num_train_examples": 12800,
         "frac_noise": 0.2},
        {**_RECALL_CHANGES, "vocab_size": (48, 80, 144), "frac_noise": (0.4, 0.6, 0.8)},
        "noisy-in-context-recall"),
    "mad_selective_copying": Task(
        _selective_copying, lambda n: n, lambda l: l, ("num_tokens_to_copy",),
        {"vocab_size": 16, "seq_len": 256, "num_tokens_to_copy": 16, "num_train_examples": 12800},
        {"vocab_size": (32, 64, 128), "seq_len": (512, 1024),
         "num_train_examples": (6400, 3200, 1600, 800), "num_tokens_to_copy": (32, 64, 96)},
        "selective-copying"),
    "mad_compression": Task(
        _compression, lambda n: 2 * n - 1, lambda l: (l + 1) // 2, (),
        {"vocab_size": 16, "seq_len": 32, "num_train_examples": 12800},
        {"vocab_size": (32, 64, 128), "seq_len": (64, 128, 256),
         "num_train_examples": (6400, 3200, 1600, 800)}, "compression"),
    "mad_memorization": Task(
        _memorization, lambda n: n, _EVEN, (),
        {"vocab_size": 256, "seq_len": 32, "num_train_examples": 256},
        {"vocab_size": (512, 1024, 2048, 4096, 8192)}, "memorization"),
}

# data.mad_<field> -> the tasks that read it (research.runs.unread refuses it elsewhere)
FIELD_READERS = {f"mad_{field.name}": tuple(n for n, t in TASKS.items() if field.name in t.reads)
                 for field in dataclasses.fields(Settings)}


def settings_grid(task: str) -> list[dict]:
  """mad-lab's settings of `task` (mad/configs.py make_benchmark_mad_configs): the baseline, then
  each `changes` value applied alone to the baseline, in the yml's order."""
  t = TASKS[task]
  grid = [dict(t.baseline)]
  for axis, values in t.changes.items():
    grid += [{**t.baseline, axis: value} for value in values]
  return grid


def overrides(task: str, setting: dict) -> dict:
  """The config overrides ("data.task_vocab_size": ...) of one mad-lab setting of `task`: its
  seq_len becomes train.seq_len and the one evaluation length (inputs of that size)."""
  t = TASKS[task]
  length = t.inputs_for_size(setting["seq_len"])
  result = {"data.name": task, "train.seq_len": length, "eval.lengths": (length,)}
  for name, value in setting.items():
    if name == "vocab_size":
      result["data.task_vocab_size"] = value
    elif name == "num_train_examples":
      result["data.num_train_examples"] = value
    elif name != "seq_len":
      result[f"data.mad_{name}"] = value
  return result


def size_problems(task: str, size: int, num_symbols: int, s: Settings) -> list[str]:
  """Why `task` cannot draw an example of mad-lab seq_len `size` from `num_symbols` ids with
  settings `s` ([] if it can); mad-lab asserts most of these."""
  if task in ("mad_in_context_recall", "mad_noisy_in_context_recall"):
    problems = [] if size >= 4 else [f"{task} needs seq_len >= 4 (a pair and the probe)"]
    if not 0 <= s.frac_noise < 1:
      problems.append(f"data.mad_frac_noise={s.frac_noise} must be in [0, 1)")
    if task == "mad_noisy_in_context_recall" and s.noise_vocab_size < 1:
      problems.append(f"data.mad_noise_vocab_size={s.noise_vocab_size} must be >= 1")
    if num_symbols - s.noise_vocab_size < 2:
      problems.append(f"data.task_vocab_size={num_symbols} leaves "
                      f"{num_symbols - s.noise_vocab_size} key/value ids after the noise ids; "
                      "need >= 2")
    return problems
  if task == "mad_fuzzy_in_context_recall":
    k, v = s.k_motif_size, s.v_motif_size
    if k < 1 or v < 1:
      return [f"data.mad_k_motif_size={k} and data.mad_v_motif_size={v} must be >= 1"]
    half = (num_symbols - 1) // 2
    problems = []
    if half < k or num_symbols - 1 - half < v:
      problems.append(f"data.task_vocab_size={num_symbols} gives {half} key ids and "
                      f"{num_symbols - 1 - half} value ids, too few for motifs of {k} and {v} "
                      "distinct tokens")
    if size <= 2 * (k + v):
      problems.append(f"{task} needs seq_len > 2 (k_motif_size + v_motif_size) = {2 * (k + v)}")
    return problems
  if task == "mad_selective_copying":
    n = s.num_tokens_to_copy
    problems = [] if num_symbols >= 3 else [f"{task} needs data.task_vocab_size >= 3"]
    if n < 1:
      problems.append(f"data.mad_num_tokens_to_copy={n} must be >= 1")
    elif size <= 2 * n + 1:
      problems.append(f"{task} needs seq_len > 2 num_tokens_to_copy + 1 = {2 * n + 1}")
    return problems
  minimum = {"mad_memorization": (3, 2), "mad_compression": (2, 2)}[task]
  return ([f"{task} needs data.task_vocab_size >= {minimum[0]}"] if num_symbols < minimum[0] else
          []) + ([f"{task} needs seq_len >= {minimum[1]}"] if size < minimum[1] else [])


def problems(config) -> list[str]:
  """research.data.validation's checks of a MAD task config: its settings, and every size the
  run draws (training, each evaluation length)."""
  d, t, e = config.data, config.train, config.eval
  task, found = TASKS[d.name], []
  s = settings(config)
  for field, length in [("train.seq_len", t.seq_len)] + [("eval.lengths", l) for l in e.lengths]:
    size = task.size_for_length(length)
    for problem in size_problems(d.name, size, d.task_vocab_size, s):
      problem = f"{problem} ({field} has {length} inputs: seq_len {size})"
      if problem not in found:
        found.append(problem)
  return found
