"""A width sweep's table over seeds: DIR/width.md, written by research.results.report beside
width.png when a task sweep (not language modelling, not MAD) varies model.d_model (MQAR,
configs/mqar.py; Zoology arXiv:2312.04927 Figure 2).

One table per width, widest first; one line per mixer (its swept fields: attention, position,
model.num_kv_heads, its own model.<variant>.* settings), one column per task setting (the other
swept fields, e.g. sequence length and number of key-value pairs) and evaluation length. A cell
gives the metric's mean +/- std over seeds (std over the population, as summary.md's) and then
each seed's value in seed order, so a result that hinges on an abrupt transition shows which
seeds crossed it. The second column is the decode state per sequence (results rows'
state_bytes, all layers) at the last column's setting; lines are ordered by that column's mean,
best first, then by the first column's.
"""

import collections
import os

from research.results import tables

WIDTH_KEY = "model.d_model"


def applies(rows: list[dict]) -> bool:
  return WIDTH_KEY in tables.swept_keys(rows)


def _seed(row):
  return int(row["seed"])


def _cell(rows, metric, seeds):
  """'mean +/- std (each seed's value)' over the rows (one per seed), in seed order; a cell that
  lacks some of the table's seeds names the seeds it has ('seed 0: 0.998')."""
  rows = sorted(rows, key=_seed)
  values = [row[metric] for row in rows]
  mean, std = tables.mean_std(values)
  if [_seed(row) for row in rows] == seeds:
    each = ", ".join(f"{v:.3f}" for v in values)
  else:
    each = ", ".join(f"seed {_seed(row)}: {row[metric]:.3f}" for row in rows)
  return f"{mean:.3f} +/- {std:.3f} ({each})" if len(seeds) > 1 else f"{mean:.3f}"


def cells(rows: list[dict], metric: str) -> dict:
  """{width: {mixer: {(setting, eval_length): [rows, one per seed]}}}."""
  keys = tables.swept_keys(rows)
  mixer_keys = tables.mixer_keys(rows)
  setting_keys = [k for k in keys if k not in mixer_keys and k not in (WIDTH_KEY, "train.seed")]
  listed = lambda: collections.defaultdict(list)
  out = collections.defaultdict(lambda: collections.defaultdict(listed))
  for row in rows:
    mixer = tables.variant_label(row, mixer_keys) if mixer_keys else row["run"]
    setting = tables.variant_label(row, setting_keys) if setting_keys else ""
    out[int(row[WIDTH_KEY])][mixer][(setting, int(row["eval_length"]))].append(row)
  return out


def _column_name(setting, length, several_lengths):
  if not setting:
    return f"length {length}"
  return f"{setting} @ length {length}" if several_lengths else setting


def table_lines(per_mixer: dict, metric: str, seeds: list[int]) -> list[str]:
  """The Markdown table of one width."""
  columns = sorted({column for per in per_mixer.values() for column in per},
                   key=lambda column: (column[1], column[0]))
  several = len({length for _, length in columns}) > len({setting for setting, _ in columns})
  last, first = columns[-1], columns[0]

  def order(item):  # best first at the last column, then at the first
    mixer, per = item
    worse = lambda column: (-tables.mean_std([r[metric] for r in per[column]])[0]
                            if column in per else 1)
    return (worse(last), worse(first), mixer)

  lines = [f"| mixer | state at {_column_name(*last, several)} | "
           + " | ".join(_column_name(*column, several) for column in columns) + " |",
           "|---" * (len(columns) + 2) + "|"]
  for mixer, per in sorted(per_mixer.items(), key=order):
    states = [r["state_bytes"] for r in per.get(last, ()) if "state_bytes" in r]
    state = tables.bytes_text(sum(states) / len(states)) if states else ""
    row = [_cell(per[c], metric, seeds) if c in per else "" for c in columns]
    lines.append(f"| {mixer} | {state} | " + " | ".join(row) + " |")
  return lines


def write(workdir: str, rows: list[dict], metric: str) -> list[str]:
  """width.md in `workdir` from the validation rows of the runs' last checkpoints; returns the
  names written."""
  by_width = cells(rows, metric)
  seeds = sorted({_seed(row) for row in rows})
  lines = ["# " + metric.replace("_", " ").capitalize() + " by width, over seeds", "",
           f"Seeds {', '.join(map(str, seeds))}. Cells: mean +/- std over seeds (each seed's "
           "value, in seed order); state: the decode state per sequence over all layers at the "
           "last column's setting. Lines: best first at the last column.", ""]
  for width in sorted(by_width, reverse=True):
    lines += [f"## Width {width}", "", *table_lines(by_width[width], metric, seeds), ""]
  with open(os.path.join(workdir, "width.md"), "w") as f:
    f.write("\n".join(lines))
  return ["width.md"]
