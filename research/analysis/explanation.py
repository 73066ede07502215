"""Attention as explanation, of the softmax layers (Jain & Wallace, arXiv:1902.10186) for the
prediction after the last position of --num_sequences validation windows (random tokens for
tasks) of train.seq_len: per example and head, Kendall's tau between the head's attention row
from the last position and the gradient-times-input importance of the same tokens, and the
median total variation distance of the output distribution when that row is permuted over its
visible keys (--num_permutations); explanation.png, explanation.csv; newest checkpoint.
"""

import os

import jax
import numpy as np

from research.analysis import base
from research.analysis import heads
from research.analysis import plots as head_plots
from research.analysis import trained
from research.model.attention import masks


def _last_row_visible(config, batch: dict) -> np.ndarray:
  """[B, L] bool: the keys the last query of each row can see (window, sinks, documents)."""
  length = batch["inputs"].shape[1]
  index = np.arange(length)
  segments = batch.get("segments")
  settings = config.model.softmax
  document_index = (None if segments is None or not settings.sinks
                    else masks.positions_in_documents(segments))
  visible = masks.allowed(index[-1:], index, settings.window, settings.sinks,
                          None if segments is None else segments[:, -1:], segments,
                          document_index)
  return np.broadcast_to(np.asarray(visible)[:, 0, 0], batch["inputs"].shape)


def explanation(run: trained.Checkpoints, name: str, out: str,
                settings: base.Settings) -> list[dict]:
  config = run.config
  layers = base.map_layers(config)
  step, state = run.state()
  windows, source = base.windows(config, config.train.seq_len, settings)
  batch = {key: np.concatenate([w[key] for w in windows]) for key in windows[0]}
  visible_BxL = _last_row_visible(config, batch)
  importance_BxL, probs_BxV = run.gradient_importance(state, batch)
  weights = run.attention_weights(state, batch)
  keys = jax.random.split(jax.random.key(settings.seed), settings.num_permutations)
  rows = []
  for layer in layers:
    for head in range(config.model.num_heads):
      permuted_KxBxV = run.permuted_outputs(state, batch, layer, head, keys)
      tvd_B = np.median(heads.total_variation(permuted_KxBxV, probs_BxV[None]), axis=0)
      for b, visible in enumerate(visible_BxL):
        row = weights[layer][b, head, -1][visible]
        common = {"run": name, "step": step, "example": b, "layer": layer, "head": head}
        rows += [dict(common, measure=measure, value=float(value)) for measure, value in (
            ("kendall_tau", heads.kendall_tau(row, importance_BxL[b][visible])),
            ("permutation_tvd", tvd_B[b]), ("max_attention", row.max()))]
    run.log(f"  {name}: layer {layer} done")
  base.write_csv(os.path.join(out, "explanation.csv"), rows)
  head_plots.save(head_plots.explanation(rows, f"{name} (step {step})"),
                  os.path.join(out, "explanation.png"))

  values = lambda measure, **match: np.asarray(
      [r["value"] for r in rows if r["measure"] == measure
       and all(r[k] == v for k, v in match.items())])
  taus, tvds = values("kendall_tau"), values("permutation_tvd")
  lines = [f"# Attention as explanation: {name}", "",
           f"Checkpoint step {step}; {config.model.attention} with {config.model.position}; "
           f"{len(windows)} windows of {config.train.seq_len} tokens of {source}; the prediction "
           "after each window's last position (Jain & Wallace, arXiv:1902.10186).", "",
           "- Kendall's tau-b, per example and head, between the head's attention row from the "
           "last position and the gradient-times-input importance |e_j . d p_y / d e_j| of the "
           "same tokens (p_y: the probability of the predicted token; over the keys the row "
           "sees). A head in a later layer attends to hidden states, which mix earlier tokens, "
           "as the paper's encoder states do.",
           f"- Permutation: the row permuted over its visible keys ({settings.num_permutations} "
           "permutations), every other head and position as they were; the median total "
           "variation distance between the output distributions with and without.", "",
           f"Over all {len(taus)} (example, head) pairs: median tau {np.nanmedian(taus):+.3f} "
           f"(interquartile {np.nanpercentile(taus, 25):+.3f} to "
           f"{np.nanpercentile(taus, 75):+.3f}); median permutation TVD {np.median(tvds):.4f}, "
           f"below 0.01 for {np.mean(tvds < 0.01):.0%} of the pairs.", ""]
  lines += base.table(["layer", "head", "median tau", "median permutation TVD",
                   "median max attention"],
                  [[layer, head, float(np.nanmedian(values("kendall_tau", layer=layer, head=head))),
                    float(np.median(values("permutation_tvd", layer=layer, head=head))),
                    float(np.median(values("max_attention", layer=layer, head=head)))]
                   for layer in layers for head in range(config.model.num_heads)])
  lines += ["", base.CAVEAT]
  base.write_summary(os.path.join(out, "summary.md"), lines)
  return rows


class Explanation(base.Analysis):
  name = "explanation"
  csv_name = "explanation.csv"
  needs_attention_maps = True

  run = staticmethod(explanation)

  @classmethod
  def compare(cls, rows, out):
    head_plots.save(head_plots.explanation_by_run(rows), os.path.join(out, "explanation.png"))
    return ["`explanation.png`: per run, the distribution over (example, head) pairs of "
            "Kendall's tau between attention and gradient-times-input importance, and of the "
            "median output change (total variation distance) when the attention row is "
            "permuted (Jain & Wallace, arXiv:1902.10186).", "", base.CAVEAT]
