"""python -m experiments.analyze on a tiny trained run writes its figures, CSVs and summaries;
an analysis a run cannot take, or a run without checkpoints, is a clear error."""

import csv
import os
import shutil
import subprocess
import sys

import pytest

from research import analysis
from research.analysis import analyze
from tests import tiny_config
from tests.conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(8))


def _rows(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def test_analyze_a_trained_run_writes_figures_csv_and_summary(trained_run, tmp_path):
  _, trained = trained_run
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  result = subprocess.run(
      [sys.executable, "-m", "experiments.analyze", f"--workdir={workdir}",
       "--analysis=attention_maps,induction,head_importance,explanation", "--num_sequences=2",
       "--num_permutations=3", "--text=the rotary"],
      env=ENV, cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-3000:]

  maps = os.path.join(workdir, "analysis", "attention_maps")
  for name in ("maps.png", "distance.png", "distance.csv", "summary.md"):
    assert os.path.getsize(os.path.join(maps, name)) > 0, name
  rows = _rows(os.path.join(maps, "distance.csv"))
  assert {r["eval_length"] for r in rows} == {"32", "256"}  # 1x and 8x train.seq_len
  for length in ("32", "256"):  # every head's buckets hold all of its attention
    masses = [float(r["value"]) for r in rows if r["eval_length"] == length
              and r["measure"] == "mass" and r["head"] == "0"]
    assert sum(masses) == pytest.approx(1.0, abs=1e-4)
  assert "arXiv:1902.10186" in open(os.path.join(maps, "summary.md")).read()

  induction = os.path.join(workdir, "analysis", "induction")
  for name in ("induction.png", "scores.csv", "summary.md"):
    assert os.path.getsize(os.path.join(induction, name)) > 0, name
  rows = _rows(os.path.join(induction, "scores.csv"))
  assert {r["step"] for r in rows} == {"4", "8"}  # every kept checkpoint
  assert {r["measure"] for r in rows} == {"induction", "previous_token", "icl_score",
                                          "early_loss", "late_loss"}
  assert len([r for r in rows if r["measure"] == "induction" and r["step"] == "8"]) == 4  # heads

  pruning = os.path.join(workdir, "analysis", "head_importance")
  for name in ("pruning.png", "pruning.csv", "importance.csv", "summary.md"):
    assert os.path.getsize(os.path.join(pruning, name)) > 0, name
  rows = _rows(os.path.join(pruning, "pruning.csv"))
  for order in ("importance", "random"):  # one head a round (10% of 4, at least one), 1 kept
    assert [r["heads_removed"] for r in rows if r["order"] == order] == ["0", "1", "2", "3"]
  importance = [float(r["importance"]) for r in _rows(os.path.join(pruning, "importance.csv"))]
  assert sum(i * i for i in importance) == pytest.approx(1.0)  # one layer, l2-normalised

  explanation = os.path.join(workdir, "analysis", "explanation")
  for name in ("explanation.png", "explanation.csv", "summary.md"):
    assert os.path.getsize(os.path.join(explanation, name)) > 0, name
  rows = _rows(os.path.join(explanation, "explanation.csv"))
  assert len(rows) == 2 * 4 * 3  # examples x heads x (tau, permutation TVD, max attention)
  for row in rows:
    value = float(row["value"])
    assert -1 <= value <= 1 if row["measure"] == "kendall_tau" else 0 <= value <= 1


def test_an_analysis_a_run_cannot_take_or_a_run_without_checkpoints_is_a_clear_error(tmp_path):
  config = tiny_config.get_config()
  config.model.update(attention="mamba", position="none")
  (tmp_path / "config.json").write_text(config.to_json())
  with pytest.raises(ValueError, match="attention_maps needs attention maps.*mha, mqa, gqa"):
    analyze.analyze(str(tmp_path), ["attention_maps"], log=lambda line: None)
  with pytest.raises(ValueError, match="explanation needs attention maps.*mha, mqa, gqa"):
    analyze.analyze(str(tmp_path), ["explanation"], log=lambda line: None)
  with pytest.raises(FileNotFoundError, match="has no checkpoint"):
    analyze.analyze(str(tmp_path), ["induction"], log=lambda line: None)
  with pytest.raises(ValueError, match="head_importance needs a mixer with heads.*linear"):
    analyze.analyze(str(tmp_path), ["head_importance"], log=lambda line: None)
  with pytest.raises(ValueError, match="unknown analysis heads; valid: attention_maps, induction"):
    analyze.analyze(str(tmp_path), ["heads"], log=lambda line: None)
  assert not os.path.exists(tmp_path / "analysis")


def test_induction_across_seeds_gives_each_variant_its_spread_and_phase_change_steps(tmp_path):
  def rows(run, scores):  # two heads per kept step: the largest is what counts
    return [{"run": run, "step": step, "layer": 0, "head": h, "measure": "induction",
             "value": value * (1 - h / 2)} for step, value in scores.items() for h in (0, 1)]
  scores = (rows("attention=mha,seed=0", {10: 0.05, 100: 0.6, 1000: 0.9})
            + rows("attention=mha,seed=1", {10: 0.05, 100: 0.2, 1000: 0.7})
            + rows("attention=mha,position=alibi,seed=0", {10: 0.05, 100: 0.1, 1000: 0.3}))
  lines = analysis.REGISTRY["induction"].compare(scores, str(tmp_path))
  table = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines
           if line.startswith("| attention")}
  assert table["attention=mha"] == ["2", "0.800 +/- 0.141 [0.700, 0.900]", "100, 1000 |"]
  assert table["attention=mha,position=alibi"] == ["1", "0.300", "not formed |"]
  assert os.path.getsize(tmp_path / "induction.png") > 0
