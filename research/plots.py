"""Figures from results rows alone (research.report: one row per run x evaluation); research.report
saves them (`save`) as

  extrapolation.png     perplexity (or task accuracy) against evaluation length, log axes with
                        plain-number ticks, the training length marked; one line per variant
                        (mean over seeds, band = min..max over seeds), one panel per evaluation
                        mode: the ALiBi paper's Figure 1 (arXiv:2108.12409) style.
  rope_scaling.png      the same for the RoPE runs under PI / NTK / YaRN scaling: a variant keeps
                        its colour, each scaling has its own line style.
  loss_by_position.png  loss at each token position of long non-overlapping windows; the title
                        says which length and mode.
Legends sit below the panels. A variant has the same colour in every panel.
"""

import collections

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

from research import report  # noqa: E402

LINE_STYLES = ("--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))  # of the RoPE scalings; unscaled: solid


def _colors(variants):
  """One color per variant, the same in every panel."""
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"] + list(plt.cm.Dark2.colors)
  return {variant: cycle[i % len(cycle)] for i, variant in enumerate(sorted(variants))}


def _line_styles(scalings):
  scaled = sorted(s for s in scalings if s != "none")
  return {"none": "-", **{s: LINE_STYLES[i % len(LINE_STYLES)] for i, s in enumerate(scaled)}}


def _plain_log_ticks(axis):
  """Label a log axis with plain numbers (6, 8, 10, 20), not 6x10^0 or 10^1."""
  axis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
  axis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _legend_below(fig, ax):
  handles, labels = ax.get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)), fontsize=8,
             frameon=False)


def save(fig: matplotlib.figure.Figure, path: str):
  fig.savefig(path, dpi=120)
  plt.close(fig)


def extrapolation(rows: list[dict], metric: str,
                  train_length: int) -> matplotlib.figure.Figure:
  """The metric against evaluation length, a panel per mode (rows: one RoPE scaling or several)."""
  table = report.aggregate(rows, metric)
  modes = sorted({mode for mode, _, _ in table})
  colors = _colors({variant for _, variant, _ in table})
  styles = _line_styles({scaling for _, _, scaling in table})
  fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 5.5), squeeze=False,
                           layout="constrained")
  for ax, mode in zip(axes[0], modes):
    for (m, variant, scaling), per_length in sorted(table.items()):
      if m != mode:
        continue
      lengths = sorted(per_length)
      values = [per_length[length] for length in lengths]
      ax.plot(lengths, [np.mean(v) for v in values], marker="o", color=colors[variant],
              linestyle=styles[scaling], label=report.scaled_label(variant, scaling))
      ax.fill_between(lengths, [min(v) for v in values], [max(v) for v in values],
                      color=colors[variant], alpha=0.15)
    ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    if metric == "perplexity":
      ax.set_yscale("log")
      _plain_log_ticks(ax.yaxis)
    ax.set_xlabel("evaluation length (tokens); dashed: training length")
    ax.set_ylabel(metric)
    ax.set_title(f"{mode} evaluation")
    ax.grid(alpha=0.3, which="both")
  _legend_below(fig, axes[0][0])
  return fig


def loss_by_position(rows: list[dict], train_length: int, bins: int = 32,
                     min_windows: int = 8) -> matplotlib.figure.Figure | None:
  """Per variant, the mean loss in `bins` position bins of non-overlapping windows: the longest
  eval length with at least `min_windows` windows (fewer make a curve of one text's noise).
  None if there are no such rows."""
  rows = [r for r in rows if r["eval_mode"] == "nonoverlapping" and r["rope_scaling"] == "none"]
  if not rows:
    return None
  lengths = {r["eval_length"] for r in rows if r["tokens"] >= min_windows * r["eval_length"]}
  longest = max(lengths or {r["eval_length"] for r in rows})
  keys = report.swept_keys(rows)
  curves = collections.defaultdict(list)
  for row in rows:
    if row["eval_length"] == longest:
      losses = np.array([np.nan if x is None else x for x in row["loss_by_position"]])
      curves[report.variant_label(row, keys)].append(losses)
  fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
  colors = _colors(curves)
  for variant, losses in sorted(curves.items()):
    mean = np.nanmean(np.stack(losses), axis=0)
    edges = np.linspace(0, len(mean), bins + 1).astype(int)
    centers = (edges[:-1] + edges[1:]) / 2
    ax.plot(centers, [np.nanmean(mean[a:b]) for a, b in zip(edges[:-1], edges[1:])], label=variant,
            color=colors[variant])
  ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
  ax.set_title(f"Loss by token position, non-overlapping windows of {longest} tokens")
  ax.set_xlabel("token position in the window; dashed: training length")
  ax.set_ylabel("loss (nats/token)")
  ax.grid(alpha=0.3)
  _legend_below(fig, ax)
  return fig
