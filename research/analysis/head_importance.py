"""Head importance and pruning, for mixers with heads (softmax, linear attention, retention): each
head's importance I_h = E |dL/dxi_h| for a head mask xi (Michel et al., arXiv:1905.10650;
research.analysis.heads), then iterative pruning by importance against random order: perplexity
(accuracy for tasks) against the fraction of heads removed (pruning.png, pruning.csv,
importance.csv); for grouped-query runs also by whole key/value groups (order kv_groups); newest
checkpoint.
"""

import os

from flax import nnx
import numpy as np

from research import data
from research.model import transformer as model_lib
from research.analysis import base
from research.analysis import heads
from research.analysis import plots as head_plots
from research.analysis import trained


def _masked_evaluation(run: trained.Checkpoints, state, mask_LxN, batches):
  """(importance E_batches |dL/d mask| [layers, N], loss, accuracy) on `batches`."""
  importance, nll, correct, tokens = 0.0, 0.0, 0.0, 0.0
  for batch in batches:
    grad, (batch_nll, batch_correct, batch_tokens) = run.masked_gradient(state, mask_LxN, batch)
    importance = importance + np.abs(np.asarray(grad))
    nll, correct = nll + float(batch_nll), correct + float(batch_correct)
    tokens += float(batch_tokens)
  return importance / len(batches), nll / tokens, correct / tokens


def head_importance(run: trained.Checkpoints, name: str, out: str,
                    settings: base.Settings) -> list[dict]:
  config = run.config
  step, state = run.state()
  model = nnx.merge(run.graphdef, state)
  projections = heads.output_projections(model)
  has_heads = np.asarray([p is not None for p in projections])
  num_heads = config.model.num_heads
  heads_alive = np.repeat(has_heads[:, None], num_heads, axis=1)
  group_sizes = [size if headed else 1
                 for size, headed in zip(heads.kv_group_sizes(model), has_heads)]
  groups_alive = heads.groups_of_heads(heads_alive, group_sizes)
  # Group pruning where some layer shares key/value heads and has more than one of them.
  grouped = any(1 < size < num_heads for size, headed in zip(group_sizes, has_heads) if headed)
  batches = list(data.eval_batches(config, config.train.seq_len, "nonoverlapping"))
  total, total_groups = int(heads_alive.sum()), int(groups_alive.sum())
  rows, initial = [], None
  for order in ("importance", "random") + (("kv_groups",) if grouped else ()):
    rng = np.random.default_rng(settings.seed)
    alive, groups = heads_alive.copy(), groups_alive.copy()
    while True:
      importance, loss, accuracy = _masked_evaluation(run, state, alive, batches)
      scores = heads.normalise_per_layer(importance)
      if initial is None:
        initial = np.where(heads_alive, scores, np.nan)
      rows.append({"run": name, "step": step, "order": order,
                   "heads_removed": total - int(alive.sum()),
                   "fraction_removed": float(1 - alive.sum() / total),
                   "kv_heads_removed": total_groups - int(groups.sum()) if grouped else "",
                   "loss": loss,
                   "perplexity": float(np.exp(min(loss, 700.0))), "accuracy": accuracy})
      if order == "kv_groups":
        removed = heads.heads_to_remove(heads.group_scores(scores, group_sizes), groups,
                                        settings.prune_fraction)
        for layer, group in removed:
          groups[layer, group] = False
        alive = heads.heads_of_groups(groups, group_sizes, num_heads) & heads_alive
      else:
        removed = heads.heads_to_remove(
            scores if order == "importance" else rng.random(alive.shape), alive,
            settings.prune_fraction)
        for layer, head in removed:
          alive[layer, head] = False
        groups = heads.groups_of_heads(alive, group_sizes)
      if not removed:
        break
    run.log(f"  {name}: {order} order pruned to {int(alive.sum())} heads")
  importance_rows = [{"run": name, "step": step, "layer": l, "head": h,
                      "importance": float(initial[l, h])}
                     for l in np.nonzero(has_heads)[0] for h in range(config.model.num_heads)]
  base.write_csv(os.path.join(out, "pruning.csv"), rows)
  base.write_csv(os.path.join(out, "importance.csv"), importance_rows)
  metric = "perplexity" if data.is_language_modeling(config) else "accuracy"
  head_plots.save(head_plots.pruning(rows, initial, metric, f"{name} (step {step})"),
                  os.path.join(out, "pruning.png"))

  full_model = rows[0][metric]
  within = [r["fraction_removed"] for r in rows if r["order"] == "importance"
            and (r[metric] <= 1.05 * full_model if metric == "perplexity"
                 else r[metric] >= full_model - 0.01)]
  lines = [f"# Head importance and pruning: {name}", "",
           f"Checkpoint step {step}; {total} heads in {int(has_heads.sum())} layers. Importance "
           "I_h = E |dL/dxi_h| of a head mask xi at the current mask (xi_h scales head h's "
           "output before the output projection), averaged over batches of "
           f"{config.eval.batch_size} validation windows of {config.train.seq_len} tokens and "
           "normalised per layer (l2) (Michel et al., arXiv:1905.10650). Pruning removes the "
           f"least important {settings.prune_fraction:.0%} of the remaining heads (at least "
           "one, never a layer's last), re-estimates, and repeats; against heads removed in a "
           "random order."
           + (" Order kv_groups prunes whole key/value groups (a group's score: the sum of its "
              "query heads' importances; never a layer's last group), which is what shrinks the "
              "decode cache; kv_heads_removed counts the key/value heads gone." if grouped
              else ""), "",
           f"- `pruning.png`, `pruning.csv`: {metric} against the fraction of heads removed.",
           "- `importance.csv`: each head's normalised importance in the full model.", "",
           f"Removable by importance with {metric} "
           + ("within 5% of the full model's" if metric == "perplexity" else
              "within 0.01 of the full model's") + f": {max(within):.0%} of the heads.", ""]
  lines += base.table(["order", "heads removed", "fraction"] + (["kv heads removed"] if grouped
                                                             else []) + [metric],
                  [[r["order"], r["heads_removed"], f"{r['fraction_removed']:.2f}"]
                   + ([r["kv_heads_removed"]] if grouped else []) + [r[metric]] for r in rows])
  base.write_summary(os.path.join(out, "summary.md"), lines)
  return rows + importance_rows


class HeadImportance(base.Analysis):
  name = "head_importance"
  csv_name = "pruning.csv"

  @classmethod
  def problem(cls, config):
    model = nnx.eval_shape(lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))
    if not any(heads.output_projections(model)):
      return (f"head_importance needs a mixer with heads, but {config.model.attention} has "
              f"none; valid: {', '.join(base.multi_head_variants())}")
    return None

  run = staticmethod(head_importance)

  @classmethod
  def compare(cls, rows, out):
    head_plots.save(head_plots.pruning_by_run(rows), os.path.join(out, "pruning.png"))
    return ["`pruning.png`: per run, perplexity (or accuracy) against the fraction of heads "
            "removed, by importance (solid), in random order (dashed) and, for grouped-query "
            "runs, by whole key/value groups (dotted)."]

  @classmethod
  def compared_rows(cls, rows):
    return [r for r in rows if "order" in r]  # the pruning curves, not the importance table
