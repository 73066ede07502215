"""The generated tables of README.md and docs/, computed from the registries and the config
schema (research.defaults.doc_tables): mixers, position schemes, which pairs are compatible,
feed-forwards, the config sub-dict of each variant and every other config field.

  python -m experiments.variants [--config.model.d_model=256 ...]   print them at these sizes
  python -m experiments.variants --write    rewrite the generated blocks of the docs
  python -m experiments.variants --check    exit 1 if a committed block is out of date
  python -m experiments.variants --fields   every config field: its default and what it is
                                            (the variants' own: model.<variant>.*, with defaults)

The docs embed each table between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`,
computed at the default model config with research.variants.DOCS_MODEL_OVERRIDES (tests/test_docs.py
runs the check).
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from experiments import cli
from research import defaults
from research import variants

_CONFIG = cli.config_flag(config_flags.DEFINE_config_dict, defaults.get_config(),
                          "The sizes to print the tables at (--config.model.d_model=256 ...).")
_WRITE = flags.DEFINE_bool("write", False, "Rewrite the generated blocks of the docs.")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 if a generated block of the docs differs.")
_FIELDS = flags.DEFINE_bool("fields", False, "Print every config field with its default and "
                            "what it is, one per line.")


def print_fields():
  """One line per config field: the schema's (research.defaults.config_fields) with what
  defaults.py says of each, then each variant's hyperparameters with their defaults."""
  rows = [(name, value, what.replace("\\|", "|")) for name, value, what in defaults.config_fields()]
  readers = {}  # settings key -> the registered names that read it
  for registry in variants.REGISTRIES:
    for name in registry:
      readers.setdefault(registry.settings_key(name), []).append(name)
  rows += [(f"model.{key}.{field}", value, f"read by {', '.join(readers[key])}")
           for key, settings in variants.default_settings().items()
           for field, value in settings.items()]
  width = max(len(name) for name, _, _ in rows)
  for name, value, what in rows:
    print(f"{name:<{width}}  {value!r:<24}  {what}")


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments {argv[1:]}; the flags are --config, --write, --check "
                     "and --fields")
  if _FIELDS.value:
    print_fields()
    return
  if not (_WRITE.value or _CHECK.value):
    for name, table in defaults.doc_tables(_CONFIG.value.model).items():
      print(f"{name}:\n\n{table}\n")
    return
  model_config = defaults.get_config().model
  model_config.update(variants.DOCS_MODEL_OVERRIDES)
  tables = defaults.doc_tables(model_config)
  stale = variants.stale_files(tables)
  if _CHECK.value:
    if stale:
      print(f"out of date: {', '.join(stale)}; run python -m experiments.variants --write")
      sys.exit(1)
    print("the generated tables of the docs are current")
    return
  for name in stale:
    path = os.path.join(variants.ROOT, name)
    with open(path) as f:
      text = f.read()
    with open(path, "w") as f:
      f.write(variants.embed(text, tables))
  print(f"rewrote {', '.join(stale)}" if stale else "the generated tables were current")


if __name__ == "__main__":
  cli.run(main)
