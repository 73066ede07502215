"""Checks that run before any work: a bad config or workdir fails here and writes nothing."""

import dataclasses
import importlib.util
import json
import os
from typing import Callable, Hashable

import ml_collections

from research.runs import checkpoints
from research.runs import config_fields
from research.runs import migrations
from research.runs import unread
from research import data
from research import defaults
from research.model import transformer as model_lib
from research.model import positions
from research.model import sharding
from research.training import trackers

# Scalar fields: (field, is the value valid, what is valid).
FIELD_RULES = (
    ("version", lambda v: v == defaults.VERSION,
     f"{defaults.VERSION}, this code's config schema (set by the code: a saved run of an older "
     "one is migrated when read, research/runs/migrations.py)"),
    ("train.num_steps", lambda v: v >= 0, ">= 1 (0 only with train.init_from)"),
    ("train.batch_size", lambda v: v >= 1, ">= 1"),
    ("train.seq_len", lambda v: v >= 1, ">= 1"),
    ("train.grad_accum_steps", lambda v: v >= 1, ">= 1"),
    ("train.log_every", lambda v: v >= 1, ">= 1"),
    ("train.checkpoint_every", lambda v: v >= 1, ">= 1"),
    ("train.keep_checkpoints", lambda v: v >= 1, ">= 1"),
    ("train.eval_batches", lambda v: v >= 1, ">= 1"),
    ("train.eval_every", lambda v: v >= 0, ">= 0 (0: validation only at the end)"),
    ("train.learning_rate", lambda v: v > 0, "> 0"),
    ("train.end_learning_rate_fraction", lambda v: 0 <= v <= 1,
     "in [0, 1] (the final learning rate as a fraction of the peak)"),
    ("train.weight_decay", lambda v: v >= 0, ">= 0 (0: no weight decay)"),
    ("train.grad_clip_norm", lambda v: v > 0,
     "> 0 (gradients are clipped to this global norm; a large value clips nothing)"),
    ("eval.num_tokens", lambda v: v >= 1, ">= 1"),
    ("eval.batch_size", lambda v: v >= 1, ">= 1"),
    ("eval.sliding_stride", lambda v: v >= 0, ">= 0 (0: half of train.seq_len)"),
)


def check_fields(config: ml_collections.ConfigDict, flat=None):
  """Raise ValueError naming every field of FIELD_RULES out of its range.
  `flat`: defaults.flatten(config), where the caller has it."""
  values = config_fields.flatten(config) if flat is None else flat
  check_replaced_fields(values)
  problems = [f"{field}={values[field]!r} must be {valid}"
              for field, is_valid, valid in FIELD_RULES if not is_valid(values[field])]
  if problems:
    raise ValueError("; ".join(problems))


@dataclasses.dataclass(frozen=True)
class ModelMemo:
  """The checks that read only a config's model section (and values named with them) run once
  for all the configs validated together whose model sections are equal: a sweep validates
  thousands of members and a few hundred distinct model sections (research.results.sweep).
  `results` is shared by those configs; `model_key`, hashable, is equal only for equal model
  sections (a sweep's: the model overrides that made the section from the common base), or None
  to check afresh. A check that raises records nothing: it runs again and raises the same."""
  results: dict
  model_key: Hashable | None

  def run(self, check: Callable, *args, reads=()):
    """check(*args), or what it returned for this model section and the values `reads` (the
    config values among `args` that are not of the model section)."""
    if self.model_key is None:
      return check(*args)
    key = (check, self.model_key, tuple(map(defaults.frozen, reads)))
    if None in key[2]:  # a value that defaults.frozen does not vouch for
      return check(*args)
    if key not in self.results:
      self.results[key] = check(*args)
    return self.results[key]


_UNMEMOISED = ModelMemo({}, None)


def validate_config(config, num_devices, process_count=1, *, unread_settings=None,
                    training=True, flat=None, memo: ModelMemo | None = None):
  """Raise ValueError naming what is wrong and what would be valid. Returns the mesh shape.
  `unread_settings`: research.runs.unread.unread_settings(config), and `flat`:
  defaults.flatten(config), where the caller has them; `memo`: where configs validated together
  share model sections (ModelMemo). training=False checks a saved run's config for evaluation:
  train.num_steps may be 0 there (an imported checkpoint's run, research/pretrained), and the
  mesh need not split train.batch_size (the run may be read on other devices than it trained
  on)."""
  memo = memo or _UNMEMOISED
  problems = _Problems()
  problems.run(check_fields, config, flat)
  if problems.run(memo.run, model_lib.validate, config.model):
    problems.run(memo.run, model_lib.validate_lengths, config.model, config.train.seq_len,
                 config.eval.lengths, reads=(config.train.seq_len, config.eval.lengths))
  unknown = [s for s in config.eval.rope_scalings if s not in positions.SCALINGS]
  if unknown:
    problems.add(f"unknown eval.rope_scalings {unknown}; valid: {', '.join(positions.SCALINGS)}")
  data_valid = problems.run(data.validate, config)
  if data_valid and config.model.vocab_size < data.vocab_size(config):
    needed = data.vocab_size(config)
    problems.add(f"model.vocab_size={config.model.vocab_size} is smaller than the {needed} "
                 f"tokens of data.name={config.data.name!r}; use >= {needed}")
  t = config.train
  outside = [s for s in t.keep_checkpoints_at
             if not (isinstance(s, int) and 1 <= s <= t.num_steps)]
  if outside:
    problems.add(f"train.keep_checkpoints_at has steps {outside} outside 1..train.num_steps="
                 f"{t.num_steps}; give integer steps in that range, or () for none")
  if training and t.num_steps == 0 and not t.init_from:
    problems.add("train.num_steps=0 must be >= 1 (0 only with train.init_from: the converted "
                 "model of another run, evaluated without training); to fine-tune a run (an "
                 "imported checkpoint's too): --config=configs/finetune.py:RUN")
  if t.num_steps and not 0 <= t.warmup_steps < t.num_steps:
    problems.add(f"train.warmup_steps={t.warmup_steps} must be in [0, num_steps="
                 f"{t.num_steps}); the cosine decay needs at least one step after warmup")
  shape = problems.run(sharding.mesh_shape, config.mesh.shape, num_devices, value=True)
  if shape is not None:
    batch_parallel = shape[0] * shape[1]
    micro_batch, remainder = divmod(t.batch_size, t.grad_accum_steps)
    # Evaluation runs no training batch: a run evaluates on a mesh that may not split it.
    if training and (remainder or micro_batch % batch_parallel):
      problems.add(
          f"train.batch_size={t.batch_size} / grad_accum_steps={t.grad_accum_steps} must be a "
          f"whole multiple of the data-parallel size data*fsdp={batch_parallel} (mesh {shape}); "
          f"valid batch sizes are multiples of {batch_parallel * t.grad_accum_steps}")
    if config.eval.batch_size % batch_parallel:
      problems.add(f"eval.batch_size={config.eval.batch_size} must be a multiple of the "
                   f"data-parallel size data*fsdp={batch_parallel}")
  if training and t.batch_size % process_count:
    problems.add(f"train.batch_size={t.batch_size} must be divisible by the number of "
                 f"processes ({process_count})")
  if t.eval_every and t.eval_every % t.log_every:
    problems.add(f"train.eval_every={t.eval_every} must be a multiple of train.log_every="
                 f"{t.log_every} (validation is reported with the logged step), or 0")
  # Validation at the training length runs at the end of training: make sure it can.
  if data_valid and data.is_language_modeling(config) and config.eval.num_tokens < t.seq_len:
    problems.add(f"eval.num_tokens={config.eval.num_tokens} must be >= train.seq_len="
                 f"{t.seq_len} for the validation loss at the training length")
  if data_valid and not data.is_language_modeling(config) and (
      t.seq_len not in config.eval.lengths):
    problems.add(f"for tasks, eval.lengths={tuple(config.eval.lengths)} must include "
                 f"train.seq_len={t.seq_len} (the validation split at the training length)")
  if training:  # evaluating a run writes to no tracker
    problems.run(check_trackers, t.trackers)
  if not problems.errors:  # which settings a run reads is asked of a valid config
    unread.check(config, unread_settings if unread_settings is not None
                 else unread.unread_settings(config, flat=flat, memo=memo))
  problems.raise_if_any()
  return shape


class _Problems:
  """The ValueErrors of checks that do not depend on each other, so that one message names every
  problem of a config rather than the first (a check that needs another's result runs only when
  that one passed)."""

  def __init__(self):
    self.errors = []

  def run(self, check, *args, value=False, **kwargs):
    """check(*args, **kwargs): True when it passed (with value=True its result, None when it
    failed), its ValueError recorded otherwise."""
    try:
      result = check(*args, **kwargs)
    except ValueError as e:
      self.errors.append(e)
      return None if value else False
    return result if value else True

  def add(self, message: str):
    self.errors.append(ValueError(message))

  def raise_if_any(self):
    """The one error as it was raised (a sweep skips an IncompatibleError), or all of them in one
    message, of the first one's kind where that is an incompatible pair."""
    if len(self.errors) == 1:
      raise self.errors[0]
    if self.errors:
      first = self.errors[0]
      kind = type(first) if isinstance(first, model_lib.IncompatibleError) else ValueError
      raise kind("; ".join(str(e) for e in self.errors)) from first


def check_trackers(names):
  """train.trackers: each a registered tracker (research.training.trackers), once, with its
  package installed."""
  unknown = [n for n in names if n not in trackers.REGISTRY]
  if unknown:
    raise ValueError(f"unknown train.trackers {unknown}; valid: {', '.join(trackers.REGISTRY)}")
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"train.trackers names {repeated} more than once; name each tracker once")
  for name in names:
    tracker = trackers.REGISTRY[name]
    if importlib.util.find_spec(tracker.module) is None:
      raise ValueError(f"train.trackers has {name!r}, which needs the {tracker.module} package: "
                       f".venv/bin/pip install -r {tracker.requirements}")


def check_replaced_fields(values):
  """A field that a migration moved or replaced (research/runs/migrations.py) is refused in a
  new config, naming its replacement: set there, it would be silently ignored."""
  stale = [f"{old} was replaced by {new} in config version {version}"
           for old, (new, version) in migrations.replacements().items() if old in values]
  if stale:
    raise ValueError("; ".join(stale) + " (research/runs/migrations.py); set the new field")


def check_workdir(workdir, config: ml_collections.ConfigDict):
  """The workdir must be writable and, if it holds a checkpointed run, one that trains the same
  as `config` (research.runs.config_fields: evaluation settings, the mesh, new fields at their
  defaults and the like may differ: a checkpoint restores into any mesh). A run without a
  checkpoint may restart with any config. Creates nothing."""
  check_writable(workdir)
  saved_path = os.path.join(workdir, "config.json")
  if not os.path.exists(saved_path) or not checkpoints.steps(workdir):
    return
  with open(saved_path) as f:
    saved = config_fields.saved_as_stored_now(json.load(f), workdir)
  differences = config_fields.training_differences(
      saved, config_fields.as_saved(config, workdir), saved_path)
  if differences:
    raise ValueError(f"workdir {workdir!r} holds a run of a different config ("
                     f"{'; '.join(differences)}); use a new --workdir, or these values to resume")


def check_writable(workdir):
  """The workdir, or its nearest existing ancestor, must be a writable directory."""
  existing = workdir
  while not os.path.exists(existing):
    existing = os.path.dirname(existing) or "."
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"workdir {workdir!r} is not writable ({existing!r} is not a writable "
                     f"directory); choose a directory you can write to")
