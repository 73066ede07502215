"""Train one configuration.

  python -m experiments.train --config=configs/lm_extrapolation.py:quick --workdir=runs/x \
      [--config.model.attention=gqa ...]

A setting of the experiment file that this run does not read (one its sweep's other members
read, e.g. model.learned.max_length beside RoPE) is left at its default, with a line naming it;
one given on the command line is refused (research.runs.unread). Writes DIR/config.json, DIR/metrics.jsonl and orbax checkpoints in DIR/checkpoints/; the same
command again resumes from the newest readable checkpoint. A user error prints one line
(--verbose: with its traceback) and exits with status 1.
"""

from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import cli
from research.runs import unread
from research.training import loop as train

_CONFIG = cli.config_flag(config_flags.DEFINE_config_file, None,
                          "Experiment config file[:preset].", lock_config=True)
_WORKDIR = cli.workdir_flag("Output directory (resumes if it holds a run).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # progress lines, not library INFO logs
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  train.train_and_evaluate(unread.for_run_of_experiment(_CONFIG.value, overrides, log=print),
                           _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
