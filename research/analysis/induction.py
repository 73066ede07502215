"""Induction heads over training, at every kept checkpoint (train.keep_checkpoints_at keeps
log-spaced ones): the induction and previous-token scores of every head on [A; A] (A = train.seq_len
/ 2 random tokens; Olsson et al., arXiv:2209.11895) and, for language modeling, the
in-context-learning score on validation windows of train.seq_len tokens (research.analysis.heads);
mixers without maps get the ICL score alone (scores.csv, induction.png).
"""

import os

import numpy as np

from research import data
from research.analysis import base
from research.analysis import heads
from research.analysis import plots as head_plots
from research.analysis import trained
from research.results import sweep

FORMED = 0.5  # a largest induction score at which the head has formed (uniform: about 0.03)


def induction(run: trained.Checkpoints, name: str, out: str,
              settings: base.Settings) -> list[dict]:
  config = run.config
  layers = base.map_layers(config)
  language = data.is_language_modeling(config)
  repeated, period = base.repeated(config, settings)
  rows = []
  for step in run.steps:
    _, state = run.state(step)
    if layers:
      weights = run.attention_weights(state, repeated)
      for i in layers:
        scores = {"induction": heads.induction_score(weights[i], period),
                  "previous_token": heads.previous_token_score(weights[i])}
        rows += [{"run": name, "step": step, "layer": i, "head": h, "measure": measure,
                  "value": float(values[h])}
                 for measure, values in scores.items() for h in range(len(values))]
    if language:
      icl = heads.icl_score(run.loss_by_position(state, config.train.seq_len))
      rows += [{"run": name, "step": step, "layer": "", "head": "", "measure": measure,
                "value": value} for measure, value in icl.items()]
    run.log(f"  {name}: step {step} done")
  base.write_csv(os.path.join(out, "scores.csv"), rows)
  head_plots.save(head_plots.scores_over_training(rows, f"{name}"),
                  os.path.join(out, "induction.png"))

  last = run.steps[-1]
  early, late = heads.icl_positions(config.train.seq_len)
  lines = [f"# Induction heads over training: {name}", "",
           f"Checkpoints {', '.join(map(str, run.steps))}; {config.model.attention} with "
           f"{config.model.position}, {config.model.num_layers} layers x "
           f"{config.model.num_heads} heads.", ""]
  if layers:
    lines += [f"Induction score: on [A; A] ({settings.num_sequences} rows, A {period} random "
              "tokens), the mean attention from each token of the second copy to the token "
              "after its earlier occurrence (a uniform causal head scores "
              f"{np.mean(1 / np.arange(period + 1, 2 * period + 1)):.3f}); previous-token score:"
              " the mean attention to the token before.", ""]
    final = {(r["layer"], r["head"], r["measure"]): r["value"] for r in rows
             if r["step"] == last and r["head"] != ""}
    lines += base.table(["layer", "head", f"induction (step {last})", "previous token"],
                    [[i, h, final[i, h, "induction"], final[i, h, "previous_token"]]
                     for i in layers for h in range(config.model.num_heads)]) + [""]
  else:
    lines += [f"No attention maps: {base.no_maps(config)}; the ICL score alone.", ""]
  if language:
    icl = {r["step"]: r["value"] for r in rows if r["measure"] == "icl_score"}
    lines += [f"ICL score: mean loss at positions {late.start}-{late.stop - 1} minus at "
              f"{early.start}-{early.stop - 1} of validation windows of {config.train.seq_len} "
              "tokens (Olsson et al.'s 500th minus 50th token of 512, scaled): "
              + ", ".join(f"{icl[s]:+.3f} at step {s}" for s in run.steps) + "."]
  base.write_summary(os.path.join(out, "summary.md"), lines)
  return rows


class Induction(base.Analysis):
  name = "induction"
  csv_name = "scores.csv"

  @classmethod
  def problem(cls, config):
    if not base.map_layers(config) and not data.is_language_modeling(config):
      return (f"induction needs attention maps or language modeling (the ICL score), but "
              f"{base.no_maps(config)} and data.name={config.data.name!r} is a task")
    return None

  run = staticmethod(induction)

  @classmethod
  def compare(cls, rows, out):
    variant_of = sweep.variant_name
    head_plots.save(head_plots.scores_by_run(rows, variant_of),
                    os.path.join(out, "induction.png"))
    lines = ["`induction.png`: per run, the largest induction score of any head and the ICL "
             "score at every kept checkpoint; the runs of one variant (its seeds) share a colour."]
    best = head_plots.largest_induction(rows)
    if not best:
      return lines
    by_variant = {}
    for run in dict.fromkeys(run for run, _ in best):
      by_variant.setdefault(variant_of(run), []).append(run)
    table_rows = []
    for variant, runs in by_variant.items():
      finals, formed = [], []
      for run in runs:
        steps = sorted(step for r, step in best if r == run)
        finals.append(best[run, steps[-1]])
        formed.append(next((str(s) for s in steps if best[run, s] >= FORMED), "not formed"))
      table_rows.append([variant, len(runs), _spread(finals), ", ".join(formed)])
    return lines + ["", f"Over each variant's runs (seeds): the largest induction score of any "
                    f"head at the last kept step (mean +/- std over runs [min, max]), and the "
                    f"first kept step at which it reached {FORMED} (the phase change; a uniform "
                    "head scores about 0.03), per run.", ""] + base.table(
                        ["variant", "runs", "largest induction score, last step",
                         f"first step >= {FORMED}, per run"], table_rows)


def _spread(values: list[float]) -> str:
  """'mean +/- std [min, max]' (the std over runs, ddof 1; '' for one run)."""
  if len(values) == 1:
    return f"{values[0]:.3f}"
  return (f"{np.mean(values):.3f} +/- {np.std(values, ddof=1):.3f} "
          f"[{min(values):.3f}, {max(values):.3f}]")
