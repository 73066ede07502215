"""Figures from results files alone (DIR/results.csv and DIR/runs/*/eval.json).

  extrapolation.png     perplexity (or task accuracy) against evaluation length, log axes, the
                        training length marked; one line per variant (mean over seeds, band =
                        min..max over seeds), one panel per evaluation mode: the ALiBi paper's
                        Figure 1 (arXiv:2108.12409) style.
  rope_scaling.png      the same for the RoPE runs under PI / NTK / YaRN scaling.
  loss_by_position.png  loss at each token position of long non-overlapping windows.
"""

import collections
import json
import os

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
