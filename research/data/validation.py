"""Checks a config's data, train and eval fields before any work, and writes nothing."""

from research.data import builders
from research.data import catalog
from research.data import corpus
from research.data import mad
from research.data import needles
from research.data import packing
from research.data import storage
from research.data import tasks
from research.data import tokenizer

EVAL_MODES = ("nonoverlapping", "sliding")
EVAL_SPLITS = builders.EVAL_SPLITS  # what eval.splits may name


def sliding_stride(config):
  """Stride of sliding-window evaluation: eval.sliding_stride, 0 meaning train.seq_len // 2."""
  return config.eval.sliding_stride or config.train.seq_len // 2


def validate(config):
  """Raises ValueError listing every problem with what would be valid; returns None if none."""
  problems = _problems(config)
  if problems:
    raise ValueError("invalid data config: " + "; ".join(problems))


def _problems(config):
  d, t, e = config.data, config.train, config.eval
  if d.name not in catalog.NAMES:
    return [f"data.name={d.name!r} is unknown; valid: {', '.join(catalog.NAMES)}"]
  problems = [f"{field}={value} must be positive" for field, value in [
      ("train.seq_len", t.seq_len), ("train.batch_size", t.batch_size),
      ("eval.batch_size", e.batch_size), ("eval.bootstrap_samples", e.bootstrap_samples)]
      if value <= 0]
  if not e.lengths or min(e.lengths) <= 0:
    problems.append(f"eval.lengths={tuple(e.lengths)} must be one or more positive lengths")
  if t.seed < 0:
    problems.append(f"train.seed={t.seed} must be >= 0")
  if not e.splits or set(e.splits) - set(EVAL_SPLITS) or len(set(e.splits)) < len(e.splits):
    problems.append(f"eval.splits={tuple(e.splits)} must be distinct held-out splits out of "
                    f"{EVAL_SPLITS}")
  if (t.batch_size > 0 and config.distributed.coordinator_address
      and t.batch_size % config.distributed.num_processes):
    problems.append(f"train.batch_size={t.batch_size} is not divisible by "
                    f"distributed.num_processes={config.distributed.num_processes}")
  problems += _packing_problems(config)
  if d.name not in catalog.SYMBOL_TASK_NAMES:  # their own ids: research.runs.unread refuses it
    try:
      tokenizer.check(d.get("tokenizer", tokenizer.BYTES))
    except ValueError as e:
      problems.append(str(e))
  if problems:  # the checks below assume positive sizes
    return problems
  if d.name in catalog.NEEDLE_NAMES:
    return _example_count_problems(config) + _needle_problems(config)
  if d.name in catalog.SYMBOL_TASK_NAMES:
    return _example_count_problems(config) + _task_problems(config)
  return _corpus_problems(config)


def _packing_problems(config):
  """data.packing: a known value; "documents" needs a corpus and the documents' positions."""
  try:
    if not packing.documents(config):
      return []
  except ValueError as err:
    return [str(err)]
  if config.data.name in catalog.TASK_NAMES:
    return [f"data.packing='documents' needs a text corpus, whose token stream separates "
            f"documents with END_OF_DOCUMENT; {config.data.name} is a synthetic task with one "
            "example per row already; use data.packing='concat' (the default) for tasks"]
  if config.model.randomize_max_length > 0:
    return [f"data.packing='documents' takes each token's position from its document (0 at the "
            f"document's start), which model.randomize_max_length="
            f"{config.model.randomize_max_length} would replace by random positions; set "
            "model.randomize_max_length=0, or data.packing='concat'"]
  return []


def _example_count_problems(config):
  d = config.data
  return [f"{field}={value} must be positive" for field, value in [
      ("data.num_train_examples", d.num_train_examples),
      ("data.num_eval_examples", d.num_eval_examples)] if value <= 0]


MAX_VALUE_DIGITS = 18  # values stay int64


def _needle_problems(config):
  d, t, e = config.data, config.train, config.eval
  problems = []
  depths = tuple(e.depths)
  if not depths or any(not 0 <= depth <= 1 for depth in depths):
    problems.append(f"eval.depths={depths} must be one or more needle depths in [0, 1] (0: the "
                    "needle starts the text, 1: it ends right before the question)")
  elif len(set(depths)) != len(depths):
    problems.append(f"eval.depths={depths} repeats a depth; give each depth once")
  if not 1 <= d.needle_value_digits <= MAX_VALUE_DIGITS:
    problems.append(f"data.needle_value_digits={d.needle_value_digits} must be in "
                    f"1..{MAX_VALUE_DIGITS}")
  if d.name == "needle_multikey" and d.num_distractors < 1:
    problems.append(f"data.num_distractors={d.num_distractors} must be >= 1 for needle_multikey "
                    "(needles of other keys; needle_single has none)")
  if d.name == "needle_multivalue" and d.num_values < 2:
    problems.append(f"data.num_values={d.num_values} must be >= 2 for needle_multivalue (values "
                    "of the asked key; needle_single has one)")
  if problems:  # the length checks below need valid parameters
    return problems
  params = builders.needle_params(config)
  values = params.num_distractors + params.num_values
  available = 9 * 10 ** (params.value_digits - 1)  # numbers without a leading zero
  if values > available:
    return [f"{d.name} needs {values} distinct values but data.needle_value_digits="
            f"{params.value_digits} gives {available}; use more digits"]
  shortest = needles.min_length(d.name, params, tokenizer.get(config))
  lengths = [("train.seq_len", t.seq_len)] + [("eval.lengths", length) for length in e.lengths]
  return [f"{field} has {length}, too short for {d.name}: its needles, question and answer "
          f"take {shortest} inputs with no filler; use lengths >= {shortest}"
          for field, length in lengths if length < shortest]


def _task_problems(config):
  d, t, e = config.data, config.train, config.eval
  task, num_symbols = tasks.TASKS[d.name], d.task_vocab_size
  problems = []
  if num_symbols < task.min_symbols:
    problems.append(f"data.task_vocab_size={num_symbols} is too small for {d.name}, which uses "
                    f"{task.min_symbols} symbols; use data.task_vocab_size >= {task.min_symbols}")
  if d.name in mad.TASKS:
    return problems + mad.problems(config)
  if d.name == "mqar":
    m = d.num_kv_pairs
    lengths = [("train.seq_len", t.seq_len)] + [("eval.lengths", length) for length in e.lengths]
    if not 1 <= m <= num_symbols // 2:
      problems.append(
          f"data.num_kv_pairs={m} must be in 1..task_vocab_size // 2 = {num_symbols // 2} (keys "
          "and values are distinct symbols from each half of the vocabulary)")
    problems += [f"mqar needs 4 * num_kv_pairs = {4 * m} <= length, but {field} has {length}; "
                 f"use num_kv_pairs <= {length // 4} or lengths >= {4 * m}"
                 for field, length in lengths if 4 * m > length]
    return problems
  low, high = d.train_min_length, d.train_max_length
  needed = task.inputs_for_size(max(high, task.min_size))
  if not 1 <= low <= high:
    problems.append(f"data.train_min_length={low} and data.train_max_length={high} must satisfy "
                    "1 <= train_min_length <= train_max_length")
  elif needed > t.seq_len:
    problems.append(
        f"{d.name} examples of data.train_max_length={high} symbols need {needed} inputs but "
        f"train.seq_len={t.seq_len}; use train.seq_len >= {needed} or train_max_length <= "
        f"{task.size_for_length(t.seq_len)}")
  shortest = task.inputs_for_size(task.min_size)
  problems += [f"eval length {length} is too short for {d.name}: examples need >= {shortest} inputs"
               for length in e.lengths if length < shortest]
  return problems


def _corpus_problems(config):
  d, t, e = config.data, config.train, config.eval
  problems = []
  unknown_modes = [m for m in e.modes if m not in EVAL_MODES]
  if unknown_modes:
    return [f"eval.modes has unknown {unknown_modes}; valid: {', '.join(EVAL_MODES)}"]
  if e.num_tokens < max(e.lengths):
    problems.append(
        f"eval.num_tokens={e.num_tokens} must be >= the longest eval length {max(e.lengths)}, so "
        "every length is evaluated on full windows of the same text")
  stride = sliding_stride(config)
  if "sliding" in e.modes and not 1 <= stride <= min(e.lengths):
    problems.append(
        f"sliding-window stride {stride} (eval.sliding_stride, 0 meaning train.seq_len // 2) "
        f"must be in 1..{min(e.lengths)} (the shortest eval length)")
  try:
    dataset = catalog.resolve(config)
    if d.name not in catalog.LOCAL_CORPORA:
      storage.check_available(dataset, storage.data_dir(config))
      return problems
  except ValueError as err:
    return problems + [str(err)]
  sizes = corpus.split_sizes(dataset.files)
  for split, needed, why in [("train", t.seq_len + 1, f"train.seq_len={t.seq_len}"),
                             ("validation", max(e.lengths) + 1, f"eval length {max(e.lengths)}")]:
    if sizes[split] < needed:
      num_files = sum(f.split == split for f in dataset.files)
      problems.append(
          f"the {split} split of {d.name} has {sizes[split]} tokens ({num_files} of "
          f"{len(dataset.files)} entries; the splits take ~90/5/5 of the files, or of each file's "
          f"bytes when there are few files) but {why} "
          f"needs {needed}; use lengths <= {max(sizes[split] - 1, 0)} or a larger corpus")
  return problems
