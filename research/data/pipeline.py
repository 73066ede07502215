"""Batches: training batches as a pure function of (seed, step, process), evaluation batches over
fixed text or examples. Every batch is a dict of numpy arrays `inputs`, `targets` (int32) and
`loss_mask` (float32), each [batch, length]. With data.packing = "documents", language-modeling
batches (training and evaluation) also hold int32 `segments` and `positions` [batch, length]:
each token's document within its row (the number of END_OF_DOCUMENT inputs before it) and its
position in that document (0 at the document's first token, or at the start of a window that
begins mid-document), and END_OF_DOCUMENT inputs get loss mask 0 (research/data/packing.py).
data.packing = "concat" (the default) returns the three arrays alone.

Training, step s: the global batch is drawn from np.random.default_rng((train.seed, s)).
Language modeling takes train.batch_size windows of seq_len + 1 tokens at uniform random starts
in the train split's token stream: inputs = window[:-1], targets = window[1:], loss mask 1.
Tasks take train.batch_size training examples drawn uniformly. Process p of P returns rows
[p B / P, (p + 1) B / P) of the global batch, so the slices concatenated in process order are the
global batch.

Evaluating language modeling at length L scores each of the first N = min(eval.num_tokens,
len - 1) targets of the split's token stream exactly once, the same text for every L:
- nonoverlapping: windows [0, L), [L, 2L), ..., every token scored;
- sliding (arXiv:2108.12409, sliding-window evaluation): windows of L inputs whose ends advance by
  the stride S: L, L + S, L + 2S, ..., the last one ending at N; the first window scores all its
  tokens, each later one only its last S (the last: those not scored yet), so every token after
  the first window is predicted with at least L - S tokens of context.
A window cut short by the end of the text is right-padded with PAD at loss mask 0 (with packed
documents, in one more segment: the row's last id + 1, positions from 0). Tasks are
evaluated on their num_eval_examples examples of exactly L inputs, whatever the mode; needle
tasks on those of one depth of eval.depths, or of every depth one after another.
"""

import itertools

import numpy as np

from research.data import builders
from research.data import catalog
from research.data import packing
from research.data import storage
from research.data import validation
from research.data import tokenizer

_READY = set()


def prepare(config):
  """Validates `config` and prepares its dataset (idempotent, cached, safe across processes)."""
  _ready(config)


def _ready(config):
  dataset, data_dir = catalog.resolve(config), storage.data_dir(config)
  key = (dataset.tfds_name, data_dir)
  if key not in _READY:
    validation.validate(config)
    storage.prepare(dataset, data_dir)
    _READY.add(key)
  return dataset, data_dir


def _stack(examples):
  return {k: np.stack([ex[k] for ex in examples]) for k in ("inputs", "targets", "loss_mask")}


def train_batch(config, step, process_index=0, process_count=1):
  """Rows [p B / P, (p + 1) B / P) of the global training batch of `step` (B = train.batch_size)."""
  batch_size, seq_len = config.train.batch_size, config.train.seq_len
  if not 0 <= process_index < process_count or batch_size % process_count:
    raise ValueError(
        f"process_index={process_index} must be in 0..process_count-1, and process_count="
        f"{process_count} must divide train.batch_size={batch_size}")
  dataset, data_dir = _ready(config)
  local = batch_size // process_count
  rows = slice(process_index * local, (process_index + 1) * local)
  rng = np.random.default_rng((config.train.seed, step))
  if dataset.text_feature is None:
    tokens, mask = storage.example_arrays(dataset, data_dir, "train")
    explicit_inputs = storage.example_inputs(dataset, data_dir, "train")  # MAD's non-shifted tasks
    chosen = rng.integers(0, len(tokens), batch_size)[rows]
    sequences = tokens[chosen].astype(np.int32)
    inputs = sequences[:, :-1] if explicit_inputs is None else explicit_inputs[chosen].astype(
        np.int32)
    return {"inputs": inputs, "targets": sequences[:, 1:],
            "loss_mask": mask[chosen].astype(np.float32)}
  tokens = tokenizer.get(config)
  stream = storage.token_stream(dataset, data_dir, "train", tokens)
  starts = rng.integers(0, len(stream) - seq_len, batch_size)[rows]
  windows = stream[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  batch = {"inputs": windows[:, :-1], "targets": windows[:, 1:],
           "loss_mask": np.ones((local, seq_len), np.float32)}
  return packing.annotate(batch, eod=tokens.eod) if packing.documents(config) else batch


def lm_windows(num_tokens, length, mode, stride):
  """(start, scored_from, end) of every evaluation window over targets 0..num_tokens-1.

  A window's inputs are tokens [start, end) and its targets [start + 1, end + 1) of the text; it
  scores targets [scored_from, end). The scored ranges of consecutive windows tile [0, num_tokens).
  """
  advance = length if mode == "nonoverlapping" else stride
  windows, end = [], 0
  while end < num_tokens:
    new_end = min(end + advance if windows else length, num_tokens)
    start = end if mode == "nonoverlapping" else max(0, new_end - length)
    windows.append((start, end, new_end))
    end = new_end
  return windows


def _lm_batches(stream, windows, length, batch_size, tokens, documents=False):
  for first in range(0, len(windows), batch_size):
    chunk = windows[first:first + batch_size]
    batch = {"inputs": np.full((len(chunk), length), tokens.pad, np.int32),
             "targets": np.full((len(chunk), length), tokens.pad, np.int32),
             "loss_mask": np.zeros((len(chunk), length), np.float32)}
    for row, (start, scored_from, end) in enumerate(chunk):
      batch["inputs"][row, :end - start] = stream[start:end]
      batch["targets"][row, :end - start] = stream[start + 1:end + 1]
      batch["loss_mask"][row, scored_from - start:end - start] = 1
    if documents:
      batch = packing.annotate(batch, np.array([end - start for start, _, end in chunk]),
                               tokens.eod)
    yield batch


def _task_batches(examples, batch_size):
  for first in range(0, len(examples), batch_size):
    yield _stack(examples.__getitems__(range(first, min(first + batch_size, len(examples)))))


def eval_batches(config, length, mode, split="validation", depth=None):
  """Evaluation batches of eval.batch_size (the last one may be smaller) at `length` inputs.

  For a needle task, `depth` (one of eval.depths) selects that depth's examples; None gives every
  depth's examples in turn. Other datasets take depth=None.
  """
  dataset, data_dir = _ready(config)
  if mode not in validation.EVAL_MODES:
    raise ValueError(f"unknown eval mode {mode!r}; valid: {', '.join(validation.EVAL_MODES)}")
  depths = catalog.eval_depths(config)
  if depth is not None and depth not in depths:
    raise ValueError(f"depth={depth} is not evaluated for {dataset.name}: valid depths are "
                     f"{depths} (eval.depths for the needle tasks {catalog.NEEDLE_NAMES})")
  if dataset.text_feature is None:
    if split not in builders.EVAL_SPLITS or length not in config.eval.lengths:
      raise ValueError(
          f"{dataset.name} has evaluation examples for splits {builders.EVAL_SPLITS} at "
          f"eval.lengths={tuple(config.eval.lengths)}, not split {split!r} at length {length}")
    names = [builders.task_split(split, length, None if d is None else i)
             for i, d in enumerate(depths) if depth is None or d == depth]
    return itertools.chain.from_iterable(
        _task_batches(storage.source(dataset, data_dir, name), config.eval.batch_size)
        for name in names)
  if split not in dataset.splits:
    raise ValueError(
        f"unknown split {split!r} of {dataset.name}; valid: {', '.join(dataset.splits)}")
  if dataset.files and all(f.split != split for f in dataset.files):
    raise ValueError(f"the {split} split of {dataset.name} has no files (a file's split is a hash "
                     "of its path, ~90/5/5): use a larger corpus or another split")
  tokens = tokenizer.get(config)
  stream = storage.token_stream(dataset, data_dir, split, tokens)
  num_tokens = min(config.eval.num_tokens, len(stream) - 1)
  if not 0 < length <= num_tokens:
    raise ValueError(
        f"eval length {length} must be in 1..{num_tokens}: the {split} split of {dataset.name} "
        f"provides {len(stream) - 1} targets and eval.num_tokens={config.eval.num_tokens}")
  stride = validation.sliding_stride(config)
  if mode == "sliding" and not 1 <= stride <= length:
    raise ValueError(f"sliding-window stride {stride} (eval.sliding_stride, 0 meaning "
                     f"train.seq_len // 2) must be in 1..{length} for eval length {length}")
  windows = lm_windows(num_tokens, length, mode, stride)
  return _lm_batches(stream, windows, length, config.eval.batch_size, tokens,
                     packing.documents(config))
