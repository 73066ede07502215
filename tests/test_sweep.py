"""The sweep runner: expansion and naming, skipping, failure isolation, resume, results files."""

import csv
import functools
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

from research.model import attention
from research.model import flops
from research import data
from research.evaluation import results as eval_results
from research.results import report
from research.results import sweep
from research.runs import provenance
from tests import tiny_sweep
from tests.conftest import xla_flags

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


def test_seeds_run_every_variant_once_per_seed_and_keep_seed_zero_names():
  sweep_ = [{"model.attention": "mha", "train.seed": 0, "model.position": "rope"},
            {"model.attention": "mha", "train.seed": 1, "model.position": "rope"},  # same variant
            {"model.attention": "linear", "model.position": "none"}]
  assert sweep.with_seeds(sweep_, None) is sweep_
  names = [sweep.run_name(o) for o in sweep.with_seeds(sweep_, 2)]
  assert names == ["attention=mha,seed=0,position=rope", "attention=linear,position=none,seed=0",
                   "attention=mha,seed=1,position=rope", "attention=linear,position=none,seed=1"]
  assert {sweep.variant_name(n) for n in names} == {"attention=mha,position=rope",
                                                    "attention=linear,position=none"}
  assert sweep.variant_name("seed=2") == "base"
  with pytest.raises(ValueError, match="--seeds=0: give the number of seeds, >= 1"):
    sweep.with_seeds(sweep_, 0)
  with pytest.raises(ValueError, match="start from other members' runs.*attention=gqa"):
    sweep.with_seeds([{"model.attention": "gqa", "train.init_from": "attention=mha"}], 3)


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
  assert states[0]["commit"] == provenance.commit()  # the code that trained it
  assert states[0]["hardware"] == provenance.hardware()  # and the machine
  assert "NonFiniteLossError" in states[2]["error"]
  summary = open(os.path.join(workdir, "summary.md")).read()
  assert "| attention=linear,position=alibi | skipped | attention 'linear' does not support" in summary
  assert "| attention=gqa,position=rope,learning_rate=1e+30 | failed | NonFiniteLossError" in summary


def test_results_csv_is_tidy_with_swept_fields(finished_sweep):
  workdir, _ = finished_sweep
  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  required = {"run", "attention", "position", "seed", "train_length", "eval_length", "eval_mode",
              "loss", "perplexity", "model.attention", "model.position", "sequences",
              *report.CI_COLUMNS}
  assert required <= set(rows[0]) and "depth" not in rows[0]
  for row in rows:
    for metric in report.INTERVAL_METRICS:
      low, high = float(row[f"{metric}_ci_low"]), float(row[f"{metric}_ci_high"])
      assert low <= float(row[metric]) <= high
    for end in ("", "_ci_low", "_ci_high"):  # a byte-level corpus: bits per byte = loss / ln 2
      assert float(row[f"bits_per_byte{end}"]) == pytest.approx(float(row[f"loss{end}"]) / math.log(2))
  assert sorted((r["eval_length"], r["eval_mode"]) for r in rows) == [
      ("32", "nonoverlapping"), ("32", "sliding"), ("64", "nonoverlapping"), ("64", "sliding")]
  for name in ("extrapolation.png", "loss_by_position.png", "summary.md"):
    assert os.path.getsize(os.path.join(workdir, name)) > 0


def test_rerun_does_only_what_is_not_done(finished_sweep):
  workdir, members = finished_sweep
  metrics = os.path.join(sweep.run_dir(workdir, members[0]), "metrics.jsonl")
  before = open(metrics).read()
  status = os.path.join(sweep.run_dir(workdir, members[0]), "status.json")
  saved = open(status).read()
  with open(status, "w") as f:  # as if trained elsewhere: a rerun keeps that commit and machine
    json.dump({"state": "done", "commit": "0123abc", "hardware": "another CPU"}, f)
  messages = []
  for member in members:
    if sweep.status(workdir, member.name)["state"] != "failed":
      sweep.run_member(workdir, member, progress=messages.append)
  assert open(metrics).read() == before
  assert any("done already" in m for m in messages)
  assert sweep.status(workdir, members[0].name)["commit"] == "0123abc"
  assert sweep.status(workdir, members[0].name)["hardware"] == "another CPU"
  with open(status, "w") as f:  # as the fixture left it, for the other tests
    f.write(saved)


def test_a_different_config_in_the_same_workdir_is_refused(finished_sweep):
  workdir, members = finished_sweep
  config = tiny_sweep.get_config()
  config.model.d_model = 64
  config.train.num_steps = 5
  with pytest.raises(ValueError, match="holds a sweep of a different config .model.d_model: 32 -> "
                                       "64; train.num_steps: 4 -> 5"):
    sweep.check_sweep_workdir(workdir, config, members)


def test_a_sweep_may_gain_members_but_not_lose_them(finished_sweep):
  """A variant registered since the sweep ran joins it in the same workdir; a member gone is
  refused (its finished run would be left out of the results unseen)."""
  workdir, members = finished_sweep
  config = tiny_sweep.get_config()
  with pytest.raises(ValueError, match=re.escape(f"(members removed: {members[-1].name})")):
    sweep.check_sweep_workdir(workdir, config, members[:-1])
  record = os.path.join(workdir, "sweep.json")
  saved = open(record).read()
  gained = members + [sweep.Member(len(members), "attention=new", {}, config)]
  sweep.check_sweep_workdir(workdir, config, gained)
  assert json.loads(open(record).read())["members"][-1] == "attention=new"
  with open(record, "w") as f:  # as the fixture left it, for the other tests
    f.write(saved)


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
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=xla_flags(8))
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


NOT_EXPERIMENTS = ("base.py", "sweeps.py", "__init__.py", "model_125m.py",  # configs/ without
                   "finetune.py")  # a sweep
EXPERIMENTS = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "configs"))
                     if name.endswith(".py") and name not in NOT_EXPERIMENTS)


@functools.lru_cache(maxsize=None)  # the protocol tests below read the sweeps validated here
def _expand(name, preset):
  module = sweep.load_module(os.path.join(ROOT, "configs", f"{name}.py"))
  return tuple(sweep.expand(module.get_sweep(preset), module.get_config(preset), num_devices=1))


@pytest.mark.parametrize("name,preset", [(n, p) for n in EXPERIMENTS for p in ("quick", "full")])
def test_experiment_configs_expand_into_valid_sweeps(name, preset):
  """Every shipped sweep validates before any work: names, fields, compatible pairs."""
  members = _expand(name, preset)
  assert len({m.name for m in members}) == len(members) > 1
  assert sum(not m.skip_reason for m in members) >= len(members) // 2


@pytest.mark.parametrize("preset", ["quick", "full"])
def test_mqar_sweeps_every_mixer_at_several_lengths_and_pair_counts(preset):
  """full: every registered mixer; quick: mha stands for mqa and gqa (registered as its head-count
  variants), so that each new mixer adds only its own 4 runs to the CPU preset."""
  members = [m.config for m in _expand("mqar", preset)]
  swept = {c.model.attention for c in members}
  assert swept == (set(attention.REGISTRY) - {"mqa", "gqa"} if preset == "quick"
                   else set(attention.REGISTRY))
  for mixer in swept:
    mine = [c for c in members if c.model.attention == mixer]
    assert len({c.train.seq_len for c in mine}) >= 2
    assert len({c.data.num_kv_pairs for c in mine}) >= 2
    assert len({c.model.d_model for c in mine}) >= 2


@pytest.mark.parametrize("preset", ["quick", "full"])
def test_algorithmic_preset_follows_the_protocol(preset):
  configs = [m.config for m in _expand("algorithmic", preset)]
  for config in configs:
    assert (config.data.train_min_length, config.data.train_max_length) == (1, 40)
  if preset == "full":
    assert {c.data.name for c in configs} == set(data.algorithmic.SUITE)
    assert {c.train.seed for c in configs} == {0, 1, 2}
    sizes = {data.tasks.TASKS[c.data.name].size_for_length(max(c.eval.lengths)) for c in configs}
    assert sizes == {500}


def _fake_evaluations(config, member_index):
  """eval.json rows as research.evaluation.extrapolation writes them, with made-up metrics (the
  validation split's rows without a split, as rows written before splits were recorded)."""
  rows = []
  depths = data.eval_depths(config)
  for split, length in itertools.product(config.eval.splits, config.eval.lengths):
    for depth in depths + ((None,) if depths != (None,) else ()):
      at = 0.5 if depth is None else depth
      settings = {"step": config.train.num_steps, "eval_length": length,
                  "eval_mode": "nonoverlapping", "rope_scaling": "none", "num_tokens": 0,
                  "sliding_stride": 0, "bootstrap_samples": 10, "bootstrap_seed": 0}
      if depths != (None,):
        settings["depths"] = list(depths)
      if depth is not None:
        settings["depth"] = depth
      if split != "validation":
        settings["split"] = split
      value = (0.9 - 0.1 * member_index - 0.3 * at * length / max(config.eval.lengths)
               - 0.05 * (split == "test"))
      metrics = {"loss": 1 - value, "perplexity": 3 - value, "accuracy": value,
                 "exact_match": value, "tokens": 80, "sequences": 16,
                 "state_bytes": 64 * length * (member_index + 1),
                 "loss_by_position": [0.5] * length}
      for name in report.INTERVAL_METRICS:
        metrics[f"{name}_ci_low"] = metrics[name] - 0.05
        metrics[f"{name}_ci_high"] = metrics[name] + 0.05
      rows.append({**settings, **metrics})
  return rows


@pytest.mark.parametrize("name,figures", [
    ("long_context", ("needle_heatmap.png", "lost_in_the_middle.png", "tasks.png",
                      "accuracy_vs_state.png")),
    ("mqar", ("width.png", "accuracy_vs_state.png", "width.md")),
    ("algorithmic", ("tasks.png", "accuracy_vs_state.png")),
    ("mad", ("tasks.png", "mad.md", "mad_state.png"))])
def test_figures_and_summary_from_results_files(name, figures, tmp_path):
  module = sweep.load_module(os.path.join(ROOT, "configs", f"{name}.py"))
  members = _expand(name, "quick")
  workdir = str(tmp_path)
  sweep.check_sweep_workdir(workdir, module.get_config("quick"), members)
  for index, member in enumerate(members):
    directory = sweep.run_dir(workdir, member)
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
      f.write(member.config.to_json())
    eval_results.append(directory, _fake_evaluations(member.config, index % 3))
    with open(os.path.join(directory, "status.json"), "w") as f:
      json.dump({"state": "done"}, f)
  written = report.write(workdir)
  assert written.missing == []
  assert set(written.files) == {"results.csv", "summary.md", "extrapolation.png",
                                "loss_by_position.png", *figures}
  for file_name in written.files:
    assert os.path.getsize(os.path.join(workdir, file_name)) > 0, file_name
  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  summary = open(os.path.join(workdir, "summary.md")).read()
  if name == "long_context":
    depths = {row["depth"] for row in rows}
    assert depths == {"", *map(str, members[0].config.eval.depths)}
    assert "## exact_match by needle depth" in summary
    # passkey with MHA and RoPE is member 0: 0.9 - 0.3 * depth * length / 1024
    assert ("| passkey / rope | 512 | 0.900 [0.850, 0.950] | 0.863 [0.812, 0.913] | "
            "0.825 [0.775, 0.875] |") in summary
  else:
    assert "depth" not in open(os.path.join(workdir, "results.csv")).readline()
  assert "[" in summary.split("## nonoverlapping")[1]  # intervals in the main table
  if name == "mqar":  # each member trains at its own length (64 or 128): no single one
    assert "Trained at lengths 64, 128, each line at the one its label names." in summary
    assert "Trained at length 64." not in summary
  if name == "mad":  # both splits in results.csv; the summary shows validation, mad.md both
    assert {row["split"] for row in rows} == {"validation", "test"}
    mad = open(os.path.join(workdir, "mad.md")).read()
    test_table = mad.split("## test-selected")[1].split("## validation-selected")[0]
    # member 0 (mha, the first task): 0.9 - 0.3 / 2 on validation, 0.05 less on test; the
    # members' validation values are 0.75, 0.65, 0.55 and their test values 0.70, 0.60, 0.50
    assert "| mha / rope | 0.700 [0.650, 0.750] |" in test_table
    main_table = summary.split("## nonoverlapping")[1]
    assert "| 0.750 [" in main_table and not any(f"| {v} [" in main_table
                                                 for v in ("0.700", "0.600", "0.500"))


def test_lm_extrapolation_baselines_get_readable_distinct_labels(tmp_path):
  """The sliding-window and packed-document rows are labelled by what they change; settings at
  their off value (window 0, sinks 0, packing concat) are left out."""
  members = _expand("lm_extrapolation", "quick")
  assert len(members) == 10 and not any(m.skip_reason for m in members)
  sweep.check_sweep_workdir(str(tmp_path), sweep.load_module(os.path.join(
      ROOT, "configs", "lm_extrapolation.py")).get_config("quick"), members)
  for index, member in enumerate(members):
    directory = sweep.run_dir(str(tmp_path), member)
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
      f.write(member.config.to_json())
    eval_results.append(directory, _fake_evaluations(member.config, index))
  rows, missing = report.collect(str(tmp_path))
  assert missing == []
  labels = {report.variant_label(row, report.swept_keys(rows)) for row in rows}
  assert labels == {"mha / none", "mha / sinusoidal", "mha / rope", "mha / alibi",
                    "linear / rope", "mamba / none", "mha / rope / window=128",
                    "mha / rope / window=128 / sinks=4", "mha / alibi / documents",
                    "mha / rope / documents"}



def _never_measured():
  raise AssertionError("the peak was measured where it should not be")


def test_members_run_at_once_share_an_accelerators_memory():
  peak = flops.PEAK_ENV
  assert sweep.members_environment({"A": "1"}, 1, _never_measured) == {"A": "1"}
  assert sweep.members_environment({peak: "2.0"}, 2, _never_measured) == {
      peak: "2.0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}
  for chosen in ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".2"},
                 {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}):
    assert sweep.members_environment({peak: "2.0", **chosen}, 4, _never_measured) == {
        peak: "2.0", **chosen}


def test_members_run_at_once_report_mfu_against_the_peak_measured_before_them(monkeypatch):
  """members_environment (which experiments.run --parallel=N calls with its environment from
  before its own settings) measures the peak once and passes it to the members, whose
  total_peak_flops reads it: measured by each while the others run, it would be a share of the
  machine's, and their MFU inflated. A peak the user set is passed on as it is."""
  measured = []
  env = sweep.members_environment({}, 2, lambda: measured.append(1) or 1.5e11)
  assert measured == [1] and env[flops.PEAK_ENV] == "150000000000.0"
  monkeypatch.setenv(flops.PEAK_ENV, env[flops.PEAK_ENV])
  assert flops.total_peak_flops.__wrapped__() == 1.5e11
  assert sweep.members_environment({flops.PEAK_ENV: "3e9"}, 2, _never_measured)[
      flops.PEAK_ENV] == "3e9"


def test_members_run_at_once_start_after_the_run_they_start_from():
  """--parallel: a member with train.init_from=<another member> waits until that one has ended
  (configs/gqa_uptraining.py's converted runs start from its MHA run)."""
  def member(name, init_from=""):
    return types.SimpleNamespace(name=name, config=types.SimpleNamespace(
        train=types.SimpleNamespace(init_from=init_from)))

  mha, scratch = member("mha"), member("gqa")
  converted, uptrained = member("gqa_converted", "mha"), member("gqa_uptrained", "mha")
  queue = [mha, converted, uptrained, scratch]
  assert sweep.ready_to_start(queue, [], 2) == [mha, scratch]
  assert sweep.ready_to_start([converted, uptrained], [mha], 2) == []
  assert sweep.ready_to_start([converted, uptrained], [scratch], 2) == [converted]
  assert sweep.ready_to_start([converted, uptrained], [], 2) == [converted, uptrained]
  a, b = member("a", "b"), member("b", "a")  # a cycle: one at a time, in order
  assert sweep.ready_to_start([a, b], [], 2) == [a]
