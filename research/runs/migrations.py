"""Config versions: how a config saved by earlier code (a run's config.json, a sweep's sweep.json)
is brought to today's schema before it is read.

Every config carries `version`, the schema's version (research/defaults.py: VERSION); a saved
config without one is version 1, the schema of every run written before versions were recorded.
A change that renames a field, moves it to another section or changes the form of its value
bumps defaults.VERSION and adds a Migration to MIGRATIONS: `moved` {old dotted name: new dotted
name} for a field whose value keeps its meaning, and `convert`, a function of the flat saved
config giving it in the new form, for anything else (units, a field split in two). `migrate` applies, in order, every
migration newer than the saved version. A field that is new with its default needs no migration:
research.runs.config_fields reads a config without it at its default (or at what the variant
declares its absence meant, `predated_settings`).

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


MIGRATIONS: tuple[Migration, ...] = (
    Migration(2, "records `version`; no field renamed or moved"),
)


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
    for old, new in migration.moved.items():
      if old in flat:
        if new in flat:
          raise ValueError(f"{source} has both {old!r} and {new!r}, which replaced it in config "
                           f"version {migration.version}; keep one")
        flat[new] = flat.pop(old)
    if migration.convert is not None:
      flat = migration.convert(flat)
  flat["version"] = defaults.VERSION
  return flat
