"""Checks that run before any work: a bad config or workdir fails here and writes nothing."""

import importlib.util
import json
import os

from research import data
from research import model as model_lib
from research import positions
from research import sharding

# Fields that may change when a run is resumed (they do not change what is being trained;
# train.num_steps does, through the length of the learning-rate schedule).
RESUMABLE_FIELDS = ("train.log_every", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.eval_every", "train.eval_batches",
                    "train.tensorboard", "eval", "distributed", "mesh", "data.dir")


def validate_config(config, num_devices, process_count=1):
  """Raise ValueError naming what is wrong and what would be valid. Returns the mesh shape."""
  model_lib.validate(config.model)
  model_lib.validate_lengths(config.model, config.train.seq_len, config.eval.lengths)
  unknown = [s for s in config.eval.rope_scalings if s not in positions.SCALINGS]
  if unknown:
    raise ValueError(f"unknown eval.rope_scalings {unknown}; valid: {', '.join(positions.SCALINGS)}")
  data.validate(config)
  needed = data.vocab_size(config)
  if config.model.vocab_size < needed:
    raise ValueError(f"model.vocab_size={config.model.vocab_size} is smaller than the "
                     f"{needed} tokens of data.name={config.data.name!r}; use >= {needed}")
  t = config.train
  for field in ("num_steps", "batch_size", "seq_len", "grad_accum_steps", "log_every",
                "checkpoint_every", "keep_checkpoints"):
    if t[field] < 1:
      raise ValueError(f"train.{field} must be >= 1, got {t[field]}")
  if not 0 <= t.warmup_steps < t.num_steps:
    raise ValueError(f"train.warmup_steps={t.warmup_steps} must be in [0, num_steps="
                     f"{t.num_steps}); the cosine decay needs at least one step after warmup")
  if t.learning_rate <= 0:
    raise ValueError(f"train.learning_rate must be > 0, got {t.learning_rate}")
  shape = sharding.mesh_shape(config.mesh.shape, num_devices)
  batch_parallel = shape[0] * shape[1]
  micro_batch, remainder = divmod(t.batch_size, t.grad_accum_steps)
  if remainder or micro_batch % batch_parallel:
    raise ValueError(
        f"train.batch_size={t.batch_size} / grad_accum_steps={t.grad_accum_steps} must be a "
        f"whole multiple of the data-parallel size data*fsdp={batch_parallel} (mesh {shape}); "
        f"valid batch sizes are multiples of {batch_parallel * t.grad_accum_steps}")
  if t.batch_size % process_count:
    raise ValueError(f"train.batch_size={t.batch_size} must be divisible by the number of "
                     f"processes ({process_count})")
  if t.eval_every and t.eval_every % t.log_every:
    raise ValueError(f"train.eval_every={t.eval_every} must be a multiple of train.log_every="
                     f"{t.log_every} (validation is reported with the logged step), or 0")
  # Validation at the training length runs at the end of training: make sure it can.
  if data.is_language_modeling(config) and config.eval.num_tokens < t.seq_len:
    raise ValueError(f"eval.num_tokens={config.eval.num_tokens} must be >= train.seq_len="
                     f"{t.seq_len} for the validation loss at the training length")
  if not data.is_language_modeling(config) and t.seq_len not in config.eval.lengths:
    raise ValueError(f"for tasks, eval.lengths={tuple(config.eval.lengths)} must include "
                     f"train.seq_len={t.seq_len} (the validation split at the training length)")
  if t.tensorboard and importlib.util.find_spec("tensorboardX") is None:
    raise ValueError("train.tensorboard=True needs the tensorboardX package (in requirements.txt; "
                     "no TensorFlow needed); install it or set train.tensorboard=False")
  if config.eval.batch_size % batch_parallel:
    raise ValueError(f"eval.batch_size={config.eval.batch_size} must be a multiple of the "
                     f"data-parallel size data*fsdp={batch_parallel}")
  return shape


def _flat(config_dict, prefix=""):
  out = {}
  for key, value in config_dict.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      out.update(_flat(value, name + "."))
    else:
      out[name] = value
  return out


def check_workdir(workdir, config_json):
  """The workdir must be writable and, if it holds a run, hold this config (up to
  RESUMABLE_FIELDS). Creates nothing."""
  check_writable(workdir)
  saved_path = os.path.join(workdir, "config.json")
  if not os.path.exists(saved_path):
    return
  with open(saved_path) as f:
    saved, current = _flat(json.load(f)), _flat(json.loads(config_json))
  keep = lambda name: not any(name == f or name.startswith(f + ".") for f in RESUMABLE_FIELDS)
  changed = sorted(n for n in set(saved) | set(current)
                   if keep(n) and saved.get(n) != current.get(n))
  if changed:
    details = ", ".join(f"{n}: {saved.get(n)!r} -> {current.get(n)!r}" for n in changed[:5])
    raise ValueError(f"workdir {workdir!r} holds a run of a different config ({details}); "
                     f"use a new workdir, or the same config to resume")


def check_writable(workdir):
  """The workdir, or its nearest existing ancestor, must be a writable directory."""
  existing = workdir
  while not os.path.exists(existing):
    existing = os.path.dirname(existing) or "."
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"workdir {workdir!r} is not writable ({existing!r} is not a writable "
                     f"directory); choose a directory you can write to")
