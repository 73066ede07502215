"""Figures from results files alone (DIR/results.csv and DIR/runs/*/eval.json).

  extrapolation.png     perplexity (or task accuracy) against evaluation length, log axes, the
                        training length marked; one line per variant (mean over seeds, band =
                        min..max over seeds), one panel per evaluation mode: the ALiBi paper's
                        Figure 1 (arXiv:2108.12409) style.
  rope_scaling.png      the same for the RoPE runs under PI / NTK / YaRN scaling.
  loss_by_position.png  loss at each token position of long non-overlapping windows.
  needle_heatmap.png    needle tasks: the metric at every (evaluation length, needle depth), one
                        panel per variant.
  lost_in_the_middle.png  needle tasks: the metric against depth, one line per evaluation length
                        ("lost in the middle", arXiv:2307.03172).
  tasks.png             a sweep over tasks: the metric against evaluation length, one panel per
                        task, one line per variant.
  width.png             a sweep over model.d_model (MQAR, Zoology arXiv:2312.04927 Figure 2): the
                        metric against width, one line per mixer.
In the last three, points are means over seeds and error bars span the seeds' mean 95% bootstrap
interval over evaluated examples (results.csv's `<metric>_ci_low` / `_ci_high`).
"""

import collections
import json
import math
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from research import report  # noqa: E402


def _colors(variants):
  """One color per variant, the same in every panel."""
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"] + list(plt.cm.Dark2.colors)
  return {variant: cycle[i % len(cycle)] for i, variant in enumerate(sorted(variants))}


def extrapolation_figure(rows, path, metric, train_length):
  table = report.aggregate(rows, metric)
  modes = sorted({mode for mode, _ in table})
  colors = _colors({variant for _, variant in table})
  fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes) + 2.5, 4.5), squeeze=False)
  for ax, mode in zip(axes[0], modes):
    for (m, variant), per_length in sorted(table.items()):
      if m != mode:
        continue
      lengths = sorted(per_length)
      values = [per_length[length] for length in lengths]
      mean = [np.mean(v) for v in values]
      ax.plot(lengths, mean, marker="o", label=variant, color=colors[variant])
      ax.fill_between(lengths, [min(v) for v in values], [max(v) for v in values],
                      color=colors[variant], alpha=0.15)
    ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    if metric == "perplexity":
      ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens); dashed: training length")
    ax.set_ylabel(metric)
    ax.set_title(f"{mode} evaluation")
    ax.grid(alpha=0.3, which="both")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="center right", fontsize=8)
  fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def loss_by_position_figure(workdir, rows, path, train_length, bins=32, min_windows=8):
  """Per variant, the mean loss in `bins` position bins of non-overlapping windows: the longest
  eval length with at least `min_windows` windows (fewer make a curve of one text's noise)."""
  keys = report.swept_keys(rows)
  lengths = {r["eval_length"] for r in rows if r["tokens"] >= min_windows * r["eval_length"]}
  longest = max(lengths or {r["eval_length"] for r in rows})
  curves = collections.defaultdict(list)
  for run in sorted({r["run"] for r in rows}):
    with open(os.path.join(workdir, "runs", run, "eval.json")) as f:
      for evaluation in json.load(f):
        if (evaluation["eval_length"] == longest and evaluation["eval_mode"] == "nonoverlapping"
            and evaluation["rope_scaling"] == "none"):
          losses = np.array([np.nan if x is None else x for x in evaluation["loss_by_position"]])
          row = next(r for r in rows if r["run"] == run)
          curves[report.variant_label(dict(row, rope_scaling="none"), keys)].append(losses)
  if not curves:
    return False
  fig, ax = plt.subplots(figsize=(8, 4.5))
  colors = _colors(curves)
  for variant, losses in sorted(curves.items()):
    mean = np.nanmean(np.stack(losses), axis=0)
    edges = np.linspace(0, len(mean), bins + 1).astype(int)
    centers = (edges[:-1] + edges[1:]) / 2
    ax.plot(centers, [np.nanmean(mean[a:b]) for a, b in zip(edges[:-1], edges[1:])], label=variant,
            color=colors[variant])
  ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
  ax.set_xlabel(f"token position in windows of {longest}; dashed: training length")
  ax.set_ylabel("loss (nats/token)")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _grid(num_panels, width=4.2, height=3.4, extra_width=2.5, max_columns=4, layout=None):
  columns = min(num_panels, max_columns)
  rows = math.ceil(num_panels / columns)
  fig, axes = plt.subplots(rows, columns, figsize=(width * columns + extra_width, height * rows),
                           squeeze=False, layout=layout)
  for ax in axes.flat[num_panels:]:
    ax.set_visible(False)
  return fig, list(axes.flat[:num_panels])


PROPORTIONS = ("accuracy", "exact_match")


def _natural(label):
  """Sort key that orders the numbers inside labels by value: 'n=64' before 'n=128'."""
  return [(0, int(part), "") if part.isdigit() else (1, 0, part)
          for part in re.split(r"(\d+)", str(label))]


def _mean(rows, key):
  return float(np.mean([row[key] for row in rows]))


def _panel_figure(rows, path, metric, x_of, line_of, panel_of, x_label, line_name=str,
                  x_log=False):
  """One panel per panel_of(row), one line per line_of(row): the mean over seeds of `metric`
  against x_of(row), error bars spanning the mean of the seeds' 95% intervals."""
  cells = collections.defaultdict(list)
  for row in rows:
    cells[(panel_of(row), line_of(row), x_of(row))].append(row)
  panels = sorted({panel for panel, _, _ in cells}, key=_natural)
  lines = sorted({line for _, line, _ in cells}, key=_natural)
  colors = _colors(lines)
  fig, axes = _grid(len(panels))
  for ax, panel in zip(axes, panels):
    for line in lines:
      xs = sorted(x for p, l, x in cells if p == panel and l == line)
      if not xs:
        continue
      points = [cells[(panel, line, x)] for x in xs]
      mean = np.array([_mean(p, metric) for p in points])
      error = None
      if f"{metric}_ci_low" in points[0][0]:
        low = np.array([_mean(p, f"{metric}_ci_low") for p in points])
        high = np.array([_mean(p, f"{metric}_ci_high") for p in points])
        error = [np.maximum(mean - low, 0), np.maximum(high - mean, 0)]
      ax.errorbar(xs, mean, yerr=error, marker="o", capsize=3, label=line_name(line),
                  color=colors[line])
    if x_log:
      ax.set_xscale("log", base=2)
      ticks = sorted({x for p, _, x in cells if p == panel})
      ax.set_xticks(ticks, [str(x) for x in ticks])
      ax.minorticks_off()
    if metric in PROPORTIONS:
      ax.set_ylim(-0.03, 1.03)
    ax.set_title(str(panel), fontsize=9)
    ax.set_xlabel(x_label)
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="center right", fontsize=8)
  fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _labeller(rows, leave_out=()):
  """row -> its variant label over the swept keys, less those in leave_out ("" if none is left)."""
  keys = [k for k in report.swept_keys(rows) if k not in leave_out]
  return (lambda row: report.variant_label(row, keys)) if keys else (lambda row: "")


def needle_heatmap_figure(rows: list[dict], path: str, metric: str = "exact_match") -> None:
  """Per variant, the mean over seeds of `metric` at every evaluation length x needle depth."""
  label = _labeller(rows)
  cells = collections.defaultdict(list)
  for row in rows:
    cells[(label(row), row["eval_length"], row["depth"])].append(row[metric])
  variants = sorted({variant for variant, _, _ in cells})
  lengths = sorted({length for _, length, _ in cells})
  depths = sorted({depth for _, _, depth in cells})
  fig, axes = _grid(len(variants), width=0.6 * len(depths) + 1.6, height=0.4 * len(lengths) + 1.6,
                    extra_width=1.0, layout="constrained")
  for ax, variant in zip(axes, variants):
    grid = np.array([[np.mean(cells[(variant, length, depth)]) if cells.get(
        (variant, length, depth)) else np.nan for depth in depths] for length in lengths])
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
      if not np.isnan(value):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                color="white" if value < 0.5 else "black")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_xlabel("needle depth (0: first, 1: last)")
    ax.set_ylabel("evaluation length (bytes)")
    ax.set_title(variant, fontsize=9)
  fig.colorbar(image, ax=axes, label=f"{metric} (mean over seeds)")
  fig.savefig(path, dpi=120)
  plt.close(fig)


def lost_in_the_middle_figure(rows: list[dict], path: str, metric: str = "exact_match") -> None:
  """Per variant, `metric` against needle depth, one line per evaluation length."""
  _panel_figure(rows, path, metric, x_of=lambda row: row["depth"],
                line_of=lambda row: row["eval_length"], panel_of=_labeller(rows),
                x_label="needle depth (0: first, 1: last)",
                line_name=lambda length: f"length {length}")


def task_panels_figure(rows: list[dict], path: str, metric: str) -> None:
  """Per task (data.name), `metric` against evaluation length, one line per variant."""
  _panel_figure(rows, path, metric, x_of=lambda row: row["eval_length"],
                line_of=_labeller(rows, leave_out=("data.name", "train.seq_len", "eval.lengths")),
                panel_of=lambda row: row["data.name"], x_label="evaluation length (tokens)",
                x_log=True)


def width_figure(rows: list[dict], path: str, metric: str) -> None:
  """`metric` against model.d_model, one line per mixer, one panel per other swept setting."""
  mixer_keys = ("model.attention", "model.position", "model.layer_pattern")
  _panel_figure(rows, path, metric, x_of=lambda row: int(row["model.d_model"]),
                line_of=lambda row: report.variant_label(
                    row, [k for k in mixer_keys if k in row]),
                panel_of=_labeller(rows, leave_out=mixer_keys + ("model.d_model", "eval.lengths")),
                x_label="model width (d_model)", x_log=True)
