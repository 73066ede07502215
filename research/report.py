"""Results files of a run or a sweep, from the runs' eval.json files alone: DIR/results.csv
(tidy), DIR/summary.md and the figures (research.plots).

results.csv has one row per run x evaluation (research.eval_results: checkpoint step x eval
length x mode x RoPE scaling x evaluated text), with the columns run, attention, position, seed,
train_length, train_steps, step, eval_length, eval_mode, rope_scaling, num_tokens,
sliding_stride, loss, perplexity, accuracy, exact_match, tokens, and, in a sweep, one column per
swept field: a field that changes training in which a run differs from the sweep's base config
(its dotted name). summary.md and the figures show each
run's latest rows (the newest checkpoint step); a run evaluated before its last step is labelled
with the step.
"""

import collections
import csv
import math
import os

from research import config_fields
from research import data
from research import eval_results
from research import sweep as sweep_lib
from research import workdirs

METRIC_COLUMNS = ("loss", "perplexity", "accuracy", "exact_match", "tokens")
FIGURES = ("extrapolation.png", "rope_scaling.png", "loss_by_position.png")


def _attention_label(config):
  return "+".join(config.model.layer_pattern) if config.model.layer_pattern else config.model.attention


def _cell(value):
  return "-".join(map(str, value)) if isinstance(value, (tuple, list)) else value


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


def collect(workdir: str) -> tuple[list[dict], list[tuple[str, dict]]]:
  """(rows, runs without rows): every evaluation of every run (with each row's loss by position),
  and (name, status) of the runs that have none. Writes DIR/results.csv (without the losses by
  position)."""
  runs = workdirs.runs(workdir)
  configs = {run.name: config_fields.load_saved(run.directory) for run in runs
             if os.path.exists(os.path.join(run.directory, "config.json"))}
  swept = _swept_fields(configs.values(), workdirs.base_config(workdir))
  rows, without = [], []
  for run in runs:
    evaluations = eval_results.read(run.directory)
    if not evaluations:
      without.append((run.name, _status(workdir, run)))
      continue
    config, flat = configs[run.name], config_fields.flatten(configs[run.name])
    for evaluation in evaluations:
      row = {"run": run.name, "attention": _attention_label(config),
             "position": config.model.position, "seed": config.train.seed,
             "train_length": config.train.seq_len, "train_steps": config.train.num_steps}
      row.update({k: evaluation.get(k) for k in eval_results.KEY})
      row.update({k: evaluation[k] for k in METRIC_COLUMNS})
      row.update({k: _cell(flat[k]) for k in swept})
      row["loss_by_position"] = evaluation["loss_by_position"]
      rows.append(row)
  columns = list(dict.fromkeys(k for row in rows for k in row if k != "loss_by_position"))
  with open(os.path.join(workdir, "results.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  return rows, without


BARE_KEYS = ("model.attention", "model.position", "data.name")  # values name themselves
OFF_VALUES = ("0", "0.0", "none", "False", "()")


def variant_label(row: dict, swept_keys: list[str]) -> str:
  """'mha / alibi' (swept values, seed left out; the run's name if nothing is swept), with the
  checkpoint step if it is not the run's last. A swept setting that is off in this run (0,
  none, False, empty) is left out: 'rope' beside 'rope / randomize_max_length=2048'."""
  parts = [str(row[k]) if k in BARE_KEYS else f"{k.split('.')[-1]}={row[k]}"
           for k in swept_keys if k != "train.seed" and row.get(k) not in (None, "")
           and (k in BARE_KEYS or str(row[k]) not in OFF_VALUES)]
  label = " / ".join(parts) or row["run"]
  step = row.get("step")
  return label if step is None or step == row["train_steps"] else f"{label} @step {step}"


def scaled_label(variant: str, rope_scaling: str) -> str:
  return variant if rope_scaling == "none" else f"{variant} +{rope_scaling}"


def swept_keys(rows: list[dict]) -> list[str]:
  return [k for k in (rows[0] if rows else {}) if "." in k]


def aggregate(rows: list[dict], metric: str) -> dict:
  """{(eval_mode, variant, rope_scaling): {eval_length: [metric per seed]}}."""
  keys = swept_keys(rows)
  table = collections.defaultdict(lambda: collections.defaultdict(list))
  for row in rows:
    variant = variant_label(row, keys)
    table[(row["eval_mode"], variant, row["rope_scaling"])][row["eval_length"]].append(row[metric])
  return table


def _mean_std(values):
  mean = sum(values) / len(values)
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
  return mean, std


def write_summary(path, rows, not_done, metric, train_length):
  best = min if metric == "perplexity" else max
  table = aggregate(rows, metric)
  all_lengths = {length for per in table.values() for length in per}
  # The ALiBi paper's comparison point, 8x the training length, else the longest one.
  ratio_length = 8 * train_length if 8 * train_length in all_lengths else max(all_lengths, default=0)
  lines = [f"# Summary: {metric} by evaluation length", "",
           f"Trained at length {train_length}. Cells: mean +/- std over seeds (best seed). "
           f"`ratio` is the mean at length {ratio_length} over the mean at the training length.",
           ""]
  for mode in sorted({mode for mode, _, _ in table}):
    lengths = sorted({length for (m, _, _), per in table.items() if m == mode for length in per})
    lines += [f"## {mode}", "", "| variant | " + " | ".join(map(str, lengths)) + " | ratio |",
              "|---" * (len(lengths) + 2) + "|"]
    for (m, variant, scaling), per_length in sorted(table.items()):
      if m != mode:
        continue
      cells = []
      for length in lengths:
        values = per_length.get(length)
        if not values:
          cells.append("")
          continue
        mean, std = _mean_std(values)
        cells.append(f"{mean:.3f} +/- {std:.3f} ({best(values):.3f})" if len(values) > 1
                     else f"{mean:.3f}")
      ratio = ""
      if (per_length.get(train_length) and per_length.get(ratio_length)
          and _mean_std(per_length[train_length])[0]):
        ratio = (f"{_mean_std(per_length[ratio_length])[0] / _mean_std(per_length[train_length])[0]:.2f}x")
      lines.append(f"| {scaled_label(variant, scaling)} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
  if not_done:
    lines += ["## Runs without results", "", "| run | state | reason |", "|---|---|---|"]
    for name, status in not_done:
      reason = (status.get("reason") or status.get("error") or "").replace("|", "/")
      lines.append(f"| {name} | {status['state']} | {reason.splitlines()[0] if reason else ''} |")
    lines.append("")
  with open(path, "w") as f:
    f.write("\n".join(lines))


def write(workdir: str) -> list[str]:
  """results.csv, summary.md and the figures of a run or sweep directory, from its runs'
  eval.json files. Returns the names of the runs without results (pending, failed, skipped or
  not evaluated)."""
  from research import plots  # noqa: PLC0415 (matplotlib only when drawing)

  rows, not_done = collect(workdir)
  rows = eval_results.latest(rows)
  config = workdirs.base_config(workdir)
  metric = "perplexity" if data.is_language_modeling(config) else "accuracy"
  train_length = config.train.seq_len
  write_summary(os.path.join(workdir, "summary.md"), rows, not_done, metric, train_length)
  if rows:
    plots.save(plots.extrapolation([row for row in rows if row["rope_scaling"] == "none"], metric,
                                   train_length), os.path.join(workdir, "extrapolation.png"))
    rope_runs = {row["run"] for row in rows if row["rope_scaling"] != "none"}
    if rope_runs:
      plots.save(plots.extrapolation(
          [row for row in rows if row["run"] in rope_runs and row["eval_mode"] == "nonoverlapping"],
          metric, train_length), os.path.join(workdir, "rope_scaling.png"))
    by_position = plots.loss_by_position(rows, train_length)
    if by_position:
      plots.save(by_position, os.path.join(workdir, "loss_by_position.png"))
  return [name for name, _ in not_done]
