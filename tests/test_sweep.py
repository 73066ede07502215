"""The sweep runner: expansion and naming, skipping, failure isolation, resume, results files."""

import csv
import json
import os
import shutil
import subprocess
import sys

import pytest

from research import eval_results
from research import report
from research import sweep
from tests import tiny_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _members():
  return sweep.expand(tiny_sweep.get_sweep(), tiny_sweep.get_config(), num_devices=8)


def test_expansion_names_overrides_and_skips():
  members = _members()
  assert [m.name for m in members] == ["attention=mha,position=alibi",
                                       "attention=linear,position=alibi",
                                       "attention=gqa,position=rope,learning_rate=1e+30"]
  assert members[0].config.model.position == "alibi" and members[2].config.model.attention == "gqa"
  assert not members[0].skip_reason
  assert "compatible positions: none, sinusoidal, rope" in members[1].skip_reason


@pytest.mark.parametrize("overrides,message", [
    ({"model.atention": "mha"}, "unknown sweep axis 'model.atention'; did you mean 'model.attention'"),
    ({"modle.attention": "mha"}, "no section 'modle'; valid sections: .*model"),
    ({"model.attention": "flash"}, r"sweep member 0 \(attention=flash\): unknown attention type"),
])
def test_bad_sweeps_fail_before_any_work(overrides, message):
  with pytest.raises(ValueError, match=message):
    sweep.expand([overrides], tiny_sweep.get_config(), num_devices=8)
  with pytest.raises(ValueError, match="the sweep is empty"):
    sweep.expand([], tiny_sweep.get_config(), num_devices=8)


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sweep"))
  members = _members()
  sweep.check_sweep_workdir(workdir, tiny_sweep.get_config(), members)
  for member in members:
    sweep.run_member(workdir, member)
  report.write(workdir)
  return workdir, members


def test_failures_are_isolated_and_recorded(finished_sweep):
  workdir, members = finished_sweep
  states = [sweep.status(workdir, m.name) for m in members]
  assert [s["state"] for s in states] == ["done", "skipped", "failed"]
  assert "NonFiniteLossError" in states[2]["error"]
  summary = open(os.path.join(workdir, "summary.md")).read()
  assert "| attention=linear,position=alibi | skipped | attention 'linear' does not support" in summary
  assert "| attention=gqa,position=rope,learning_rate=1e+30 | failed | NonFiniteLossError" in summary


def test_results_csv_is_tidy_with_swept_fields(finished_sweep):
  workdir, _ = finished_sweep
  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  required = {"run", "attention", "position", "seed", "train_length", "eval_length", "eval_mode",
              "loss", "perplexity", "model.attention", "model.position"}
  assert required <= set(rows[0])
  assert sorted((r["eval_length"], r["eval_mode"]) for r in rows) == [
      ("32", "nonoverlapping"), ("32", "sliding"), ("64", "nonoverlapping"), ("64", "sliding")]
  for name in ("extrapolation.png", "loss_by_position.png", "summary.md"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0


def test_rerun_does_only_what_is_not_done(finished_sweep):
  workdir, members = finished_sweep
  metrics = os.path.join(sweep.run_dir(workdir, members[0]), "metrics.jsonl")
  before = open(metrics).read()
  messages = []
  for member in members:
    if sweep.status(workdir, member.name)["state"] != "failed":
      sweep.run_member(workdir, member, progress=messages.append)
  assert open(metrics).read() == before
  assert any("done already" in m for m in messages)


def test_a_different_config_in_the_same_workdir_is_refused(finished_sweep):
  workdir, members = finished_sweep
  config = tiny_sweep.get_config()
  config.model.d_model = 64
  config.train.num_steps = 5
  with pytest.raises(ValueError, match="holds a sweep of a different config .model.d_model: 32 -> "
                                       "64; train.num_steps: 4 -> 5"):
    sweep.check_sweep_workdir(workdir, config, members)


def test_a_rerun_with_new_eval_lengths_evaluates_only_those(finished_sweep, tmp_path):
  shutil.copytree(finished_sweep[0], tmp_path / "sweep")
  workdir = str(tmp_path / "sweep")
  config = tiny_sweep.get_config()
  config.eval.lengths = (32, 64, 128)
  members = sweep.expand(tiny_sweep.get_sweep(), config, num_devices=8)
  sweep.check_sweep_workdir(workdir, config, members)  # evaluation settings may change
  before = eval_results.read(sweep.run_dir(workdir, members[0]))
  messages = []
  sweep.run_member(workdir, members[0], progress=messages.append)
  rows = eval_results.read(sweep.run_dir(workdir, members[0]))
  assert rows[:len(before)] == before
  assert sorted((r["eval_length"], r["eval_mode"]) for r in rows[len(before):]) == [
      (128, "nonoverlapping"), (128, "sliding")]
  assert "evaluated 2 new settings" in messages[-1]
  report.write(workdir)
  with open(os.path.join(workdir, "results.csv")) as f:
    assert {row["eval_length"] for row in csv.DictReader(f)} == {"32", "64", "128"}


def test_command_line_one_member_then_plot_names_the_missing_then_parallel_rest(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  command = [sys.executable, "-m", "experiments.run", f"--config={ROOT}/tests/tiny_sweep.py",
             f"--workdir={tmp_path}"]
  subprocess.run(command + ["--sweep_index=1"], env=env, cwd=ROOT, check=True, capture_output=True)
  assert json.load(open(tmp_path / "runs" / "attention=linear,position=alibi" / "status.json"))[
      "state"] == "skipped"
  result = subprocess.run([sys.executable, "-m", "experiments.plot", str(tmp_path)], env=env,
                          cwd=ROOT, check=True, capture_output=True, text=True)
  assert "attention=mha,position=alibi" in result.stdout  # not run yet, so named as missing
  subprocess.run(command + ["--parallel=2"], env=env, cwd=ROOT, check=True, capture_output=True)
  states = {p.name: json.load(open(p / "status.json"))["state"] for p in (tmp_path / "runs").iterdir()}
  assert sorted(states.values()) == ["done", "failed", "skipped"]
  assert (tmp_path / "results.csv").exists() and (tmp_path / "extrapolation.png").exists()


EXPERIMENTS = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "configs"))
                     if name.endswith(".py") and name not in ("base.py", "__init__.py"))


@pytest.mark.parametrize("name,preset", [(n, p) for n in EXPERIMENTS for p in ("quick", "full")])
def test_experiment_configs_expand_into_valid_sweeps(name, preset):
  """Every shipped sweep validates before any work: names, fields, compatible pairs."""
  module = sweep.load_module(os.path.join(ROOT, "configs", f"{name}.py"))
  members = sweep.expand(module.get_sweep(preset), module.get_config(preset), num_devices=1)
  assert len({m.name for m in members}) == len(members) > 1
  assert sum(not m.skip_reason for m in members) >= len(members) // 2
