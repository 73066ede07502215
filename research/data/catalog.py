"""The datasets `config.data.name` selects, and the TFDS builder behind each.

- Synthetic tasks (research.data.tasks): copy, reverse, sort, induction, mqar, the
  algorithmic suite of research.data.algorithmic (parity_check, ..., bucket_sort) and MAD's six
  tasks of research.data.mad (mad_in_context_recall, ..., mad_memorization).
- Needle tasks (research.data.needles): passkey and RULER's needle_single, needle_multikey,
  needle_multivalue, byte level, evaluated at every eval length x eval depth.
- Local byte corpora (research.data.corpus): stdlib_bytes, text_dir.
- Named TFDS corpora, which download their text: pg19, lm1b (lm1b has no validation split; its
  test split serves as validation). Preparing them needs the network, and TFDS's own builders
  for them use tf.io.gfile, so TensorFlow too; reading prepared array_record files needs neither.
"""

import dataclasses
import functools
import logging
import socket
import threading
from typing import Callable

import numpy as np
import tensorflow_datasets as tfds

from research.data import builders
from research.data import corpus
from research.data import needles
from research.data import tasks
from research.data import tokenizer
from research.data import vocab

SYMBOL_TASK_NAMES = tuple(tasks.TASKS)
NEEDLE_NAMES = tuple(needles.TASKS)
TASK_NAMES = SYMBOL_TASK_NAMES + NEEDLE_NAMES
LOCAL_CORPORA = ("stdlib_bytes", "text_dir")


@dataclasses.dataclass(frozen=True)
class NamedCorpus:
  text_feature: str
  splits: dict  # our split -> TFDS split
  host: tuple[str, int]  # where its download comes from, to tell whether we are online


NAMED_CORPORA = {
    "pg19": NamedCorpus("book_text", {"train": "train", "validation": "validation", "test": "test"},
                        ("storage.googleapis.com", 443)),
    "lm1b": NamedCorpus("text", {"train": "train", "validation": "test", "test": "test"},
                        ("www.statmt.org", 80)),
}
NAMES = TASK_NAMES + LOCAL_CORPORA + tuple(NAMED_CORPORA)


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A configured dataset: its TFDS name, how to build it, and how to read its splits."""

  name: str  # config.data.name
  tfds_name: str  # for tfds.data_source: "builder/config" for the local builders
  version: str
  make_builder: Callable  # data_dir -> tfds.core.DatasetBuilder
  text_feature: str | None = None  # corpora: the feature holding a document; None for tasks
  splits: dict | None = None  # corpora: split -> TFDS split
  files: tuple = ()  # local corpora
  download: NamedCorpus | None = None
  token_dtype: np.dtype = np.dtype("<u2")  # tasks: of the prepared example arrays


def check_name(name):
  if name not in NAMES:
    raise ValueError(f"unknown dataset data.name={name!r}; valid: {', '.join(NAMES)}")


def is_language_modeling(config):
  """True for the byte corpora (loss, perplexity), False for the synthetic tasks (accuracy)."""
  check_name(config.data.name)
  return config.data.name not in TASK_NAMES


def is_text(config):
  """True for the corpora and the needle tasks: tokens of text (bytes, or data.tokenizer's)."""
  return is_language_modeling(config) or config.data.name in NEEDLE_NAMES


def vocab_size(config):
  """Number of token ids the configured dataset uses."""
  if is_text(config):
    return tokenizer.get(config).vocab_size
  return vocab.TaskVocab(config.data.task_vocab_size).size


def eval_depths(config) -> tuple:
  """The needle depths evaluated at each length: eval.depths for the needle tasks, else (None,)."""
  check_name(config.data.name)
  return tuple(config.eval.depths) if config.data.name in NEEDLE_NAMES else (None,)


class _WithoutCustomConfigWarning(logging.Filter):
  """Drops TFDS's warning for a builder config made at run time ("Using custom data
  configuration: ..."), printed on every command: every local dataset here is one by design
  (its config is derived from the run's settings), so the line says nothing."""

  def filter(self, record):
    return "Using custom data configuration" not in str(record.msg)


logging.getLogger("absl").addFilter(_WithoutCustomConfigWarning())  # TFDS logs through absl


def _local(builder_cls, name, builder_config, **kwargs):
  return Dataset(
      name=name, tfds_name=f"{builder_cls.name}/{builder_config.name}",
      version=str(builder_cls.VERSION),
      make_builder=lambda data_dir: builder_cls(
          data_dir=data_dir, config=builder_config, file_format="array_record"), **kwargs)


def resolve(config):
  """The Dataset of `config`; local corpus files are listed once per process."""
  d = config.data
  check_name(d.name)
  if d.name in SYMBOL_TASK_NAMES:
    return _local(builders.SyntheticTask, d.name, builders.task_config(config))
  if d.name in NEEDLE_NAMES:
    return _local(builders.NeedleTask, d.name, builders.needle_config(config),
                  token_dtype=tokenizer.get(config).dtype)
  if d.name in LOCAL_CORPORA:
    return _corpus(d.name, d.corpus_path if d.name == "text_dir" else "")
  name, named = d.name, NAMED_CORPORA[d.name]
  return Dataset(
      name=name, tfds_name=name, version=str(tfds.builder_cls(name).VERSION),
      make_builder=lambda data_dir: tfds.builder(
          name, data_dir=data_dir, file_format="array_record"),
      text_feature=named.text_feature, splits=named.splits, download=named)


@functools.lru_cache(maxsize=16)
def _corpus(name, corpus_path):
  files = corpus.text_files(corpus_path) if name == "text_dir" else corpus.stdlib_files()
  return _local(builders.ByteCorpus, name, builders.corpus_config(name, files), text_feature="text",
                splits={s: s for s in corpus.SPLITS}, files=tuple(files))


def reachable(host, port, timeout_s=3.0):
  """Whether a TCP connection to host:port opens within timeout_s (DNS included)."""
  result = []

  def connect():
    try:
      socket.create_connection((host, port), timeout=timeout_s).close()
      result.append(True)
    except OSError:
      pass

  thread = threading.Thread(target=connect, daemon=True)  # getaddrinfo ignores timeouts
  thread.start()
  thread.join(timeout_s)
  return bool(result)
