"""Run a whole sweep: train and evaluate each member, then results.csv, summary.md, figures.

  python -m experiments.run --config=configs/lm_extrapolation.py:quick --workdir=runs/demo
  python -m experiments.run --config=... --workdir=DIR --parallel=4      # 4 runs at once
  python -m experiments.run --config=... --workdir=DIR --sweep_index=$SLURM_ARRAY_TASK_ID
  python -m experiments.run --config=... --workdir=DIR --collect         # after an array job
  python -m experiments.run --config=... --workdir=DIR --seeds=3         # each member x seeds 0-2

Rerunning the same command does only what is not done (finished runs are kept, and evaluated
at eval settings they have no results for; interrupted ones resume from their checkpoints;
failed ones are retried). A user error prints one line (--verbose: with its traceback).
SIGTERM or SIGINT stops the sweep, each member that was training at a checkpoint of its own,
with one line and status 0 (SIGTERM) or 130 (SIGINT): research.training.preemption.
"""

import os
import signal
import subprocess
import sys
import time

import jax
from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import cli
from research.model import flops
from research.results import report
from research.results import sweep
from research.training import preemption

_CONFIG = cli.config_flag(config_flags.DEFINE_config_file, None,
                          "Experiment config file[:preset].", lock_config=True)
_WORKDIR = cli.workdir_flag("Sweep output directory.")
_SWEEP_INDEX = flags.DEFINE_integer("sweep_index", None, "Run only this member (array jobs).")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Members to run at once, as subprocesses.")
_COLLECT = flags.DEFINE_bool("collect", False, "Only gather results and draw the figures.")
_SEEDS = flags.DEFINE_integer("seeds", None, "Run every member with train.seed 0..N-1 (replacing "
                              "the sweep's own seeds).")
flags.mark_flags_as_required(["config", "workdir"])


def _config_path_and_preset():
  """(path.py, preset) of --config=path.py:preset; get_sweep takes the preset like get_config."""
  path, _, preset = config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")
  return path, preset


def _run_in_subprocesses(members, parallel, child_env):
  """Each member as `--sweep_index=i` in its own process, `parallel` at a time; a member that
  starts from another member's parameters (train.init_from) starts once that one has ended. A
  child that dies without recording a status is reported as missing by the collect step.

  SIGTERM or SIGINT starts no more members and reaches the running ones as SIGTERM: each stops
  at a checkpoint (research.training.preemption; one that the signal reached already, as Ctrl-C
  reaches a terminal's whole process group, ignores the second). A scheduler may signal this
  process alone. Returns that signal, once they have ended; None when every member ran."""
  base_args = [a for a in sys.argv[1:] if not a.startswith(("--parallel", "--sweep_index"))]
  queue, running, passed_on = list(members), [], False
  with preemption.Stop() as stop:
    while queue or running:
      if stop.signal is not None and not passed_on:
        queue, passed_on = [], True
        for _, process in running:
          process.send_signal(signal.SIGTERM)
      for member in sweep.ready_to_start(queue, [m for m, _ in running], parallel):
        queue.remove(member)
        running.append((member, subprocess.Popen(
            [sys.executable, "-m", "experiments.run", *base_args,
             f"--sweep_index={member.index}"], env=child_env)))
      time.sleep(1)
      running = [(m, p) for m, p in running if p.poll() is None]
  return stop.signal


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # progress lines, not library INFO logs
  workdir = _WORKDIR.value
  environ = dict(os.environ)  # the members' environment, before this process's setting below
  if _PARALLEL.value > 1:  # this process only plans: keep it from reserving accelerator memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  path, preset = _config_path_and_preset()
  get_sweep = sweep.load_module(path).get_sweep
  overrides = sweep.with_seeds(get_sweep(preset) if preset else get_sweep(), _SEEDS.value)
  members = sweep.expand(overrides, _CONFIG.value, jax.device_count())
  if _SWEEP_INDEX.value is not None and not 0 <= _SWEEP_INDEX.value < len(members):
    raise ValueError(f"--sweep_index={_SWEEP_INDEX.value} is out of range; valid: 0.."
                     f"{len(members) - 1} (the sweep has {len(members)} members)")
  sweep.check_sweep_workdir(workdir, _CONFIG.value, members)
  if _SWEEP_INDEX.value is not None:
    sweep.run_member(workdir, members[_SWEEP_INDEX.value])
    return
  if not _COLLECT.value:
    states = {m.name: sweep.status(workdir, m.name)["state"] for m in members}
    pending = [m for m in members if states[m.name] not in ("done", "skipped")]
    print(f"sweep of {len(members)} runs, {len(pending)} to do, in {workdir}", flush=True)
    for member in members:  # finished runs: only evaluation settings they have no results for
      if states[member.name] == "done":
        sweep.run_member(workdir, member)
    if _PARALLEL.value > 1:
      child_env = sweep.members_environment(environ, _PARALLEL.value, flops.total_peak_flops)
      signum = _run_in_subprocesses(pending, _PARALLEL.value, child_env)
      if signum is not None:
        print("stopped; the members that were training saved a checkpoint each; rerun the same "
              "command to resume", file=sys.stderr, flush=True)
        sys.exit(preemption.exit_status(signum))
    else:
      for member in pending:
        sweep.run_member(workdir, member)
  written = report.write(workdir)
  print(f"results in {workdir}/: {', '.join(written.files)}")
  if written.missing:
    print(f"runs without results ({len(written.missing)}): {', '.join(written.missing)}; "
          "see summary.md")


if __name__ == "__main__":
  cli.run(main)
