"""Sweeps: expand an experiment's override list, name its runs, run them, record their status.

An experiment config file defines `get_config(preset)` and `get_sweep(preset)`, the latter a list
of override dicts such as {"model.attention": "mha", "model.position": "alibi", "train.seed": 0}.
Each member trains in DIR/runs/<name>/ and is evaluated at every eval length (research.
extrapolation); DIR/runs/<name>/status.json says done (with the commit of the code and the
hardware that trained it: research.runs.provenance), failed (with the error) or skipped (an
incompatible attention x position pair, with the reason). A setting of the experiment that a
member does not read (eval.rope_scalings in an ALiBi member, model.learned.* beside other
schemes) is reset to its default in that member (research.runs.unread); one that no member reads
is refused. A rerun does only what is not done: it trains unfinished members and evaluates
finished ones at the settings they have no results for (eval fields may change between reruns;
fields that change training may not).
"""

import functools
import dataclasses
import importlib.util
import json
import os
import traceback
from typing import Callable

import ml_collections

from research import defaults
from research.training import checks
from research.runs import config_fields
from research.evaluation import extrapolation
from research.model import flops
from research.model import transformer as model_lib
from research.training import loop as train
from research.runs import lock as workdir_lock
from research.runs import provenance
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


SEED_KEY = "train.seed"


def with_seeds(sweep: list[dict], num_seeds: int | None) -> list[dict]:
  """The sweep with every member run once per train.seed in 0..num_seeds-1 (replacing the seeds
  it sets: members that differ only in their seed become one), seed-major so that every variant
  has a seed early; the sweep as it is for None."""
  if num_seeds is None:
    return sweep
  if num_seeds < 1:
    raise ValueError(f"--seeds={num_seeds}: give the number of seeds, >= 1 (seeds 0..N-1)")
  starts_elsewhere = [run_name(o) for o in sweep if o.get("train.init_from")]
  if starts_elsewhere:
    raise ValueError(f"--seeds cannot expand a sweep whose members start from other members' "
                     f"runs (train.init_from: {', '.join(starts_elsewhere)}); their seeds are "
                     "the sweep's own: set train.seed in its get_sweep")
  variants = list({run_name({k: v for k, v in o.items() if k != SEED_KEY}): o
                   for o in sweep}.values())
  # A member's own seed key keeps its place (so its seed-0 run keeps its name); else it is last.
  return [{**o, SEED_KEY: seed} for seed in range(num_seeds) for o in variants]


def variant_name(name: str) -> str:
  """A run's name (run_name) without its seed: what the runs of one variant share."""
  seed = SEED_KEY.split(".")[-1] + "="
  return ",".join(p for p in name.split(",") if not p.startswith(seed)) or "base"


def apply_overrides(config, overrides):
  """A copy of `config` with dotted-key overrides; an unknown key names the valid ones."""
  config = config.copy_and_resolve_references()
  _set_overrides(config, overrides)
  return config


def _set_overrides(config, overrides):
  """Set the overrides in `config`; returns [(key, the node it set a field of, field)]."""
  fields = []
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
    fields.append((key, node, field))
  return fields


class _Base:
  """The sweep's base config, from which each member is made: what apply_overrides and flatten
  give for each of thousands of members, at a fraction of their cost.

  apply_overrides copies the base with copy_and_resolve_references, whose ConfigDict.__setitem__
  per field costs a third of an expansion. Here the base is resolved once, and each member copies
  the resolved tree (`_copy`): what copy_and_resolve_references makes of a tree without
  references, plain dicts or a node reached twice (`plain`; another base takes the slow path).
  A member's flattened config is the base's with the fields the member set read back from it
  (after ConfigDict's casts), where those are leaves of the base and still are; else it is
  flattened afresh."""

  def __init__(self, config):
    self.config = config
    self.resolved = config.copy_and_resolve_references()
    self.plain = _plain(self.resolved, set())
    self.flat = defaults.flatten(self.resolved) if self.plain else None
    self.template = _template(self.resolved) if self.plain else None

  def member(self, overrides):
    """(apply_overrides(base, overrides), the copy's flattened config)."""
    if not self.plain:
      config = apply_overrides(self.config, overrides)
      return config, defaults.flatten(config)
    config = _copy(self.template)
    return config, self.updated_flat(config, _set_overrides(config, overrides))

  def reset(self, config, overrides, names):
    """(unread.reset(config, names), its flattened config) for a member made by `member`."""
    if not self.plain:
      config = unread.reset(config, names)
      return config, defaults.flatten(config)
    unread.set_defaults(config, names)  # the member's own copy: no need for another
    names = [*overrides, *names]
    if any(name not in self.flat for name in names):  # as in updated_flat
      return config, defaults.flatten(config)
    fields = []
    for name in names:  # each a leaf of the base, so none replaced the sections above another
      *path, field = name.split(".")
      node = config
      for part in path:
        node = node[part]
      fields.append((name, node, field))
    return config, self.updated_flat(config, fields)

  def model_key(self, overrides, reset):
    """A key equal only for members with equal model sections (checks.ModelMemo), or None: the
    model overrides in order and the model fields reset to defaults, since a member's model
    section is the base's with these and nothing else (in a `plain` base, no section is
    another's)."""
    model_overrides = tuple((key, defaults.frozen(value)) for key, value in overrides.items()
                            if unread.within(key, "model"))
    if not self.plain or any(value is None for _, value in model_overrides):
      return None
    return model_overrides, tuple(name for name in reset if unread.within(name, "model"))

  def updated_flat(self, config, fields):
    """defaults.flatten(config) for a member made from the base that set only `fields`, each
    (dotted name, the node it is a field of, field)."""
    flat = dict(self.flat)
    # Where one is a section, the tree's shape may have changed; where none is, the nodes hold.
    if any(name not in flat for name, _, _ in fields):
      return defaults.flatten(config)
    for name, node, field in fields:
      value = node[field]
      if isinstance(value, (ml_collections.ConfigDict, dict)):  # a None leaf set to a section
        return defaults.flatten(config)
      flat[name] = defaults.as_json(value)
    return flat


def _plain(node, seen):
  """Whether `node` is a tree of ConfigDicts (no subclass, no node twice, no attributes but
  ConfigDict's own) with keys free of dots and no FieldReference or dict among its values: one
  that _copy copies as copy_and_resolve_references would, and whose flattened names each name
  one field."""
  if (type(node) is not ml_collections.ConfigDict or id(node) in seen
      or vars(node).keys() != _CONFIGDICT_ATTRIBUTES):  # as _copy sets them
    return False
  seen.add(id(node))
  for key, value in node._fields.items():  # noqa: SLF001
    if not isinstance(key, str) or "." in key:
      return False
    if isinstance(value, (ml_collections.FieldReference, dict)):
      return False
    if isinstance(value, ml_collections.ConfigDict) and not _plain(value, seen):
      return False
  return True


_CONFIGDICT_ATTRIBUTES = vars(ml_collections.ConfigDict()).keys()


def _template(node):
  """What _copy builds copies of `node` (a `_plain` tree) from: its attributes, its fields, and
  the templates of its ConfigDict fields."""
  children = [(key, _template(value)) for key, value in node._fields.items()  # noqa: SLF001
              if type(value) is ml_collections.ConfigDict]
  return vars(node), node._fields, children  # noqa: SLF001


def _copy(template, new=object.__new__, config_dict=ml_collections.ConfigDict):
  """node.copy_and_resolve_references() of the `_plain` node of `template` when that node was
  made by copy_and_resolve_references (so has the attributes of such a copy): new ConfigDicts
  with its attributes and new fields dicts (the leaves shared, as there), made without
  ConfigDict.__init__ and __setitem__, whose checks every field of such a copy passes. (The
  defaults spare global lookups in what runs for every node of every member.)"""
  attributes, fields, children = template
  copy = new(config_dict)
  state = copy.__dict__
  state.update(attributes)
  fields = state["_fields"] = fields.copy()
  for key, child in children:
    fields[key] = _copy(child)
  return copy


def expand(sweep, base_config, num_devices):
  """Members of the sweep, each validated; raises on bad axes or values before any work."""
  if not sweep:
    raise ValueError("the sweep is empty: get_sweep() returned no overrides; give at least one "
                     "override dict (an empty dict {} runs the base config)")
  members, names, never_read = [], set(), None
  base, model_checks = _Base(base_config), {}
  for index, overrides in enumerate(sweep):
    config, flat = base.member(overrides)
    # The experiment's shared settings apply to the members that read them (module docstring).
    memo = checks.ModelMemo(model_checks, base.model_key(overrides, ()))
    settings = unread.unread_settings_if_valid(config, flat=flat, memo=memo)
    not_read_here = unread.outside(settings or {}, overrides)
    if not_read_here:  # reset: validation finds what is left unread again
      config, flat, settings = *base.reset(config, overrides, not_read_here), None
      memo = checks.ModelMemo(model_checks, base.model_key(overrides, not_read_here))
    never_read = dict(not_read_here) if never_read is None else {
        name: who for name, who in never_read.items() if name in not_read_here}
    name = run_name(overrides)
    if name in names:
      raise ValueError(f"two sweep members are both named {name!r}; make their overrides differ")
    names.add(name)
    member = Member(index, name, dict(overrides), config)
    try:
      checks.validate_config(config, num_devices, unread_settings=settings, flat=flat, memo=memo)
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
    differences = config_fields.training_differences(
        saved["config"], base_config, os.path.join(workdir, workdirs.SWEEP_FILE))
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


def members_environment(environ, parallel, peak_flops):
  """The environment of members run `parallel` at a time (> 1) as subprocesses. Sharing one
  accelerator, each reserves 0.9 / parallel of its memory (JAX's default is 0.75 each) unless the
  user chose otherwise; and each reports MFU against `peak_flops()`, the machine's peak measured
  here before they start (measured by each while the others run, it would be a share of the
  machine's, and their MFU inflated), unless $RESEARCH_PEAK_FLOPS is set already."""
  env = dict(environ)
  if parallel <= 1:
    return env
  if not {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"} & set(env):
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / parallel:.3f}"
  if not env.get(flops.PEAK_ENV):
    env[flops.PEAK_ENV] = repr(peak_flops())
  return env


def ready_to_start(queue, running, parallel):
  """The members of `queue` to start beside those `running`, at most `parallel` in all, in queue
  order: those whose train.init_from names no member still queued or running (a cycle of
  init_from runs in queue order, one at a time)."""
  unfinished = {m.name for m in queue} | {m.name for m in running}
  ready = [m for m in queue if m.config.train.init_from not in unfinished]
  if not ready and not running:
    ready = queue[:1]
  return ready[:max(parallel - len(running), 0)]


def run_member(workdir: str, member: Member,
               progress: Callable[[str], None] = functools.partial(print, flush=True)):
  """Train and evaluate one member; if it is done, evaluate it at the settings it has no results
  for. A failure is recorded, not raised; a member that another process runs is left to it."""
  directory, label = run_dir(workdir, member), f"[{member.index}] {member.name}"
  previous = status(workdir, member.name)
  try:
    with workdir_lock.hold(directory):
      if member.skip_reason:
        progress(f"{label}: skipped: {member.skip_reason}")
        _write_json(os.path.join(directory, "status.json"),
                    {"state": "skipped", "reason": member.skip_reason})
        return
      _train_and_evaluate(directory, member, label, previous, progress)
  except workdir_lock.WorkdirBusyError as e:
    progress(f"{label}: left alone: {e}")


PROVENANCE = ("commit", "hardware")  # what a done run's status.json says made it


def _train_and_evaluate(directory, member, label, previous, progress):
  """Train (unless `previous`, the run's status, says done) and evaluate; status.json then says
  done, with the commit and hardware that trained it (kept from `previous` when done already)."""
  status_path = os.path.join(directory, "status.json")
  done = previous["state"] == "done"
  try:
    finished = {"state": "done", **{k: previous[k] for k in PROVENANCE if k in previous}}
    if not done:
      progress(f"{label}: training")
      finished["commit"] = provenance.commit()  # the code that trains it (to its end)
      train.train_and_evaluate(member.config, directory)
      # and the machine (asked after training: jax.distributed starts before jax's backends)
      finished["hardware"] = provenance.hardware()
      progress(f"{label}: evaluating")
    new_rows = extrapolation.evaluate_run(member.config, directory, progress=progress)
    _write_json(status_path, finished)
    if done:
      progress(f"{label}: done already" + (f"; evaluated {len(new_rows)} new settings"
                                           if new_rows else ""))
  except Exception as e:  # noqa: BLE001 (isolate any failure of one run from the others)
    progress(f"{label}: FAILED: {type(e).__name__}: {e}")
    _write_json(status_path, {"state": "failed", "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()})
