"""Benchmark outputs: DIR/<suite>.json (rows + metadata), DIR/<suite>.md and DIR/<suite>.png.

A suite is measured once into rows (flat dicts, one per measured point); everything written
here is made from those rows alone, so the tables, the target ratios and the figures of one
file always come from the same run.
"""

import dataclasses
import datetime
import json
import os
from typing import Callable, Optional

import jax
import matplotlib

from research.runs import provenance

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Panel:
  """One log-log plot of rows[y] (divided by `scale`) against rows[x], a line per rows[group]."""
  x: str
  y: str
  group: str
  title: str
  ylabel: str
  scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Suite:
  """A benchmark: `run(args) -> rows`, and how to report them.

  tables(rows) -> [(title, markdown table)]; summary(rows) -> markdown lines (the targets, as
  ratios computed from the rows); panels: the figures' plots; takes_lengths: whether --lengths
  applies (False: the suite measures at its own fixed lengths); configure(args), if given: called
  before JAX starts its backend (peers: thread counts), and only such a suite takes --threads;
  figure(path, suite, rows, meta), if given: draws the PNG instead of the panels.
  """
  name: str
  description: str
  run: Callable
  tables: Callable
  summary: Callable
  panels: tuple
  takes_lengths: bool = True
  configure: Optional[Callable] = None
  figure: Optional[Callable] = None


def metadata(command):
  """When, where, with what and from which commit a run is made (its "minutes" set after it)."""
  return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "hardware": provenance.hardware(), "backend": jax.default_backend(),
          "jax_version": jax.__version__, "command": command, "commit": provenance.commit()}


def lookup(rows, field, **match):
  """rows[field] of the one row matching all `match` items, or None if absent or unset."""
  for row in rows:
    if all(row.get(k) == v for k, v in match.items()):
      return row.get(field)
  return None


def ratio(numerator, denominator):
  if numerator is None or not denominator:
    return None
  return numerator / denominator


def verdict(value, target, at_most=True):
  """'met' / 'MISSED by Nx' for a measured ratio against its target bound."""
  if value is None:
    return "not measured in this run"
  if value <= target if at_most else value >= target:
    return "met"
  miss = value / target if at_most else target / value
  return f"MISSED by {miss:.2f}x"


def verdicts_over(values, target, at_most=True):
  """One clause over {name: measured ratio}: how many meet `target`, the range, and each miss
  and each point not measured by name."""
  measured = {name: value for name, value in values.items() if value is not None}
  missed = {name: value for name, value in measured.items()
            if verdict(value, target, at_most) != "met"}
  text = f"met by {len(measured) - len(missed)} of {len(values)}"
  if measured:
    low, high = min(measured, key=measured.get), max(measured, key=measured.get)
    text += (f" ({low} {fmt_ratio(measured[low])})" if low == high else
             f" ({low} {fmt_ratio(measured[low])} to {high} {fmt_ratio(measured[high])})")
  if missed:
    text += "; **missed** by " + ", ".join(f"{n} ({fmt_ratio(v)})" for n, v in missed.items())
  unmeasured = sorted(set(values) - set(measured))
  if unmeasured:
    text += "; not measured: " + ", ".join(unmeasured)
  return text


def fmt_ratio(value):
  return "n/a" if value is None else f"{value:.2f}x"


def markdown_table(header, body):
  lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(map(str, line)) + " |" for line in body]
  return "\n".join(lines)


def pivot(rows, index, columns, value, fmt, missing="—"):
  """A markdown table of rows[value]: one line per rows[index], one column per rows[columns]."""
  names = list(dict.fromkeys(row[index] for row in rows))
  keys = sorted(set(row[columns] for row in rows))
  body = []
  for name in names:
    cells = [lookup(rows, value, **{index: name, columns: key}) for key in keys]
    body.append([name] + [missing if cell is None else fmt(cell) for cell in cells])
  return markdown_table([f"{index} \\ {columns}"] + keys, body)


def error_reason(error, limit=160):
  """One line naming an exception, for a row's `skipped` field."""
  return f"error: {type(error).__name__}: {str(error)[:limit]}".splitlines()[0]


def progress_line(row):
  """One short line per measured point, for the console."""
  return "  ".join(f"{k}={v}" for k, v in row.items() if v not in (None, ""))


def write_json(path, rows, meta):
  with open(path, "w") as f:
    json.dump({"metadata": meta, "rows": rows}, f, indent=1)


def read_json(path):
  """(rows, metadata) of a run's DIR/<suite>.json."""
  with open(path) as f:
    saved = json.load(f)
  return saved["rows"], saved["metadata"]


def body(suite, rows, meta, level=2, max_tables=None):
  """One run's markdown under a title: description, metadata, targets and tables (the first
  `max_tables` of them, all by default), with headings at `level` (a run's own file: 2; its
  section of BENCHMARKS.md: 3)."""
  heading = "#" * level
  when = meta["date"]
  if meta.get("commit"):
    when += f" (commit {meta['commit']})"
  if meta.get("minutes") is not None:
    when += f", {meta['minutes']:.1f} minutes"
  parts = [suite.description, "", f"- date: {when}",
           f"- hardware: {meta['hardware']} ({meta['backend']})",
           f"- jax: {meta['jax_version']}", f"- command: `{meta['command']}`", "",
           f"{heading} Targets (ratios from this run)", ""]
  parts += [f"- {line}" for line in suite.summary(rows)]
  for title, table in suite.tables(rows)[:max_tables]:
    parts += ["", f"{heading} {title}", "", table]
  return "\n".join(parts)


def write_markdown(path, suite, rows, meta):
  with open(path, "w") as f:
    f.write(f"# Benchmark: {suite.name}\n\n{body(suite, rows, meta)}\n")


def write_figure(path, suite, rows, meta):
  """Log-log curves, one panel per suite.panels entry, points with no value left out."""
  fig, axes = plt.subplots(1, len(suite.panels), figsize=(6 * len(suite.panels), 4.5),
                           squeeze=False)
  for ax, panel in zip(axes[0], suite.panels):
    for name in dict.fromkeys(row[panel.group] for row in rows):
      points = sorted((row[panel.x], row[panel.y] / panel.scale) for row in rows
                      if row[panel.group] == name and row.get(panel.y))
      if points:
        ax.plot(*zip(*points), marker="o", label=str(name))
    ax.set(xscale="log", yscale="log", xlabel=panel.x, ylabel=panel.ylabel, title=panel.title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=8)
  fig.suptitle(f"{suite.name}: {meta['hardware']}, jax {meta['jax_version']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(out_dir, suite, rows, meta):
  """Writes DIR/<suite>.json, .md and .png; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {ext: os.path.join(out_dir, f"{suite.name}.{ext}") for ext in ("json", "md", "png")}
  write_json(paths["json"], rows, meta)
  write_markdown(paths["md"], suite, rows, meta)
  (suite.figure or write_figure)(paths["png"], suite, rows, meta)
  return paths
