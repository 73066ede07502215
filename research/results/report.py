"""Results files of a run or a sweep, from the runs' eval.json files alone (but for
training_curves.png, from their metrics.jsonl): DIR/results.csv (tidy), DIR/summary.md and the
figures (research.results.plots).

results.csv has one row per run x evaluation (research.evaluation.results: checkpoint step x
split x eval length x mode x RoPE scaling x evaluated text x needle depth), with the columns run,
attention, position, seed, train_length, train_steps, step, split, eval_length, eval_mode,
rope_scaling, num_tokens, sliding_stride, bootstrap_samples, bootstrap_seed, loss, perplexity,
accuracy, exact_match, bits_per_byte (a language model of bytes: loss / ln 2, with its interval),
tokens and sequences (scored windows or examples), state_bytes (the
decode state per sequence at that length), the 95% bootstrap interval of
each metric over those sequences (`loss_ci_low`, `loss_ci_high`, ...), macro_accuracy and its
interval where the evaluation recorded it (MAD's tasks), and, in a sweep, one
column per swept field: a field that changes training in which a run differs from the sweep's
base config (its dotted name). Needle tasks add `depths` (those evaluated) and a row per needle
depth, with its `depth`; their row with an empty depth pools every depth. summary.md and the
figures show each run's latest rows (the newest checkpoint step) of the validation split; a run
evaluated before its last step is labelled with the step. A sweep of MAD tasks adds mad.md and
mad_state.png (research.results.mad_table), which read the test split too; another task sweep
over model.d_model adds width.md (research.results.width_table: every cell over seeds, seed by
seed). training_curves.png (research.results.training_curves) plots each run's training and
validation loss from its metrics.jsonl, evaluated or not.
"""

import collections
import csv
import math
import os
from typing import NamedTuple

from research.runs import config_fields
from research import data
from research.evaluation import results as eval_results
from research.results import mad_table
from research.results import sweep as sweep_lib
from research.results import training_curves
from research.results import width_table
from research.results.tables import (aggregate, cell, intervals, mean_std, scaled_label,
                                     swept_keys, variant_label)
from research.runs import unread
from research.runs import workdirs

INTERVAL_METRICS = ("loss", "perplexity", "accuracy", "exact_match")
CI_COLUMNS = tuple(f"{m}_ci_{end}" for m in INTERVAL_METRICS for end in ("low", "high"))
# Recorded by some evaluations only (MAD's tasks: research.evaluation.extrapolation).
OPTIONAL_METRICS = ("macro_accuracy", "macro_accuracy_ci_low", "macro_accuracy_ci_high")
METRIC_COLUMNS = (INTERVAL_METRICS + ("tokens", "sequences", "state_bytes") + CI_COLUMNS
                  + OPTIONAL_METRICS)


def _attention_label(config):
  return "+".join(config.model.layer_pattern) if config.model.layer_pattern else config.model.attention


def _swept_fields(configs, base_config):
  """Training fields in which some run's config differs from the sweep's base config."""
  base = config_fields.flatten(base_config)
  flat = [config_fields.flatten(config) for config in configs]
  return sorted(name for name in base if config_fields.changes_training(name)
                and any(f[name] != base[name] for f in flat))


def _status(workdir, run):
  if workdirs.is_sweep(workdir):
    return sweep_lib.status(workdir, run.name)
  return {"state": "not evaluated",
          "reason": f"python -m experiments.evaluate --workdir={workdir} evaluates it"}


def _saved_configs(workdir):
  """(the runs, {name: config} of those that have a config.json, the fields swept over them)."""
  runs = workdirs.runs(workdir)
  configs = {run.name: config_fields.load_saved(run.directory) for run in runs
             if os.path.exists(os.path.join(run.directory, "config.json"))}
  return runs, configs, _swept_fields(configs.values(), workdirs.base_config(workdir))


def _swept_cells(config, swept):
  """The run's value of each swept field as its rows hold it; "" for a setting it does not read
  (another variant's), which is then no part of its name."""
  flat = config_fields.flatten(config)
  try:
    skipped = unread.not_read(config)
  except ValueError:  # a variant no longer registered: name it by every swept setting
    skipped = {}
  return {k: "" if unread.enclosing(k, skipped) else cell(flat[k]) for k in swept}


def _bits_per_byte(config, evaluation) -> dict:
  """bits_per_byte = loss / ln 2 and its interval, for a language model of bytes; else none."""
  if config.data.tokenizer != "bytes" or not data.is_language_modeling(config):
    return {}
  return {f"bits_per_byte{end}": evaluation[f"loss{end}"] / math.log(2)
          for end in ("", "_ci_low", "_ci_high") if evaluation.get(f"loss{end}") is not None}


def collect(workdir: str) -> tuple[list[dict], list[tuple[str, dict]]]:
  """(rows, runs without rows): every evaluation of every run (with each row's loss by position),
  and (name, status) of the runs that have none. Writes DIR/results.csv (without the losses by
  position)."""
  runs, configs, swept = _saved_configs(workdir)
  rows, without = [], []
  for run in runs:
    evaluations = eval_results.read(run.directory)
    if not evaluations:
      without.append((run.name, _status(workdir, run)))
      continue
    config = configs[run.name]
    swept_cells = _swept_cells(config, swept)
    for evaluation in evaluations:
      row = {"run": run.name, "attention": _attention_label(config),
             "position": config.model.position, "seed": config.train.seed,
             "train_length": config.train.seq_len, "train_steps": config.train.num_steps}
      row.update({k: cell(evaluation[k]) for k in eval_results.KEY if k in evaluation})
      row["split"] = eval_results.split(evaluation)
      row.update({k: evaluation[k] for k in METRIC_COLUMNS if k in evaluation})
      row.update(_bits_per_byte(config, evaluation))
      row.update(swept_cells)
      row["loss_by_position"] = evaluation["loss_by_position"]
      rows.append(row)
  columns = list(dict.fromkeys(k for row in rows for k in row if k != "loss_by_position"))
  with open(os.path.join(workdir, "results.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  return rows, without


def _summary_cell(values, lows, highs, best):
  """'mean +/- std (best) [low, high]': over seeds, and the seeds' mean 95% interval."""
  if not values:
    return ""
  mean, std = mean_std(values)
  text = f"{mean:.3f} +/- {std:.3f} ({best(values):.3f})" if len(values) > 1 else f"{mean:.3f}"
  if lows:
    text += f" [{mean_std(lows)[0]:.3f}, {mean_std(highs)[0]:.3f}]"
  return text


def _depth_lines(rows, metric, best):
  """A table of the metric at every needle depth, one line per variant and evaluation length."""
  keys = swept_keys(rows)
  cells = collections.defaultdict(lambda: collections.defaultdict(list))
  for row in rows:
    variant = scaled_label(variant_label(row, keys), row["rope_scaling"])
    cells[(variant, row["eval_length"])][row["depth"]].append(row)
  depths = sorted({depth for per_depth in cells.values() for depth in per_depth})
  lines = [f"## {metric} by needle depth", "",
           "Depth 0: the needle starts the text; 1: it ends right before the question.", "",
           "| variant | length | " + " | ".join(f"{d:g}" for d in depths) + " |",
           "|---" * (len(depths) + 2) + "|"]
  for (variant, length), per_depth in sorted(cells.items()):
    column = lambda depth, key: [row[key] for row in per_depth.get(depth, ()) if key in row]
    lines.append(f"| {variant} | {length} | " + " | ".join(
        _summary_cell(column(d, metric), column(d, f"{metric}_ci_low"),
                      column(d, f"{metric}_ci_high"), best) for d in depths) + " |")
  return lines + [""]


def write_summary(path, rows, not_done, metric, train_length, depth_rows=()):
  """summary.md: `metric` by evaluation length per variant (the rows without a depth), by needle
  depth (depth_rows, when there are some), and the runs without results."""
  best = min if metric == "perplexity" else max
  table = aggregate(rows, metric)
  lows, highs = intervals(rows, metric)
  all_lengths = {length for per in table.values() for length in per}
  # Each line's training length (a sweep over train.seq_len names it in the line's label).
  trained = {point: max(v for per in per_length.values() for v in per)
             for point, per_length in aggregate(rows, "train_length").items()}
  train_lengths = sorted(set(trained.values())) or [train_length]
  longest = max(all_lengths, default=0)

  def ratio_length(length):  # the ALiBi paper's comparison point, 8x training, else the longest
    return 8 * length if 8 * length in all_lengths else longest

  cells_text = ("Cells: mean +/- std over seeds (best seed) [95% bootstrap interval over the "
                "evaluated windows or examples, averaged over seeds].")
  if len(train_lengths) == 1:
    trained_text = (f"Trained at length {train_lengths[0]}. {cells_text} `ratio` is the mean at "
                    f"length {ratio_length(train_lengths[0])} over the mean at the training length.")
  else:
    trained_text = (f"Trained at lengths {', '.join(map(str, train_lengths))}, each line at the "
                    f"one its label names. {cells_text} `ratio` is a line's mean at 8x its "
                    f"training length (else at length {longest}) over its mean at its training "
                    "length, where it has both.")
  lines = [f"# Summary: {metric} by evaluation length", "", trained_text, ""]
  for mode in sorted({mode for mode, _, _ in table}):
    lengths = sorted({length for (m, _, _), per in table.items() if m == mode for length in per})
    lines += [f"## {mode}", "", "| variant | " + " | ".join(map(str, lengths)) + " | ratio |",
              "|---" * (len(lengths) + 2) + "|"]
    for point, per_length in sorted(table.items()):
      m, variant, scaling = point
      if m != mode:
        continue
      cells = [_summary_cell(per_length.get(length), lows.get(point, {}).get(length),
                             highs.get(point, {}).get(length), best)
               for length in lengths]
      ratio, own, far = "", trained[point], ratio_length(trained[point])
      if far != own and per_length.get(own) and per_length.get(far) and mean_std(per_length[own])[0]:
        ratio = f"{mean_std(per_length[far])[0] / mean_std(per_length[own])[0]:.2f}x"
      lines.append(f"| {scaled_label(variant, scaling)} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
  if depth_rows:
    lines += _depth_lines(depth_rows, metric, best)
  if not_done:
    lines += ["## Runs without results", "", "| run | state | reason |", "|---|---|---|"]
    for name, status in not_done:
      reason = (status.get("reason") or status.get("error") or "").replace("|", "/")
      lines.append(f"| {name} | {status['state']} | {reason.splitlines()[0] if reason else ''} |")
    lines.append("")
  with open(path, "w") as f:
    f.write("\n".join(lines))


class Written(NamedTuple):
  files: list[str]  # the files written in the workdir: results.csv, summary.md, the figures
  # The runs without results (pending, failed, skipped or not evaluated) and, where
  # training_curves.png is drawn, the runs left out of it (no metrics.jsonl, or no step logged).
  missing: list[str]


def curves(workdir: str) -> tuple[list[training_curves.Curve], str, list[str]]:
  """(curves, title, runs without a curve): the training curve of every run that has logged a
  step (research.results.training_curves), labelled by its swept fields as its results rows
  are; the figure's title; and the other runs."""
  runs, configs, swept = _saved_configs(workdir)
  found, without = [], []
  for run in runs:
    config = configs.get(run.name)
    curve = None if config is None else training_curves.curve(
        run.name, variant_label({"run": run.name, **_swept_cells(config, swept)}, swept),
        run.directory, config)
    if curve:
      found.append(curve)
    else:
      without.append(run.name)
  title = training_curves.title(workdir, [configs[c.run] for c in found],
                                workdirs.is_sweep(workdir))
  return found, title, without


def _write_figures(workdir, rows, depth_rows, config, metric, train_length):
  """Draws the figures of the results (research.results.plots) into `workdir`; returns their names:
  extrapolation.png and loss_by_position.png always, rope_scaling.png with RoPE-scaled rows,
  needle_heatmap.png and lost_in_the_middle.png with needle depths, tasks.png over several tasks,
  width.png over several widths, accuracy_vs_state.png for tasks whose runs' states differ
  (these three of the unscaled rows)."""
  from research.results import plots  # noqa: PLC0415 (matplotlib only when drawing)

  plain = [row for row in rows if row["rope_scaling"] == "none"]
  rope_runs = {row["run"] for row in rows if row["rope_scaling"] != "none"}
  keys = swept_keys(rows)
  figures = [  # (name, whether the results call for it, how to draw it)
      ("extrapolation.png", True, lambda: plots.extrapolation(plain, metric, train_length)),
      ("rope_scaling.png", bool(rope_runs), lambda: plots.extrapolation(
          [row for row in rows if row["run"] in rope_runs and row["eval_mode"] == "nonoverlapping"],
          metric, train_length)),
      ("loss_by_position.png", True, lambda: plots.loss_by_position(rows, train_length)),
      ("needle_heatmap.png", bool(depth_rows), lambda: plots.needle_heatmap(depth_rows, metric)),
      ("lost_in_the_middle.png", bool(depth_rows),
       lambda: plots.lost_in_the_middle(depth_rows, metric)),
      ("tasks.png", "data.name" in keys and not data.is_language_modeling(config),
       lambda: plots.task_panels(plain, metric)),
      ("width.png", width_table.applies(rows), lambda: plots.width(plain, metric)),
      # (MAD's sweeps draw mad_state.png instead: research.results.mad_table)
      ("accuracy_vs_state.png", not data.is_language_modeling(config)
       and not mad_table.applies(plain) and len({row.get("state_bytes") for row in plain}) > 1
       and all("state_bytes" in row for row in plain),
       lambda: plots.accuracy_against_state(plain, metric)),
  ]
  written = []
  for name, wanted, draw in figures:
    figure = draw() if wanted else None
    if figure is not None:
      plots.save(figure, os.path.join(workdir, name))
      written.append(name)
  return written


def write(workdir: str) -> Written:
  """results.csv, summary.md and the figures of a run or sweep directory, from its runs'
  eval.json files, and training_curves.png from their metrics.jsonl files."""
  every_split, not_done = collect(workdir)
  every_split = eval_results.latest(every_split)
  # Summaries and figures show the validation split; MAD's table also reads the test split.
  all_rows = [row for row in every_split if row["split"] == eval_results.DEFAULT_SPLIT]
  rows = [row for row in all_rows if row.get("depth") is None]  # one per run x length x mode
  depth_rows = [row for row in all_rows if row.get("depth") is not None]
  config = workdirs.base_config(workdir)
  metric = ("perplexity" if data.is_language_modeling(config) else
            "exact_match" if config.data.name in data.NEEDLE_NAMES else "accuracy")
  train_length = config.train.seq_len
  write_summary(os.path.join(workdir, "summary.md"), rows, not_done, metric, train_length,
                depth_rows)
  figures = _write_figures(workdir, rows, depth_rows, config, metric, train_length) if rows else []
  if mad_table.applies(every_split):
    figures += mad_table.write(workdir, every_split, config.data.name)
  elif rows and width_table.applies(rows) and not data.is_language_modeling(config):
    figures += width_table.write(workdir, rows, metric)
  missing = [name for name, _ in not_done]
  trained, title, untrained = curves(workdir)
  if trained:  # drawn before any evaluation too: a run or sweep still training
    from research.results import plots  # noqa: PLC0415 (matplotlib only when drawing)
    plots.save(plots.training_curves(trained, title),
               os.path.join(workdir, training_curves.FIGURE))
    figures.append(training_curves.FIGURE)
    missing += [name for name in untrained if name not in missing]
  return Written(["results.csv", "summary.md", *figures], missing)
