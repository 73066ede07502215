"""Compile a config's training, evaluation and decode steps for a TPU slice, on this CPU host,
and say whether each fits the slice's memory: before a pod is paid for.

  python -m experiments.compile --config=configs/model_125m.py:mfu --topology=v5e-8 \
      [--config.train.batch_size=64 --config.model.attention=mamba2 ...] [--steps=train]
  python -m experiments.compile --config=configs/model_125m.py:mfu --topology=v5e-8 \
      --config.train.batch_size=64 --every_mixer --markdown=docs/accelerators/memory_125m.md

Needs libtpu: .venv/bin/pip install -r requirements-tpu.txt (no TPU: libtpu describes the slice
and compiles for it). The training step is the one experiments.train runs
(research.training.loop.make_train_step), on the config's mesh (mesh.shape, -1 filling the
slice's devices); the evaluation step at the longest eval length with eval.batch_size rows; one
decode step against a cache of that length. Per step: per-device argument, output and temporary
bytes, the peak against the device's HBM with a verdict, XLA's FLOPs beside the model's, and
the compile time; the last line is the verdict of all of them. --every_mixer compiles the
training step of every registered mixer (model.attention) and writes the table to --markdown.
Slices: v4-N and v5p-N count TensorCores, v5e-N and v6e-N chips (research/training/tpu_slices.py).
"""

import os

# A CPU host compiles for the slice: JAX itself runs on the CPU (and libtpu stays quiet).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402

from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import cli  # noqa: E402
from research.model import attention  # noqa: E402
from research.model.attention import core  # noqa: E402
from research.model import sharding  # noqa: E402
from research.runs import unread  # noqa: E402
from research.training import aot  # noqa: E402
from research.training import checks  # noqa: E402
from research.training import tpu_slices  # noqa: E402

_CONFIG = cli.config_flag(config_flags.DEFINE_config_file, None,
                          "Experiment config file[:preset].", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "A TPU slice as Cloud TPU names it: v5e-8, "
                                "v6e-8, v4-8, v5p-8, v5e-256, ...")
_STEPS = flags.DEFINE_list("steps", ["train", "eval", "decode"], "Which steps to compile.")
_EVERY_MIXER = flags.DEFINE_bool("every_mixer", False, "Compile the training step of every "
                                 "registered mixer (model.attention) and write --markdown.")
_MARKDOWN = flags.DEFINE_string("markdown", None, "With --every_mixer: the table's file.")
_JSON = flags.DEFINE_string("json", None, "Also write every step's numbers, one JSON per line.")
flags.mark_flags_as_required(["config", "topology"])

STEPS = ("train", "eval", "decode")


def _line(row) -> str:
  model = (f", model {row['model_tflops']:.2f} ({row['xla_tflops'] / row['model_tflops']:.2f}x)"
           if row["model_tflops"] else "")
  return (f"{row['step']:<7}{row['shapes']:<34}per device: arguments {row['argument_gib']:.2f} "
          f"GiB, outputs {row['output_gib']:.2f} (aliased {row['alias_gib']:.2f}), temporaries "
          f"{row['temp_gib']:.2f}; peak {row['peak_gib']:.2f} GiB of {row['hbm_gib']:.0f}: "
          f"{row['verdict']}; XLA {row['xla_tflops']:.2f} TFLOP{model}; compiled in "
          f"{row['compile_seconds']:.0f} s")


def _verdict(rows) -> str:
  failing = [row for row in rows if not row["fits"]]
  if not failing:
    return "fits"
  worst = max(failing, key=lambda row: row["peak_gib"])
  return (f"does not fit (needs {worst['peak_gib']:.1f} GiB of {worst['hbm_gib']:.0f}: "
          f"{', '.join(row['step'] for row in failing)})")


def _config(base_config, overrides):
  return unread.for_run_of_experiment(base_config, overrides, log=lambda line: None)


def _check(config, num_devices):
  checks.validate_config(config, num_devices)
  return sharding.mesh_shape(config.mesh.shape, num_devices)


def _mixer_table(base_config, overrides, devices, hbm, log) -> list[str]:
  """One row per registered mixer: the training step's memory, or why it was not compiled."""
  lines = [f"| mixer | parameters | arguments GiB | temporaries GiB | peak GiB of {hbm / 2**30:.0f} "
           "| verdict | XLA / model FLOPs | compile s |", "|---|---|---|---|---|---|---|---|"]
  for name in attention.REGISTRY:
    try:
      config = _config(base_config, dict(overrides, **{"model.attention": name}))
      mesh = sharding.make_mesh(_check(config, len(devices)), devices)
      step, = aot.compile_steps(config, mesh, steps=("train",))
    except Exception as e:  # noqa: BLE001 (a mixer that cannot run this preset: its reason)
      reason = " ".join(str(e).split())[:160]
      lines.append(f"| {name} | | | | | not compiled: {reason} | | |")
      log(f"{name}: not compiled: {reason}")
      continue
    row = aot.summary(step, hbm)
    params = config_params(config)
    ratio = f"{row['xla_tflops'] / row['model_tflops']:.2f}" if row["model_tflops"] else ""
    lines.append(f"| {name} | {params / 1e6:.1f}M | {row['argument_gib']:.2f} | "
                 f"{row['temp_gib']:.2f} | {row['peak_gib']:.2f} | {row['verdict']} | {ratio} | "
                 f"{row['compile_seconds']:.0f} |")
    log(f"{name}: {_line(row)}")
  return lines


def config_params(config) -> int:
  from flax import nnx  # noqa: PLC0415
  from research.model import transformer  # noqa: PLC0415
  model = nnx.eval_shape(lambda: transformer.build_model(config.model, rngs=nnx.Rngs(0)))
  return transformer.count_params(model)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  with core.compiling_for("tpu"):  # the config's backends are checked for the slice, not here
    _compile(_TOPOLOGY.value)


def _compile(topology):
  unknown = [step for step in _STEPS.value if step not in STEPS]
  if unknown:
    raise ValueError(f"--steps has {', '.join(unknown)}; valid: {', '.join(STEPS)}")
  if _EVERY_MIXER.value and not _MARKDOWN.value:
    raise ValueError("--every_mixer writes its table to --markdown=FILE; give one")
  tpu_slice = tpu_slices.parse(topology)
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  config = _config(_CONFIG.value, overrides)
  devices = tpu_slices.devices(tpu_slice)
  hbm = tpu_slices.hbm_bytes(devices[0])
  shape = _check(config, len(devices))  # before anything compiles
  print(f"{tpu_slice.name} ({tpu_slice.topology}): {len(devices)} x {devices[0].device_kind}, "
        f"{hbm / 2**30:.0f} GiB HBM each; mesh (data, fsdp, tensor) = {shape}; "
        f"{config_params(config) / 1e6:.1f}M parameters, {config.model.compute_dtype}", flush=True)
  if _EVERY_MIXER.value:
    lines = _mixer_table(config, overrides, devices, hbm, log=lambda line: print(line, flush=True))
    command = "python -m experiments.compile " + " ".join(sys.argv[1:])
    with open(_MARKDOWN.value, "w") as f:
      f.write(f"Made by `{command}`.\n\n" + "\n".join(lines) + "\n")
    print(f"table in {_MARKDOWN.value}")
    return
  mesh = sharding.make_mesh(shape, devices)
  rows = []
  for step in aot.compile_steps(config, mesh, steps=tuple(_STEPS.value)):
    rows.append(aot.summary(step, hbm))
    print(_line(rows[-1]), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      f.writelines(json.dumps(dict(row, topology=tpu_slice.name)) + "\n" for row in rows)
  print(_verdict(rows))


if __name__ == "__main__":
  cli.run(main)
