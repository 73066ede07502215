"""Evaluate a trained run, or every run of a sweep, at new lengths, modes and RoPE scalings,
from its newest readable checkpoint, without retraining; then redraw its results.

  python -m experiments.evaluate --workdir=runs/alibi --config.eval.lengths='(128,1024,4096)'
  python -m experiments.evaluate --workdir=runs/demo --config.model.rope.scaling=yarn
  python -m experiments.evaluate --workdir=runs/demo --config.eval.modes='("sliding",)' \
      --config.eval.sliding_stride=64

The run's own config.json gives everything else. Only evaluation settings may be changed: the
eval.* fields, mesh.shape (the layout on the devices present, not a setting of the run), and
model.rope.scaling=NAME (or model.xpos / model.prope), which evaluates that scaling as
--config.eval.rope_scalings='("NAME",)' does (factor eval length / train.seq_len, as
research.evaluation.extrapolation applies it). Each evaluation is a
row of RUN/eval.json keyed by the checkpoint step and its settings, appended (settings evaluated
before are not recomputed, nothing is overwritten); results.csv, summary.md and the figures are
then redrawn in --workdir. A partially trained run is evaluated at its newest complete checkpoint,
also while it trains (docs/evaluation.md). Without --config.mesh.shape a run evaluates on its
own mesh where that fits the devices present, else on one that does, with a line saying which
(research.model.sharding.fitting_mesh_shape): a run trained on 8 devices evaluates on 1.
"""

import jax
from absl import flags
from absl import logging
from ml_collections import config_flags

from configs import base
from experiments import cli
from research.runs import checkpoints
from research.training import checks
from research.runs import config_fields
from research.evaluation import extrapolation
from research.model import sharding
from research.runs import lock as workdir_lock
from research.results import report
from research.runs import workdirs

_CONFIG = cli.config_flag(config_flags.DEFINE_config_dict, base.get_config(),
                          "Evaluation settings to change: eval.*, mesh.shape, "
                          "model.rope.scaling.")
_WORKDIR = cli.workdir_flag("A run directory (config.json) or a sweep "
                            "directory (sweep.json).")
flags.mark_flags_as_required(["workdir"])

ROPE_SCALINGS = tuple(f for f in config_fields.ROTARY_SCALING_FIELDS if f.endswith(".scaling"))
LAYOUT = ("mesh.shape",)  # how the evaluation is laid out on the devices, not what it computes


def evaluation_settings(overrides: dict) -> dict:
  """The overridden fields as eval.* and mesh.shape settings; ValueError for a field that changes
  training."""
  not_evaluation = sorted(name for name in overrides if not name.startswith("eval.")
                          and name not in ROPE_SCALINGS + LAYOUT)
  if not_evaluation:
    raise ValueError(
        f"experiments.evaluate changes evaluation settings only (eval.*, {', '.join(LAYOUT)}, "
        f"{', '.join(ROPE_SCALINGS)}), not {', '.join(not_evaluation)}; train with those values "
        "in a new --workdir instead")
  settings = {name: value for name, value in overrides.items()
              if name.startswith("eval.") or name in LAYOUT}
  asked = [overrides[name] for name in ROPE_SCALINGS if overrides.get(name, "none") != "none"]
  if asked:
    scalings = settings.get("eval.rope_scalings", ())
    settings["eval.rope_scalings"] = tuple(dict.fromkeys((*scalings, *asked)))
  return settings


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  workdir = _WORKDIR.value
  settings = evaluation_settings(config_flags.get_override_values(flags.FLAGS["config"]))
  runs = [run for run in workdirs.runs(workdir) if checkpoints.steps(run.directory)]
  if not runs:
    raise ValueError(f"{workdir} has no checkpoint to evaluate; train it first")
  configs = []
  for run in runs:  # every check before any evaluation
    config = config_fields.load_saved(run.directory)
    config.update_from_flattened_dict(settings)
    if "mesh.shape" not in settings:  # the run's own mesh, or one that fits these devices
      config.mesh.shape, note = sharding.fitting_mesh_shape(
          config.mesh.shape, jax.device_count(), config.eval.batch_size)
      if note:
        print(f"{run.name}: {note}", flush=True)
    checks.validate_config(config, jax.device_count(), training=False)
    configs.append(config)
  for run, config in zip(runs, configs):
    print(f"{run.name}: evaluating", flush=True)
    extrapolation.evaluate_run(config, run.directory)
  with workdir_lock.hold_results(workdir):  # another evaluator may redraw them meanwhile
    written = report.write(workdir)
  print(f"results in {workdir}/: {', '.join(written.files)}"
        + (f"; runs without results: {', '.join(written.missing)}" if written.missing else ""))


if __name__ == "__main__":
  cli.run(main)
