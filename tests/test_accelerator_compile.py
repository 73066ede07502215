"""Ahead-of-time compilation for an accelerator on this CPU host (research.training.aot,
tpu_slices, gpu_targets, experiments/compile.py; libtpu from requirements-tpu.txt, which .ci/run
installs): the tiny model's training, evaluation and decode steps compile for v5e-4 on a (data 2,
tensor 2) mesh with the Splash kernel in the training step, the memory analysis is the
compiler's, and the command's bad inputs are one line each. GPU targets need JAX's CUDA plugin
(requirements-gpu.txt, gigabytes: not in CI); their names are checked here, their compilation in
docs/accelerators.md."""

import os

import jax
import pytest

from research.model import sharding
from research.model.attention import core
from research.training import aot
from research.training import gpu_targets
from research.training import loop
from research.training import tpu_slices
from tests import forked_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")


@pytest.mark.parametrize("name,topology,chips", [
    ("v5e-8", "v5e:2x4", 8), ("v5litepod-8", "v5e:2x4", 8), ("v6e-8", "v6e:2x4", 8),
    ("v5e-256", "v5e:16x16", 256), ("v5e-1", "v5e:1x1", 1), ("v4-8", "v4:2x2x1", 4),
    ("v5p-8", "v5p:2x2x1", 4), ("v4-32", "v4:2x2x4", 16), ("v5p-128", "v5p:4x4x4", 64)])
def test_slice_names_as_cloud_tpu_writes_them(name, topology, chips):
  assert tpu_slices.parse(name) == tpu_slices.Slice(name, topology, chips)


@pytest.mark.parametrize("name", ["v5e-6", "v4-4", "v7-8", "tpu"])
def test_an_unknown_slice_names_the_valid_ones(name):
  with pytest.raises(ValueError, match=r"unknown TPU slice .*valid: v4-N and v5p-N"):
    tpu_slices.parse(name)


@pytest.mark.parametrize("name,hosts,per_host", [("h100-1", 1, 1), ("h100-8", 1, 8),
                                                 ("h200-16", 2, 8), ("h100-64", 8, 8)])
def test_gpu_target_names(name, hosts, per_host):
  target = gpu_targets.parse(name)
  assert (target.hosts, target.devices_per_host) == (hosts, per_host)
  assert f"device_memory_size: {gpu_targets.hbm_bytes(target)}" in gpu_targets.target_config(
      target.gpu)


@pytest.mark.parametrize("name", ["h100-3", "h100-12", "a100-8"])
def test_an_unknown_gpu_target_names_the_valid_ones(name):
  with pytest.raises(ValueError, match=r"unknown GPU target .*valid: h100-N or h200-N"):
    gpu_targets.parse(name)


def _tiny_config(**model):
  from tests import tiny_config  # noqa: PLC0415
  config = tiny_config.get_config()
  config.model.update(dict(num_heads=4, d_model=64, compute_dtype="bfloat16", **model))
  config.mesh.shape = (2, 1, 2)
  return config


def test_the_tiny_step_compiles_for_a_v5e_slice_with_splash_attention():
  pytest.importorskip("libtpu", reason="requirements-tpu.txt (.ci/run installs it)")
  devices = tpu_slices.devices(tpu_slices.parse("v5e-4"))
  assert len(devices) == 4 and devices[0].device_kind == "TPU v5 lite"
  assert tpu_slices.hbm_bytes(devices[0]) == 16 * 2**30
  config = _tiny_config(attention="gqa", num_kv_heads=2)
  mesh = sharding.make_mesh((2, 1, 2), devices)
  # The suite's float32 matmul passes (tests/conftest.py) are not for bfloat16 Splash blocks.
  with jax.set_mesh(mesh), core.compiling_for("tpu"), jax.default_matmul_precision("default"):
    step_fn = loop.make_train_step(config, mesh)
    lowered = step_fn.train.lower(sharding.sharded_abstract(step_fn.abstract_state, mesh),
                                  loop.abstract_batch(config, step_fn.batch_sharding))
  assert "tpu_custom_call" in lowered.as_text()  # `auto` took the Splash kernel (Mosaic)
  with jax.default_matmul_precision("default"):
    steps = aot.compile_steps(config, mesh)
  assert [step.name for step in steps] == ["train", "eval", "decode"]
  for step in steps:
    row = aot.summary(step, tpu_slices.hbm_bytes(devices[0]))
    assert 0 < step.peak_bytes < 2**30 and row["fits"] and row["verdict"] == "fits", row
  train = steps[0]
  # The donated state is aliased to the new one; XLA's FLOPs are of the same order as the
  # model's count (the Splash custom call's own are not in XLA's cost analysis).
  assert train.alias_bytes > 0 and 0.3 < train.xla_flops / train.model_flops < 3


def test_the_command_compiles_and_ends_with_the_verdict_and_refuses_bad_input_in_one_line(
    tmp_path):
  pytest.importorskip("libtpu", reason="requirements-tpu.txt (.ci/run installs it)")
  table = tmp_path / "mixers.md"
  table.write_text("Made by `an earlier command`.\n\n| mixer | position | parameters | remat | "
                   "arguments GiB | temporaries GiB | peak GiB of 16 | verdict | XLA / model "
                   "FLOPs | compile s |\n|---|---|---|---|---|---|---|---|---|---|\n"
                   "| mha | rope | an old row |\n| linear | rope | a stale row |\n")
  every = [f"--config={TINY}", "--topology=v5e-4", "--every_mixer", f"--markdown={table}"]
  good, unknown, indivisible, bad_step, one_mixer, bad_mixer = forked_commands.run([
      ("compile", [f"--config={TINY}", "--topology=v5e-4", "--steps=train"]),
      ("compile", [f"--config={TINY}", "--topology=v5e-3"]),
      ("compile", [f"--config={TINY}", "--topology=v5e-8", "--config.mesh.shape=(3,1,-1)"]),
      ("compile", [f"--config={TINY}", "--topology=v5e-4", "--steps=train,backward"]),
      ("compile", every + ["--mixers=linear"]),
      ("compile", every + ["--mixers=linear,nosuch"])])
  assert good.returncode == 0, good.stderr[-2000:]
  lines = good.stdout.strip().splitlines()
  assert lines[0].startswith("v5e-4 (v5e:2x2): 4 x TPU v5 lite, 16 GiB HBM each; mesh")
  assert lines[1].startswith("train") and "peak" in lines[1] and lines[-1] == "fits", lines
  for result, phrase in ((unknown, "unknown TPU slice 'v5e-3'; valid:"),
                         (indivisible, "mesh.shape=(3, 1, -1): 8 devices cannot be split"),
                         (bad_step, "--steps has backward; valid: train, eval, decode"),
                         (bad_mixer, "--mixers has nosuch; valid: mha, ")):
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().startswith("error: ") and phrase in result.stderr, result.stderr
  # --mixers: the named mixer's row replaced (compiled), the others' kept, both commands named.
  assert one_mixer.returncode == 0, one_mixer.stderr[-2000:]
  lines = table.read_text().splitlines()
  assert lines[0] == "Made by `an earlier command`."
  assert lines[1].startswith("Rows of linear made by `python -m experiments.compile ")
  rows = [line for line in lines if line.startswith("| ") and not line.startswith("| mixer")]
  assert rows[0] == "| mha | rope | an old row |" and len(rows) == 2
  assert rows[1].startswith("| linear | rope | ") and "| fits |" in rows[1], rows
