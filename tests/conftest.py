"""Test set-up: 8 fake CPU devices (before JAX initialises its backend), one temporary directory
for the session, removed at its end, and shared helpers."""

import gzip
import os
import random
import shutil
import subprocess
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Everything temporary of the session lives in one directory, removed when the session ends:
# pytest's tmp_path, the prepared data (shared with the subprocesses tests start) and the scratch
# directories TFDS makes for datasets it has not prepared (through TMPDIR in subprocesses too).
if "RESEARCH_TESTS_TMP" not in os.environ:  # once, though pytest and `tests.conftest` import us
  os.environ["RESEARCH_TESTS_TMP"] = tempfile.mkdtemp(prefix="research_tests_")
SESSION_TMP = os.environ["RESEARCH_TESTS_TMP"]
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMP
os.environ.setdefault("RESEARCH_DATA_DIR", os.path.join(SESSION_TMP, "research_data"))

# Tests run tiny shapes: compile time dominates, so skip most XLA optimisation passes. Set through
# the environment, so that the training, sweep and generation commands the tests start as
# subprocesses compile the same way (a third faster each).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# XLA:CPU's fusion emitters (its default code generator for fusions) take about three times as
# long to compile a test's program as the elemental emitter they replace, and splitting the
# code generation across threads costs another ~10% with both cores busy; what the programs
# compute is the same, and the tests compare it with references in fp32.
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false "
                      "--xla_cpu_parallel_codegen_split_count=1")
if FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
# One persistent compilation cache for the session and the processes its tests start: the
# training, sweep, CLI and multi-process tests compile the same tiny programs in many processes.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(SESSION_TMP, "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from configs import base  # noqa: E402


def tiny_model_config(**overrides):
  """A model small enough to compile in about a second, with several blocks and chunks: every
  registered variant's own `test_settings` (research.variants.test_settings).

  A dict value updates that variant's settings: tiny_model_config(rope=dict(scaling="yarn")).
  """
  from research import variants  # noqa: PLC0415 (imported after the JAX set-up above)
  config = base.get_config().model
  config.update(dict(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_ratio=2,
                     vocab_size=61))
  settings = variants.test_settings()
  for key, values in list(settings.items()) + list(overrides.items()):
    if isinstance(values, dict):
      config[key].update(values)
    else:
      config[key] = values
  return config


def xla_flags(num_devices):
  """XLA_FLAGS for a command a test starts with `num_devices` CPU devices."""
  return f"{FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count={num_devices}"


def can_mount_in_a_namespace():
  """Whether `unshare -rm` gives this process a mount namespace of its own (for tmpfs tests)."""
  return bool(shutil.which("unshare")) and subprocess.run(
      ["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.fixture
def model_config():
  return tiny_model_config()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
  """(config, workdir) of a tiny run trained to its end (tests/tiny_config.py: 8 steps,
  checkpoints 4 and 8) on a text_dir corpus of one gzip file. Tests that change the workdir work
  on a copy (shutil.copytree)."""
  from research.training import loop as train  # noqa: PLC0415 (imported after the JAX set-up above)
  from tests import tiny_config  # noqa: PLC0415

  root = tmp_path_factory.mktemp("trained_run")
  rng = random.Random(0)
  words = "the of attention position rotary linear state length token bytes window".split()
  with gzip.open(root / "corpus.txt.gz", "wt") as f:
    f.write(" ".join(rng.choice(words) for _ in range(10_000)))
  config = tiny_config.get_config()
  config.data.update(dict(name="text_dir", corpus_path=str(root / "corpus.txt.gz")))
  train.train_and_evaluate(config, str(root / "run"))
  return config, str(root / "run")


# CI (.ci/run) sets this: there every test must run, so a skipped test fails the session, named
# (a check that CI skips checks nothing). A plain `make test` may skip the few tests that need an
# optional install or user namespaces, saying which.
FORBID_SKIPS = os.environ.get("RESEARCH_TESTS_FORBID_SKIPS") == "1"
_SKIPPED = []


def _record_skip(report):
  if FORBID_SKIPS and report.skipped and not hasattr(report, "wasxfail"):  # an xfail is not one
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
    _SKIPPED.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):  # under pytest-xdist, the controller sees every report
  _record_skip(report)


def pytest_collectreport(report):  # a module skipped as a whole (importorskip at its top)
  _record_skip(report)


def pytest_terminal_summary(terminalreporter):
  if _SKIPPED:
    terminalreporter.write_line(f"RESEARCH_TESTS_FORBID_SKIPS=1: {len(_SKIPPED)} tests skipped, "
                                "which fails the session:", red=True)
    for line in _SKIPPED:
      terminalreporter.write_line(f"  {line}")


def pytest_sessionfinish(session, exitstatus):
  if _SKIPPED and exitstatus == 0:
    session.exitstatus = 1
  # pytest-xdist workers share the directory their controller made: the controller removes it.
  if "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


# The longest files first (seconds on 2 busy cores, 2026-12-03): pytest-xdist's loadfile
# scheduling hands out whole files in collection order, so a long file collected last ran alone at
# the end while the other worker idled.
LONGEST_FILES = ("test_conformance.py",  # ~265 s
                 "test_train.py", "test_bench.py",  # ~130-150 s each
                 "test_kernels.py", "test_sweep.py", "test_pretrained.py",  # ~75-95 s each
                 "test_lost_process.py", "test_workflow.py", "test_streaming_sinks.py",  # ~50 s
                 "test_preemption.py", "test_tracking.py")  # ~30-40 s


def _variant(item):
  """The conformance suite's variant of a test (its parameters), "" for any other test: the
  tests of one variant run one after the other, so that the suite keeps one variant's compiled
  programs alive at a time (tests/test_conformance.py)."""
  if item.path.name != "test_conformance.py" or not hasattr(item, "callspec"):
    return ""
  return item.callspec.id if "window" in item.callspec.params else ""


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  # Stable: otherwise in the files' own order.
  items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), _variant(item)))
