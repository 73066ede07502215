"""MAD's six tasks (research.data.mad): each task's targets against an independent few-line
solution, the scored positions, determinism per seed, the settings' effect, the mad-lab grid, and
one prepared dataset read back through the training pipeline. numpy only, no model."""

import numpy as np
import pytest

from configs import base
from research import data
from research.data import mad
from research.data import tasks
from research.data.vocab import TaskVocab
from research.runs import unread

SEEDS = range(40)


def _draw(task, seed, size, num_symbols, train=False, **settings):
  return mad.TASKS[task].generate(np.random.default_rng(seed), size, TaskVocab(num_symbols),
                                  mad.Settings(**settings), train)


def _check_shapes(task, inputs, targets, scored, size):
  length = mad.TASKS[task].inputs_for_size(size)
  assert inputs.shape == targets.shape == scored.shape == (length,)
  assert mad.TASKS[task].size_for_length(length) == size


@pytest.mark.parametrize("noise", [{}, {"frac_noise": 0.5, "noise_vocab_size": 8}])
def test_recall_answers_are_the_value_last_paired_with_the_key(noise):
  task = "mad_noisy_in_context_recall" if noise else "mad_in_context_recall"
  symbols = 16
  for seed in SEEDS:
    inputs, targets, scored = _draw(task, seed, 64, symbols + noise.get("noise_vocab_size", 0),
                                    **noise)
    _check_shapes(task, inputs, targets, scored, 64)
    seq = np.append(inputs, targets[-1])
    assert np.array_equal(seq[1:], targets)  # next-token task
    expected, memory = np.zeros(seq.size, bool), {}
    for i in range(0, seq.size, 2):
      key, value = seq[i], seq[i + 1]
      if key >= symbols:  # a noise pair
        assert value >= symbols
        continue
      assert key < symbols // 2 <= value < symbols
      if key in memory:
        assert memory[key] == value  # a key keeps its value
        expected[i + 1] = True
      memory[key] = value
    assert seq[-2] in memory and expected[-1]  # the final probe was shown before
    assert np.array_equal(scored, expected[1:])
    _, _, train_scored = _draw(task, seed, 64, symbols + noise.get("noise_vocab_size", 0),
                               train=True, **noise)
    assert train_scored.all()  # mad-lab trains on every next token


def test_noise_fraction_and_vocabulary_follow_the_settings():
  for frac in (0.2, 0.8):
    pairs = np.concatenate([_draw("mad_noisy_in_context_recall", s, 128, 48, frac_noise=frac,
                                  noise_vocab_size=16)[0][:-1:2] for s in SEEDS])
    assert abs((pairs >= 32).mean() - frac) < 0.05
  inputs = np.concatenate([_draw("mad_in_context_recall", s, 128, 64)[0] for s in SEEDS])
  assert inputs.max() < 64 and inputs.max() >= 48  # values fill the upper half of 64 ids


def _assemble(padding, pairs, pad):
  tokens, scored = [pad] * padding, [False] * padding
  for key, value, value_scored in pairs:
    tokens += [*key, *value]
    scored += [False] * len(key) + [value_scored] * len(value)
  return np.array(tokens), np.array(scored)


@pytest.mark.parametrize("train", [False, True])
def test_fuzzy_recall_motifs_and_answers(train):
  symbols, k, v, size = 16, 3, 3, 128
  half = (symbols - 1) // 2
  shown = 0
  for seed in SEEDS:
    settings = mad.Settings(k_motif_size=k, v_motif_size=v)
    padding, pairs, probe_shown = mad.fuzzy_layout(
        np.random.default_rng(seed), size, symbols, settings, train)
    inputs, targets, scored = _draw("mad_fuzzy_in_context_recall", seed, size, symbols, train,
                                    k_motif_size=k, v_motif_size=v)
    _check_shapes("mad_fuzzy_in_context_recall", inputs, targets, scored, size)
    tokens, expected = _assemble(padding, pairs, symbols - 1)
    assert np.array_equal(inputs, tokens[:-1]) and np.array_equal(targets, tokens[1:])
    assert np.array_equal(scored, np.ones(size, bool) if train else expected[1:])
    memory = {}
    for key, value, value_scored in pairs[:-1]:
      assert 1 <= len(key) <= k and 1 <= len(value) <= v
      assert train or len(key) == k  # tested at the longest key motif
      assert len(set(key)) == len(key) and len(set(value)) == len(value)
      assert max(key) < half <= min(value) and max(value) < symbols - 1
      assert value_scored == (key in memory)
      assert memory.setdefault(key, value) == value
    probe_key, probe_value, _ = pairs[-1]
    assert probe_shown == (probe_key in memory)
    if probe_shown:
      shown += 1
      assert memory[probe_key] == probe_value
  assert shown >= 0.8 * len(SEEDS)  # mad-lab's loop may stop before the probe's offset


def test_selective_copying_targets_are_the_non_blank_tokens_in_order():
  symbols, size = 16, 64
  blank, copy = symbols - 2, symbols - 1
  for n in (4, 16):
    for seed in SEEDS:
      for train in (False, True):
        inputs, targets, scored = _draw("mad_selective_copying", seed, size, symbols, train,
                                        num_tokens_to_copy=n)
        _check_shapes("mad_selective_copying", inputs, targets, scored, size)
        at = list(inputs).index(copy)
        content = [t for t in inputs[:at] if t != blank]
        assert len(content) == n and at == size - n - 1
        assert (inputs[at + 1:] == blank).all()
        assert np.flatnonzero(scored).tolist() == list(range(at + 1, size))
        assert targets[scored].tolist() == content


MAD_LAB_MAP_256 = {120: 175, 0: 239, 101: 249, 119: 185, 126: 214}  # generate_kv_map(255, 12345)


def test_memorization_uses_mad_labs_fixed_map():
  keys, values = mad.memorization_map(256)
  table = dict(zip(keys.tolist(), values.tolist()))
  assert len(table) == 127 and sorted(table) == list(range(127))
  assert len(set(table.values())) == 127 and 127 <= min(table.values()) <= max(table.values()) < 255
  assert all(table[key] == value for key, value in MAD_LAB_MAP_256.items())
  keys, values = mad.memorization_map(512)
  assert dict(zip(keys.tolist(), values.tolist()))[0] == 316
  for seed in SEEDS:
    inputs, targets, scored = _draw("mad_memorization", seed, 32, 256, train=seed % 2 == 0)
    _check_shapes("mad_memorization", inputs, targets, scored, 32)
    assert (inputs[1::2] == 255).all() and scored.tolist() == [False, True] * 16
    assert [table[key] for key in inputs[::2]] == targets[1::2].tolist()


def test_compression_reconstructs_the_sequence_after_the_compression_token():
  symbols, size = 16, 32
  pad = TaskVocab(symbols).pad
  for seed in SEEDS:
    inputs, targets, scored = _draw("mad_compression", seed, size, symbols)
    _check_shapes("mad_compression", inputs, targets, scored, size)
    sequence = inputs[:size]
    assert sequence[-1] == symbols - 1 and sequence[:-1].max() < symbols - 1
    assert (inputs[size:] == pad).all()
    assert np.flatnonzero(scored).tolist() == list(range(size - 1, 2 * size - 1))
    assert targets[scored].tolist() == sequence.tolist()


@pytest.mark.parametrize("task", list(mad.TASKS))
def test_examples_are_deterministic_per_seed_and_differ_across_seeds(task):
  setting = mad.TASKS[task].baseline
  settings = {name: setting[name] for name in mad.TASKS[task].reads}
  size, symbols = min(setting["seq_len"], 64), setting["vocab_size"]
  first = _draw(task, 3, size, symbols, **settings)
  again = _draw(task, 3, size, symbols, **settings)
  other = _draw(task, 4, size, symbols, **settings)
  assert all(np.array_equal(a, b) for a, b in zip(first, again))
  assert not np.array_equal(first[0], other[0])
  example = tasks.example(task, np.random.default_rng(3), size, symbols, 0,
                          mad.TASKS[task].inputs_for_size(size) + 5, mad.Settings(**settings))
  assert np.array_equal(example["inputs"][:first[0].size], first[0])
  assert (example["inputs"][first[0].size:] == TaskVocab(symbols).pad).all()
  assert (example["loss_mask"][first[0].size:] == 0).all()


def test_the_grid_is_mad_labs_and_maps_onto_config_fields():
  counts = {task: len(mad.settings_grid(task)) for task in mad.TASKS}
  assert counts == {"mad_in_context_recall": 11, "mad_fuzzy_in_context_recall": 11,
                    "mad_noisy_in_context_recall": 14, "mad_selective_copying": 13,
                    "mad_compression": 11, "mad_memorization": 6}
  noisy = mad.settings_grid("mad_noisy_in_context_recall")[-1]
  assert noisy == {"vocab_size": 32, "noise_vocab_size": 16, "seq_len": 128,
                   "num_train_examples": 12800, "frac_noise": 0.8}
  assert mad.overrides("mad_noisy_in_context_recall", noisy) == {
      "data.name": "mad_noisy_in_context_recall", "train.seq_len": 127, "eval.lengths": (127,),
      "data.task_vocab_size": 32, "data.mad_noise_vocab_size": 16,
      "data.num_train_examples": 12800, "data.mad_frac_noise": 0.8}
  assert mad.overrides("mad_compression", mad.TASKS["mad_compression"].baseline)[
      "train.seq_len"] == 63


def _config(task, **fields):
  config = base.get_config()
  config.data.name = task
  for name, value in fields.items():
    section, field = name.split(".")
    config[section][field] = value
  return config


def test_settings_are_read_only_by_their_task_and_checked():
  config = _config("mad_in_context_recall", **{"data.mad_frac_noise": 0.5})
  assert "data.mad_frac_noise" in unread.unread_settings(config)
  config = _config("mad_noisy_in_context_recall", **{"data.mad_frac_noise": 0.5})
  assert not unread.unread_settings(config)
  assert mad.settings(config) == mad.Settings(frac_noise=0.5, noise_vocab_size=16)
  config = _config("mad_selective_copying", **{"train.seq_len": 32, "eval.lengths": (32,)})
  assert any("2 num_tokens_to_copy + 1 = 33" in p for p in mad.problems(config))
  config = _config("mad_fuzzy_in_context_recall", **{"data.task_vocab_size": 6})
  assert any("too few for motifs" in p for p in mad.problems(config))


def test_a_prepared_dataset_trains_on_its_explicit_inputs(tmp_path):
  config = _config("mad_selective_copying", **{
      "data.dir": str(tmp_path), "data.num_train_examples": 64, "data.num_eval_examples": 4,
      "data.mad_num_tokens_to_copy": 4, "train.seq_len": 24, "train.batch_size": 8,
      "eval.lengths": (24,), "eval.batch_size": 4})
  batch = data.train_batch(config, 0)
  copy = 15
  for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"]):
    at = list(inputs).index(copy)
    assert targets[mask > 0].tolist() == [t for t in inputs[:at] if t != 14]
  evaluation = next(data.eval_batches(config, 24, "nonoverlapping"))
  assert (evaluation["loss_mask"].sum(1) == 4).all()
