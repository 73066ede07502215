"""Labels and aggregates of results rows (one row per run x evaluation, research.results.report):
what a run is called in a table or a legend, and its metric per evaluation length over seeds.
The report and the figures both read them from here."""

import collections
import functools
import math

from research import defaults
from research.runs import config_fields


# values that name themselves
BARE_KEYS = ("model.attention", "model.position", "data.name", "data.packing")
OFF_VALUES = ("0", "0.0", "none", "False", "()")
OFF_VALUES_OF = {"data.packing": ("concat",)}  # a field's value that means "as before it existed"


def _is_off(key, value):
  """Whether a swept setting is off in this run and off by default: a switch that is on by
  default (use_forget_gate=True) is named when it is turned off."""
  if key in OFF_VALUES_OF:
    return str(value) in OFF_VALUES_OF[key]
  if key in BARE_KEYS or str(value) not in OFF_VALUES:
    return False
  return str(cell(defaults.flat_defaults().get(key))) in OFF_VALUES + ("",)


def cell(value):
  """A config value as results rows hold it: tuples joined by '-'."""
  return "-".join(map(str, value)) if isinstance(value, (tuple, list)) else value


LEADING_KEYS = ("data.name", "model.attention", "model.position")  # labels start with these


@functools.lru_cache(maxsize=1)
def _config_order() -> dict:
  return {name: i for i, name in enumerate(config_fields.flatten(defaults.get_config()))}


def _label_order(key):
  """The dataset, attention and position first, then the other fields in research/defaults.py's
  order (model.softmax.window before model.softmax.sinks)."""
  if key in LEADING_KEYS:
    return (LEADING_KEYS.index(key), 0)
  return (len(LEADING_KEYS), _config_order().get(key, len(_config_order())))


def variant_label(row: dict, swept_keys: list[str]) -> str:
  """'mha / alibi' (swept values, seed left out; the run's name if nothing is swept), with the
  checkpoint step if it is not the run's last. A swept setting that is off in this run (0,
  none, False, empty; data.packing=concat) and off by default is left out, and so is one the
  run does not read (empty in its row): 'rope' beside 'rope / randomize_max_length=2048',
  'mha / alibi' beside 'mha / alibi / documents' and 'mha / rope / window=128 / sinks=4'."""
  parts = [str(row[k]) if k in BARE_KEYS else f"{k.split('.')[-1]}={row[k]}"
           for k in sorted(swept_keys, key=_label_order)
           if k != "train.seed" and row.get(k) not in (None, "") and not _is_off(k, row[k])]
  label = " / ".join(parts) or row["run"]
  step = row.get("step")
  return label if step is None or step == row["train_steps"] else f"{label} @step {step}"


def scaled_label(variant: str, rope_scaling: str) -> str:
  return variant if rope_scaling == "none" else f"{variant} +{rope_scaling}"


def swept_keys(rows: list[dict]) -> list[str]:
  return [k for k in (rows[0] if rows else {}) if "." in k]


MIXER_KEYS = ("model.attention", "model.position", "model.layer_pattern", "model.num_kv_heads")


def mixer_keys(rows: list[dict]) -> list[str]:
  """The swept fields that name a mixer: MIXER_KEYS (model.num_kv_heads is in a run's config only
  where its mixer reads it) and the variants' own settings, model.<name>.*."""
  return [k for k in swept_keys(rows) if k in MIXER_KEYS or k.count(".") > 1
          and k.startswith("model.")]


def bytes_text(value: float) -> str:
  """'36 KiB', '43.88 KiB', '1.5 MiB': a size in the largest binary unit it reaches, to four
  significant digits."""
  for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if value >= size:
      return f"{value / size:.4g} {unit}"
  return f"{value:.4g} B"


def aggregate(rows: list[dict], metric: str) -> dict:
  """{(eval_mode, variant, rope_scaling): {eval_length: [metric per seed]}}."""
  keys = swept_keys(rows)
  table = collections.defaultdict(lambda: collections.defaultdict(list))
  for row in rows:
    variant = variant_label(row, keys)
    table[(row["eval_mode"], variant, row["rope_scaling"])][row["eval_length"]].append(row[metric])
  return table


def intervals(rows, metric):
  """aggregate() of the metric's interval bounds over the rows that have them (rows evaluated
  before intervals existed have none)."""
  rows = [row for row in rows if f"{metric}_ci_low" in row]
  return aggregate(rows, f"{metric}_ci_low"), aggregate(rows, f"{metric}_ci_high")


def mean_std(values):
  """(mean, std) of a list of seeds' values; the std is the population's (divided by n), as every
  summary table reports it."""
  mean = sum(values) / len(values)
  return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
