"""No setting is silently ignored: which config fields a run reads, given what it chose.

A field is read or not depending on other fields: `data.corpus_path` only by `data.name=text_dir`,
`model.fire.*` only by a model whose position scheme is fire, `eval.depths` only by the needle
tasks. `not_read(config)` lists the fields the config's choices do not read (each with who would
read it); `check(config)` refuses any of them set away from its default, before any work
(research.training.checks.validate_config calls it), naming who reads it.

Two places apply the same rule without refusing:
  - a sweep's shared settings (the experiment file's, e.g. eval.rope_scalings for a sweep that
    also has ALiBi members) apply to the members that read them: research.results.sweep resets
    them to their defaults in the members that do not, and refuses a shared setting that no
    member reads;
  - a run's saved config.json is read without the settings its run did not read
    (research.runs.config_fields.merge_saved), so runs saved before this rule still evaluate.
"""

import functools
import types
from typing import Iterator, NamedTuple

import ml_collections

from research.model import attention
from research import defaults
from research.model import feed_forward
from research.model import transformer as model_lib
from research.model import norms
from research.model import positions
from research import variants
from research.data import catalog
from research.data import mad


def _used_variants(config) -> dict[str, str]:
  """{model.<settings key>: the variant names of this model that read it}."""
  m = config.model
  used = {}
  for registry, names in [(attention.REGISTRY, model_lib.layer_types(m)),
                          (positions.REGISTRY, (m.position,)),
                          (feed_forward.REGISTRY, model_lib.feed_forward_types(m)),
                          (norms.REGISTRY, (m.norm,))]:
    for name in dict.fromkeys(names):
      key = registry.settings_key(name)
      if key in m and isinstance(m[key], ml_collections.ConfigDict):
        used.setdefault(f"model.{key}", []).append(name)
  return used


def _rules(config) -> Iterator[tuple[str, bool, str]]:
  """(field or section, whether this config reads it, who reads it). Reads only the model section
  and the fields of _ChoicesRead: not_read memoises on them, and hands this function no more."""
  d, m = config.data, config.model
  name = d.name
  language_modeling = name not in catalog.TASK_NAMES
  symbol_task = name in catalog.SYMBOL_TASK_NAMES
  yield "data.corpus_path", name == "text_dir", "data.name=text_dir"
  yield ("data.tokenizer", not symbol_task, "the language-modeling corpora and the needle "
         "tasks")
  yield "data.task_vocab_size", symbol_task, "the synthetic tasks"
  for field in ("train_min_length", "train_max_length"):
    yield (f"data.{field}", symbol_task and name != "mqar" and name not in mad.TASKS,
           "the synthetic tasks but mqar and MAD's")
  for field, readers in mad.FIELD_READERS.items():
    yield f"data.{field}", name in readers, f"data.name={'|'.join(readers)}"
  yield "data.num_kv_pairs", name == "mqar", "data.name=mqar"
  for field in ("num_train_examples", "num_eval_examples"):
    yield f"data.{field}", not language_modeling, "the synthetic and needle tasks"
  yield "data.needle_value_digits", name in catalog.NEEDLE_NAMES, "the needle tasks"
  yield "data.num_distractors", name == "needle_multikey", "data.name=needle_multikey"
  yield "data.num_values", name == "needle_multivalue", "data.name=needle_multivalue"
  yield "eval.depths", name in catalog.NEEDLE_NAMES, "the needle tasks"
  yield "eval.num_tokens", language_modeling, "the text corpora (tasks count examples)"
  yield "eval.modes", language_modeling, "the text corpora (tasks are scored per example)"
  yield ("eval.sliding_stride", language_modeling and "sliding" in config.eval.modes,
         "eval.modes with 'sliding' on a text corpus")
  yield ("eval.rope_scalings", positions.rotary(m.position),
         f"the rotary schemes ({', '.join(n for n in positions.REGISTRY if positions.rotary(n))})")
  mixers = [attention.REGISTRY.lookup(n) for n in dict.fromkeys(model_lib.layer_types(m))]
  yield ("model.attention", not m.layer_pattern,
         "a model without model.layer_pattern (which names every layer's mixer)")
  yield ("model.feed_forward", not m.feed_forward_pattern,
         "a model without model.feed_forward_pattern")
  readers = _registry_readers(variants.registry_state())
  yield ("model.num_kv_heads", any(cls.reads_num_kv_heads for cls in mixers),
         readers["model.num_kv_heads"])
  yield ("model.attention_backend", any(cls.backends for cls in mixers),
         readers["model.attention_backend"])
  used = _used_variants(config)
  for key in readers["sections"]:
    yield key, key in used, readers[key]
  coordinated = bool(config.distributed.coordinator_address)
  for field in ("num_processes", "process_id"):
    yield (f"distributed.{field}", coordinated,
           "a multi-process run (distributed.coordinator_address set)")


@functools.lru_cache(maxsize=1)
def _registry_readers(registry_state: tuple) -> dict:
  """Who reads the registry-dependent fields, for one state of the registries (the key): derived
  once, not for each of a sweep's thousands of members."""
  del registry_state  # the cache key: a variant (un)registered derives them again
  readers = {
      "model.num_kv_heads": "mixers with a number of key/value heads of their own: "
                            + ", ".join(n for n, cls in attention.REGISTRY.items()
                                        if cls.reads_num_kv_heads),
      "model.attention_backend": "the softmax-family mixers: "
                                 + ", ".join(n for n, cls in attention.REGISTRY.items()
                                             if cls.backends),
      "sections": sorted(variant_sections())}
  readers.update({key: f"a model with {_owners(key)}" for key in readers["sections"]})
  return readers


def variant_sections() -> set[str]:
  """model.<key> of every variant's settings sub-dict."""
  return {f"model.{key}" for key in variants.default_settings()}


def _owners(section: str) -> str:
  key = section.split(".", 1)[1]
  fields = [("model.attention", attention.REGISTRY), ("model.position", positions.REGISTRY),
            ("model.feed_forward", feed_forward.REGISTRY), ("model.norm", norms.REGISTRY)]
  return " or ".join(f"{field}={'|'.join(names)}" for field, registry in fields
                     if (names := [n for n in registry if registry.settings_key(n) == key]))


def within(name: str, prefix: str) -> bool:
  """Whether dotted `name` is `prefix` or a field inside it."""
  return name == prefix or name.startswith(prefix + ".")


def enclosing(name: str, sections: dict[str, str]) -> str | None:
  """The entry of `sections` that dotted `name` is or lies inside, or None."""
  end = name.find(".")
  while end != -1:  # each enclosing section, outermost first
    if name[:end] in sections:
      return name[:end]
    end = name.find(".", end + 1)
  return name if name in sections else None


def not_read(config: ml_collections.ConfigDict, *, memo=None) -> dict[str, str]:
  """{field or section this config does not read: who reads it}. Assumes the choices (data.name,
  the model's variants) are valid: research.training.checks validates them first. `memo`: a
  research.training.checks.ModelMemo, where configs that share model sections are checked
  together; the dict returned is then shared by them too, not to be changed. Without a memo
  (or a key) the config is read as _rules needs it, a field at a time: tests/test_unread.py
  records a run's reads; with one, the fields of _ChoicesRead are read up front."""
  if memo is None or memo.model_key is None:
    return _not_read(config)
  try:
    choices = _ChoicesRead(config.model, types.SimpleNamespace(name=config.data.name),
                           types.SimpleNamespace(modes=config.eval.modes),
                           types.SimpleNamespace(
                               coordinator_address=config.distributed.coordinator_address))
  except (AttributeError, KeyError):  # a config without them: as _rules reads it, unmemoised
    return _not_read(config)
  return memo.run(_not_read, choices, reads=(choices.data.name, choices.eval.modes,
                                             choices.distributed.coordinator_address))


class _ChoicesRead(NamedTuple):
  """What _rules reads of a config, and no more: not_read memoises _rules on the model section and
  these fields, and a rule that read another field would fail here rather than be memoised on
  too little."""
  model: ml_collections.ConfigDict
  data: types.SimpleNamespace  # name
  eval: types.SimpleNamespace  # modes
  distributed: types.SimpleNamespace  # coordinator_address


def _not_read(config) -> dict[str, str]:
  return {field: who for field, reads, who in _rules(config) if not reads}


def unread_settings(config: ml_collections.ConfigDict, *, flat=None,
                    memo=None) -> dict[str, str]:
  """{field set away from its default that this config does not read: who reads it}.
  `flat`: defaults.flatten(config), where the caller has it; `memo`: as not_read's."""
  values, default = defaults.flatten(config) if flat is None else flat, defaults.flat_defaults()
  skipped = not_read(config, memo=memo)
  unread = {}
  for name, value in values.items():
    if value == default.get(name):
      continue
    section = enclosing(name, skipped)
    if section is not None:
      unread[name] = skipped[section]
  return unread


def check(config: ml_collections.ConfigDict, settings: dict[str, str] | None = None):
  """Raise ValueError naming every setting this config would not read, and who reads it.
  `settings`: unread_settings(config), where the caller has computed it already."""
  unread = unread_settings(config) if settings is None else settings
  if unread:
    values = defaults.flatten(config)
    raise ValueError("settings this run would not read (no setting is silently ignored): "
                     + "; ".join(f"{name}={values[name]!r} is read only by {who}"
                                 for name, who in unread.items())
                     + "; remove them, or choose what reads them")


def experiment_settings_not_read(config: ml_collections.ConfigDict, overrides) -> dict[str, str]:
  """{setting of the experiment file that `config` does not read: who reads it}: the unread
  settings not among `overrides` (dotted names, from the command line or a sweep member), which
  stay for validation to refuse. {} when a choice is invalid (validation names it)."""
  return outside(unread_settings_if_valid(config) or {}, overrides)


def unread_settings_if_valid(config: ml_collections.ConfigDict, *, flat=None,
                             memo=None) -> dict[str, str] | None:
  """unread_settings(config), or None when a choice is invalid (validation names it)."""
  try:
    return unread_settings(config, flat=flat, memo=memo)
  except ValueError:
    return None


def outside(settings: dict[str, str], overrides) -> dict[str, str]:
  """The entries of `settings` (unread settings) that no key of `overrides` sets."""
  return {name: who for name, who in settings.items()
          if not any(within(name, key) for key in overrides)}


def for_run_of_experiment(config: ml_collections.ConfigDict, overrides, log=print):
  """`config` without the experiment's settings this run does not read (set for its sweep's
  other members), which a line names; see experiment_settings_not_read."""
  shared = experiment_settings_not_read(config, overrides)
  if shared:
    log("settings of the experiment this run does not read, left at their defaults: "
        + "; ".join(f"{name} (read by {who})" for name, who in shared.items()))
  return reset(config, shared)


def _from_json(value):
  """A flattened default as the schema holds it: JSON lists back to tuples."""
  return tuple(map(_from_json, value)) if isinstance(value, list) else value


def reset(config: ml_collections.ConfigDict, names) -> ml_collections.ConfigDict:
  """A copy of `config` with the fields `names` at their defaults."""
  config = config.copy_and_resolve_references()
  set_defaults(config, names)
  return config


def set_defaults(config: ml_collections.ConfigDict, names):
  """Set the fields `names` of `config` to their defaults, in place (reset, on a copy)."""
  if not names:
    return
  default = defaults.flat_defaults()
  for name in names:
    *sections, field = name.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[field] = _from_json(default[name])
