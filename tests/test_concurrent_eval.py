"""Evaluating a run while it trains: the evaluator takes no writer lock, reads only complete
checkpoints (one deleted by rotation or changed while it is read is read again from the newest),
and appends its rows to eval.json under the run's results lock, so evaluators never lose each
other's rows."""

import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from flax import nnx

from research.model import transformer as model_lib
from research.model import sharding
from research.evaluation import extrapolation
from research.evaluation import results as eval_results
from research.runs import checkpoints
from research.runs import config_fields
from research.runs import lock as workdir_lock
from tests.conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "tiny_config.py")


def _rows(writer, count):
  return [{"step": 1, "eval_length": writer, "eval_mode": "nonoverlapping",
           "rope_scaling": "none", "num_tokens": i, "loss": 1.0} for i in range(count)]


def test_evaluators_appending_at_once_keep_every_row_once(tmp_path):
  """Four writers (threads, each with its own lock descriptor, as processes have) append rows one
  at a time; a fifth appends rows the others wrote, which are not added twice."""
  run = str(tmp_path)

  def write(writer):
    for row in _rows(writer, 25):
      eval_results.append(run, [row])

  threads = [threading.Thread(target=write, args=(writer,)) for writer in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert eval_results.append(run, _rows(0, 30)) == _rows(0, 30)[25:]
  rows = eval_results.read(run)
  assert sorted(eval_results.key(row) for row in rows) == sorted(
      eval_results.key(row) for writer in range(4) for row in _rows(writer, 30 if writer == 0
                                                                      else 25))
  assert sorted(os.listdir(run)) == [eval_results.FILE_NAME, workdir_lock.RESULTS_LOCK_NAME]


def _abstract_params(config):
  mesh = sharding.make_mesh((8, 1, 1))
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.build_model(config.model,
                                                                    rngs=nnx.Rngs(0))))
  return sharding.sharded_abstract(abstract, mesh)


# A read that fails leaves orbax's coroutines of its other arrays to the garbage collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_rotated_out_or_deleted_while_it_is_read_is_read_again_from_the_newest(
    trained_run, tmp_path, monkeypatch):
  config, trained = trained_run
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  lines = []
  read = checkpoints.ocp.CheckpointManager.restore
  events = []

  def rotate_then_read(manager, step, *args, **kwargs):
    """The first read finds its checkpoint deleted (rotated out) just before it opens it."""
    events.append(step)
    if len(events) == 1:
      shutil.rmtree(os.path.join(checkpoints.directory(workdir), str(step)))
    return read(manager, step, *args, **kwargs)

  monkeypatch.setattr(checkpoints.ocp.CheckpointManager, "restore", rotate_then_read)
  step, _ = checkpoints.restore_params(workdir, _abstract_params(config), log=lines.append)
  assert (events, step, lines) == ([8, 4], 4, [])  # a rotated-out checkpoint is no damage

  shutil.rmtree(workdir)
  shutil.copytree(trained, workdir)
  events.clear()

  def read_then_damage(manager, step, *args, **kwargs):
    """The first read succeeds, but its checkpoint's files change while it runs (a deletion that
    began meanwhile, here half of every array file): its result is not used, and the
    checkpoint, now damaged, is skipped."""
    restored = read(manager, step, *args, **kwargs)
    events.append(step)
    if len(events) == 1:
      for root, _, names in os.walk(os.path.join(checkpoints.directory(workdir), str(step))):
        for path in (os.path.join(root, name) for name in names):
          if os.path.getsize(path) > 1024:
            os.truncate(path, os.path.getsize(path) // 2)
    return restored

  monkeypatch.setattr(checkpoints.ocp.CheckpointManager, "restore", read_then_damage)
  step, _ = checkpoints.restore_params(workdir, _abstract_params(config), log=lines.append)
  assert (events, step) == ([8, 4], 4)
  assert len(lines) == 1 and lines[0].startswith("checkpoint 8 of ") and (
      "using step 4 (left in place" in lines[0]), lines
  # A reader moves nothing: only the trainer, holding the writer lock, moves checkpoints aside.
  assert checkpoints.steps(workdir) == [4, 8]
  assert not os.path.exists(os.path.join(workdir, checkpoints.UNREADABLE_DIR))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
def test_a_run_is_evaluated_while_it_trains(tmp_path):
  """A trainer in a subprocess saves a checkpoint every step and keeps only the last (the
  checkpoint being read may be rotated out); two evaluators at once (threads, other lengths)
  evaluate its newest complete checkpoint meanwhile, and the trainer ends as it would alone."""
  workdir, num_steps = str(tmp_path / "run"), 50
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=xla_flags(8))
  env.pop("JAX_NUM_CPU_DEVICES", None)
  trainer = subprocess.Popen(
      [sys.executable, "-m", "experiments.train", f"--config={CONFIG}", f"--workdir={workdir}",
       f"--config.train.num_steps={num_steps}", "--config.train.checkpoint_every=1",
       "--config.train.keep_checkpoints=1"],
      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    for line in trainer.stdout:
      if line.startswith("step ") and checkpoints.steps(workdir):
        break
    with pytest.raises(workdir_lock.WorkdirBusyError, match=f"in use by pid {trainer.pid} on"):
      with workdir_lock.hold(workdir):  # the trainer holds the writer lock ...
        pass
    config = config_fields.load_saved(workdir)  # ... and the evaluators need not take it
    config.eval.update(dict(modes=("nonoverlapping",), rope_scalings=()))
    found, errors = {}, []

    def evaluate(length):
      try:
        evaluator_config = config.copy_and_resolve_references()
        evaluator_config.eval.lengths = (length,)
        found[length] = extrapolation.evaluate_run(evaluator_config, workdir,
                                                   progress=lambda line: None)
      except Exception as e:  # noqa: BLE001 (reported below)
        errors.append(e)

    evaluators = [threading.Thread(target=evaluate, args=(length,)) for length in (32, 64)]
    started = time.monotonic()
    for evaluator in evaluators:
      evaluator.start()
    for evaluator in evaluators:
      evaluator.join()
    print(f"evaluated in {time.monotonic() - started:.1f} s at", checkpoints.steps(workdir))
    assert not errors, errors
    assert trainer.poll() is None, "the trainer finished before the evaluation; raise num_steps"
  finally:
    output = trainer.communicate(timeout=300)[0]
  assert trainer.returncode == 0, output[-3000:]

  rows = eval_results.read(workdir)
  assert sorted(row["eval_length"] for row in rows) == [32, 64]  # both evaluators' rows
  assert rows == [row for length in (32, 64) for row in found[length]] or rows == [
      row for length in (64, 32) for row in found[length]]
  for row in rows:  # a checkpoint of training, not its end: evaluated while it trained
    assert 1 <= row["step"] < num_steps and np.isfinite(row["loss"]), row
  # The trainer's checkpoints are as they would be without the evaluators.
  assert os.listdir(checkpoints.directory(workdir)) == [str(num_steps)]
  assert not os.path.exists(os.path.join(workdir, checkpoints.UNREADABLE_DIR))
  step, _ = checkpoints.restore_params(workdir, _abstract_params(config))
  assert step == num_steps
