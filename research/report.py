"""Results files from finished runs: DIR/results.csv (tidy) and DIR/summary.md.

results.csv has one row per run x eval length x eval mode x RoPE scaling, with the columns
run, attention, position, seed, train_length, eval_length, eval_mode, rope_scaling, loss,
perplexity, accuracy, exact_match, tokens, and one column per swept field (its dotted key).
"""

import collections
import csv
import json
import math
import os

import ml_collections

from research import data
from research import sweep as sweep_lib

METRIC_COLUMNS = ("loss", "perplexity", "accuracy", "exact_match", "tokens")


def _attention_label(config):
  return "+".join(config.model.layer_pattern) if config.model.layer_pattern else config.model.attention


def collect(workdir, members):
  """Rows of every done member (written to DIR/results.csv), and the names of the others."""
  rows, not_done = [], []
  for member in members:
    status = sweep_lib.status(workdir, member.name)
    if status["state"] != "done":
      not_done.append(member.name)
      continue
    with open(os.path.join(sweep_lib.run_dir(workdir, member), "eval.json")) as f:
      evaluations = json.load(f)
    config = member.config
    for evaluation in evaluations:
      row = {"run": member.name, "attention": _attention_label(config),
             "position": config.model.position, "seed": config.train.seed,
             "train_length": config.train.seq_len, "eval_length": evaluation["eval_length"],
             "eval_mode": evaluation["eval_mode"], "rope_scaling": evaluation["rope_scaling"]}
      row.update({k: evaluation[k] for k in METRIC_COLUMNS})
      row.update({k: _cell(v) for k, v in member.overrides.items()})
      rows.append(row)
  write_csv(os.path.join(workdir, "results.csv"), rows)
  return rows, not_done


def _cell(value):
  return "-".join(map(str, value)) if isinstance(value, (tuple, list)) else value


def write_csv(path, rows):
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, columns)
    writer.writeheader()
    writer.writerows(rows)


def read_csv(path):
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for key in ("eval_length", "train_length", "seed", "tokens"):
      row[key] = int(row[key])
    for key in ("loss", "perplexity", "accuracy", "exact_match"):
      row[key] = float(row[key])
  return rows


BARE_KEYS = ("model.attention", "model.position", "data.name")  # values name themselves


def variant_label(row, swept_keys):
  """'mha / alibi' (swept values, seed left out), plus the RoPE scaling used at evaluation."""
  parts = [str(row[k]) if k in BARE_KEYS else f"{k.split('.')[-1]}={row[k]}"
           for k in swept_keys if k != "train.seed" and row.get(k) not in (None, "")]
  label = " / ".join(parts) or row["run"]
  return label if row["rope_scaling"] == "none" else f"{label} +{row['rope_scaling']}"


def swept_keys(rows):
  return [k for k in (rows[0] if rows else {}) if "." in k]


def aggregate(rows, metric):
  """{(eval_mode, variant): {eval_length: [metric per seed]}}."""
  keys = swept_keys(rows)
  table = collections.defaultdict(lambda: collections.defaultdict(list))
  for row in rows:
    table[(row["eval_mode"], variant_label(row, keys))][row["eval_length"]].append(row[metric])
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
  for mode in sorted({mode for mode, _ in table}):
    lengths = sorted({length for (m, _), per in table.items() if m == mode for length in per})
    lines += [f"## {mode}", "", "| variant | " + " | ".join(map(str, lengths)) + " | ratio |",
              "|---" * (len(lengths) + 2) + "|"]
    for (m, variant), per_length in sorted(table.items()):
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
      lines.append(f"| {variant} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
  if not_done:
    lines += ["## Runs without results", "", "| run | state | reason |", "|---|---|---|"]
    for name, status in not_done:
      reason = (status.get("reason") or status.get("error") or "").replace("|", "/")
      lines.append(f"| {name} | {status['state']} | {reason.splitlines()[0] if reason else ''} |")
    lines.append("")
  with open(path, "w") as f:
    f.write("\n".join(lines))


def redraw(workdir):
  """summary.md and the figures from DIR/sweep.json, DIR/results.csv and the runs' files.

  Returns the names of the sweep's runs that have no results (pending, failed or skipped).
  """
  from research import plots  # noqa: PLC0415 (matplotlib only when drawing)

  with open(os.path.join(workdir, "sweep.json")) as f:
    record = json.load(f)
  not_done = [(name, sweep_lib.status(workdir, name)) for name in record["members"]]
  not_done = [(name, status) for name, status in not_done if status["state"] != "done"]
  results_path = os.path.join(workdir, "results.csv")
  rows = read_csv(results_path) if os.path.exists(results_path) else []
  config = ml_collections.ConfigDict(record["config"])
  metric = "perplexity" if data.is_language_modeling(config) else "accuracy"
  train_length = config.train.seq_len
  write_summary(os.path.join(workdir, "summary.md"), rows, not_done, metric, train_length)
  if rows:
    plain = [row for row in rows if row["rope_scaling"] == "none"]
    plots.extrapolation_figure(plain, os.path.join(workdir, "extrapolation.png"), metric,
                               train_length)
    scaled = [row for row in rows if row["rope_scaling"] != "none"]
    if scaled:
      rope_runs = {row["run"] for row in scaled}
      plots.extrapolation_figure(
          [row for row in rows if row["run"] in rope_runs and row["eval_mode"] == "nonoverlapping"],
          os.path.join(workdir, "rope_scaling.png"), metric, train_length)
    plots.loss_by_position_figure(workdir, rows, os.path.join(workdir, "loss_by_position.png"),
                                  train_length)
  return [name for name, _ in not_done]
