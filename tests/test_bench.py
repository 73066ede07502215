"""The benchmark suites' code paths on tiny lengths: outputs written with the expected rows.

No timing is asserted (benchmarks measure, tests check); only that every point was measured or skipped
with a reason, and that the JSON, markdown and PNG files hold what the reports need.
"""

import json
import sys
import threading
import time

import jax
import numpy as np
import pytest
from absl import app
from flax import nnx

from experiments import bench
from research.model import transformer as model_lib
from research.bench import decode
from research.bench import document_decode
from research.bench import mixers
from research.bench import peers
from research.bench import recurrent
from research.bench import report
from research.bench import state
from research.bench import timing

LENGTHS = (16, 32)


def _run(suite, tmp_path, *extra):
  argv = [f"--suite={suite}", f"--out={tmp_path}", "--lengths=32,16", "--quick", *extra]
  paths = bench.main(argv)
  with open(paths["json"]) as f:
    written = json.load(f)
  with open(paths["md"]) as f:
    markdown = f.read()
  with open(paths["png"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert written["metadata"]["command"] == "python -m experiments.bench " + " ".join(argv)
  assert {"date", "hardware", "jax_version"} <= set(written["metadata"])
  return written["rows"], markdown


def _table_rows(markdown, title):
  """The body lines of the markdown table under `## title`, as lists of cells."""
  section = markdown.split(f"## {title}\n\n", 1)[1].split("\n\n", 1)[0]
  lines = section.strip().splitlines()
  assert lines[0].split("|")[2:-1] == [f" {n} " for n in LENGTHS], lines[0]
  return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]


def test_mixers_suite_writes_rows_tables_and_targets(tmp_path):
  """The suite's code paths on one kernel of each family and one score bias (each kernel is
  checked against its naive reference by test_kernels.py)."""
  every = [kernel.name for kernel in mixers.kernels()]
  names = ["xla", "blockwise", "blockwise_alibi", "linear", "mamba"]
  assert set(names) <= set(every)
  rows, markdown = _run("mixers", tmp_path, "--only=" + ",".join(names))
  assert [(row["kernel"], row["length"]) for row in rows] == [
      (name, length) for name in names for length in LENGTHS]
  for row in rows:
    assert row["temp_bytes"] > 0, row
    assert (row["time_ms"] is not None) != bool(row["skipped"]), row
  assert ("cudnn" in every) == (jax.default_backend() == "gpu")  # cudnn is listed on GPUs only
  time_table = _table_rows(markdown, "fwd+bwd time, ms (median)")
  assert [line[0] for line in time_table] == names
  memory_table = _table_rows(markdown, "compiled temp memory, MiB (fwd+bwd)")
  assert [line[0] for line in memory_table] == names
  assert "blockwise temp memory 8192/1024" in markdown  # lengths this run lacks:
  assert "not measured in this run" in markdown


def test_decode_suite_writes_rows_tables_and_targets(tmp_path):
  """The suite's code paths on the variants its targets name (each mixer's decode is checked
  against its forward by the conformance suite)."""
  only = ["mha", "gqa_kv2", "linear", "mamba"]
  assert set(only) <= set(decode.variants())
  rows, markdown = _run("decode", tmp_path, "--only=" + ",".join(only))
  assert [(row["variant"], row["context"]) for row in rows] == [
      (name, length) for name in only for length in LENGTHS]
  for row in rows:
    assert row["latency_ms"] > 0 and row["cache_bytes"] > 0, row
  latency_table = _table_rows(markdown, "per-token decode latency, ms (median)")
  assert [line[0] for line in latency_table] == only
  line = next(l for l in markdown.splitlines() if "constant-state mixers' latency 32/16" in l)
  assert "of 2 (" in line and "linear" in line and "mamba" in line, line
  assert "gqa_kv2 / mha cache bytes = 0.2500, 0.2500 at every context" in markdown
  assert ("growing caches' cache_bytes = the analytic bytes (layers x cache bytes per token x "
          "context) + a part of fixed size: yes") in markdown
  recurrent = [row["cache_bytes"] for row in rows if row["attention"] in ("linear", "mamba")]
  assert recurrent[0::2] == recurrent[1::2]  # a fixed-size state, whatever the context


def test_analytic_kv_bytes_formula():
  config = decode.model_config("gqa_kv2", "bfloat16")
  head_dim = decode.D_MODEL // decode.HEADS
  assert decode.analytic_kv_bytes(config, 100) == 2 * decode.LAYERS * 2 * head_dim * 2 * 100
  assert decode.analytic_kv_bytes(decode.model_config("mamba", "float32"), 100) is None


@pytest.mark.parametrize("history,length,want", [
    ([], 4096, 0.0),
    ([(1024, 1.0)], 2048, 4.0),  # one point: quadratic
    ([(1024, 1.0), (2048, 8.0)], 4096, 64.0),  # measured exponent 3
    ([(1024, 2.0), (2048, 1.0)], 4096, 2.0),  # never below linear growth
])
def test_forecast_seconds(history, length, want):
  assert timing.forecast_seconds(history, length) == pytest.approx(want)


def test_verdicts_and_pivot():
  assert report.verdict(8.0, 10) == "met"
  assert report.verdict(20.0, 10) == "MISSED by 2.00x"
  assert report.verdict(5.0, 10, at_most=False) == "MISSED by 2.00x"
  assert report.verdict(None, 10) == "not measured in this run"
  rows = [{"k": "a", "n": 1, "v": 1.0}, {"k": "a", "n": 2, "v": None}, {"k": "b", "n": 2, "v": 3.0}]
  assert report.pivot(rows, "k", "n", "v", str).splitlines()[2:] == ["| a | 1.0 | — |",
                                                                     "| b | — | 3.0 |"]


def test_train_suite_compares_the_loop_with_a_minimal_step(tmp_path):
  argv = ["--suite=train", f"--out={tmp_path}", "--lengths=16", "--quick", "--only=mha/rope"]
  paths = bench.main(argv)
  with open(paths["json"]) as f:
    rows = json.load(f)["rows"]
  variants = {row["variant"] for row in rows}
  assert variants == {"mha/rope"}
  assert {(row["variant"], row["implementation"]) for row in rows} == {
      (v, impl) for v in variants for impl in ("loop", "minimal")} | {
      ("mha/rope", f"loop, packing={p}") for p in ("concat", "documents")}
  for row in rows:
    assert row["tokens_per_second"] > 0 and 0 < row["mfu"] < 1, row
    assert len(row.get("runs", [0])) == 1  # --quick: one run of each packing
  with open(paths["md"]) as f:
    markdown = f.read()
  assert markdown.count("loop / minimal NNX step tokens/s") == 1
  assert "| mha/rope | " in markdown and "| loop / minimal |" in markdown
  assert "packed-document training loop: documents / concat tokens/s" in markdown


def test_state_suite_measures_window_cache_and_prefill(tmp_path):
  argv = ["--suite=state", f"--out={tmp_path}", "--quick", "--only=mha/rope,mamba/none"]
  paths = bench.main(argv)
  with open(paths["json"]) as f:
    rows = json.load(f)["rows"]
  with open(paths["md"]) as f:
    markdown = f.read()
  assert not [row for row in rows if row.get("skipped")], markdown
  window = [row for row in rows if row["part"] == "window"]
  assert [row["window"] for row in window] == [0, state.QUICK.window]
  assert all(row["time_ms"] > 0 and row["temp_bytes"] > 0 for row in window)
  assert f"blockwise window={state.QUICK.window} / full causal blockwise fwd+bwd time" in markdown
  cache = {(row["variant"], row["cache"], row["context"]): row["cache_bytes"]
           for row in rows if row["part"] == "cache"}
  rolling = f"window={state.QUICK.cache_window}+sinks={state.QUICK.cache_sinks}"
  short, long = state.QUICK.contexts
  assert cache["mha", rolling, short] == cache["mha", rolling, long] < cache["mha", "full", long]
  variants = {variant for variant, _, _ in cache}
  assert "sigmoid" in variants  # a mixer with settings of its own gets the window there
  for variant in variants:
    assert (cache[variant, rolling, short] == cache[variant, rolling, long]
            < cache[variant, "full", long]), variant
  assert cache["mha", "full", long] == decode.analytic_kv_bytes(
      decode.model_config("mha", "float32"), long)
  assert "mha window + sinks cache bytes at contexts 1024, 16384" in markdown
  assert "(target identical): met" in markdown
  prefill = [(row["variant"], row["mode"]) for row in rows if row["part"] == "prefill"]
  assert prefill == [(v, m) for v in ("mha/rope", "mamba/none")
                     for m in ("prefill", "token_by_token")]
  length = state.QUICK.prefill_length
  assert (f"one prefill of {length} tokens >= 10x faster than {length} one-token decode steps: "
          "met by ") in markdown
  assert "| mha/rope |" in markdown and "| mamba/none |" in markdown and "| speed-up |" in markdown


def test_state_suite_refuses_lengths():
  with pytest.raises(app.UsageError, match="--lengths applies to"):
    bench.parse_args(["--suite=state", "--out=x", "--lengths=16"])


def test_recurrent_suite_times_chunked_against_the_recurrence(tmp_path):
  """Every constant-state mixer is found in the registry; for one, both forms are timed and the
  chunked form's memory is read at two lengths, and the targets are computed from them."""
  found = recurrent.constant_state_mixers("float32")
  assert {"linear", "retention", "mamba"} <= set(found) and not {"mha", "gqa"} & set(found)
  paths = bench.main(["--suite=recurrent", f"--out={tmp_path}", "--quick", "--only=linear"])
  with open(paths["json"]) as f:
    rows = json.load(f)["rows"]
  with open(paths["md"]) as f:
    markdown = f.read()
  assert not [row for row in rows if row.get("skipped")], markdown
  assert {(r["part"], r["form"], r["length"]) for r in rows} == {
      ("time", "chunked", recurrent.QUICK.time_length),
      ("time", "recurrence", recurrent.QUICK.time_length),
      *(("memory", "chunked", length) for length in recurrent.QUICK.memory_lengths)}
  assert all(r["time_ms"] > 0 for r in rows if r["part"] == "time")
  assert all(r["temp_bytes"] > 0 for r in rows if r["part"] == "memory")
  assert ("chunked fwd+bwd at 256 >= 5x faster than its token-by-token recurrence: met by 1 of 1 "
          "(linear" in markdown or "missed by linear" in markdown), markdown
  assert "| linear |" in markdown and "temp MiB 1024 | growth |" in markdown


def test_recurrent_forms_compute_the_same_gradients():
  """The token-by-token recurrence the suite times is the same function as the chunked form."""
  grads, params = recurrent.forms("linear", "float32")
  x, cotangent = (0.1 * a for a in recurrent._inputs(24, "float32"))  # pylint: disable=protected-access
  chunked, stepwise = (jax.tree.leaves(grads[form](params, x, cotangent))
                       for form in ("chunked", "recurrence"))
  for a, b in zip(chunked, stepwise):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)


def test_interleaved_seconds_takes_turns_after_one_warm_up_each():
  order = []
  times = timing.interleaved_seconds({"a": lambda: order.append("a"),
                                      "b": lambda: order.append("b")}, 3)
  assert order == ["a", "b"] * 4
  assert {name: len(seconds) for name, seconds in times.items()} == {"a": 3, "b": 3}


def test_turns_wait_an_idle_gap_before_each_sample_and_measure_its_cpu_load():
  """Each timed sample follows a gap of idle_seconds, whose last part's CPU load is recorded:
  near 0 for a parked process, near 1 core while a thread of it spins."""
  starts = []
  times, loads = timing.turns_seconds({"a": lambda: starts.append(time.perf_counter()),
                                       "b": lambda: starts.append(time.perf_counter())},
                                      2, idle_seconds=0.05, probe_seconds=0.02)
  assert len(loads) == 4 and all(len(t) == 2 for t in times.values())
  assert min(b - a for a, b in zip(starts[1:], starts[2:])) >= 0.05  # a gap before each sample
  assert timing.idle_load(0.05) < 0.1
  stop = threading.Event()

  def spin():
    while not stop.is_set():
      pass

  spinner = threading.Thread(target=spin)
  spinner.start()
  try:
    assert timing.idle_load(0.2) > 0.2  # a thread of this process spins through the gap
  finally:
    stop.set()
    spinner.join()


def test_accelerator_check_fits_its_budget_and_its_model_is_125m():
  """The prepared GPU check: its bench command lines parse, its step limits sum to under 10
  minutes, and configs/model_125m.py:mfu builds a model of about 125M parameters (abstractly)."""
  from configs import model_125m  # noqa: PLC0415
  from experiments import accelerator_check  # noqa: PLC0415
  commands = accelerator_check.steps("/tmp/out", dry_run=False)
  assert sum(limit for _, _, limit, _ in commands) < 600
  for _, command, _, _ in commands:
    if "experiments.bench" in command:
      bench.parse_args(command[command.index("experiments.bench") + 1:])
  config = model_125m.get_config("mfu")
  # `auto`: cuDNN's fused attention on a GPU, Splash on a TPU, at the preset's length and dtype.
  assert config.model.attention_backend == "auto"
  from research.model.attention import core  # noqa: PLC0415
  with jax.default_matmul_precision("default"):  # not the suite's float32 passes (conftest)
    for platform, backend in (("gpu", "cudnn"), ("tpu", "splash")):
      assert core.auto_backend(config.train.seq_len, compute_dtype=jax.numpy.bfloat16,
                               platform=platform) == backend
  model = nnx.eval_shape(lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))
  assert 120e6 < model_lib.count_params(model) < 130e6
  assert config.train.seq_len == 2048 and config.model.compute_dtype == "bfloat16"


def test_peers_suite_without_pytorch_says_how_to_install_it(tmp_path, monkeypatch):
  """One line, no traceback, nothing written, whether or not torch is installed here."""
  monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
  with pytest.raises(SystemExit) as exited:
    bench.main(["--suite=peers", f"--out={tmp_path}"])
  message = exited.value.code
  assert isinstance(message, str) and "\n" not in message, message
  assert "pip install -r requirements-peers.txt" in message
  assert not list(tmp_path.iterdir())
  with pytest.raises(app.UsageError, match="--threads applies to --suite=peers"):
    bench.parse_args(["--suite=mixers", "--out=x", "--threads=2"])


def _peer_rows():
  def timed(side, implementation, times_ms):
    return {"part": "time", "case": "train", "title": "training step", "side": side,
            "implementation": implementation, "time_ms": float(np.median(times_ms)),
            "min_ms": min(times_ms), "max_ms": max(times_ms), "times_ms": times_ms,
            "repeats": len(times_ms), "idle_seconds": 0.3,
            "idle_load_max": 0.002 if side == "project" else 0.004}

  return [{"part": "settings", "threads": 2, "torch_version": "2.x", "torch_num_threads": 2,
           "pjrt_nproc": "2", "xla_pool_pinned": True, "xla_flags": ""},
          {"part": "agreement", "case": "train", "size": "batch 2 x 16", "tensors": 3,
           "max_abs_error": 2e-6, "max_relative_error": 1e-6, "worst": "logits"},
          timed("project", "jit", [100.0, 110.0, 90.0]),
          timed("pytorch", "eager", [50.0, 66.0, 45.0]),
          {"part": "time", "case": "train", "title": "training step", "side": "pytorch",
           "implementation": "compile", "skipped": "no C++ compiler"}]


def test_peers_tables_ratios_and_figure_from_rows(tmp_path):
  """Ratio = PyTorch / project of the medians, of the minima and of each round; the targets, the
  idle gaps' CPU load, the agreement and the skipped implementations are reported; the figure is
  drawn from rows alone."""
  rows = _peer_rows()
  [(ours, theirs)] = peers.pairs(rows)
  assert (ours["implementation"], theirs["implementation"]) == ("jit", "eager")
  assert peers.round_ratios(ours, theirs) == pytest.approx([0.5, 0.6, 0.5])
  lines = peers.summary(rows)
  assert lines[0].startswith("threads: 2 each; PyTorch 2.x torch.set_num_threads(2)")
  assert "PJRT_NPROC=2 (XLA's CPU client pool, set before the backend started)" in lines[0]
  assert ("train: PyTorch eager / project jit time = 0.50x (target >= 0.8x): MISSED by 1.60x"
          in lines)
  assert not any(line.startswith("decode:") for line in lines)  # no rows, no target line
  assert ("turns: one sample of each implementation in turn, each after an idle gap of 0.3 s; "
          "the process's largest CPU load over a gap's last 0.1 s: 0.004 cores (0: both "
          "runtimes' threads parked)") in lines
  (title, table), (_, agreement), (_, skipped) = peers.tables(rows)
  assert title.startswith("PyTorch time / project time")
  assert table.splitlines()[2] == ("| training step | jit | eager | 100.00 [90.00–110.00] | "
                                   "50.00 [45.00–66.00] | 0.50x | 0.50x | 0.50–0.60 | 2.0e-06 |")
  assert "| train |  | batch 2 x 16 | 3 | 2.00e-06 | 1.00e-06 | logits |" in agreement
  assert "| train | pytorch | compile | no C++ compiler |" in skipped
  meta = {"date": "d", "hardware": "cpu", "backend": "cpu", "jax_version": "0", "command": "c"}
  paths = report.write_all(tmp_path, peers.SUITE, rows, meta)
  with open(paths["png"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_peers_agreement_stops_on_a_difference():
  row = peers.compare("case", "tiny", [("x", np.ones(3), np.ones(3) + 1e-7)])
  assert row["max_abs_error"] == pytest.approx(1e-7) and row["worst"] == "x"
  with pytest.raises(peers.AgreementError, match="disagree on y"):
    peers.compare("case", "tiny", [("x", np.ones(3), np.ones(3)), ("y", np.ones(3), np.full(3, 1.01))])


def test_peers_weight_names_cover_every_parameter_once():
  """The PyTorch model's names hold exactly the project's parameters, in PyTorch's layouts."""
  config = peers.train_config(peers.REFERENCE, 2, 16)
  model = model_lib.build_model(config.model, rngs=nnx.Rngs(0))
  named = peers.torch_weights(model)
  assert sum(a.size for a in named.values()) == model_lib.count_params(model)
  d = config.model.d_model
  assert named["h.0.attn.c_attn.weight"].shape == (3 * d, d)  # Linear: [out, in]
  key = np.asarray(model.blocks[1].mixer.key.kernel[...]).reshape(d, d).T
  np.testing.assert_array_equal(named["h.1.attn.c_attn.weight"][d:2 * d], key)
  np.testing.assert_array_equal(named["lm_head.weight"], np.asarray(model.head.kernel[...]).T)


def test_peers_suite_agrees_with_pytorch_and_times_each_case(tmp_path, monkeypatch):
  """Only where PyTorch is installed (an optional extra; CI installs it): each case's agreement
  check at its small size, then one quick round of its timing. All but train_large, the train
  case's code at 4 layers of width 512 (20 s of the test; the benchmark itself checks it)."""
  pytest.importorskip("torch")
  monkeypatch.setenv("PJRT_NPROC", "")  # restored afterwards; the suite sets it
  cases = [case for case in peers.CASES if case != "train_large"]
  paths = bench.main(["--suite=peers", f"--out={tmp_path}", "--quick", "--threads=2",
                      f"--only={','.join(cases)}"])
  with open(paths["json"]) as f:
    rows = json.load(f)["rows"]
  checked = {row["case"] for row in rows if row["part"] == "agreement"}
  assert checked == set(cases)
  timed = {(row["case"], row["side"]) for row in rows if row.get("time_ms")}
  assert timed == {(case, side) for case in cases for side in ("project", "pytorch")}
  assert [row["implementation"] for row in rows if row.get("skipped")] == ["compile"]
  # The 8 test devices give the rows split over 2 host devices (--threads=2), checked too.
  split = {(row["case"], row["implementation"]) for row in rows
           if row["part"] == "agreement" and "over 2 devices" in row.get("implementation", "")}
  assert split == {("train", "jit over 2 devices"), ("attention", "blockwise over 2 devices")}
  assert {("train", "jit over 2 devices"), ("attention", "blockwise over 2 devices")} <= {
      (row["case"], row["implementation"]) for row in rows if row.get("time_ms")}


def test_document_decode_bench_times_both_caches_of_each_mixer():
  rows = document_decode.main(["--context", "16", "--repeats", "1", "--only", "mha,moba"])
  assert [row["variant"] for row in rows] == ["mha", "moba"]
  for row in rows:
    assert row["plain_ms"] > 0 and row["documents_ms"] > 0
    assert row["ratio"] == row["documents_ms"] / row["plain_ms"]
  assert document_decode.table(rows).count("\n| ") == 2
  with pytest.raises(SystemExit):
    document_decode.main(["--only", "no_such_mixer"])
