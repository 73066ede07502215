"""SIGTERM and SIGINT stop a run at the end of a step with a checkpoint of it and one line
(research.training.preemption): `python -m experiments.train` stopped by SIGTERM exits 0 and its
rerun ends bit-identical to an uninterrupted run, training no step twice; SIGINT exits 130; the
two processes of a jax.distributed run stop at the same step when one of them is signalled; the
agreement rule holds under every interleaving of processes (on a stand-in for the coordination
service); the handlers come back, and a second Ctrl-C interrupts at once; a stopped sweep member
is not recorded as failed, and a parallel sweep signalled alone passes the signal on."""

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from research.results import sweep
from research.runs import checkpoints
from research.training import preemption
from tests import test_lost_process
from tests import tiny_sweep
from tests.test_lost_process import _KeyValueStore
from tests.test_lost_process import stop_leftovers  # noqa: F401 (a fixture)
from tests.test_train import ROOT
from tests.test_train import _env
from tests.test_train import _final_params
from tests.test_train import _losses
from tests.test_train import _run
from tests.test_train import _train_command

LINE = re.compile(r"^stopped at step (\d+); checkpoint \1 saved; rerun the same command to "
                  r"resume$")
ABSL_LOG = re.compile(r"^[IWEF]\d{4} ")  # absl's warnings (TFDS's about the corpus' config)


def _logged_steps(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


def _stop_after(workdir, step, signum, *overrides):
  """Start experiments.train, send `signum` once it has logged `step`; (exit status, the step it
  stopped at from its one line, its stderr)."""
  process = subprocess.Popen(_train_command(workdir, *overrides), env=_env(8), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in process.stdout:
    if line.startswith(f"step {step}/"):
      process.send_signal(signum)
      break
  _, errors = process.communicate(timeout=120)
  lines = [line for line in errors.splitlines() if not ABSL_LOG.match(line)]
  assert len(lines) == 1 and LINE.match(lines[0]), errors[-3000:]
  return process.returncode, int(LINE.match(lines[0]).group(1)), errors


def test_sigterm_saves_the_step_exits_0_and_the_rerun_ends_bit_identical(tmp_path):
  steps = ["--config.train.num_steps=30", "--config.train.checkpoint_every=8"]
  reference, resumed = str(tmp_path / "reference"), str(tmp_path / "resumed")
  _run(reference, *steps)
  status, stopped, _ = _stop_after(resumed, 3, signal.SIGTERM, *steps)
  assert status == 0
  assert 3 <= stopped < 30, "the run ended before the signal came"
  assert checkpoints.steps(resumed)[-1] == stopped  # saved, and no later step trained
  assert _logged_steps(resumed) == list(range(1, stopped + 1))
  result = subprocess.run(_train_command(resumed, *steps), env=_env(8), cwd=ROOT, check=True,
                          capture_output=True, text=True)
  assert f"resuming {resumed} from step {stopped}" in result.stdout
  for got, want in zip(_final_params(resumed), _final_params(reference), strict=True):
    np.testing.assert_array_equal(got, want)
  assert _logged_steps(resumed) == list(range(1, 31))  # no step trained (logged) twice
  assert _losses(resumed) == _losses(reference)


def test_sigint_saves_the_step_and_exits_130_without_a_traceback(tmp_path):
  workdir = str(tmp_path / "run")
  status, stopped, errors = _stop_after(workdir, 2, signal.SIGINT,
                                        "--config.train.num_steps=100000")
  assert status == 130 and "Traceback" not in errors
  assert checkpoints.steps(workdir)[-1] == stopped == _logged_steps(workdir)[-1]


def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path, stop_leftovers,  # noqa: F811
                                                             monkeypatch):
  """Process 1 (which writes nothing) is signalled; process 0 stops at the same step, both with
  the line and status 0, and the checkpoint of that step is complete."""
  monkeypatch.setattr(test_lost_process, "STEPS", ["--config.train.num_steps=100000"])
  workdir = str(tmp_path / "run")
  first, second = test_lost_process._launch(workdir, tmp_path)
  for line in first.stdout:
    if line.startswith("step 3/"):
      second.send_signal(signal.SIGTERM)
      break
  _, errors = first.communicate(timeout=120)
  assert second.wait(timeout=120) == 0 and first.returncode == 0, errors[-3000:]
  with open(tmp_path / "process_1.log") as f:
    lines = [[line for line in output.splitlines() if LINE.match(line)]
             for output in (errors, f.read())]
  assert len(lines[0]) == len(lines[1]) == 1 and lines[0] == lines[1], lines
  stopped = int(LINE.match(lines[0][0]).group(1))
  assert checkpoints.steps(workdir)[-1] == stopped == _logged_steps(workdir)[-1]


def _interleave(rng, count, num_steps, monkeypatch):
  """One run of `count` processes' stop checks on a stand-in for the coordination service, in a
  random order of their events that keeps the order the step's collectives impose: a process
  starts step k after its check of step k - 1, and checks step k once every process has started
  step k - 1 (the check waits for that step to finish). A random process gets SIGTERM at a
  random moment, at the latest once the loops have ended. Each process's outcome: the step of
  its Stopped, or None."""
  store = _KeyValueStore()
  stops = [preemption.Stop(store, me) for me in range(count)]
  started, done, in_loop = [0] * count, [0] * count, set(range(count))
  signal_at, signalled = rng.randrange(2 * count * num_steps), stops[rng.randrange(count)]
  for moment in itertools.count():
    if moment == signal_at:
      signalled.signal = signal.SIGTERM  # what its handler does
    ready = [p for p in in_loop
             if started[p] == done[p] or all(s >= started[p] - 1 for s in started)]
    if not ready:
      break
    p = rng.choice(ready)
    if started[p] == done[p]:
      started[p] += 1
    else:
      done[p] += 1
      if stops[p].at(done[p], metrics=None) or done[p] == num_steps:
        in_loop.remove(p)
  signalled.signal = signal.SIGTERM
  # After their loops, every process raises or not at once (sync_global_devices: a barrier).
  monkeypatch.setattr(preemption.multihost_utils, "sync_global_devices",
                      lambda name, barrier=threading.Barrier(count): barrier.wait())
  outcomes = [None] * count

  def finish(p):
    try:
      stops[p].raise_if_stopped(done[p])
    except preemption.Stopped as stopped:
      outcomes[p] = stopped.step

  threads = [threading.Thread(target=finish, args=(p,)) for p in range(count)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return outcomes


def test_every_process_stops_at_the_same_step_whatever_the_interleaving(monkeypatch):
  rng = random.Random(0)
  for _ in range(300):
    outcomes = _interleave(rng, rng.choice((2, 3, 4)), 8, monkeypatch)
    assert len(set(outcomes)) == 1 and outcomes[0] is not None, outcomes


def test_handlers_are_restored_and_a_second_sigint_interrupts_at_once():
  before = {signum: signal.getsignal(signum) for signum in preemption.SIGNALS}
  with pytest.raises(KeyboardInterrupt):
    with preemption.Stop() as stop:
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGTERM)  # ignored: the stop is on its way
      assert stop.at(5, metrics=None) and stop.signal == signal.SIGTERM
      with pytest.raises(preemption.Stopped, match="stopped at step 5; checkpoint 5 saved") as e:
        stop.raise_if_stopped(5)
      assert e.value.exit_status == 0
      os.kill(os.getpid(), signal.SIGINT)
  assert {signum: signal.getsignal(signum) for signum in preemption.SIGNALS} == before
  assert preemption.Stopped(5, signal.SIGINT).exit_status == 130
  with preemption.Stop() as stop:  # no signal: never stops
    assert not stop.at(1, metrics=None)
    stop.raise_if_stopped(1)


def test_a_stopped_sweep_member_is_not_recorded_as_failed(tmp_path, monkeypatch):
  """In a sweep run in one process (--parallel=1, --sweep_index), Stopped passes the member's
  failure record (`except Exception`) and stops the command, which experiments.cli reports."""
  def stopped(config, workdir):
    raise preemption.Stopped(3, signal.SIGTERM)

  monkeypatch.setattr(sweep.train, "train_and_evaluate", stopped)
  member = sweep.expand(tiny_sweep.get_sweep(), tiny_sweep.get_config(), num_devices=8)[0]
  with pytest.raises(preemption.Stopped):
    sweep.run_member(str(tmp_path), member, progress=lambda line: None)
  assert sweep.status(str(tmp_path), member.name) == {"state": "pending"}


def test_a_signal_to_a_parallel_sweep_reaches_its_members(tmp_path):
  """experiments.run --parallel=2 signalled alone (as a container's first process is) passes
  SIGTERM on: the member training stops at a checkpoint, and the sweep with one line, status 0."""
  command = [sys.executable, "-m", "experiments.run", f"--config={ROOT}/tests/tiny_sweep.py",
             f"--workdir={tmp_path}", "--parallel=2", "--config.train.num_steps=100000"]
  process = subprocess.Popen(command, env=_env(8), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  for line in process.stdout:  # the members' output too
    if line.startswith("step 4/"):  # the mha member's (the gqa member diverges at step 2)
      process.send_signal(signal.SIGTERM)
      break
  _, errors = process.communicate(timeout=120)
  assert process.returncode == 0, errors[-3000:]
  lines = [line for line in errors.splitlines() if line.startswith("stopped")]
  assert lines[-1] == ("stopped; the members that were training saved a checkpoint each; rerun "
                       "the same command to resume"), errors[-3000:]
  stopped = int(LINE.match(lines[0]).group(1))
  workdir = str(tmp_path / "runs" / "attention=mha,position=alibi")
  assert checkpoints.steps(workdir)[-1] == stopped
  assert sweep.status(str(tmp_path), "attention=mha,position=alibi") == {"state": "pending"}
