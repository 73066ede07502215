"""MAD's score from results rows (research.results.mad_table): the best test accuracy over the
(lr, wd) grid per task setting, averaged per task and over tasks (mad-lab's analysis), the
validation-selected score beside it, their intervals, and the state figure."""

import json
import math
import os
import shutil

import pytest

from research.results import mad_table
from research.results import plots
from research.results import report

GRID = [(1e-3, 0.0), (1e-4, 0.1)]


def _row(mixer, task, examples, grid, split, accuracy, state_bytes):
  lr, wd = grid
  return {"run": f"{mixer}-{task}-{examples}-{lr}-{wd}", "attention": mixer, "step": 10,
          "train_steps": 10, "split": split, "eval_length": 32, "rope_scaling": "none",
          "model.attention": mixer, "data.name": task, "data.mad_num_train_examples": examples,
          "train.learning_rate": lr, "train.weight_decay": wd, "model.vocab_size": 18,
          "accuracy": accuracy, "accuracy_ci_low": accuracy - 0.02,
          "accuracy_ci_high": accuracy + 0.02, "state_bytes": state_bytes}


def _rows():
  """mha on two tasks (recall with two settings), deltanet on both with one setting each; in
  recall/128 the grid point that wins on validation is not the one that wins on test."""
  rows = []
  accuracies = {  # (mixer, task, examples): {grid point: (validation, test)}
      ("mha", "mad_in_context_recall", 128): {GRID[0]: (0.9, 0.6), GRID[1]: (0.5, 0.8)},
      ("mha", "mad_in_context_recall", 256): {GRID[0]: (0.4, 0.4), GRID[1]: (0.2, 0.2)},
      ("mha", "mad_memorization", 256): {GRID[0]: (1.0, 1.0), GRID[1]: (0.9, 0.9)},
      ("deltanet", "mad_in_context_recall", 128): {GRID[0]: (0.3, 0.3), GRID[1]: (0.7, 0.7)},
      ("deltanet", "mad_memorization", 256): {GRID[0]: (0.5, 0.5), GRID[1]: (0.1, 0.1)},
  }
  for (mixer, task, examples), per_grid in accuracies.items():
    for grid, (validation, test) in per_grid.items():
      state = 4096 if mixer == "mha" else 512
      rows.append(_row(mixer, task, examples, grid, "validation", validation, state))
      rows.append(_row(mixer, task, examples, grid, "test", test, state))
  return rows


def test_test_selection_takes_the_best_test_point_and_validation_selection_scores_on_test():
  scores = mad_table.scores(_rows(), "mad_in_context_recall")
  test, validation = scores["test-selected"], scores["validation-selected"]
  # mha recall: settings 128 -> max(0.6, 0.8), 256 -> 0.4; mean 0.6. By validation: 0.6 and 0.4.
  assert test["mha"]["mad_in_context_recall"].value == pytest.approx(0.6)
  assert validation["mha"]["mad_in_context_recall"].value == pytest.approx(0.5)
  assert mad_table.overall(test["mha"]).value == pytest.approx((0.6 + 1.0) / 2)
  assert mad_table.overall(validation["deltanet"]).value == pytest.approx((0.7 + 0.5) / 2)
  # two independent settings of half-width 0.02: the mean's half-width is sqrt(2) 0.02 / 2
  cell = test["mha"]["mad_in_context_recall"]
  assert cell.high - cell.low == pytest.approx(math.sqrt(2) * 0.02)
  assert cell.state_bytes == 4096


def test_validation_rows_alone_give_the_selection_on_validation():
  rows = [row for row in _rows() if row["split"] == "validation"]
  scores = mad_table.scores(rows, "mad_in_context_recall")
  assert list(scores) == ["validation"]
  assert scores["validation"]["mha"]["mad_in_context_recall"].value == pytest.approx(0.65)


def test_write_gives_the_table_ranked_by_score_and_the_state_figure(tmp_path):
  written = mad_table.write(str(tmp_path), _rows(), "mad_in_context_recall")
  assert written == ["mad.md", "mad_state.png"]
  assert os.path.getsize(tmp_path / "mad_state.png") > 0
  text = (tmp_path / "mad.md").read_text()
  assert "## test-selected" in text and "## validation-selected" in text
  table = text.split("## test-selected")[1].split("##")[0]
  lines = [line for line in table.splitlines() if line.startswith("| ")]
  assert lines[0].startswith("| mixer | in_context_recall | memorization | MAD score")
  assert lines[1].startswith("| mha | 0.600") and lines[2].startswith("| deltanet | 0.700")


def test_seeds_are_averaged_in_the_cells_and_their_spread_is_shown_seed_by_seed(tmp_path):
  """Seed 1 scores every test row 0.2 lower: the cells average the two seeds, and the seed table
  gives each seed's own score (selection and means within that seed) and their std."""
  seed0 = [dict(row, **{"train.seed": 0}) for row in _rows()]
  seed1 = [dict(row, **{"train.seed": 1, "accuracy": row["accuracy"] - 0.2}) for row in _rows()]
  rows = seed0 + seed1
  mean = mad_table.overall(mad_table.scores(rows, "mad_in_context_recall")["test-selected"]["mha"])
  assert mean.value == pytest.approx((0.6 + 1.0) / 2 - 0.1)
  spread = mad_table.per_seed(rows, "mad_in_context_recall")["test-selected"]["mha"]
  assert spread == pytest.approx([0.8, 0.6])
  assert mad_table.per_seed(seed0, "mad_in_context_recall") == {}
  mad_table.write(str(tmp_path), rows, "mad_in_context_recall")
  text = (tmp_path / "mad.md").read_text()
  section = text.split("## test-selected, seed by seed")[1].split("##")[0]
  assert "| mha | 0.700 +/- 0.100 | 0.800, 0.600 |" in section


def test_accuracy_against_state_draws_one_line_per_mixer_with_byte_ticks():
  rows = [dict(row, eval_mode="nonoverlapping") for row in _rows()
          if row["split"] == "validation" and row["data.name"] == "mad_memorization"]
  figure = plots.accuracy_against_state(rows, "accuracy")
  figure.canvas.draw()
  ax = figure.axes[0]
  labels = [t.get_text() for t in ax.xaxis.get_ticklabels() if t.get_text()]
  assert labels and all(label.endswith(("B", "KiB")) for label in labels), labels
  mixers, title = sorted(c.get_label() for c in ax.containers), ax.get_title()
  plots.plt.close(figure)
  assert mixers == ["deltanet", "mha"] and title.startswith("mad_memorization"), (mixers, title)


def test_rows_with_macro_accuracy_are_scored_by_it_as_mad_lab_scores(tmp_path):
  rows = _rows()
  for row in rows:  # macro accuracy a tenth below the per-token one, everywhere
    row.update(macro_accuracy=row["accuracy"] - 0.1, macro_accuracy_ci_low=row["accuracy"] - 0.12,
               macro_accuracy_ci_high=row["accuracy"] - 0.08)
  per_mixer = mad_table.scores(rows, "mad_in_context_recall")["test-selected"]
  # mha's memorization: the best test point's macro accuracy, 1.0 - 0.1.
  assert per_mixer["mha"]["mad_memorization"].value == pytest.approx(0.9)
  mad_table.write(str(tmp_path), rows, "mad_in_context_recall")
  with open(tmp_path / "mad.md") as f:
    assert "Macro accuracy over the vocabulary's classes" in f.read()
  del rows[0]["macro_accuracy"]  # one row from before: the per-token accuracy for all
  per_mixer = mad_table.scores(rows, "mad_in_context_recall")["test-selected"]
  assert per_mixer["mha"]["mad_memorization"].value == pytest.approx(1.0)


def test_a_runs_macro_accuracy_reaches_the_results_rows_and_csv(tmp_path):
  """report.collect keeps the macro accuracy eval.json records for MAD's tasks, so mad.md is
  scored by it (rows built by hand above bypass that path)."""
  fixture = os.path.join(os.path.dirname(__file__), "fixtures", "run_e4f910a")
  run = tmp_path / "run"
  run.mkdir()
  shutil.copy(os.path.join(fixture, "config.json"), run / "config.json")
  with open(os.path.join(fixture, "eval.json")) as f:
    evaluation = json.load(f)[0]
  evaluation.update(macro_accuracy=0.25, macro_accuracy_ci_low=0.2, macro_accuracy_ci_high=0.3)
  with open(run / "eval.json", "w") as f:
    json.dump([evaluation], f)
  rows, _ = report.collect(str(run))
  assert [row["macro_accuracy"] for row in rows] == [0.25]
  with open(run / "results.csv") as f:
    header = f.readline().strip().split(",")
  assert {"macro_accuracy", "macro_accuracy_ci_low", "macro_accuracy_ci_high"} <= set(header)
