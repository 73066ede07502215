"""Default configuration: every field the library reads, with its default, as one ConfigDict.

The fields and their defaults are defined in research/defaults.py (the library's config schema);
this file serves them to the command line and to the experiment files, which start from
`get_config()` and change what they need. Any field can be overridden on the command line, e.g.

  python -m experiments.train --config=configs/base.py --workdir=/tmp/run \
      --config.model.attention=gqa --config.model.num_kv_heads=2
"""

from research import defaults


def get_config():
  return defaults.get_config()


def check_preset(preset, valid=("quick", "full")):
  """Experiment files call this first: an unknown preset names the valid ones."""
  if preset not in valid:
    raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(valid)}")
