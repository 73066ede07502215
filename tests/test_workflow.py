"""A researcher's workflow on a trained run: evaluating and plotting it without retraining,
resuming it under a changed config (what may change and what may not), and user errors on the
command line as one line that writes nothing."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from configs import base
from research.evaluation import results as eval_results
from research.evaluation import extrapolation
from research.results import report
from research.training import loop as train
from tests import forked_commands
from tests import tiny_config
from tests.conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(8))


def _copy(trained_run, tmp_path):
  config, trained = trained_run
  shutil.copytree(trained, tmp_path / "run")
  return config.copy_and_resolve_references(), str(tmp_path / "run")


def _command(module, *args):
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], env=ENV, cwd=ROOT,
                        capture_output=True, text=True)


def test_evaluate_a_trained_run_at_new_lengths_and_scalings_then_plot_it(trained_run, tmp_path,
                                                                          monkeypatch):
  config, workdir = _copy(trained_run, tmp_path)
  monkeypatch.chdir(tmp_path)  # a relative workdir, as in `make demo` (orbax needs absolute paths)
  first = extrapolation.evaluate_run(config, "run", progress=lambda line: None)
  assert sorted((r["eval_length"], r["eval_mode"]) for r in first) == [
      (32, "nonoverlapping"), (32, "sliding"), (64, "nonoverlapping"), (64, "sliding")]
  result = _command("evaluate", f"--workdir={workdir}", "--config.eval.lengths=(32,128)",
                    "--config.model.rope.scaling=yarn")
  assert result.returncode == 0, result.stderr[-3000:]
  rows = eval_results.read(workdir)
  assert rows[:4] == json.loads(json.dumps(first))  # kept as they were
  assert sorted(eval_results.key(r)[2:5] for r in rows[4:]) == [
      (32, "nonoverlapping", "yarn"), (128, "nonoverlapping", "none"),
      (128, "nonoverlapping", "yarn"), (128, "sliding", "none")]  # only what was new
  assert all(r["step"] == 8 for r in rows)
  # the decode state per sequence: a KV cache, 4x the bytes at 4x the length
  state = {r["eval_length"]: r["state_bytes"] for r in rows[4:]}
  assert state[128] == 4 * state[32] > 0
  for name in ("extrapolation.png", "rope_scaling.png", "loss_by_position.png"):
    os.remove(os.path.join(workdir, name))
  result = _command("plot", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr[-3000:]
  for name in ("results.csv", "summary.md", "extrapolation.png", "rope_scaling.png",
               "loss_by_position.png"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0, name
  summary = open(os.path.join(workdir, "summary.md")).read()
  assert "| run +yarn |" in summary and "| 32 | 64 | 128 |" in summary


def test_resume_ignores_evaluation_fields_and_new_fields_at_their_default(trained_run, tmp_path,
                                                                         capsys):
  """Also the softmax backend: a run trained with xla resumes under the default auto."""
  config, workdir = _copy(trained_run, tmp_path)
  saved = json.load(open(os.path.join(workdir, "config.json")))
  del saved["train"]["end_learning_rate_fraction"]  # as if the run predated the field
  saved["model"]["attention_backend"] = "xla"  # every backend computes the same attention
  json.dump(saved, open(os.path.join(workdir, "config.json"), "w"))
  refused = config.copy_and_resolve_references()
  refused.train.update(dict(end_learning_rate_fraction=0.5, seed=1))
  with pytest.raises(ValueError, match=(
      r"different config \(train.end_learning_rate_fraction: absent \(the run predates it; its "
      r"default is 0.1\) -> 0.5; train.seed: 0 -> 1\)")):
    train.train_and_evaluate(refused, workdir)
  config.eval.lengths = (32, 128)
  config.train.log_every = 2
  train.train_and_evaluate(config, workdir)
  assert "trained to step 8 already" in capsys.readouterr().out


def test_user_errors_are_one_line_and_write_nothing(trained_run, tmp_path):
  _, trained = trained_run
  config_file, sweep_file = f"{ROOT}/tests/tiny_config.py", f"{ROOT}/tests/tiny_sweep.py"
  new = str(tmp_path / "new")
  cases = [  # (module, arguments, the error line starts with)
      ("train", [f"--config={config_file}", f"--workdir={new}", "--config.train.num_step=5"],
       "error: unknown config field 'train.num_step'; did you mean 'train.num_steps'?"),
      ("train", [f"--config={ROOT}/configs/lm_extrapolation.py:quikc", f"--workdir={new}"],
       "error: unknown preset 'quikc'; valid: quick, full"),
      ("train", [f"--config={config_file}", f"--workdir={new}", "--config.train.grad_clip_norm=0"],
       "error: train.grad_clip_norm=0.0 must be > 0"),
      ("run", [f"--config={sweep_file}", f"--workdir={new}", "--sweep_index=9"],
       "error: --sweep_index=9 is out of range; valid: 0..2"),
      ("evaluate", [f"--workdir={trained}", "--config.train.num_steps=9"],
       "error: experiments.evaluate changes evaluation settings only"),
      ("train", [f"--config={config_file}", f"--workdir={new}", "--config.train.weight_decay=-1",
                 "--verbose"], "Traceback"),
  ]
  results = forked_commands.run([(module, args) for module, args, _ in cases])
  for result, (module, args, expected) in zip(results, cases):
    errors = result.stderr
    assert result.returncode == 1, (module, args, errors[-2000:])
    if "--verbose" in args:
      assert expected in errors and "must be >= 0" in errors
      continue
    assert "Traceback" not in errors, errors[-2000:]
    (line,) = [line for line in errors.splitlines() if line.startswith("error:")]
    assert line.startswith(expected), (line, expected)
  assert not os.path.exists(new)


def test_a_needle_run_gets_a_row_per_depth_and_one_pooling_them(tmp_path):
  config = tiny_config.get_config()
  config.data.update(dict(name="passkey", needle_value_digits=2, num_train_examples=64,
                          num_eval_examples=4))
  config.train.seq_len = 128
  config.eval.update(dict(lengths=(128,), depths=(0.0, 1.0), bootstrap_samples=50,
                          num_tokens=base.get_config().eval.num_tokens))  # corpora only
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  rows = extrapolation.evaluate_run(config, workdir, progress=lambda line: None)
  assert [row.get("depth") for row in rows] == [0.0, 1.0, None]
  assert all(row["depths"] == [0.0, 1.0] for row in rows)
  assert [row["sequences"] for row in rows] == [4, 4, 8]
  assert extrapolation.evaluate_run(config, workdir, progress=lambda line: None) == []
  config.eval.depths = (0.5,)  # other depths: new rows, the earlier ones kept
  assert [row.get("depth") for row in extrapolation.evaluate_run(
      config, workdir, progress=lambda line: None)] == [0.5, None]
  assert len(eval_results.read(workdir)) == 5
  written = report.write(workdir)
  assert {"needle_heatmap.png", "lost_in_the_middle.png"} <= set(written.files)
  summary = open(os.path.join(workdir, "summary.md")).read()
  assert "## exact_match by needle depth" in summary and "| 0 | 0.5 | 1 |" in summary
