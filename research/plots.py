"""Figures from results files alone (DIR/results.csv and DIR/runs/*/eval.json).

  extrapolation.png     perplexity (or task accuracy) against evaluation length, log axes, the
                        training length marked; one line per variant (mean over seeds, band =
                        min..max over seeds), one panel per evaluation mode: the ALiBi paper's
                        Figure 1 (arXiv:2108.12409) style.
  loss_by_position.png  loss at each token position of the longest non-overlapping windows.
"""

import collections
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from research import report  # noqa: E402


def extrapolation_figure(rows, path, metric, train_length):
  table = report.aggregate(rows, metric)
  modes = sorted({mode for mode, _ in table})
  fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
  for ax, mode in zip(axes[0], modes):
    for (m, variant), per_length in sorted(table.items()):
      if m != mode:
        continue
      lengths = sorted(per_length)
      values = [per_length[length] for length in lengths]
      mean = [np.mean(v) for v in values]
      line, = ax.plot(lengths, mean, marker="o", label=variant)
      ax.fill_between(lengths, [min(v) for v in values], [max(v) for v in values],
                      color=line.get_color(), alpha=0.15)
    ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    if metric == "perplexity":
      ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens); dashed: training length")
    ax.set_ylabel(metric)
    ax.set_title(f"{mode} evaluation")
    ax.grid(alpha=0.3, which="both")
  axes[0][-1].legend(fontsize=7, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def loss_by_position_figure(workdir, rows, path, train_length, bins=64):
  """Per variant, the mean loss in `bins` position bins of the longest non-overlapping eval."""
  keys = report.swept_keys(rows)
  longest = max(r["eval_length"] for r in rows)
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
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for variant, losses in sorted(curves.items()):
    mean = np.nanmean(np.stack(losses), axis=0)
    edges = np.linspace(0, len(mean), bins + 1).astype(int)
    centers = (edges[:-1] + edges[1:]) / 2
    ax.plot(centers, [np.nanmean(mean[a:b]) for a, b in zip(edges[:-1], edges[1:])], label=variant)
  ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
  ax.set_xlabel(f"token position in windows of {longest}; dashed: training length")
  ax.set_ylabel("loss (nats/token)")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True
