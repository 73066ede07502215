"""Config versions: how a config saved by earlier code (a run's config.json, a sweep's sweep.json)
is brought to today's schema before it is read.

Every config carries `version`, the schema's version (research/defaults.py: VERSION); a saved
config without one is version 1, the schema of every run written before versions were recorded.
A change that renames a field, moves it to another section or changes the form of its value
(or adds a field whose default changes what an older run computed) bumps defaults.VERSION and
adds a Migration to MIGRATIONS: `moved` {old dotted name: new dotted
name} for a field whose value keeps its meaning, and `convert`, a function of the flat saved
config giving it in the new form, for anything else (units, a field split in two), with
`replaced` {old dotted name: new dotted name} naming what it replaces, and `predated` {dotted
name: value, or a function of the flat saved config giving one or None} for a field new in that
version whose absence meant something other than its default (RWKV-7's value residual did not
exist, so an older run's absent `model.rwkv7.value_residual` is False). `migrate` applies, in
order, every migration newer than the saved version. A field a migration moved or replaced is
refused in a new config, naming its replacement (research.training.checks; on the command line,
"did you mean": research.runs.config_fields.closest_field). A field that is new with its
default needs no migration: research.runs.config_fields reads a config without it at its default.
Compatibility with old runs lives here alone, keyed by the dotted field: no variant class
declares it, so a new variant (a subclass with settings of its own) inherits none of it.

A field removed without a migration makes a saved config unreadable (config_fields refuses
fields it does not know, naming them): remove one with a `convert` that checks the saved value
computes what today's code does, and drops it.
"""

import dataclasses
from typing import Any, Callable, Mapping

from research import defaults


@dataclasses.dataclass(frozen=True)
class Migration:
  """The change that makes the schema `version` from `version - 1`."""
  version: int
  description: str
  moved: Mapping[str, str] = dataclasses.field(default_factory=dict)
  convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None
  replaced: Mapping[str, str] = dataclasses.field(default_factory=dict)
  predated: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _saved_or_default(flat: Mapping[str, Any], name: str):
  """A saved config's value of `name`, or today's default where it has none."""
  return flat[name] if name in flat else defaults.flat_defaults()[name]


def _original_positions_with_sinks(flat: Mapping[str, Any]):
  """Runs saved before model.softmax.sink_positions kept every token at its own position:
  "original", which differs from today's default ("cache") only with a window and sinks."""
  with_sinks = (_saved_or_default(flat, "model.softmax.window")
                and _saved_or_default(flat, "model.softmax.sinks"))
  return "original" if with_sinks else None


def _trackers_from_tensorboard(flat: dict[str, Any]) -> dict[str, Any]:
  """train.tensorboard=True is train.trackers=["tensorboard"]; False, no tracker."""
  flat = dict(flat)
  if "train.tensorboard" in flat:
    flat["train.trackers"] = ["tensorboard"] if flat.pop("train.tensorboard") else []
  return flat


MIGRATIONS: tuple[Migration, ...] = (
    Migration(2, "records `version`; no field renamed or moved. The fields added before versions "
              "were recorded whose absence meant something other than their default",
              predated={
                  "model.softmax.sink_positions": _original_positions_with_sinks,
                  # Runs saved before the value residual computed every layer as layer 0.
                  "model.rwkv7.value_residual": False,
                  # Runs saved before rotary_frequencies rotated at RoPE's frequencies.
                  "model.retention.rotary_frequencies": "rope",
              }),
    Migration(3, "train.tensorboard (a bool) replaced by train.trackers (tracker names)",
              convert=_trackers_from_tensorboard,
              replaced={"train.tensorboard": "train.trackers"}),
)


def replacements() -> dict[str, tuple[str, int]]:
  """{old dotted name: (the field that replaced it today, the version that did)} of every field
  a migration moved or replaced (following later moves of the new name)."""
  found = {}
  for migration in reversed(MIGRATIONS):
    for old, new in {**migration.moved, **migration.replaced}.items():
      found[old] = (found.get(new, (new,))[0], migration.version)
  return found


def saved_version(flat: Mapping[str, Any], source: str) -> int:
  """The schema version of a saved config (flat, by dotted name); 1 without one. A version newer
  than this code's is refused, naming both."""
  version = flat.get("version", 1)
  if not isinstance(version, int) or not 1 <= version <= defaults.VERSION:
    raise ValueError(f"{source} has config version {version!r}; this code reads versions 1.."
                     f"{defaults.VERSION}: use the code that wrote it, or a newer one")
  return version


def migrate(flat: Mapping[str, Any], source: str) -> dict[str, Any]:
  """The saved config (flat, by dotted name, read from `source`) in today's schema: every
  migration newer than its version applied in turn, `version` set to defaults.VERSION."""
  flat = dict(flat)
  version = saved_version(flat, source)
  for migration in MIGRATIONS:
    if migration.version <= version:
      continue
    for old, new in {**migration.moved, **migration.replaced}.items():
      if old in flat and new in flat:
        raise ValueError(f"{source} has both {old!r} and {new!r}, which replaced it in config "
                         f"version {migration.version}; keep one")
    for old, new in migration.moved.items():
      if old in flat:
        flat[new] = flat.pop(old)
    if migration.convert is not None:
      flat = migration.convert(flat)
    for name, meant in migration.predated.items():
      value = meant(flat) if callable(meant) else meant
      if name not in flat and value is not None:
        flat[name] = value
  flat["version"] = defaults.VERSION
  return flat
