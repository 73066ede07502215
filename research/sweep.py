"""Sweeps: expand an experiment's override list, name its runs, run them, record their status.

An experiment config file defines `get_config(preset)` and `get_sweep(preset)`, the latter a list
of override dicts such as {"model.attention": "mha", "model.position": "alibi", "train.seed": 0}.
Each member trains in DIR/runs/<name>/ and is evaluated at every eval length (research.
extrapolation); DIR/runs/<name>/status.json says done, failed (with the error) or skipped (an
incompatible attention x position pair, with the reason). A rerun does only what is not done.
"""

import functools
import dataclasses
import importlib.util
import json
import os
import traceback

from research import checks
from research import extrapolation
from research import model as model_lib
from research import train


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
      raise ValueError(f"unknown sweep axis {key!r}; valid fields of {'.'.join(path) or 'config'}:"
                       f" {', '.join(sorted(node.keys()))}")
    node[field] = type(node[field])(value) if isinstance(node[field], tuple) else value
  return config


def expand(sweep, base_config, num_devices):
  """Members of the sweep, each validated; raises on bad axes or values before any work."""
  if not sweep:
    raise ValueError("the sweep is empty: get_sweep() returned no overrides; give at least one "
                     "override dict (an empty dict {} runs the base config)")
  members, names = [], set()
  for index, overrides in enumerate(sweep):
    config = apply_overrides(base_config, overrides)
    name = run_name(overrides)
    if name in names:
      raise ValueError(f"two sweep members are both named {name!r}; make their overrides differ")
    names.add(name)
    member = Member(index, name, dict(overrides), config)
    try:
      checks.validate_config(config, num_devices)
    except model_lib.IncompatibleError as e:
      member.skip_reason = str(e)
    except ValueError as e:
      raise ValueError(f"sweep member {index} ({name}): {e}") from e
    members.append(member)
  return members


def check_sweep_workdir(workdir, base_config, members):
  """Refuse a workdir that holds a sweep of a different config; record this one's otherwise."""
  record = {"config": json.loads(base_config.to_json(sort_keys=True)),
            "members": [m.name for m in members]}
  path = os.path.join(workdir, "sweep.json")
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    if saved != record:
      raise ValueError(f"workdir {workdir!r} holds results of a different sweep config; use a "
                       f"new --workdir (or delete {path} and the runs to start over)")
    return
  checks.check_writable(workdir)
  os.makedirs(workdir, exist_ok=True)
  _write_json(path, record)


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


def run_member(workdir, member, progress=functools.partial(print, flush=True)):
  """Train and evaluate one member unless done; a failure is recorded, not raised."""
  directory = run_dir(workdir, member)
  state = status(workdir, member.name)["state"]
  if state == "done":
    progress(f"[{member.index}] {member.name}: done already")
    return
  os.makedirs(directory, exist_ok=True)
  status_path = os.path.join(directory, "status.json")
  if member.skip_reason:
    progress(f"[{member.index}] {member.name}: skipped: {member.skip_reason}")
    _write_json(status_path, {"state": "skipped", "reason": member.skip_reason})
    return
  progress(f"[{member.index}] {member.name}: training")
  try:
    train.train_and_evaluate(member.config, directory)
    progress(f"[{member.index}] {member.name}: evaluating")
    rows = extrapolation.length_sweep(member.config, directory, progress=progress)
    _write_json(os.path.join(directory, "eval.json"), rows)
    _write_json(status_path, {"state": "done"})
  except Exception as e:  # noqa: BLE001 (isolate any failure of one run from the others)
    progress(f"[{member.index}] {member.name}: FAILED: {type(e).__name__}: {e}")
    _write_json(status_path, {"state": "failed", "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()})
