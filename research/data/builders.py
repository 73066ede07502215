"""TFDS builders of the local datasets, written as array_record files (no TensorFlow needed).

SyntheticTask: a builder config per set of task parameters, named `<task>_<hash>` from a hash of
the parameters that change the data, so different parameters never share a prepared dataset.
Splits: `train` (num_train_examples of training size, padded to seq_len inputs) and
`validation_<L>`, `test_<L>` for every evaluation length L (num_eval_examples of the largest size
that fits, exactly L inputs). Every split draws from its own generator seeded by
(seed, split, L), so an example depends on the builder config alone.

NeedleTask (research.data.needles): the same for the byte-level retrieval tasks, with a builder
config per task parameters, `train` examples of random length and depth padded to seq_len, and
`validation_<L>_depth<i>`, `test_<L>_depth<i>` splits of exactly L inputs for every evaluation
length L and every i-th depth of eval.depths, each seeded by (seed, split, L, i).

ByteCorpus: one example per corpus file (a whole file, or a byte range of one), features `path`
and `text` (its raw bytes, decompressed if gzip), in relative-path order, splits train /
validation / test as assigned by research.data.corpus; a builder config per file list, named
`<label>_<hash>` of (split, relative path, byte range, gzip, mtime) of every entry.
"""

import dataclasses
import hashlib
import json

import numpy as np
import tensorflow_datasets as tfds

from research.data import corpus
from research.data import mad
from research.data import needles
from research.data import tasks
from research.data import tokenizer

_SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}
EVAL_SPLITS = ("validation", "test")


def _digest(obj):
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def task_split(split: str, length: int, depth_index: int | None = None) -> str:
  """Name of the split of evaluation examples with `length` inputs (at the depth_index-th
  depth of a needle task)."""
  return f"{split}_{length}" if depth_index is None else f"{split}_{length}_depth{depth_index}"


@dataclasses.dataclass(eq=False)
class TaskConfig(tfds.core.BuilderConfig):
  task: str = "copy"
  num_symbols: int = 16
  num_kv_pairs: int = 0  # mqar only
  train_min_length: int = 0  # not mqar
  train_max_length: int = 0  # not mqar
  seq_len: int = 128
  num_train_examples: int = 0
  eval_lengths: tuple[int, ...] = ()
  num_eval_examples: int = 0
  seed: int = 0
  mad_settings: mad.Settings = mad.Settings()  # MAD tasks only


def task_config(config):
  """The builder config of the synthetic task that `config` (a research config) asks for."""
  d, mqar = config.data, config.data.name == "mqar"
  fixed_length = mqar or d.name in mad.TASKS  # examples of train.seq_len's size
  params = dict(
      task=d.name, num_symbols=d.task_vocab_size, num_kv_pairs=d.num_kv_pairs if mqar else 0,
      train_min_length=0 if fixed_length else d.train_min_length,
      train_max_length=0 if fixed_length else d.train_max_length, seq_len=config.train.seq_len,
      num_train_examples=d.num_train_examples, eval_lengths=tuple(sorted(set(config.eval.lengths))),
      num_eval_examples=d.num_eval_examples, seed=0)
  if d.name in mad.TASKS:  # only MAD configs carry (and hash) their settings
    params["mad_settings"] = mad.settings(config)
    key = dict(params, mad_settings=dataclasses.asdict(params["mad_settings"]))
    return TaskConfig(name=f"{d.name}_{_digest(key)}", **params)
  return TaskConfig(name=f"{d.name}_{_digest(params)}", **params)


class _NextTokenExamples(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Examples of inputs, targets (int32) and loss_mask (float32), in generation order."""

  def _info(self):
    sequence = lambda dtype: tfds.features.Tensor(shape=(None,), dtype=dtype, encoding="bytes")
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__, disable_shuffling=True,
        features=tfds.features.FeaturesDict(
            {"inputs": sequence(np.int32), "targets": sequence(np.int32),
             "loss_mask": sequence(np.float32)}))


class SyntheticTask(_NextTokenExamples):
  """Synthetic length-generalization tasks (research.data.tasks) as next-token examples."""

  name = "research_synthetic_task"
  VERSION = tfds.core.Version("1.0.0")

  def _split_generators(self, dl_manager):
    del dl_manager
    c = self.builder_config
    splits = {"train": self._generate_examples("train", c.seq_len)}
    for split in EVAL_SPLITS:
      for length in c.eval_lengths:
        splits[task_split(split, length)] = self._generate_examples(split, length)
    return splits

  def _generate_examples(self, split, length):
    c = self.builder_config
    rng = np.random.default_rng([c.seed, _SPLIT_SEEDS[split], length])
    train = split == "train"
    for i in range(c.num_train_examples if train else c.num_eval_examples):
      if train:
        size = tasks.train_size(c.task, rng, c.train_min_length, c.train_max_length, c.seq_len)
      else:
        size = tasks.TASKS[c.task].size_for_length(length)
      yield i, tasks.example(c.task, rng, size, c.num_symbols, c.num_kv_pairs, length,
                             c.mad_settings, train)


@dataclasses.dataclass(eq=False)
class NeedleConfig(tfds.core.BuilderConfig):
  task: str = "passkey"
  params: needles.NeedleParams = needles.NeedleParams(value_digits=5)
  seq_len: int = 256
  num_train_examples: int = 0
  eval_lengths: tuple[int, ...] = ()
  eval_depths: tuple[float, ...] = ()
  num_eval_examples: int = 0
  seed: int = 0
  tokenizer: str = "bytes"  # data.tokenizer


def needle_params(config) -> needles.NeedleParams:
  """The parameters of the configured needle task; those it does not use keep their defaults."""
  d = config.data
  return needles.NeedleParams(
      value_digits=d.needle_value_digits,
      num_distractors=d.num_distractors if d.name == "needle_multikey" else 0,
      num_values=d.num_values if d.name == "needle_multivalue" else 1)


def needle_config(config) -> NeedleConfig:
  """The builder config of the needle task that `config` (a research config) asks for."""
  d = config.data
  params = dict(task=d.name, params=needle_params(config), seq_len=config.train.seq_len,
                num_train_examples=d.num_train_examples,
                eval_lengths=tuple(sorted(set(config.eval.lengths))),
                eval_depths=tuple(config.eval.depths), num_eval_examples=d.num_eval_examples,
                seed=0, tokenizer=d.get("tokenizer", tokenizer.BYTES))
  key = dict(params, params=dataclasses.asdict(params["params"]))
  del key["tokenizer"]  # byte-level tasks keep their names; a tokenizer adds its digest
  if params["tokenizer"] != tokenizer.BYTES:
    key["tokenizer"] = tokenizer.load(params["tokenizer"]).digest
  return NeedleConfig(name=f"{d.name}_{_digest(key)}", **params)


class NeedleTask(_NextTokenExamples):
  """Byte-level passkey and needle retrieval (research.data.needles) as next-token examples."""

  name = "research_needle_task"
  VERSION = tfds.core.Version("1.0.0")

  def _split_generators(self, dl_manager):
    del dl_manager
    c = self.builder_config
    splits = {"train": self._generate_examples("train")}
    for split in EVAL_SPLITS:
      for length in c.eval_lengths:
        for index, depth in enumerate(c.eval_depths):
          splits[task_split(split, length, index)] = self._generate_examples(
              split, length, index, depth)
    return splits

  def _generate_examples(self, split, length=None, depth_index=None, depth=None):
    """The train split (length None), or the examples of one evaluation (length, depth)."""
    c = self.builder_config
    tokens = tokenizer.load(c.tokenizer)
    if length is None:
      rng = np.random.default_rng([c.seed, _SPLIT_SEEDS[split]])
      for i in range(c.num_train_examples):
        yield i, needles.train_example(c.task, rng, c.params, c.seq_len, tokens)
      return
    rng = np.random.default_rng([c.seed, _SPLIT_SEEDS[split], length, depth_index])
    for i in range(c.num_eval_examples):
      yield i, needles.example(c.task, rng, c.params, length, depth, length, tokens)


@dataclasses.dataclass(eq=False)
class CorpusConfig(tfds.core.BuilderConfig):
  files: tuple[corpus.CorpusFile, ...] = dataclasses.field(default=(), repr=False)


def corpus_config(label, files):
  """The builder config of a corpus made of `files` (research.data.corpus.CorpusFile)."""
  key = [(f.split, f.relpath, f.start, f.end, f.gzipped, f.mtime_ns) for f in files]
  return CorpusConfig(name=f"{label}_{_digest(key)}", files=tuple(files))


class ByteCorpus(tfds.core.GeneratorBasedBuilder):
  """Text files as documents of raw bytes, for byte-level language modeling."""

  name = "research_byte_corpus"
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, description=__doc__, disable_shuffling=True,
        features=tfds.features.FeaturesDict(
            {"path": tfds.features.Text(), "text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    present = {f.split for f in self.builder_config.files}
    return {s: self._generate_examples(s) for s in corpus.SPLITS if s in present}

  def _generate_examples(self, split):
    for f in self.builder_config.files:
      if f.split == split:
        yield f.relpath, {"path": f.relpath, "text": corpus.read(f)}
