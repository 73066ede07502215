"""Figures of research.analysis.analyze, from the measures of research.analysis.heads:

  attention_grid        a panel per layer x head: the attention probabilities (query rows, key
                        columns), square-root colour scale so that small weights show
  distance_mass         a panel per layer: the attention mass in each log-spaced distance bucket,
                        a line per head, solid at the training length, dashed at longer lengths
  scores_over_training  induction and previous-token scores of every head and the ICL score
                        against the checkpoint step (log axis): Olsson et al.'s phase change
  mean_distance_by_run  a sweep: every head's mean attention distance per run and length
  scores_by_run         a sweep: the largest induction score and the ICL score against step, a
                        line per run, a colour per variant (its seeds)
  pruning               the metric against the fraction of heads removed (by importance, in
                        random order), beside the heads' importances
  pruning_by_run        a sweep: the same, a colour per run
  explanation           per head, the distribution of Kendall's tau between attention and
                        gradient importance over examples; the median output change under
                        permuted attention against the row's largest weight (Jain & Wallace)
  explanation_by_run    a sweep: both distributions, one violin per run
  uptraining            a sweep: perplexity (95% interval) and decode-cache bytes per run,
                        coloured by how the run came to be (scratch, converted, uptrained)
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import colors as mcolors  # noqa: E402

from research.results import plots  # noqa: E402

save = plots.save
# Pruning orders (research.analysis.analyze.head_importance) and their line styles.
ORDER_STYLES = {"importance": "-", "random": "--", "kv_groups": ":"}


def attention_grid(weights: dict, labels: list[str] | None, title: str) -> matplotlib.figure.Figure:
  """weights: {layer: [N, L, L]}; labels: the tokens as characters (ticks when short), or None."""
  layers = sorted(weights)
  num_heads = weights[layers[0]].shape[0]
  fig, axes = plt.subplots(len(layers), num_heads, figsize=(2.6 * num_heads, 2.6 * len(layers)),
                           squeeze=False, layout="constrained")
  norm = mcolors.PowerNorm(0.5, vmin=0.0, vmax=1.0)
  for row, layer in zip(axes, layers):
    for h, ax in enumerate(row):
      image = ax.imshow(weights[layer][h], cmap="viridis", norm=norm, interpolation="nearest")
      ax.set_title(f"layer {layer} head {h}", fontsize=8)
      if labels is not None and len(labels) <= 40:
        ax.set_xticks(range(len(labels)), labels, fontsize=5)
        ax.set_yticks(range(len(labels)), labels, fontsize=5)
      else:
        ax.tick_params(labelsize=6)
  fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability")
  fig.suptitle(f"{title}: query (rows) attends to key (columns)", fontsize=9)
  return fig


def _bucket_label(low: int, high: int) -> str:
  return str(low) if low == high else f"{low}-{high}"


def distance_mass(masses: dict, buckets: list[tuple[int, int]], train_length: int,
                  title: str) -> matplotlib.figure.Figure:
  """masses: {(length factor, layer): [N, buckets of that length]}; buckets: those of the
  longest length."""
  layers = sorted({layer for _, layer in masses})
  factors = sorted({factor for factor, _ in masses})
  fig, axes = plt.subplots(1, len(layers), figsize=(5 * len(layers), 4), squeeze=False,
                           layout="constrained")
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  styles = ["-", "--", ":", "-."]
  for ax, layer in zip(axes[0], layers):
    for k, factor in enumerate(factors):
      for h, mass in enumerate(masses[factor, layer]):
        ax.plot(range(len(mass)), mass, marker="o", markersize=3, color=cycle[h % len(cycle)],
                linestyle=styles[k % len(styles)],
                label=f"head {h}, {factor}x ({factor * train_length})")
    ax.set_xticks(range(len(buckets)), [_bucket_label(*b) for b in buckets], rotation=60,
                  fontsize=7)
    ax.set_xlabel("distance i - j (tokens)")
    ax.set_ylabel("mean attention mass")
    ax.set_title(f"layer {layer}", fontsize=9)
    ax.grid(alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=7,
             frameon=False)
  fig.suptitle(f"{title}: how far each head looks", fontsize=9)
  return fig


def _series(rows, measure, key):
  """{key(row): (steps, values)} of the rows of `measure`, sorted by step."""
  series = {}
  for row in sorted((r for r in rows if r["measure"] == measure), key=lambda r: r["step"]):
    steps, values = series.setdefault(key(row), ([], []))
    steps.append(row["step"])
    values.append(row["value"])
  return series


def scores_over_training(rows: list[dict], title: str) -> matplotlib.figure.Figure:
  measures = [m for m in ("induction", "previous_token", "icl_score")
              if any(r["measure"] == m for r in rows)]
  fig, axes = plt.subplots(1, len(measures), figsize=(5 * len(measures), 4), squeeze=False,
                           layout="constrained")
  colormaps = [plt.cm.Blues, plt.cm.Oranges, plt.cm.Greens, plt.cm.Purples, plt.cm.Reds]
  for ax, measure in zip(axes[0], measures):
    series = _series(rows, measure, lambda r: (r["layer"], r["head"]))
    layers = sorted({layer for layer, _ in series if layer != ""})
    for (layer, head), (steps, values) in sorted(series.items(), key=str):
      if layer == "":
        ax.plot(steps, values, marker="o", color="black")
        continue
      heads_of_layer = sorted(h for l, h in series if l == layer)
      shade = 0.45 + 0.5 * heads_of_layer.index(head) / max(1, len(heads_of_layer) - 1)
      ax.plot(steps, values, marker="o", markersize=3,
              color=colormaps[layers.index(layer) % len(colormaps)](shade),
              label=f"layer {layer} head {head}")
    ax.set_xscale("log")
    plots._plain_log_ticks(ax.xaxis)  # noqa: SLF001
    ax.set_xlabel("training step")
    ax.set_ylabel({"induction": "induction score", "previous_token": "previous-token score",
                   "icl_score": "ICL score (late - early loss)"}[measure])
    ax.grid(alpha=0.3, which="both")
  if "induction" in measures:
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=7,
               frameon=False)
  fig.suptitle(f"{title}: heads over training", fontsize=9)
  return fig


def mean_distance_by_run(rows: list[dict]) -> matplotlib.figure.Figure:
  rows = [r for r in rows if r["measure"] == "mean_distance"]
  runs = list(dict.fromkeys(r["run"] for r in rows))
  lengths = sorted({r["eval_length"] for r in rows})
  fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(runs) * len(lengths)), 4.5),
                         layout="constrained")
  width = 0.8 / len(lengths)
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for k, length in enumerate(lengths):
    for x, run in enumerate(runs):
      values = [r["value"] for r in rows if r["run"] == run and r["eval_length"] == length]
      if not values:
        continue
      position = x - 0.4 + width * (k + 0.5)
      ax.bar(position, np.mean(values), width, color=cycle[k % len(cycle)], alpha=0.5,
             label=f"{length} tokens" if x == 0 else None)
      ax.scatter([position] * len(values), values, color=cycle[k % len(cycle)], s=8)
  ax.set_xticks(range(len(runs)), runs, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("mean attention distance (tokens)")
  ax.set_yscale("log")
  ax.grid(alpha=0.3, axis="y")
  ax.legend(fontsize=8)
  return fig


def largest_induction(rows: list[dict]) -> dict:
  """{(run, step): the largest induction score of any head} of induction rows."""
  best = {}
  for r in rows:
    if r["measure"] == "induction":
      key = (r["run"], r["step"])
      best[key] = max(best.get(key, -1.0), r["value"])
  return best


def scores_by_run(rows: list[dict], variant_of=lambda run: run) -> matplotlib.figure.Figure:
  """The panels that have values: tasks have no ICL score, mixers without maps no induction. A
  colour per variant_of(run) (the runs of one variant's seeds share it), a line per run."""
  best_rows = [{"run": run, "step": step, "measure": "best", "value": v}
               for (run, step), v in largest_induction(rows).items()]
  panels = [(measure, source, label) for measure, source, label in (
      ("best", best_rows, "largest induction score of any head"),
      ("icl_score", rows, "ICL score (late - early loss)"))
            if any(r["measure"] == measure for r in source)]
  variants = list(dict.fromkeys(variant_of(r["run"]) for r in rows))
  colour = {v: f"C{i % 10}" for i, v in enumerate(variants)}
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False,
                           layout="constrained")
  for ax, (measure, source, label) in zip(axes[0], panels):
    labelled = set()
    for run, (steps, values) in _series(source, measure, lambda r: r["run"]).items():
      variant = variant_of(run)
      ax.plot(steps, values, marker="o", markersize=3, color=colour[variant], alpha=0.8,
              label=None if variant in labelled else variant)
      labelled.add(variant)
    ax.set_xscale("log")
    plots._plain_log_ticks(ax.xaxis)  # noqa: SLF001
    ax.set_xlabel("training step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3, which="both")
  handles = {}
  for ax in axes[0]:
    handles.update(zip(*reversed(ax.get_legend_handles_labels())))
  fig.legend(list(handles.values()), list(handles), loc="outside lower center",
             ncol=min(4, len(handles)), fontsize=7, frameon=False)
  return fig


def _pruning_axes(ax, metric, legend_size):
  """Labels of a metric-against-fraction-removed panel (log scale for perplexity)."""
  if metric == "perplexity":
    ax.set_yscale("log")
    plots._plain_log_ticks(ax.yaxis)  # noqa: SLF001 (one formatter for every figure)
  ax.set_xlabel("fraction of heads removed")
  ax.set_ylabel(metric)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=legend_size)


def pruning(rows: list[dict], importance_LxN: np.ndarray, metric: str,
            title: str) -> matplotlib.figure.Figure:
  """The metric against the fraction of heads removed (by importance, in random order), and the
  full model's normalised head importances."""
  fig, (ax, heat) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained",
                                 gridspec_kw={"width_ratios": [3, 2]})
  for order in dict.fromkeys(r["order"] for r in rows if "order" in r):
    mine, style = [r for r in rows if r.get("order") == order], ORDER_STYLES[order]
    ax.plot([r["fraction_removed"] for r in mine], [r[metric] for r in mine], marker="o",
            linestyle=style, label=f"{order} order")
  _pruning_axes(ax, metric, legend_size=8)
  image = heat.imshow(importance_LxN, cmap="magma", aspect="auto")
  heat.set_xlabel("head")
  heat.set_ylabel("layer")
  heat.set_xticks(range(importance_LxN.shape[1]))  # whole heads and layers, not 0.5 steps
  heat.set_yticks(range(importance_LxN.shape[0]))
  heat.set_title("importance (normalised per layer)", fontsize=9)
  fig.colorbar(image, ax=heat)
  fig.suptitle(f"{title}: head pruning (arXiv:1905.10650)", fontsize=9)
  return fig


def pruning_by_run(rows: list[dict]) -> matplotlib.figure.Figure:
  metric = "perplexity" if any(np.isfinite(r["perplexity"]) and r["perplexity"] > 1.0
                               for r in rows) else "accuracy"
  fig, ax = plt.subplots(figsize=(6, 4.5), layout="constrained")
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for k, run in enumerate(dict.fromkeys(r["run"] for r in rows)):
    for order, style in ORDER_STYLES.items():
      mine = [r for r in rows if r["run"] == run and r["order"] == order]
      if not mine:
        continue
      ax.plot([r["fraction_removed"] for r in mine], [r[metric] for r in mine], marker="o",
              markersize=3, linestyle=style, color=cycle[k % len(cycle)],
              label=f"{run} ({order})")
  _pruning_axes(ax, metric, legend_size=7)
  return fig


def _violins(ax, groups: list[np.ndarray], labels: list[str], ylabel: str):
  """One violin (with its median marked) per group of values; empty or all-nan groups skipped."""
  kept = [(g[np.isfinite(g)], label) for g, label in zip(groups, labels)]
  kept = [(g, label) for g, label in kept if g.size]
  if kept:
    ax.violinplot([g for g, _ in kept], showmedians=True)
  ax.set_xticks(range(1, len(kept) + 1), [label for _, label in kept], rotation=30, ha="right",
                fontsize=7)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3, axis="y")


def _measure(rows, measure, **match):
  return np.asarray([r["value"] for r in rows if r["measure"] == measure
                     and all(r[k] == v for k, v in match.items())], float)


def explanation(rows: list[dict], title: str) -> matplotlib.figure.Figure:
  pairs = list(dict.fromkeys((r["layer"], r["head"]) for r in rows))
  fig, (taus, tvds) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
  _violins(taus, [_measure(rows, "kendall_tau", layer=l, head=h) for l, h in pairs],
           [f"L{l} H{h}" for l, h in pairs], "Kendall tau (attention vs gradient x input)")
  taus.axhline(0.0, color="black", linewidth=0.8)
  cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for k, layer in enumerate(dict.fromkeys(l for l, _ in pairs)):
    tvds.scatter(_measure(rows, "max_attention", layer=layer),
                 _measure(rows, "permutation_tvd", layer=layer), s=8, alpha=0.6,
                 color=cycle[k % len(cycle)], label=f"layer {layer}")
  tvds.set_xlabel("largest attention weight of the row")
  tvds.set_ylabel("median output TVD, row permuted")
  tvds.set_yscale("symlog", linthresh=1e-4)
  tvds.grid(alpha=0.3)
  tvds.legend(fontsize=7)
  fig.suptitle(f"{title}: attention as explanation (arXiv:1902.10186), one point per "
               "example and head", fontsize=9)
  return fig


def explanation_by_run(rows: list[dict]) -> matplotlib.figure.Figure:
  runs = list(dict.fromkeys(r["run"] for r in rows))
  fig, (taus, tvds) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(runs) + 4), 4.5),
                                   layout="constrained")
  _violins(taus, [_measure(rows, "kendall_tau", run=run) for run in runs], runs,
           "Kendall tau (attention vs gradient x input)")
  taus.axhline(0.0, color="black", linewidth=0.8)
  _violins(tvds, [_measure(rows, "permutation_tvd", run=run) for run in runs], runs,
           "output TVD, row permuted (median)")
  return fig


STAGE_COLOURS = {"from scratch": "tab:blue", "converted": "tab:red", "uptrained": "tab:green"}


def uptraining(rows: list[dict]) -> matplotlib.figure.Figure:
  fig, (ppl, cache) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
  labels = [f"{r['attention']} kv={r['kv_heads']}\n{r['stage']} ({r['total_steps']} steps)"
            for r in rows]
  x = np.arange(len(rows))
  colours = [STAGE_COLOURS.get(r["stage"], "gray") for r in rows]
  values = np.asarray([r["perplexity"] for r in rows], float)
  low = np.asarray([r["perplexity_ci_low"] or r["perplexity"] for r in rows], float)
  high = np.asarray([r["perplexity_ci_high"] or r["perplexity"] for r in rows], float)
  ppl.bar(x, values, color=colours, alpha=0.8)
  ppl.errorbar(x, values, yerr=[values - low, high - values], fmt="none", color="black",
               capsize=3)
  ppl.set_yscale("log")
  plots._plain_log_ticks(ppl.yaxis)  # noqa: SLF001
  ppl.set_ylabel("validation perplexity at the training length")
  cache.bar(x, [r["cache_bytes"] / 1024 for r in rows], color=colours, alpha=0.8)
  cache.set_ylabel("decode cache per sequence (KiB)")
  for ax in (ppl, cache):
    ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y", which="both")
  fig.suptitle("MHA to GQA: converted by mean-pooling, uptrained, or trained from scratch "
               "(arXiv:2305.13245)", fontsize=9)
  return fig
