"""MHA -> GQA uptraining, for any run: validation perplexity at the training length (its evaluation,
research.evaluation.extrapolation) against decode-cache bytes at that length, and how the run came
to be: trained from scratch, converted from another run's MHA by mean-pooling key/value heads
(train.init_from, 0 steps), or uptrained after the conversion (Ainslie et al., arXiv:2305.13245;
configs/gqa_uptraining.py); over a sweep, one table and figure (uptraining.csv, uptraining.png).
"""

import os

from flax import nnx

from research.model import attention
from research.model import transformer as model_lib
from research.analysis import base
from research.analysis import plots as head_plots
from research.analysis import trained
from research.evaluation import results as eval_results
from research.runs import config_fields
from research.training import init_from


def _stage(config) -> str:
  """How a run came to be: from scratch, converted (train.init_from, 0 steps) or uptrained."""
  if not config.train.init_from:
    return "from scratch"
  return "converted" if config.train.num_steps == 0 else "uptrained"


def uptraining(run: trained.Checkpoints, name: str, out: str,
               settings: base.Settings) -> list[dict]:
  del settings
  config = run.config
  length = config.train.seq_len
  rows = [r for r in eval_results.latest(eval_results.read(run.directory))
          if r["eval_length"] == length and r["eval_mode"] == "nonoverlapping"
          and r.get("rope_scaling", "none") == "none" and r.get("depth") is None]
  if not rows:
    raise ValueError(f"{name} has no non-overlapping evaluation at its training length {length}; "
                     f"evaluate it first (python -m experiments.evaluate --workdir="
                     f"{run.directory})")
  source_steps = 0
  if config.train.init_from:
    source = config_fields.load_saved(init_from.source_directory(config, run.directory))
    source_steps = source.train.num_steps
  model = nnx.eval_shape(lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))
  kv_heads = {attention.REGISTRY.lookup(name).kv_heads(config.model)
              for name in model_lib.layer_types(config.model)} - {None}
  evaluation = rows[-1]
  row = {"run": name, "attention": config.model.attention,
         "kv_heads": ",".join(map(str, sorted(kv_heads))), "stage": _stage(config),
         "steps": config.train.num_steps, "total_steps": source_steps + config.train.num_steps,
         "perplexity": evaluation["perplexity"],
         "perplexity_ci_low": evaluation.get("perplexity_ci_low"),
         "perplexity_ci_high": evaluation.get("perplexity_ci_high"),
         "cache_bytes": int(model.cache_bytes(1, length)), "eval_length": length,
         "tokens": evaluation.get("tokens")}
  base.write_csv(os.path.join(out, "uptraining.csv"), [row])
  base.write_summary(os.path.join(out, "summary.md"), [
      f"# Perplexity and decode cache: {name}", "",
      f"{row['stage']}, {row['steps']} steps ({row['total_steps']} in all); perplexity "
      f"{row['perplexity']:.3f} at {length} tokens; decode cache {row['cache_bytes']} bytes per "
      f"sequence of {length} tokens."])
  return [row]


def _uptraining_summary(rows: list[dict]) -> list[str]:
  lines = ["Validation perplexity at the training length (non-overlapping windows, 95% "
           "bootstrap interval) against the decode cache of one sequence of that length. "
           "Converted: another run's MHA with each group's key and value heads mean-pooled "
           "(Ainslie et al., arXiv:2305.13245), before any training; uptrained: the same, "
           "trained on with a fresh optimizer; total steps count the MHA run's too.", ""]
  return lines + base.table(
      ["run", "attention", "kv heads", "stage", "steps", "total steps", "perplexity",
       "95% interval", "cache bytes"],
      [[r["run"], r["attention"], r["kv_heads"], r["stage"], r["steps"], r["total_steps"],
        float(r["perplexity"]),
        "" if r["perplexity_ci_low"] is None else
        f"{r['perplexity_ci_low']:.3f}-{r['perplexity_ci_high']:.3f}", r["cache_bytes"]]
       for r in rows])


class Uptraining(base.Analysis):
  name = "uptraining"
  csv_name = "uptraining.csv"

  run = staticmethod(uptraining)

  @classmethod
  def compare(cls, rows, out):
    head_plots.save(head_plots.uptraining(rows), os.path.join(out, "uptraining.png"))
    return (["`uptraining.png`: perplexity (left) and decode-cache bytes (right) per run.", ""]
            + _uptraining_summary(rows))
