"""Config fields by dotted name: which ones change training, how a saved config compares with a
new one, and the closest field to a misspelt name.

A workdir's identity is the set of fields that change training. Not part of it:
  - evaluation settings: eval.*, and the context extension of the rotary schemes
    (model.rope.scaling, its scaling_factor and original_length; the same in model.xpos and
    model.prope), which research.evaluation.extrapolation sets per evaluation length;
  - how the run is carried out: logging, validation and checkpoint cadence, the trackers, the
    mesh, the processes, where prepared data lives, and the softmax backend
    (model.attention_backend: every backend computes the same attention, so a run trained with
    xla may resume with auto, or move to cudnn on a GPU).
A field that a saved config predates counts as unchanged while it has its default
(research/defaults.py): the default reproduces what the code did before the field existed. A field
that the run does not read (research.runs.unread: a sweep's shared setting such as
model.learned.max_length in an ALiBi member saved before that rule) does not count either, and a
saved config is read without such settings. Where a new field's default changes what the code
computes, the migration of its schema version says what its absence meant
(research/runs/migrations.py, `Migration.predated`: model.softmax.sink_positions is "original"
for a run with sinks): a saved config without the field loads with that value, and counts as
unchanged while it has it.
"""

import difflib
import json
import os
from typing import Mapping

import ml_collections

from research import defaults
from research.data import tokenizer
from research.model import positions
from research.defaults import flatten  # noqa: F401 (config_fields.flatten, as before)
from research.runs import migrations
from research.runs import unread

ROTARY_SCALING_FIELDS = tuple(
    f"model.{positions.REGISTRY.settings_key(name)}.{field}"
    for name in positions.REGISTRY if positions.rotary(name)
    for field in ("scaling", "scaling_factor", "original_length"))
EVALUATION_FIELDS = ("eval",) + ROTARY_SCALING_FIELDS
EXECUTION_FIELDS = ("train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
                    "train.keep_checkpoints_at",
                    "train.eval_every", "train.eval_batches", "train.trackers", "mesh",
                    "distributed", "data.dir", "model.attention_backend", "model.moe.dispatch",
                    "model.remat")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
  return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def is_evaluation_field(name: str) -> bool:
  return _within(name, EVALUATION_FIELDS)


def changes_training(name: str) -> bool:
  return not _within(name, EVALUATION_FIELDS + EXECUTION_FIELDS)


def training_differences(saved: Mapping, current: ml_collections.ConfigDict,
                         source: str = "the saved config") -> list[str]:
  """'field: saved -> current' for every field that changes training and differs between a saved
  config (the nested dict of a config.json, read from `source`) and `current`; empty if they
  train the same run."""
  not_read = unread.not_read(current)
  saved = migrations.migrate(flatten(saved), source)
  current, default = flatten(current), flatten(defaults.get_config())
  differences = []
  for name in sorted(saved.keys() | current.keys()):
    if not changes_training(name) or _within(name, tuple(not_read)):
      continue
    if name not in saved:
      if current[name] != default.get(name):
        differences.append(f"{name}: absent (the run predates it; its default is "
                           f"{default.get(name)!r}) -> {current[name]!r}")
    elif name not in current:
      differences.append(f"{name}: {saved[name]!r} -> absent (this code has no such field)")
    elif saved[name] != current[name]:
      differences.append(f"{name}: {saved[name]!r} -> {current[name]!r}")
  return differences


def load_saved(run_dir: str) -> ml_collections.ConfigDict:
  """The config of the run in `run_dir`: its config.json over the current defaults, with a
  data.tokenizer inside the run (stored relative to it) as a path from here, so that a copied or
  moved run reads its own (research.data.tokenizer.from_run)."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{run_dir} holds no run (no config.json); give a directory that "
                            "experiments.train or experiments.run wrote")
  with open(path) as f:
    try:
      saved = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON ({e}); restore it from a copy, or train the run "
                       "again in a new --workdir") from e
  config = merge_saved(saved, path)
  config.data.tokenizer = tokenizer.from_run(config.data.tokenizer, run_dir)
  return config


def as_saved(config: ml_collections.ConfigDict, run_dir: str) -> ml_collections.ConfigDict:
  """`config` as `run_dir`'s config.json keeps it: data.tokenizer relative to the run where the
  run holds it, else absolute (research.data.tokenizer.for_run), so that the run reads the same
  tokenizer from any directory, and a copied run its own."""
  saved = config.copy_and_resolve_references()
  saved.data.tokenizer = tokenizer.for_run(config.data.tokenizer, run_dir)
  return saved


def saved_as_stored_now(saved: dict, run_dir: str) -> dict:
  """A config.json's dict with its data.tokenizer in as_saved's form (a run saved before as_saved
  kept a relative path as the command line gave it, from the current directory)."""
  name = saved.get("data", {}).get("tokenizer")
  if name is not None:
    saved["data"]["tokenizer"] = tokenizer.for_run(tokenizer.from_run(name, run_dir), run_dir)
  return saved


def merge_saved(saved: Mapping, source: str) -> ml_collections.ConfigDict:
  """A saved config (nested dict, read from `source`) over the current defaults, so fields that
  it predates take their defaults (see training_differences), without the settings its run did
  not read; one of an older schema version is migrated first (research/runs/migrations.py)."""
  saved = migrations.migrate(flatten(saved), source)
  config = defaults.get_config()
  unknown = sorted(saved.keys() - flatten(config).keys())
  if unknown:
    raise ValueError(f"{source} has fields this code does not know ({', '.join(unknown)}); use "
                     "the code that wrote it, or, where the field was renamed or moved, say so "
                     "in research/runs/migrations.py")
  for name, value in saved.items():
    *sections, field = name.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[field] = tuple(value) if isinstance(node[field], tuple) else value
  return unread.reset(config, unread.unread_settings(config))


def closest_field(name: str, config: ml_collections.ConfigDict) -> str | None:
  """`name` if `config` has that field, else the field that replaced it (a migration's), else
  the most similar field name, or None."""
  names = list(flatten(config))
  if name in names:
    return name
  replacement, _ = migrations.replacements().get(name, (None, None))
  if replacement in names:
    return replacement
  matches = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
  return matches[0] if matches else None
