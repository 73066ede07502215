"""Compile a config's training, evaluation and decode steps for a TPU slice or NVIDIA GPUs, on
this CPU host, and say whether each fits the devices' memory: before a pod is paid for.

  python -m experiments.compile --config=configs/model_125m.py:mfu --topology=v5e-8 \
      [--config.train.batch_size=64 --config.model.attention=mamba2 ...] [--steps=train]
  python -m experiments.compile --config=configs/model_125m.py:mfu --topology=h100-8
  python -m experiments.compile --config=configs/model_125m.py:mfu --topology=v5e-8 \
      --config.train.batch_size=64 --every_mixer --markdown=docs/accelerators/mixers_125m.md \
      [--mixers=kda,mamba3]

A TPU slice needs libtpu (.venv/bin/pip install -r requirements-tpu.txt), GPUs JAX's CUDA plugin
and cuDNN (requirements-gpu.txt); neither needs the device: libtpu and the plugin describe it and
compile for it. The training step is the one experiments.train runs
(research.training.loop.make_train_step), on the config's mesh (mesh.shape, -1 filling the
devices); the evaluation step at the longest eval length with eval.batch_size rows; one decode
step against a cache of that length. Per step: per-device argument, output and temporary bytes,
the peak against the device's HBM with a verdict, XLA's FLOPs beside the model's (TPU only: the
GPU compiler gives none), and the compile time; the last line is the verdict of all of them.
--every_mixer compiles the training step of every registered mixer (model.attention; with the
config's position scheme, or "none" where the mixer takes no rotary scheme), and where one does
not fit, again with model.remat=dots_no_batch, then full; the table goes to --markdown. With
--mixers only those are compiled, and their rows replace theirs in an existing --markdown (a
variant just added gets its row without recompiling the others).
TPU slices: v4-N and v5p-N count TensorCores, v5e-N and v6e-N chips
(research/training/tpu_slices.py); GPUs: research/training/gpu_targets.py.
"""

import os

# A CPU host compiles for the devices: JAX itself runs on the CPU (and libtpu stays quiet).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import cli  # noqa: E402
from research.model import attention  # noqa: E402
from research.model.attention import core  # noqa: E402
from research.model import sharding  # noqa: E402
from research.model import transformer  # noqa: E402
from research.runs import unread  # noqa: E402
from research.training import aot  # noqa: E402
from research.training import checks  # noqa: E402
from research.training import gpu_targets  # noqa: E402
from research.training import tpu_slices  # noqa: E402

_CONFIG = cli.config_flag(config_flags.DEFINE_config_file, None,
                          "Experiment config file[:preset].", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "A TPU slice as Cloud TPU names it (v5e-8, "
                                "v6e-8, v4-8, v5p-8, v5e-256, ...) or NVIDIA GPUs (h100-8, "
                                "h200-16: hosts of 8).")
_STEPS = flags.DEFINE_list("steps", ["train", "eval", "decode"], "Which steps to compile.")
_EVERY_MIXER = flags.DEFINE_bool("every_mixer", False, "Compile the training step of every "
                                 "registered mixer (model.attention) and write --markdown.")
_MARKDOWN = flags.DEFINE_string("markdown", None, "With --every_mixer: the table's file.")
_MIXERS = flags.DEFINE_list("mixers", None, "With --every_mixer: only these mixers; their rows "
                            "replace theirs in an existing --markdown, the others' stay.")
_JSON = flags.DEFINE_string("json", None, "Also write every step's numbers, one JSON per line.")
flags.mark_flags_as_required(["config", "topology"])

STEPS = ("train", "eval", "decode")
# --every_mixer: the model.remat policies tried, in turn, for a mixer whose training step does not
# fit at the config's own: the matrix products kept, then only each block's input.
REMAT_FALLBACKS = ("dots_no_batch", "full")


def _size(gib: float) -> str:
  return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def _flops(row) -> str:
  model = "" if row["model_tflops"] is None else f"model {row['model_tflops']:.3g} TFLOP"
  if not row["xla_tflops"]:  # the GPU compiler's cost analysis gives none
    return model or "no FLOP count"
  ratio = (f" ({row['xla_tflops'] / row['model_tflops']:.2f}x the model's "
           f"{row['model_tflops']:.3g})" if row["model_tflops"] else "")
  return f"XLA {row['xla_tflops']:.3g} TFLOP{ratio}"


def _line(row) -> str:
  return (f"{row['step']:<7}{row['shapes']:<34}per device: arguments {_size(row['argument_gib'])}, "
          f"outputs {_size(row['output_gib'])} (aliased {_size(row['alias_gib'])}), temporaries "
          f"{_size(row['temp_gib'])}; peak {_size(row['peak_gib'])} of {row['hbm_gib']:.0f} GiB: "
          f"{row['verdict']}; {_flops(row)}; compiled in {row['compile_seconds']:.0f} s")


def _verdict(rows) -> str:
  failing = [row for row in rows if not row["fits"]]
  if not failing:
    return "fits"
  worst = max(failing, key=lambda row: row["peak_gib"])
  return (f"does not fit (needs {worst['peak_gib']:.1f} GiB of {worst['hbm_gib']:.0f}: "
          f"{', '.join(row['step'] for row in failing)})")


def _config(base_config, overrides):
  return unread.for_run_of_experiment(base_config, overrides, log=lambda line: None)


def _mixer_config(base_config, overrides, name):
  """`base_config` with model.attention=`name`, and the base's position scheme where the mixer
  honours it, else "none" (recurrent mixers take no rotary scheme): (config, position)."""
  config = base_config.copy_and_resolve_references()
  config.model.attention = name
  mixer = attention.REGISTRY.lookup(name)
  if config.model.position not in transformer.compatible_positions(mixer):
    config.model.position = "none"
  changed = {"model.attention": name, "model.position": config.model.position}
  return _config(config, dict(overrides, **changed)), config.model.position


def _mixer_table(base_config, overrides, devices, hbm, log, names) -> list[str]:
  """One row per mixer of `names`: the training step's memory at the config's model.remat, and
  where that does not fit, the first of REMAT_FALLBACKS that does; or why it was not compiled."""
  lines = [f"| mixer | position | parameters | remat | arguments GiB | temporaries GiB | peak GiB "
           f"of {hbm / 2**30:.0f} | verdict | XLA / model FLOPs | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for name in names:
    try:
      config, position = _mixer_config(base_config, overrides, name)
      mesh = sharding.make_mesh(checks.validate_config(config, len(devices)), devices)
      policies = [config.model.remat] + [p for p in REMAT_FALLBACKS if p != config.model.remat]
      for policy in policies:
        config.model.remat = policy
        step, = aot.compile_steps(config, mesh, steps=("train",))
        row = aot.summary(step, hbm)
        log(f"{name} ({position}, remat {policy}): {_line(row)}")
        refused = step.out_of_memory is not None  # the compiler gave the temporaries alone
        ratio = (f"{row['xla_tflops'] / row['model_tflops']:.2f}"
                 if row["model_tflops"] and not refused else "")
        arguments, peak = ("", "") if refused else (f"{row['argument_gib']:.2f}",
                                                    f"{row['peak_gib']:.2f}")
        lines.append(f"| {name} | {position} | {config_params(config) / 1e6:.1f}M | {policy} | "
                     f"{arguments} | {row['temp_gib']:.2f} | {peak} | {row['verdict']} | "
                     f"{ratio} | {row['compile_seconds']:.0f} |")
        if row["fits"]:
          break
    except Exception as e:  # noqa: BLE001 (a mixer that cannot run this preset: its reason)
      reason = " ".join(str(e).split())[:160]
      lines.append(f"| {name} | | | | | | | not compiled: {reason} | | |")
      log(f"{name}: not compiled: {reason}")
  return lines


def _read_table(path):
  """The lines of a --markdown file of --every_mixer (a ValueError if it holds no such table)."""
  with open(path) as f:
    old = f.read().splitlines()
  if not any(line.startswith("| mixer |") for line in old):
    raise ValueError(f"--markdown={path} holds no table of --every_mixer to update; give a new "
                     "file or one it wrote")
  return old


def _merged_table(path, lines, names, made):
  """The table of `path` with the rows of `names` replaced by those of `lines` (new rows last),
  and `made` added to its first lines; `lines` as they are if there is no such file."""
  if not os.path.exists(path):
    return [made, ""] + lines
  old = _read_table(path)
  table = next(i for i, line in enumerate(old) if line.startswith("| mixer |"))
  notes = [line for line in old[:table] if line]
  kept = [line for line in old[table + 2:] if line.split("|")[1].strip() not in names]
  return notes + [made, ""] + lines[:2] + kept + lines[2:]


def config_params(config) -> int:
  model = nnx.eval_shape(lambda: transformer.build_model(config.model, rngs=nnx.Rngs(0)))
  return transformer.count_params(model)


def _target(topology):
  """(description, devices, HBM bytes per device, platform) of a TPU slice or GPU target."""
  if re.match(r"h\d00-", topology):
    target = gpu_targets.parse(topology)
    devices = gpu_targets.devices(target)
    return (f"{target.name} ({target.hosts} host(s) of {target.devices_per_host})", devices,
            gpu_targets.hbm_bytes(target), "gpu")
  try:
    tpu_slice = tpu_slices.parse(topology)
  except ValueError as e:
    raise ValueError(f"{e}; or GPUs: h100-N, h200-N (N = 1, 2, 4, 8, 16, ...)") from None
  devices = tpu_slices.devices(tpu_slice)
  return (f"{tpu_slice.name} ({tpu_slice.topology})", devices, tpu_slices.hbm_bytes(devices[0]),
          "tpu")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  unknown = [step for step in _STEPS.value if step not in STEPS]
  if unknown:
    raise ValueError(f"--steps has {', '.join(unknown)}; valid: {', '.join(STEPS)}")
  if _EVERY_MIXER.value and not _MARKDOWN.value:
    raise ValueError("--every_mixer writes its table to --markdown=FILE; give one")
  unknown = [name for name in _MIXERS.value or () if name not in attention.REGISTRY]
  if unknown:
    raise ValueError(f"--mixers has {', '.join(unknown)}; valid: {', '.join(attention.REGISTRY)}")
  if _MIXERS.value and _MARKDOWN.value and os.path.exists(_MARKDOWN.value):
    _read_table(_MARKDOWN.value)  # before anything compiles
  description, devices, hbm, platform = _target(_TOPOLOGY.value)
  # The config's backends are chosen and checked for the target, not for this host.
  with core.compiling_for(platform):
    _compile(description, devices, hbm)


def _compile(description, devices, hbm):
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  config = _config(_CONFIG.value, overrides)
  shape = checks.validate_config(config, len(devices))  # before anything compiles
  print(f"{description}: {len(devices)} x {devices[0].device_kind}, "
        f"{hbm / 2**30:.0f} GiB HBM each; mesh (data, fsdp, tensor) = {shape}; "
        f"{config_params(config) / 1e6:.1f}M parameters, {config.model.compute_dtype}", flush=True)
  if _EVERY_MIXER.value:
    names = _MIXERS.value or list(attention.REGISTRY)
    lines = _mixer_table(config, overrides, devices, hbm, lambda line: print(line, flush=True),
                         names)
    command = "python -m experiments.compile " + " ".join(sys.argv[1:])
    if _MIXERS.value:
      lines = _merged_table(_MARKDOWN.value, lines, names,
                            f"Rows of {', '.join(names)} made by `{command}`.")
    else:
      lines = [f"Made by `{command}`.", ""] + lines
    with open(_MARKDOWN.value, "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"table in {_MARKDOWN.value}")
    return
  mesh = sharding.make_mesh(shape, devices)
  rows = []
  for step in aot.compile_steps(config, mesh, steps=tuple(_STEPS.value)):
    rows.append(aot.summary(step, hbm))
    print(_line(rows[-1]), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      f.writelines(json.dumps(dict(row, topology=_TOPOLOGY.value)) + "\n" for row in rows)
  print(_verdict(rows))


if __name__ == "__main__":
  cli.run(main)
