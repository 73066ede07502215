"""Tests of research.data: tasks, corpora, batches, evaluation windows, preparation, errors."""

import gzip
import os
import pathlib
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import base
from research import data
from research.data import algorithmic
from research.data import catalog
from research.data import corpus
from research.data import needles
from research.data import packing
from research.data import pipeline
from research.data import storage
from research.data import tasks
from research.data import vocab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("copy", "reverse", "sort", "mqar", "induction")
SMALL = {
    "data.num_train_examples": 256, "data.num_eval_examples": 8, "data.train_max_length": 20,
    "data.num_kv_pairs": 4, "train.seq_len": 64, "train.batch_size": 8,
    "eval.lengths": (64, 640), "eval.batch_size": 4, "eval.num_tokens": 700,
}


def make_config(name, data_dir, **overrides):
  """The base config with small sizes, `name`, `data_dir` and "a.b"-style overrides."""
  config = base.get_config()
  for key, value in {**SMALL, "data.name": name, "data.dir": str(data_dir), **overrides}.items():
    section, field = key.split(".")
    setattr(config[section], field, value)
  return config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
  """80 small text files, each mentioning its own name so every document is distinct."""
  root = tmp_path_factory.mktemp("corpus")
  words = "the of attention position rotary linear state length token bytes window".split()
  for i in range(80):
    rng = random.Random(i)
    path = root / f"dir{i % 3}" / f"doc{i:02d}.txt"
    path.parent.mkdir(exist_ok=True)
    text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 250)))
    path.write_text(f"document {i}\n{text}")
  (root / ".hidden").write_text("never read")
  return root


def lm_config(data_dir, text_corpus, **overrides):
  return make_config("text_dir", data_dir, **{
      "data.corpus_path": str(text_corpus), "eval.lengths": (32, 64), "eval.num_tokens": 500,
      "eval.sliding_stride": 12, **overrides})


def sequences(batch):
  """The full token sequences behind next-token batches: inputs[0] followed by targets."""
  return np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)


def check_task_example(task, seq, mask, config):
  """Asserts that one example follows its task's definition (see research.data.tasks)."""
  v = vocab.TaskVocab(config.data.task_vocab_size)
  scored = np.flatnonzero(mask) + 1  # positions in seq of the scored targets
  if task == "mqar":
    m = config.data.num_kv_pairs
    keys, values = seq[0:2 * m:2], seq[1:2 * m:2]
    assert len(set(keys)) == m and len(set(values)) == m
    assert len(scored) == m and scored.min() > 2 * m
    assert set(seq[scored - 1]) == set(keys)  # every key queried once
    answers = dict(zip(keys, values))
    np.testing.assert_array_equal(seq[scored], [answers[k] for k in seq[scored - 1]])
    return
  if task == "induction":
    n = 1 + np.flatnonzero(seq[1:] == seq[0])[0]  # the first symbol recurs only to start P again
    np.testing.assert_array_equal(seq[n:2 * n], seq[:n])
    np.testing.assert_array_equal(scored, np.arange(n + 1, 2 * n))
    assert (seq[2 * n:] == v.pad).all()
    return
  n = int(np.flatnonzero(seq == v.sep)[0])
  x, y = seq[:n], seq[n + 1:2 * n + 1]
  expected = {"copy": x, "reverse": x[::-1], "sort": np.sort(x)}[task]
  np.testing.assert_array_equal(y, expected)
  np.testing.assert_array_equal(scored, np.arange(n + 1, 2 * n + 1))
  assert (seq[2 * n + 1:] == v.pad).all()


@pytest.mark.parametrize("task", TASKS)
def test_task_examples(task, data_dir):
  config = make_config(task, data_dir)
  assert not data.is_language_modeling(config)
  batches = [("train", data.train_batch(config, step)) for step in range(2)]
  batches += [(length, b) for length in config.eval.lengths
              for b in data.eval_batches(config, length, "nonoverlapping")]
  assert sum(len(b["inputs"]) for key, b in batches if key == 640) == config.data.num_eval_examples
  for key, batch in batches:
    length = config.train.seq_len if key == "train" else key
    assert batch["inputs"].shape == batch["loss_mask"].shape == (len(batch["inputs"]), length)
    assert batch["inputs"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert batch["inputs"].max() < data.vocab_size(config)
    for seq, mask in zip(sequences(batch), batch["loss_mask"]):
      check_task_example(task, seq, mask, config)
      if key != "train" and task in ("copy", "reverse", "sort"):
        assert mask.sum() == length // 2  # evaluation examples fill their length
      if key == "train" and task != "mqar":
        assert mask.sum() <= config.data.train_max_length


# The answer of every algorithmic task from its input, written independently of
# research.data.algorithmic (arXiv:2207.02098's definitions).
REFERENCE = {
    "parity_check": lambda x: [x.count(1) % 2],
    "even_pairs": lambda x: [int(x[0] != x[-1])],
    "modular_arithmetic": lambda x: [eval("".join({5: "+", 6: "-", 7: "*"}.get(t, str(t))
                                                  for t in x)) % 5],
    "cycle_navigation": lambda x: [sum(t - 1 for t in x) % 5],
    "stack_manipulation": lambda x: [int(c) for c in reversed(_stack(x))],
    "duplicate_string": lambda x: x + x,
    "missing_duplicate_string": lambda x: [_missing(x)],
    "odds_first": lambda x: [t for i, t in enumerate(x) if i % 2 == 0] + [
        t for i, t in enumerate(x) if i % 2 == 1],
    "binary_addition": lambda x: [int(c) for c in reversed(bin(_little_endian_sum(x))[2:])],
    "bucket_sort": sorted,
}
TERMINATED = ("stack_manipulation", "binary_addition")  # answers end with SEP


def _stack(x):
  """Bits 0/1 push themselves (the initial stack), 2 pops, 3/4 push 0/1."""
  stack = ""
  for t in x:
    stack = stack[:-1] if t == 2 else stack + str(t if t < 2 else t - 3)
  return stack


def _missing(x):
  w = [t for t in x if t != 3]
  i, half = w.index(2), len(w) // 2
  return w[i - half] if i >= half else w[i + half]


def _little_endian_sum(x):
  a, b = "".join(map(str, x)).split("2")
  return int(a[::-1], 2) + int(b[::-1], 2)


def test_suite_is_the_papers():
  assert sorted(algorithmic.SUITE) == sorted(REFERENCE)
  assert set(algorithmic.SUITE) <= set(catalog.TASK_NAMES)


@pytest.mark.parametrize("task", sorted(algorithmic.SUITE))
def test_algorithmic_task_targets(task, data_dir):
  config = make_config(task, data_dir, **{"data.task_vocab_size": 8})
  sep, pad = vocab.TaskVocab(8).sep, vocab.TaskVocab(8).pad
  batches = [("train", config.train.seq_len, data.train_batch(config, step)) for step in range(2)]
  batches += [("eval", length, b) for length in config.eval.lengths
              for b in data.eval_batches(config, length, "nonoverlapping")]
  train_sizes = []
  for split, length, batch in batches:
    assert batch["inputs"].shape[1] == length and batch["inputs"].max() <= pad
    for seq, mask in zip(sequences(batch), batch["loss_mask"]):
      n = int(np.flatnonzero(seq == sep)[0])
      x = seq[:n].tolist()
      answer = REFERENCE[task](x) + ([sep] if task in TERMINATED else [])
      end = n + 1 + len(answer)
      assert seq[n + 1:end].tolist() == answer, (task, x)
      np.testing.assert_array_equal(np.flatnonzero(mask) + 1, np.arange(n + 1, end))
      assert (seq[end:] == pad).all()
      if split == "train":
        train_sizes.append(n)
      else:  # evaluation examples are of the largest size that fits (odd for modular_arithmetic)
        assert n in (tasks.TASKS[task].size_for_length(length),
                     tasks.TASKS[task].size_for_length(length) - 1)
  assert tasks.TASKS[task].min_size <= min(train_sizes) < max(train_sizes) <= 20


NEEDLE = {"train.seq_len": 400, "eval.lengths": (400, 700), "eval.depths": (0.0, 0.3, 1.0),
          "data.num_train_examples": 16, "data.num_eval_examples": 3, "train.batch_size": 4,
          "data.num_distractors": 2, "data.num_values": 3}
_NEEDLE_LINE = rb"\n([^\n]*)\n"


def parse_needle_text(task, text):
  """(the expected answer, the filler bytes before the asked needle, all filler bytes), read
  from the text alone: the needles in it and the question that ends it."""
  context, question = text.rsplit(b"\n", 1)
  pieces = re.split(_NEEDLE_LINE, context)  # filler, needle, filler, needle, ..., filler
  filler, lines = pieces[0::2], pieces[1::2]
  assert b"".join(filler) == ((needles.FILLER + b" ") * 100)[:sum(map(len, filler))]
  if task == "passkey":
    assert question.startswith(b"What is the pass key? The pass key is ")
    (key,) = re.findall(rb"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", context)
    values, asked = [key], [i for i, line in enumerate(lines) if key in line]
  else:
    key = re.match(rb"What (?:is|are all) the special magic numbers? for ([a-z]+)\?", question)[1]
    values = re.findall(rb"special magic numbers for " + key + rb" is: (\d+)\.", context)
    asked = [i for i, line in enumerate(lines) if key in line]
    num_needles = len(re.findall(rb"special magic numbers for [a-z]+ is", context))
    expected = {"needle_single": (1, 1), "needle_multikey": (1, 1 + NEEDLE["data.num_distractors"]),
                "needle_multivalue": (NEEDLE["data.num_values"], NEEDLE["data.num_values"])}
    assert (len(values), num_needles) == expected[task]
  assert len(asked) == 1
  before = sum(len(piece) for piece in filler[:asked[0] + 1])
  return b" " + b", ".join(values), before, sum(map(len, filler))


@pytest.mark.parametrize("task", needles.TASKS)
def test_needle_examples(task, data_dir):
  config = make_config(task, data_dir, **NEEDLE)
  assert data.vocab_size(config) == vocab.BYTE_VOCAB_SIZE and not data.is_language_modeling(config)
  batches = [(None, data.train_batch(config, step)) for step in range(2)]
  batches += [(depth, b) for length in config.eval.lengths for depth in config.eval.depths
              for b in data.eval_batches(config, length, "nonoverlapping", depth=depth)]
  assert sum(len(b["inputs"]) for _, b in batches) == 8 + 2 * 3 * 3
  for depth, batch in batches:
    for seq, mask in zip(sequences(batch), batch["loss_mask"]):
      real = seq[seq != vocab.PAD]
      assert (seq[len(real):] == vocab.PAD).all() and real.max() < 256
      text = real.astype(np.uint8).tobytes()
      answer, before, filler = parse_needle_text(task, text)
      assert text.endswith(answer)
      scored = np.flatnonzero(mask) + 1  # positions in seq of the scored targets
      assert seq[scored].astype(np.uint8).tobytes() == answer.replace(b" ", b"").replace(b",", b"")
      assert scored.min() > len(text) - len(answer)
      if depth is None:  # training: random length and depth, padded to seq_len
        assert needles.min_length(task, data.builders.needle_params(config)) < len(text) <= 401
      else:  # evaluation: exactly the eval length, the asked needle at the depth
        assert len(text) == len(seq) and abs(before - depth * filler) <= 0.5


def test_needle_depths_and_lengths_spread(data_dir):
  config = make_config("passkey", data_dir, **{**NEEDLE, "data.num_train_examples": 64})
  seen = []
  for batch in [data.train_batch(config, step) for step in range(8)]:
    for seq in sequences(batch):
      text = seq[seq != vocab.PAD].astype(np.uint8).tobytes()
      _, before, filler = parse_needle_text("passkey", text)
      seen.append((len(text), before / max(filler, 1)))
  lengths, depths = np.array(seen).T
  assert lengths.min() < 250 and lengths.max() > 350 and depths.min() < 0.2 and depths.max() > 0.8


def test_eval_batches_depth_errors(data_dir):
  with pytest.raises(ValueError, match=r"valid depths are \(0.0, 0.3, 1.0\)"):
    data.eval_batches(make_config("passkey", data_dir, **NEEDLE), 400, "nonoverlapping", depth=0.5)
  with pytest.raises(ValueError, match=r"valid depths are \(None,\)"):
    data.eval_batches(make_config("copy", data_dir), 64, "nonoverlapping", depth=0.5)


def test_task_configs_do_not_collide(data_dir):
  tfds_name = lambda name, **o: catalog.resolve(make_config(name, data_dir, **o)).tfds_name
  changes = [{}, {"data.task_vocab_size": 8}, {"train.seq_len": 128}, {"eval.lengths": (64,)}]
  assert len({tfds_name("copy", **o) for o in changes}) == len(changes)
  assert tfds_name("mqar") != tfds_name("mqar", **{"data.num_kv_pairs": 2})
  assert tfds_name("mqar") == tfds_name("mqar", **{"data.train_max_length": 30})  # unused by mqar
  needle = lambda name, **o: tfds_name(name, **{**NEEDLE, **o})
  assert needle("passkey") != needle("passkey", **{"eval.depths": (0.0, 1.0)})
  assert needle("needle_multikey") != needle("needle_multikey", **{"data.num_distractors": 1})
  assert needle("passkey") == needle("passkey", **{"data.num_distractors": 1})  # unused by passkey


@pytest.mark.parametrize("name", ["mqar", "text_dir"])
def test_train_batch_is_a_pure_function_partitioned_over_processes(name, data_dir, text_corpus):
  if name == "text_dir":
    config = lm_config(data_dir, text_corpus)
  else:
    config = make_config(name, data_dir)
  batch = data.train_batch(config, 3)
  for key in batch:
    np.testing.assert_array_equal(batch[key], data.train_batch(config, 3)[key])
  assert not np.array_equal(batch["inputs"], data.train_batch(config, 4)["inputs"])
  config.train.seed = 1
  assert not np.array_equal(batch["inputs"], data.train_batch(config, 3)["inputs"])
  config.train.seed = 0
  for count in (2, 4, 8):
    parts = [data.train_batch(config, 3, index, count) for index in range(count)]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), batch[key])
  with pytest.raises(ValueError, match="divide"):
    data.train_batch(config, 3, 0, 3)


@pytest.mark.parametrize("name", ["copy", "passkey"])
def test_train_batches_are_the_prepared_examples(name, data_dir):
  """Training batches gather from the example arrays: the same rows as the TFDS split."""
  config = make_config(name, data_dir, **(NEEDLE if name == "passkey" else {}))
  batch = data.train_batch(config, 7)
  dataset = catalog.resolve(config)
  examples = storage.source(dataset, storage.data_dir(config), "train")
  chosen = np.random.default_rng((config.train.seed, 7)).integers(
      0, len(examples), config.train.batch_size)
  for row, index in enumerate(chosen.tolist()):
    for key in batch:
      np.testing.assert_array_equal(batch[key][row], examples[index][key])
      assert batch[key].dtype == examples[index][key].dtype


_SUBPROCESS = """
import ast, sys
import numpy as np
from configs import base
from research import data
config = base.get_config()
for key, value in ast.literal_eval(sys.argv[1]).items():
  section, field = key.split(".")
  setattr(config[section], field, value)
data.prepare(config)
np.savez(sys.argv[2], **data.train_batch(config, 5))
"""


def start_subprocess(config, out_path):
  overrides = {f"{s}.{f}": config[s][f] for s in ("data", "train", "eval") for f in config[s]}
  return subprocess.Popen([sys.executable, "-c", _SUBPROCESS, repr(overrides), str(out_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def assert_same_batch(npz_path, batch):
  with np.load(npz_path) as saved:
    for key in batch:
      np.testing.assert_array_equal(saved[key], batch[key])


def test_fresh_process_gives_the_same_batch(data_dir, text_corpus, tmp_path):
  config = lm_config(data_dir, text_corpus)
  process = start_subprocess(config, tmp_path / "batch.npz")
  assert process.wait(timeout=120) == 0, process.stdout.read()
  assert_same_batch(tmp_path / "batch.npz", data.train_batch(config, 5))


def test_concurrent_preparation(tmp_path):
  config = make_config("sort", tmp_path / "fresh", **{"data.num_train_examples": 3000})
  processes = [start_subprocess(config, tmp_path / f"{i}.npz") for i in range(2)]
  for process in processes:
    assert process.wait(timeout=120) == 0, process.stdout.read()
  batch = data.train_batch(config, 5)
  for i in range(2):
    assert_same_batch(tmp_path / f"{i}.npz", batch)
  dataset_dir = tmp_path / "fresh" / catalog.resolve(config).tfds_name
  assert os.listdir(dataset_dir) == ["1.0.0"]  # no incomplete.* left behind


def documents(stream):
  text = np.asarray(stream)
  ends = np.flatnonzero(text == vocab.EOD)
  return [text[a + 1:b].astype(np.uint8).tobytes() for a, b in zip(np.r_[-1, ends[:-1]], ends)]


def test_corpus_splits_are_disjoint_and_ordered(data_dir, text_corpus):
  config = lm_config(data_dir, text_corpus)
  data.prepare(config)
  dataset = catalog.resolve(config)
  assert [f.relpath for f in dataset.files] == sorted(f.relpath for f in dataset.files)
  assert len(dataset.files) == 80  # the hidden file is skipped
  seen = set()
  for split in corpus.SPLITS:
    files = [f for f in dataset.files if f.split == split]
    assert files, split
    docs = documents(storage.token_stream(dataset, storage.data_dir(config), split))
    assert docs == [pathlib.Path(f.path).read_bytes() for f in files]
    assert not seen & set(docs)
    seen |= set(docs)
  assert data.vocab_size(config) == data.BYTE_VOCAB_SIZE and data.is_language_modeling(config)


def test_a_one_file_corpus_is_split_by_byte_ranges(data_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  text = " ".join(f"line {i} of the only file" for i in range(2000)).encode()
  (tmp_path / "one.txt").write_bytes(text)
  config = lm_config(data_dir, "~/one.txt")  # `~` is expanded
  data.prepare(config)
  dataset = catalog.resolve(config)
  assert [(f.split, f.start, f.end) for f in dataset.files] == [
      ("train", 0, int(0.9 * len(text))),
      ("validation", int(0.9 * len(text)), int(0.95 * len(text))),
      ("test", int(0.95 * len(text)), len(text))]
  for f in dataset.files:
    (document,) = documents(storage.token_stream(dataset, storage.data_dir(config), f.split))
    assert document == text[f.start:f.end]


def test_gzip_files_are_read_as_text_and_binary_files_refused(data_dir, tmp_path):
  texts = {f"doc{i}.txt.gz": f"document {i} ".encode() * (50 + i) for i in range(40)}
  (tmp_path / "gz").mkdir()
  for name, text in texts.items():
    with gzip.open(tmp_path / "gz" / name, "wb") as f:
      f.write(text)
  config = lm_config(data_dir, tmp_path / "gz", **{"eval.lengths": (16,), "eval.num_tokens": 20})
  data.prepare(config)
  dataset = catalog.resolve(config)
  assert {f.relpath for f in dataset.files} == set(texts) and all(f.gzipped for f in dataset.files)
  docs = documents(storage.token_stream(dataset, storage.data_dir(config), "train"))
  assert docs == [texts[f.relpath][f.start:f.end] for f in dataset.files if f.split == "train"]
  (tmp_path / "mixed").mkdir()
  (tmp_path / "mixed" / "notes.txt").write_text("text " * 1000)
  (tmp_path / "mixed" / "weights.bin").write_bytes(bytes(range(256)) * 4)
  with gzip.open(tmp_path / "mixed" / "archive.tar.gz", "wb") as f:
    f.write(b"x" * 100 + b"\0" * 100)
  with pytest.raises(ValueError,
                     match="2 files are binary, not text: .*archive.tar.gz.*weights.bin"):
    data.validate(lm_config(data_dir, tmp_path / "mixed"))


def test_stdlib_files_are_deterministic():
  files = corpus.stdlib_files()
  assert files == corpus.stdlib_files()
  assert [f.relpath for f in files] == sorted(f.relpath for f in files)
  assert all(f.relpath.endswith(".py") and "site-packages" not in f.relpath for f in files)
  assert {f.split for f in files} == set(corpus.SPLITS)
  assert all(f.split == corpus.split_of(f.relpath) for f in files)


def test_stdlib_bytes(data_dir):
  config = make_config("stdlib_bytes", data_dir, **{"train.seq_len": 128, "eval.lengths": (128,)})
  batch = data.train_batch(config, 0)
  assert batch["inputs"].shape == (8, 128) and batch["inputs"].max() <= vocab.EOD
  assert (batch["loss_mask"] == 1).all()
  (first,) = list(data.eval_batches(config, 128, "nonoverlapping"))[:1]
  assert first["inputs"].shape == (4, 128)


@pytest.mark.parametrize("mode,length", [("nonoverlapping", 32), ("nonoverlapping", 64),
                                         ("sliding", 32), ("sliding", 64)])
def test_lm_evaluation_scores_every_token_once(mode, length, data_dir, text_corpus):
  config = lm_config(data_dir, text_corpus)
  stream = storage.token_stream(catalog.resolve(config), storage.data_dir(config), "validation")
  num_tokens, stride = config.eval.num_tokens, config.eval.sliding_stride
  rows = [(i, t, m) for b in data.eval_batches(config, length, mode)
          for i, t, m in zip(b["inputs"], b["targets"], b["loss_mask"])]
  assert all(len(b) <= config.eval.batch_size for b in data.eval_batches(config, length, mode))
  scored = np.concatenate([t[m == 1] for _, t, m in rows])
  np.testing.assert_array_equal(scored, stream[1:num_tokens + 1])  # same text at every length
  for k, (inputs, targets, mask) in enumerate(rows):
    real = np.flatnonzero(inputs != vocab.PAD)
    np.testing.assert_array_equal(real, np.arange(len(real)))
    positions = np.flatnonzero(mask)
    assert positions[-1] == real[-1]  # scored tokens end the window
    np.testing.assert_array_equal(positions, np.arange(positions[0], positions[-1] + 1))
    if mode == "nonoverlapping" or k == 0:
      assert positions[0] == 0
    else:
      assert len(real) == length and len(positions) <= stride
      assert len(positions) == stride or k == len(rows) - 1


def test_lm_windows():
  assert pipeline.lm_windows(10, 4, "nonoverlapping", 2) == [(0, 0, 4), (4, 4, 8), (8, 8, 10)]
  assert pipeline.lm_windows(9, 4, "sliding", 2) == [(0, 0, 4), (2, 4, 6), (4, 6, 8), (5, 8, 9)]
  assert pipeline.lm_windows(3, 4, "sliding", 2) == [(0, 0, 3)]


def loop_documents(inputs, num_real):
  """segments and positions of one row, token by token: a new document after each EOD input and
  at the first padding input."""
  segments, positions, segment, position = [], [], 0, 0
  for t in range(len(inputs)):
    if t > 0 and (inputs[t - 1] == vocab.EOD or t == num_real):
      segment, position = segment + 1, 0
    segments.append(segment)
    positions.append(position)
    position += 1
  return segments, positions


def test_packed_documents_of_a_hand_made_row():
  e, p = vocab.EOD, vocab.PAD
  batch = {"inputs": np.array([[5, e, 7, 8, e, e, 9, p, p], [e, 1, 2, 3, 4, 5, 6, 7, 8]]),
           "targets": np.zeros((2, 9), np.int32), "loss_mask": np.ones((2, 9), np.float32)}
  batch["loss_mask"][0, 7:] = 0
  packed = packing.annotate(batch, np.array([7, 9]))
  np.testing.assert_array_equal(packed["segments"], [[0, 0, 1, 1, 1, 2, 3, 4, 4],
                                                     [0, 1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(packed["positions"], [[0, 1, 0, 1, 2, 0, 0, 0, 1],
                                                      [0, 0, 1, 2, 3, 4, 5, 6, 7]])
  np.testing.assert_array_equal(packed["loss_mask"], [[1, 0, 1, 1, 0, 0, 1, 0, 0],
                                                      [0, 1, 1, 1, 1, 1, 1, 1, 1]])
  assert packed["segments"].dtype == packed["positions"].dtype == np.int32
  assert set(batch) == {"inputs", "targets", "loss_mask"}  # the input batch is left as it was


def check_packed(packed, concat, num_real):
  """A documents-mode batch against the concat batch of the same step or windows."""
  assert set(concat) == {"inputs", "targets", "loss_mask"}
  assert set(packed) == set(concat) | {"segments", "positions"}
  for key in concat:
    if key != "loss_mask":
      np.testing.assert_array_equal(packed[key], concat[key])
  np.testing.assert_array_equal(packed["loss_mask"],
                                concat["loss_mask"] * (concat["inputs"] != vocab.EOD))
  for row, real in zip(range(len(packed["inputs"])), num_real):
    segments, positions = loop_documents(packed["inputs"][row], real)
    np.testing.assert_array_equal(packed["segments"][row], segments)
    np.testing.assert_array_equal(packed["positions"][row], positions)


def test_packed_documents_in_training_and_evaluation_batches(data_dir, text_corpus):
  concat = lm_config(data_dir, text_corpus, **{"train.seq_len": 512})
  documents = lm_config(data_dir, text_corpus, **{"train.seq_len": 512,
                                                  "data.packing": "documents"})
  packed = data.train_batch(documents, 3)
  check_packed(packed, data.train_batch(concat, 3), [512] * 8)
  assert packed["segments"].max() > 0  # the windows do cross documents
  parts = [data.train_batch(documents, 3, index, 4) for index in range(4)]
  for key in packed:
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), packed[key])
  for mode in data.EVAL_MODES:
    pairs = list(zip(data.eval_batches(documents, 64, mode), data.eval_batches(concat, 64, mode)))
    assert len(pairs) == len(list(data.eval_batches(concat, 64, mode)))
    for packed, plain in pairs:
      num_real = (plain["inputs"] != vocab.PAD).sum(1)
      check_packed(packed, plain, num_real)
    last = pairs[-1][0]
    if mode == "nonoverlapping":  # 500 targets: the last window has 52 inputs and 12 PADs
      assert last["segments"][-1, 52] == last["segments"][-1, 51] + 1
      np.testing.assert_array_equal(last["positions"][-1, 52:], np.arange(12))


@pytest.mark.parametrize("name", ["pg19", "lm1b"])
def test_named_corpora_with_mock_data(name, tmp_path, monkeypatch):
  monkeypatch.setattr(catalog, "reachable", lambda host, port: True)
  config = make_config(name, tmp_path, **{
      "eval.lengths": (16,), "eval.num_tokens": 50, "eval.sliding_stride": 8})
  with tfds.testing.mock_data(num_examples=5):
    batch = data.train_batch(config, 0)
    assert batch["inputs"].shape == (8, 64) and batch["inputs"].max() <= vocab.EOD
    dataset = catalog.resolve(config)
    docs = tfds.data_source(name, split=dataset.splits["validation"])
    text = [docs[i][dataset.text_feature] for i in range(len(docs))]
    expected = np.concatenate([list(t.encode() if isinstance(t, str) else t) + [vocab.EOD]
                               for t in text])
    stream = storage.token_stream(dataset, storage.data_dir(config), "validation")
    np.testing.assert_array_equal(stream, expected)
    (batch,) = list(data.eval_batches(config, 16, "sliding"))[:1]
    assert batch["loss_mask"][0].sum() == 16


@pytest.mark.parametrize("name", ["pg19", "lm1b"])
def test_named_corpora_offline(name, tmp_path, monkeypatch):
  monkeypatch.setattr(catalog, "reachable", lambda host, port: False)
  config = make_config(name, tmp_path / "empty")
  for call in (data.validate, lambda c: data.train_batch(c, 0)):
    with pytest.raises(ValueError, match="offline") as error:
      call(config)
    assert "stdlib_bytes" in str(error.value) and "text_dir" in str(error.value)
  assert not (tmp_path / "empty").exists()


def bad_configs(data_dir, text_corpus, empty_dir):
  """(name, overrides, phrases the error must contain)."""
  lm = {"data.corpus_path": str(text_corpus), "eval.lengths": (32,), "eval.num_tokens": 500}
  return [
      ("bogus", {}, ["data.name='bogus' is unknown", "stdlib_bytes", "mqar", "pg19"]),
      ("mqar", {"data.num_kv_pairs": 20, "data.task_vocab_size": 64},
       ["4 * num_kv_pairs = 80", "train.seq_len has 64", "use num_kv_pairs <= 16"]),
      ("mqar", {"eval.lengths": (8, 64)}, ["eval.lengths has 8", "num_kv_pairs <= 2"]),
      ("mqar", {"data.num_kv_pairs": 9}, ["num_kv_pairs=9 must be in 1..task_vocab_size // 2 = 8"]),
      ("copy", {"data.train_max_length": 40}, ["train.seq_len >= 80", "train_max_length <= 32"]),
      ("copy", {"train.seq_len": 0}, ["train.seq_len=0 must be positive"]),
      ("copy", {"eval.lengths": (64, -1)}, ["eval.lengths=(64, -1) must be", "positive"]),
      ("copy", {"data.train_min_length": 0}, ["1 <= train_min_length <= train_max_length"]),
      ("text_dir", {**lm, "eval.modes": ("strided",)},
       ["unknown ['strided']", "nonoverlapping, sliding"]),
      ("text_dir", {**lm, "eval.lengths": (100_000,), "eval.num_tokens": 100_000},
       ["the validation split of text_dir has", "needs 100001", "use lengths <="]),
      ("text_dir", {**lm, "eval.sliding_stride": 40}, ["stride 40", "must be in 1..32"]),
      ("text_dir", {**lm, "eval.num_tokens": 10}, ["eval.num_tokens=10 must be >= the longest"]),
      ("text_dir", {**lm, "data.packing": "docs"},
       ["data.packing='docs' is unknown; valid: concat, documents"]),
      ("copy", {"data.packing": "documents"},
       ["data.packing='documents' needs a text corpus", "copy is a synthetic task"]),
      ("passkey", {**NEEDLE, "data.packing": "documents"}, ["passkey is a synthetic task"]),
      ("text_dir", {**lm, "data.packing": "documents", "model.randomize_max_length": 2048},
       ["model.randomize_max_length=2048", "set model.randomize_max_length=0"]),
      ("text_dir", {**lm, "data.corpus_path": ""}, ["corpus_path is empty", "directory or a glob"]),
      ("text_dir", {**lm, "data.corpus_path": str(empty_dir)}, ["contains no files"]),
      ("text_dir", {**lm, "data.corpus_path": str(empty_dir / "missing")}, ["neither a file, a directory"]),
      ("text_dir", {**lm, "data.corpus_path": str(empty_dir / "*.txt")}, ["contains no files"]),
      ("parity", {}, ["data.name='parity' is unknown", "parity_check", "passkey", "bucket_sort"]),
      ("modular_arithmetic", {"data.task_vocab_size": 4},
       ["task_vocab_size=4 is too small for modular_arithmetic", "task_vocab_size >= 8"]),
      ("duplicate_string", {"data.train_max_length": 30}, ["need 90 inputs", "use train.seq_len "
                                                          ">= 90 or train_max_length <= 21"]),
      ("passkey", {**NEEDLE, "eval.depths": (0.5, 1.5)},
       ["eval.depths=(0.5, 1.5) must be one or more needle depths in [0, 1]"]),
      ("passkey", {**NEEDLE, "eval.depths": ()}, ["eval.depths=() must be"]),
      ("passkey", {**NEEDLE, "eval.lengths": (100, 400)},
       ["eval.lengths has 100, too short for passkey", "use lengths >= 103"]),
      ("needle_multikey", {**NEEDLE, "data.num_distractors": 3, "train.seq_len": 300},
       ["train.seq_len has 300, too short for needle_multikey", "use lengths >= 313"]),
      ("needle_multikey", {**NEEDLE, "data.num_distractors": 0},
       ["data.num_distractors=0 must be >= 1 for needle_multikey"]),
      ("needle_multivalue", {**NEEDLE, "data.num_values": 1},
       ["data.num_values=1 must be >= 2 for needle_multivalue"]),
      ("needle_single", {**NEEDLE, "data.needle_value_digits": 0},
       ["data.needle_value_digits=0 must be in 1..18"]),
      ("needle_multivalue", {**NEEDLE, "data.needle_value_digits": 1, "data.num_values": 10},
       ["needs 10 distinct values but data.needle_value_digits=1 gives 9"]),
      ("passkey", {**NEEDLE, "eval.bootstrap_samples": 0},
       ["eval.bootstrap_samples=0 must be positive"]),
  ]


def test_validate_errors(tmp_path, text_corpus):
  (tmp_path / "empty").mkdir()
  for name, overrides, phrases in bad_configs(tmp_path / "data", text_corpus, tmp_path / "empty"):
    with pytest.raises(ValueError) as error:
      data.validate(make_config(name, tmp_path / "data", **overrides))
    for phrase in phrases:
      assert phrase in str(error.value), (name, overrides, str(error.value))
  data.validate(lm_config(tmp_path / "data", text_corpus))
  data.validate(lm_config(tmp_path / "data", text_corpus, **{"data.packing": "documents"}))
  data.validate(make_config("mqar", tmp_path / "data"))
  for task in needles.TASKS:
    data.validate(make_config(task, tmp_path / "data", **NEEDLE))
  assert not (tmp_path / "data").exists()  # validate writes nothing


def test_eval_batches_errors(data_dir, text_corpus):
  config = lm_config(data_dir, text_corpus)
  with pytest.raises(ValueError, match="nonoverlapping, sliding"):
    data.eval_batches(config, 32, "strided")
  with pytest.raises(ValueError, match="must be in 1..500"):
    data.eval_batches(config, 501, "nonoverlapping")
  with pytest.raises(ValueError, match="stride 12 .* must be in 1..8"):
    data.eval_batches(config, 8, "sliding")
  with pytest.raises(ValueError, match="valid: train, validation, test"):
    data.eval_batches(config, 32, "nonoverlapping", split="dev")
  with pytest.raises(ValueError, match="eval.lengths=.64, 640."):
    data.eval_batches(make_config("copy", data_dir), 100, "nonoverlapping")
  config.data.packing = "docs"  # validated when the dataset was first prepared: refused here too
  for call in (lambda: data.train_batch(config, 0),
               lambda: data.eval_batches(config, 32, "sliding")):
    with pytest.raises(ValueError, match="packing='docs' is unknown; valid: concat, documents"):
      call()
