"""Figures from results rows alone (research.results.report: one row per run x evaluation);
research.results.report saves them (`save`) as

  extrapolation.png     perplexity (or task accuracy) against evaluation length, log axes with
                        plain-number ticks, the training length marked; one line per variant
                        (mean over seeds), one panel per evaluation mode: the ALiBi paper's
                        Figure 1 (arXiv:2108.12409) style.
  rope_scaling.png      the same for the RoPE runs under PI / NTK / YaRN scaling: a variant keeps
                        its colour, each scaling has its own line style.
                        In both, the band spans the seeds' values and each seed's 95% bootstrap
                        interval (over evaluation windows), where results.csv has intervals.
  loss_by_position.png  loss at each token position of long non-overlapping windows; the title
                        says which length and mode.
  needle_heatmap.png    needle tasks: the metric at every (evaluation length, needle depth), one
                        panel per variant.
  lost_in_the_middle.png  needle tasks: the metric against depth, one line per evaluation length
                        ("lost in the middle", arXiv:2307.03172).
  tasks.png             a sweep over tasks: the metric against evaluation length, one panel per
                        task, one line per variant.
  width.png             a sweep over model.d_model (MQAR, Zoology arXiv:2312.04927 Figure 2): the
                        metric against width, one line per mixer.
  accuracy_vs_state.png tasks (not MAD): the metric against the decode state a run carries per
                        sequence (KV cache or recurrent state, results rows' state_bytes), one
                        line per mixer (Zoology Figure 3).
  mad_state.png         MAD sweeps (research.results.mad_table): each mixer's score per task and
                        overall against its state size.
In the last four, points are means over seeds and error bars span the seeds' mean 95% bootstrap
interval over evaluated examples (results.csv's `<metric>_ci_low` / `_ci_high`); tasks.png,
width.png and accuracy_vs_state.png also mark each seed's value (small hollow markers), the
spread across seeds that the intervals over examples do not show.
From the runs' metrics.jsonl instead (research.results.training_curves): training_curves.png,
each run's training and validation loss against the step and against the tokens trained on.
Legends sit below the panels. A variant has the same colour in every panel.
"""

import collections
import math
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

from research.results import tables as report  # noqa: E402

LINE_STYLES = ("--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))  # of the RoPE scalings; unscaled: solid
MARKERS = ("o", "s", "^", "D")  # markers of the lines, once the colors repeat


def _color_cycle():
  return plt.rcParams["axes.prop_cycle"].by_key()["color"] + list(plt.cm.Dark2.colors)


def _colors(variants):
  """One color per variant, the same in every panel."""
  cycle = _color_cycle()
  return {variant: cycle[i % len(cycle)] for i, variant in enumerate(sorted(variants))}


def _markers(variants):
  """One marker per variant, changing each time the colors repeat (more variants than colors)."""
  count = len(_color_cycle())
  return {variant: MARKERS[i // count % len(MARKERS)] for i, variant in enumerate(sorted(variants))}


def _line_styles(scalings):
  scaled = sorted(s for s in scalings if s != "none")
  return {"none": "-", **{s: LINE_STYLES[i % len(LINE_STYLES)] for i, s in enumerate(scaled)}}


class _PlainLogFormatter(ticker.LogFormatter):
  """The ticks LogFormatter labels, in plain numbers below 1 too (0.01, not 1e-02)."""

  def __call__(self, x, pos=None):
    return f"{x:g}" if super().__call__(x, pos) else ""


def _plain_log_ticks(axis):
  """Label a log axis with plain numbers (0.5, 6, 8, 10, 20), not 6x10^0 or 10^1."""
  axis.set_major_formatter(_PlainLogFormatter(labelOnlyBase=False))
  axis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _legend_below(fig, axes):
  """One legend below the panels for every line of any of `axes` (an axis or a list), in as many
  columns as its labels fit across the figure; the figure grows by the legend's rows."""
  entries = {}
  for ax in np.ravel(axes):
    for handle, label in zip(*ax.get_legend_handles_labels()):
      entries.setdefault(label, handle)
  if not entries:
    return
  labels = sorted(entries, key=_natural)
  width, height = fig.get_size_inches()
  column = 0.6 + 0.065 * max(map(len, labels))  # inches per column at fontsize 8
  columns = max(1, min(len(labels), 4, int(width // column)))
  fig.set_size_inches(width, height + 0.2 * math.ceil(len(labels) / columns))
  fig.legend([entries[label] for label in labels], labels, loc="outside lower center",
             ncol=columns, fontsize=8, frameon=False)


def save(fig: matplotlib.figure.Figure, path: str):
  fig.savefig(path, dpi=120)
  plt.close(fig)


def extrapolation(rows: list[dict], metric: str,
                  train_length: int) -> matplotlib.figure.Figure:
  """The metric against evaluation length, a panel per mode (rows: one RoPE scaling or several)."""
  table = report.aggregate(rows, metric)
  lows, highs = report.intervals(rows, metric)
  intervals = {key: (lows[key], highs[key]) for key in lows}
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
      low, high = [min(v) for v in values], [max(v) for v in values]
      interval = intervals.get((m, variant, scaling))
      if interval:  # the band also spans every seed's 95% interval
        low = [min(a, *interval[0].get(n, [a])) for a, n in zip(low, lengths)]
        high = [max(b, *interval[1].get(n, [b])) for b, n in zip(high, lengths)]
      ax.fill_between(lengths, low, high, color=colors[variant], alpha=0.15)
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
  fig.suptitle(f"{metric} against evaluation length, trained at {train_length} tokens: lines the "
               "mean over seeds, bands each seed's 95% bootstrap interval and the seeds' spread",
               fontsize=9)
  _legend_below(fig, axes)
  return fig


def _mean_of_scored(values: np.ndarray, axis=None):
  """Mean over the non-NaN entries, NaN where there are none (positions no example scores, as in
  MQAR), without np.nanmean's warning for them."""
  counts = np.sum(~np.isnan(values), axis=axis)
  return np.where(counts > 0, np.nansum(values, axis=axis) / np.maximum(counts, 1), np.nan)


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
    mean = _mean_of_scored(np.stack(losses), axis=0)
    edges = np.linspace(0, len(mean), bins + 1).astype(int)
    centers = (edges[:-1] + edges[1:]) / 2
    ax.plot(centers, [_mean_of_scored(mean[a:b]) for a, b in zip(edges[:-1], edges[1:])],
            label=variant, color=colors[variant])
  ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
  ax.set_title(f"Loss by token position, non-overlapping windows of {longest} tokens")
  ax.set_xlabel("token position in the window; dashed: training length")
  ax.set_ylabel("loss (nats/token)")
  ax.grid(alpha=0.3)
  _legend_below(fig, ax)
  return fig


PROPORTIONS = ("accuracy", "exact_match")


def _grid(num_panels, width=4.2, height=3.6, max_columns=4):
  """A figure of num_panels panels, at most max_columns a row, and the panels in order."""
  columns = min(num_panels, max_columns)
  rows = math.ceil(num_panels / columns)
  fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows + 0.8),
                           squeeze=False, layout="constrained")
  for ax in axes.flat[num_panels:]:
    ax.set_visible(False)
  return fig, list(axes.flat[:num_panels])


def _natural(label):
  """Sort key that orders the numbers inside labels by value: 'n=64' before 'n=128'."""
  return [(0, int(part), "") if part.isdigit() else (1, 0, part)
          for part in re.split(r"(\d+)", str(label))]


def _mean(rows, key):
  return float(np.mean([row[key] for row in rows]))


def _bytes_label(value, _=None):
  return report.bytes_text(value)


def _state_axis(ax):
  """A log axis of bytes, ticks at powers of 4 labelled in KiB / MiB."""
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_locator(ticker.LogLocator(base=4))
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(_bytes_label))
  ax.xaxis.set_minor_locator(ticker.NullLocator())


def _panels(rows, metric, x_of, line_of, panel_of, x_label, line_name=str, x_log=False,
            x_axis=None):
  """One panel per panel_of(row), one line per line_of(row): the mean over seeds of `metric`
  against x_of(row), error bars spanning the mean of the seeds' 95% intervals, and with several
  seeds each seed's value as a small hollow marker of the line's colour. x_log: a log axis ticked
  at every x; x_axis: a function that sets the x axis up instead."""
  cells = collections.defaultdict(list)
  for row in rows:
    cells[(panel_of(row), line_of(row), x_of(row))].append(row)
  panels = sorted({panel for panel, _, _ in cells}, key=_natural)
  lines = sorted({line for _, line, _ in cells}, key=_natural)
  colors, markers = _colors(lines), _markers(lines)
  fig, axes = _grid(len(panels))
  for ax, panel in zip(axes, panels):
    for line in lines:
      xs = sorted(x for p, l, x in cells if p == panel and l == line)
      if not xs:
        continue
      points = [cells[(panel, line, x)] for x in xs]
      mean = np.array([_mean(p, metric) for p in points])
      error = None
      if all(f"{metric}_ci_low" in row for p in points for row in p):
        low = np.array([_mean(p, f"{metric}_ci_low") for p in points])
        high = np.array([_mean(p, f"{metric}_ci_high") for p in points])
        error = [np.maximum(mean - low, 0), np.maximum(high - mean, 0)]
      ax.errorbar(xs, mean, yerr=error, marker=markers[line], capsize=3, label=line_name(line),
                  color=colors[line])
      if any(len(p) > 1 for p in points):  # each seed's value, so the spread across seeds shows
        seeds = [(x, row[metric]) for x, p in zip(xs, points) for row in p]
        ax.scatter(*zip(*seeds), s=14, marker=markers[line], facecolors="none",
                   edgecolors=colors[line], alpha=0.6, linewidths=0.8, zorder=1.5)
    if x_axis:
      x_axis(ax)
    elif x_log:
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
  _legend_below(fig, axes)
  return fig


def _labeller(rows, leave_out=()):
  """row -> its variant label over the swept keys, less those in leave_out, with its RoPE scaling
  ("" if nothing is left)."""
  keys = [k for k in report.swept_keys(rows) if k not in leave_out]
  return lambda row: report.scaled_label(report.variant_label(row, keys) if keys else "",
                                         row["rope_scaling"]).strip()


def needle_heatmap(rows: list[dict], metric: str = "exact_match") -> matplotlib.figure.Figure:
  """Per variant, the mean over seeds of `metric` at every evaluation length x needle depth."""
  label = _labeller(rows)
  cells = collections.defaultdict(list)
  for row in rows:
    cells[(label(row), row["eval_length"], row["depth"])].append(row[metric])
  variants = sorted({variant for variant, _, _ in cells}, key=_natural)
  lengths = sorted({length for _, length, _ in cells})
  depths = sorted({depth for _, _, depth in cells})
  fig, axes = _grid(len(variants), width=0.6 * len(depths) + 1.6, height=0.4 * len(lengths) + 1.6)
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
  return fig


def lost_in_the_middle(rows: list[dict], metric: str = "exact_match") -> matplotlib.figure.Figure:
  """Per variant, `metric` against needle depth, one line per evaluation length."""
  return _panels(rows, metric, x_of=lambda row: row["depth"],
                 line_of=lambda row: row["eval_length"], panel_of=_labeller(rows),
                 x_label="needle depth (0: first, 1: last)",
                 line_name=lambda length: f"length {length}")


def task_panels(rows: list[dict], metric: str) -> matplotlib.figure.Figure:
  """Per task (data.name), `metric` against evaluation length, one line per variant."""
  return _panels(rows, metric, x_of=lambda row: row["eval_length"],
                 line_of=_labeller(rows, leave_out=("data.name", "train.seq_len")),
                 panel_of=lambda row: row["data.name"], x_label="evaluation length (tokens)",
                 x_log=True)


def width(rows: list[dict], metric: str) -> matplotlib.figure.Figure:
  """`metric` against model.d_model, one line per mixer, one panel per other swept setting."""
  mixer_keys = report.mixer_keys(rows)
  return _panels(rows, metric, x_of=lambda row: int(row["model.d_model"]),
                 line_of=_labeller(rows, leave_out=[k for k in report.swept_keys(rows)
                                                    if k not in mixer_keys]),
                 panel_of=_labeller(rows, leave_out=mixer_keys + ["model.d_model"]),
                 x_label="model width (d_model)", x_log=True)


def accuracy_against_state(rows: list[dict], metric: str) -> matplotlib.figure.Figure:
  """`metric` against the decode state a run carries per sequence at the evaluated length
  (results rows' state_bytes), one line per mixer through its widths or other sizes, one panel
  per task and evaluation length: Zoology's Figure 3 (arXiv:2312.04927)."""
  mixer_keys = report.mixer_keys(rows)
  other = [k for k in report.swept_keys(rows)
           if k not in mixer_keys and k.startswith(("data.", "train.seq_len"))]
  task = _labeller(rows, leave_out=[k for k in report.swept_keys(rows) if k not in other])
  return _panels(rows, metric, x_of=lambda row: row["state_bytes"],
                 line_of=_labeller(rows, leave_out=[k for k in report.swept_keys(rows)
                                                    if k not in mixer_keys]),
                 panel_of=lambda row: " ".join(filter(None, (task(row),
                                                             f"length {row['eval_length']}"))),
                 x_label="decode state per sequence (all layers)", x_axis=_state_axis)


def score_against_state(panels: list[tuple[str, dict]]) -> matplotlib.figure.Figure:
  """One panel per (title, {mixer: cell}): each mixer's score (cells with value, low, high and
  state_bytes, as research.results.mad_table's) against its decode state per sequence."""
  mixers = {mixer for _, cells in panels for mixer in cells}
  colors, markers = _colors(mixers), _markers(mixers)
  fig, axes = _grid(len(panels))
  for ax, (title, cells) in zip(axes, panels):
    for mixer, cell in sorted(cells.items()):
      ax.errorbar([cell.state_bytes], [cell.value], marker=markers[mixer], capsize=3, label=mixer,
                  color=colors[mixer], yerr=[[max(cell.value - cell.low, 0)],
                                             [max(cell.high - cell.value, 0)]])
    _state_axis(ax)
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("decode state per sequence (all layers)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
  _legend_below(fig, axes)
  return fig


def training_curves(curves: list, title: str) -> matplotlib.figure.Figure:
  """Each run's training loss (a line) and validation loss (markers) against its training step
  (left) and against the tokens it has trained on (right: step x train.batch_size x
  train.seq_len, which differ between the runs of a sweep over lengths); `curves` are
  research.results.training_curves.Curve. The loss axis is logarithmic where the losses span more
  than a decade (a task's, falling towards 0), linear otherwise. A variant has its colour of the
  other figures (its label's), and its seeds share it and one legend entry, which counts them;
  once the colours repeat, markers on the lines tell the variants apart. Every line's gid is its
  run (its validation markers': "<run> validation"), for the tests to find its series."""
  labels = {curve.label for curve in curves}
  colors, markers = _colors(labels), _markers(labels)
  repeated = len(labels) > len(_color_cycle())
  seeds = collections.Counter(curve.label for curve in curves)
  fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True, layout="constrained")
  for ax, in_tokens in zip(axes, (False, True)):
    for curve in curves:
      scale = curve.tokens_per_step if in_tokens else 1
      count = seeds[curve.label]
      ax.plot(np.multiply(curve.steps, scale), curve.loss, color=colors[curve.label],
              linewidth=1.2, gid=curve.run, marker=markers[curve.label] if repeated else None,
              markevery=0.2, markersize=4,
              label=curve.label if count == 1 else f"{curve.label} ({count} seeds)")
      ax.plot(np.multiply(curve.validation_steps, scale), curve.validation_loss, linestyle="none",
              marker=markers[curve.label], color=colors[curve.label], markeredgecolor="black",
              markeredgewidth=0.5, gid=f"{curve.run} validation")
    ax.grid(alpha=0.3, which="both")
  losses = [loss for curve in curves for loss in curve.loss + curve.validation_loss]
  if max(losses) > 10 * min(losses):  # a task's loss falling towards 0: show its last decades
    axes[0].set_yscale("log")
    _plain_log_ticks(axes[0].yaxis)
  axes[0].set_ylabel("loss (nats/token): lines training, markers validation")
  axes[0].set_xlabel("training step")
  axes[1].set_xlabel("tokens trained on (step x train.batch_size x train.seq_len)")
  axes[1].xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
  fig.suptitle(title, fontsize=10)
  _legend_below(fig, axes)
  return fig
