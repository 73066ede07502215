"""Sweeps: expand an experiment's override list, name its runs, run them, record their status.

An experiment config file defines `get_config(preset)` and `get_sweep(preset)`, the latter a list
of override dicts such as {"model.attention": "mha", "model.position": "alibi", "train.seed": 0}.
Each member trains in DIR/runs/<name>/ and is evaluated at every eval length (research.
extrapolation); DIR/runs/<name>/status.json says done, failed (with the error) or skipped (an
incompatible attention x position pair, with the reason). A setting of the experiment that a member does not read (eval.rope_scalings in an ALiBi member,
model.learned.* beside other schemes) is reset to its default in that member (research.runs.unread);
one that no member reads is refused. A rerun does only what is not done:
it trains unfinished members and evaluates finished ones at the settings they have no results
for (eval fields may change between reruns; fields that change training may not).
"""

import functools
import dataclasses
import importlib.util
import json
import os
import traceback
from typing import Callable

import ml_collections

from research.training import checks
from research.runs import config_fields
from research.evaluation import extrapolation
from research import model as model_lib
from research.training import loop as train
from research.runs import lock as workdir_lock
from research.runs import unread
from research.runs import workdirs


@dataclasses.dataclass
class Member:
  index: int
  name: str
  overrides: dict
  config: object
  skip_reason: str = ""


def load_module(path):
  spec = importlib.util.spec_from_file_location("experiment_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_name(overrides):
  """'attention=mha,position=alibi,seed=0' from the overrides' last key components."""
  if not overrides:
    return "base"
  parts = []
  for key, value in overrides.items():
    value = "-".join(map(str, value)) if isinstance(value, (tuple, list)) else value
    parts.append(f"{key.split('.')[-1]}={value}")
  return ",".join(parts).replace("/", "_").replace(" ", "")


def apply_overrides(config, overrides):
  """A copy of `config` with dotted-key overrides; an unknown key names the valid ones."""
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    *path, field = key.split(".")
    node = config
    for part in path:
      if part not in node:
        raise ValueError(f"unknown sweep axis {key!r}: no section {part!r}; valid sections: "
                         f"{', '.join(sorted(node.keys()))}")
      node = node[part]
    if field not in node:
      closest = config_fields.closest_field(key, config)
      hint = f"did you mean {closest!r}? " if closest else ""
      raise ValueError(f"unknown sweep axis {key!r}; {hint}valid fields of "
                       f"{'.'.join(path) or 'config'}: {', '.join(sorted(node.keys()))}")
    node[field] = type(node[field])(value) if isinstance(node[field], tuple) else value
  return config


def expand(sweep, base_config, num_devices):
  """Members of the sweep, each validated; raises on bad axes or values before any work."""
  if not sweep:
    raise ValueError("the sweep is empty: get_sweep() returned no overrides; give at least one "
                     "override dict (an empty dict {} runs the base config)")
  members, names, never_read = [], set(), None
  for index, overrides in enumerate(sweep):
    config = apply_overrides(base_config, overrides)
    # The experiment's shared settings apply to the members that read them (module docstring).
    settings = unread.unread_settings_if_valid(config)
    not_read_here = unread.outside(settings or {}, overrides)
    if not_read_here:  # reset: validation finds what is left unread again
      config, settings = unread.reset(config, not_read_here), None
    never_read = dict(not_read_here) if never_read is None else {
        name: who for name, who in never_read.items() if name in not_read_here}
    name = run_name(overrides)
    if name in names:
      raise ValueError(f"two sweep members are both named {name!r}; make their overrides differ")
    names.add(name)
    member = Member(index, name, dict(overrides), config)
    try:
      checks.validate_config(config, num_devices, unread_settings=settings)
    except model_lib.IncompatibleError as e:
      member.skip_reason = str(e)
    except ValueError as e:
      raise ValueError(f"sweep member {index} ({name}): {e}") from e
    members.append(member)
  if never_read:
    raise ValueError("settings of the experiment that no member of its sweep reads: "
                     + "; ".join(f"{name} is read only by {who}" for name, who in never_read.items())
                     + "; remove them, or add a member that reads them")
  return members



def check_sweep_workdir(workdir: str, base_config: ml_collections.ConfigDict,
                        members: list[Member]):
  """Refuse a workdir that holds a sweep that trains differently or lacks some of its members
  (naming every difference); record this sweep's config and members otherwise (evaluation
  settings may have changed, and members may have been added: a variant registered since, whose
  runs join the finished ones)."""
  record = {"config": json.loads(base_config.to_json(sort_keys=True)),
            "members": [m.name for m in members]}
  if workdirs.is_sweep(workdir):
    saved = workdirs.sweep_record(workdir)
    differences = config_fields.training_differences(saved["config"], base_config)
    removed = [name for name in saved["members"] if name not in record["members"]]
    differences += [f"members removed: {', '.join(removed)}"] if removed else []
    if differences:
      raise ValueError(f"workdir {workdir!r} holds a sweep of a different config "
                       f"({'; '.join(differences)}); use a new --workdir, or these values to "
                       "continue it")
  else:
    checks.check_writable(workdir)
    os.makedirs(workdir, exist_ok=True)
  _write_json(os.path.join(workdir, workdirs.SWEEP_FILE), record)


def _write_json(path, obj):
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)  # atomic: readers see the old file or the new one


def run_dir(workdir, member):
  return os.path.join(workdir, "runs", member.name)


def status(workdir, name):
  path = os.path.join(workdir, "runs", name, "status.json")
  if not os.path.exists(path):
    return {"state": "pending"}
  with open(path) as f:
    return json.load(f)


def run_member(workdir: str, member: Member,
               progress: Callable[[str], None] = functools.partial(print, flush=True)):
  """Train and evaluate one member; if it is done, evaluate it at the settings it has no results
  for. A failure is recorded, not raised; a member that another process runs is left to it."""
  directory, label = run_dir(workdir, member), f"[{member.index}] {member.name}"
  done = status(workdir, member.name)["state"] == "done"
  try:
    with workdir_lock.hold(directory):
      if member.skip_reason:
        progress(f"{label}: skipped: {member.skip_reason}")
        _write_json(os.path.join(directory, "status.json"),
                    {"state": "skipped", "reason": member.skip_reason})
        return
      _train_and_evaluate(directory, member, label, done, progress)
  except workdir_lock.WorkdirBusyError as e:
    progress(f"{label}: left alone: {e}")


def _train_and_evaluate(directory, member, label, done, progress):
  status_path = os.path.join(directory, "status.json")
  try:
    if not done:
      progress(f"{label}: training")
      train.train_and_evaluate(member.config, directory)
      progress(f"{label}: evaluating")
    new_rows = extrapolation.evaluate_run(member.config, directory, progress=progress)
    _write_json(status_path, {"state": "done"})
    if done:
      progress(f"{label}: done already" + (f"; evaluated {len(new_rows)} new settings"
                                           if new_rows else ""))
  except Exception as e:  # noqa: BLE001 (isolate any failure of one run from the others)
    progress(f"{label}: FAILED: {type(e).__name__}: {e}")
    _write_json(status_path, {"state": "failed", "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()})
