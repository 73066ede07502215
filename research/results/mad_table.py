"""MAD's score (Poli et al., arXiv:2403.17844) from a sweep's results rows: DIR/mad.md and
DIR/mad_state.png, written by research.results.report when the sweep ran MAD tasks
(configs/mad.py).

mad-lab's analysis (athms/mad-lab@0f49a45, mad/analysis.py): for each mixer and task setting
(a task at its baseline or one `changes` value), the best test accuracy over the learning-rate x
weight-decay grid; the task's score is the mean over its settings, the mixer's score the mean
over the six tasks. That selects on the test set. This table gives it ("test-selected") and the
honest form beside it ("validation-selected"): per setting, the grid point with the best
validation accuracy, scored by its test accuracy. Each run evaluates both splits
(eval.splits = ("validation", "test")); rows of the validation split alone give only the first
table's form, computed on validation.

Intervals: a setting's cell carries the 95% bootstrap interval over test examples of the run it
selected; a mean over independent settings (or tasks) carries half-widths combined as for a mean
of independent estimates, sqrt(sum h_i^2) / n, around the mean of the interval midpoints. The
test-selected maximum is biased upwards and its interval does not say so; the validation-selected
one is not.
"""

import collections
import math
import os

from research.data import mad
from research.evaluation import results as eval_results
from research.results import tables

GRID_KEYS = ("train.learning_rate", "train.weight_decay")  # what the protocol selects over
TASK_KEY = "data.name"
PREFIX = "mad_"
# Swept fields that follow from a task setting or from a grid point, not from the mixer.
DERIVED_KEYS = ("model.vocab_size", "train.end_learning_rate_fraction", "train.num_steps")


def applies(rows: list[dict]) -> bool:
  return any(str(row.get(TASK_KEY, "")).startswith(PREFIX) for row in rows)


def _task_of(row, base_task):
  return str(row.get(TASK_KEY) or base_task)


class _Cell(collections.namedtuple("_Cell", "value low high state_bytes")):
  """A score with its interval, and the decode state of the run(s) it comes from."""


def _mean_cell(cells):
  n = len(cells)
  halves = [(c.high - c.low) / 2 for c in cells]
  middle = sum((c.high + c.low) / 2 for c in cells) / n
  half = math.sqrt(sum(h * h for h in halves)) / n
  return _Cell(sum(c.value for c in cells) / n, middle - half, middle + half,
               sum(c.state_bytes for c in cells) / n)


def _metric(rows):
  """macro_accuracy, mad-lab's (research.evaluation.evaluate), where every row has it; rows
  evaluated before it was recorded give the per-token accuracy."""
  return "macro_accuracy" if all("macro_accuracy" in row for row in rows) else "accuracy"


def _seed_mean(rows, metric="accuracy"):
  """A grid point's cell over its seeds' rows (each one split): the means of value and bounds."""
  mean = lambda key: sum(row.get(key, row[metric]) for row in rows) / len(rows)
  return _Cell(mean(metric), mean(f"{metric}_ci_low"), mean(f"{metric}_ci_high"),
               mean("state_bytes") if all("state_bytes" in row for row in rows) else 0)


def scores(rows: list[dict], base_task: str) -> dict:
  """{selection: {mixer: {task: _Cell}}} for selection "test-selected" and, when the rows hold
  both splits, "validation-selected"; a task's cell is the mean over its settings."""
  keys = tables.swept_keys(rows)
  mixer_keys = [k for k in keys if k.startswith("model.") and k not in DERIVED_KEYS]
  setting_keys = [k for k in keys if k not in mixer_keys and k not in GRID_KEYS
                  and k not in (TASK_KEY, "train.seed") and k not in DERIVED_KEYS]
  points = collections.defaultdict(lambda: collections.defaultdict(list))
  metric = _metric([row for row in rows if _task_of(row, base_task).startswith(PREFIX)])
  for row in rows:
    if row.get("depth") is not None:
      continue
    mixer = tables.variant_label(row, mixer_keys) if mixer_keys else row["attention"]
    setting = tuple(str(row.get(k)) for k in setting_keys)
    grid = tuple(str(row.get(k)) for k in GRID_KEYS)
    points[(mixer, _task_of(row, base_task), setting)][(grid, eval_results.split(row))].append(row)
  has_test = any(split == "test" for per in points.values() for _, split in per)
  selected = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
  for (mixer, task, _), per_point in points.items():
    cells = {(grid, split): _seed_mean(r, metric) for (grid, split), r in per_point.items()}
    scored_split = "test" if has_test else eval_results.DEFAULT_SPLIT
    scored = {grid: cell for (grid, split), cell in cells.items() if split == scored_split}
    if not scored:
      continue
    selected["test-selected" if has_test else "validation"][mixer][task].append(
        max(scored.values(), key=lambda c: c.value))
    validation = {grid: cell for (grid, split), cell in cells.items()
                  if split == eval_results.DEFAULT_SPLIT and grid in scored}
    if has_test and validation:
      best = max(validation, key=lambda grid: validation[grid].value)
      selected["validation-selected"][mixer][task].append(scored[best])
  return {selection: {mixer: {task: _mean_cell(cells) for task, cells in per_task.items()}
                      for mixer, per_task in per_mixer.items()}
          for selection, per_mixer in selected.items()}


def _text(cell):
  return f"{cell.value:.3f} [{cell.low:.3f}, {cell.high:.3f}]"


def _table(per_mixer, tasks):
  lines = ["| mixer | " + " | ".join(t.removeprefix(PREFIX) for t in tasks) + " | MAD score |",
           "|---" * (len(tasks) + 2) + "|"]
  for mixer, per_task in sorted(per_mixer.items(), key=lambda item: -overall(item[1]).value):
    cells = [_text(per_task[t]) if t in per_task else "" for t in tasks]
    score = _text(overall(per_task)) if len(per_task) == len(tasks) else "(tasks missing)"
    lines.append(f"| {mixer} | " + " | ".join(cells) + f" | {score} |")
  return lines


def overall(per_task):
  return _mean_cell(list(per_task.values()))


def per_seed(rows: list[dict], base_task: str) -> dict:
  """{selection: {mixer: [MAD score of seed s for each seed]}}: the whole selection and means
  made from each seed's rows alone, so the spread across training seeds shows beside the
  intervals over test examples (which say nothing about it). Empty for rows of one seed."""
  seeds = sorted({row.get("train.seed", 0) for row in rows})
  if len(seeds) < 2:
    return {}
  out = collections.defaultdict(lambda: collections.defaultdict(list))
  for seed in seeds:
    scored = scores([row for row in rows if row.get("train.seed", 0) == seed], base_task)
    for selection, per_mixer in scored.items():
      for mixer, per_task in per_mixer.items():
        out[selection][mixer].append(overall(per_task).value)
  return out


def _spread_table(per_mixer):
  """mean +/- std over seeds (as summary.md's: tables.mean_std) and each seed's MAD score."""
  lines = ["| mixer | MAD score over seeds | each seed |", "|---|---|---|"]
  for mixer, values in sorted(per_mixer.items(), key=lambda item: -sum(item[1])):
    mean, std = tables.mean_std(values)
    lines.append(f"| {mixer} | {mean:.3f} +/- {std:.3f} | "
                 + ", ".join(f"{v:.3f}" for v in values) + " |")
  return lines


SELECTION_TEXT = {
    "test-selected": "mad-lab's score: per task setting the best test accuracy over the "
                     "learning-rate x weight-decay grid, then the mean per task and over tasks.",
    "validation-selected": "per task setting the grid point with the best validation accuracy, "
                           "scored on test; then the same means.",
    "validation": "only the validation split was evaluated: the best validation accuracy per "
                  "task setting (as mad-lab selects, but on validation), then the same means.",
}


def write(workdir: str, rows: list[dict], base_task: str) -> list[str]:
  """mad.md (and mad_state.png when the rows record state sizes) in `workdir`; returns the
  names written."""
  by_selection = scores(rows, base_task)
  order = {task: i for i, task in enumerate(mad.TASKS)}  # mad-lab's order
  tasks = sorted({task for per_mixer in by_selection.values() for per_task in per_mixer.values()
                  for task in per_task}, key=lambda task: (order.get(task, len(order)), task))
  mad_rows = [row for row in rows if _task_of(row, base_task).startswith(PREFIX)]
  measure = ("macro accuracy over the vocabulary's classes at the scored tokens, as mad-lab's "
             "torchmetrics MulticlassAccuracy" if _metric(mad_rows) == "macro_accuracy" else
             "accuracy over the scored tokens (rows evaluated before macro accuracy was "
             "recorded)")
  lines = ["# MAD scores", "",
           f"{measure[0].upper()}{measure[1:]}, mean over seeds; [95% interval] "
           "(research/results/mad_table.py says how it is combined over settings and tasks).", ""]
  for selection, per_mixer in by_selection.items():
    lines += [f"## {selection}", "", SELECTION_TEXT[selection], "", *_table(per_mixer, tasks), ""]
  for selection, per_mixer in per_seed(rows, base_task).items():
    lines += [f"## {selection}, seed by seed", "",
              "The same score made from each training seed's runs alone: mean +/- std over "
              "seeds, then each seed's score (the intervals above are over test examples and do "
              "not include this spread).", "", *_spread_table(per_mixer), ""]
  with open(os.path.join(workdir, "mad.md"), "w") as f:
    f.write("\n".join(lines))
  written = ["mad.md"]
  chosen = by_selection.get("validation-selected") or next(iter(by_selection.values()), None)
  if chosen and all(cell.state_bytes for per in chosen.values() for cell in per.values()):
    from research.results import plots  # noqa: PLC0415 (matplotlib only when drawing)
    panels = [(task.removeprefix(PREFIX), {mixer: per[task] for mixer, per in chosen.items()
                                           if task in per}) for task in tasks]
    panels.append(("MAD score (mean over tasks)", {mixer: overall(per) for mixer, per
                                                   in chosen.items() if len(per) == len(tasks)}))
    plots.save(plots.score_against_state(panels), os.path.join(workdir, "mad_state.png"))
    written.append("mad_state.png")
  return written
