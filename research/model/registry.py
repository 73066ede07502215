"""A name -> class table whose lookup errors list the valid names.

Each registered class declares its own hyperparameters (`hyperparameters`, a dict of defaults).
They live in the config sub-dict `model.<settings key>` (the registry name unless the entry names
a shared one, as mha / mqa / gqa share `model.softmax`), so the config schema (research/defaults.py) lists no
family-prefixed fields and `--config.model.fire.hidden=32` works for any variant.
"""

import difflib

import ml_collections


def did_you_mean(name, valid) -> str:
  """" (did you mean 'x'?)" for the valid name closest to a misspelt `name`, or ""."""
  closest = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
  return f" (did you mean {closest[0]!r}?)" if closest else ""


class Registry(dict):

  def __init__(self, what, config_field):
    super().__init__()
    self.what = what
    self.config_field = config_field
    self._settings_keys = {}
    self._variant_of = {}

  def register(self, name, cls, settings=None, variant_of=None):
    """Add `cls` as `name`; its hyperparameters go under model.<settings or name>. variant_of
    names an entry whose code this one runs with other head counts (mqa, gqa: of mha), so
    CPU sweeps may run that entry alone for both."""
    if name in self:
      raise ValueError(f"{self.what} {name!r} is already registered (to {self[name].__name__})")
    if variant_of is not None and variant_of not in self:
      raise ValueError(f"{name!r} is a variant of {variant_of!r}, which is not registered")
    self[name] = cls
    self._settings_keys[name] = settings or name
    self._variant_of[name] = variant_of
    return cls

  def unregister(self, name):
    """Remove entry `name` (a variant registered for a test or a scratch experiment)."""
    self.lookup(name)
    del self[name], self._settings_keys[name], self._variant_of[name]

  def variant_of(self, name):
    """The entry this one is a head-count variant of, or None."""
    return self._variant_of[name]

  def lookup(self, name, config_field=None):
    if name not in self:
      raise ValueError(f"unknown {self.what} {name!r} in {config_field or self.config_field}"
                       f"{did_you_mean(name, self)}; valid: {', '.join(sorted(self))}")
    return self[name]

  def settings_key(self, name):
    return self._settings_keys[name]

  def settings(self, name, model_config) -> ml_collections.ConfigDict:
    """The entry's hyperparameters from `model_config` (its defaults where the sub-dict is absent)."""
    key = self.settings_key(name)
    defaults = ml_collections.ConfigDict(dict(self.lookup(name).hyperparameters))
    # Not get() alone: on a missing key it builds a did-you-mean message (per sweep member).
    given = model_config.get(key) if key in model_config else None
    if given is None:
      return defaults
    unknown = sorted(set(given) - set(defaults))
    if unknown:
      raise ValueError(f"unknown field(s) {', '.join(f'model.{key}.{u}' for u in unknown)} for "
                       f"{self.what} {name!r}; valid: "
                       f"{', '.join(f'model.{key}.{f}' for f in defaults) or '(none)'}")
    defaults.update(dict(given))
    return defaults

  def test_settings(self):
    """{settings key: the small settings of the conformance suite} of every entry that declares
    them (`test_settings`); entries sharing a key share them, and must not declare different
    ones (the suite builds them all from one sub-dict)."""
    out, declared_by = {}, {}
    for name, cls in self.items():
      if cls.test_settings:
        unknown = set(cls.test_settings) - set(cls.hyperparameters)
        if unknown:
          raise ValueError(f"{self.what} {name!r} declares test_settings {sorted(unknown)} that "
                           f"are not among its hyperparameters {sorted(cls.hyperparameters)}")
        key = self.settings_key(name)
        if key in out and out[key] != dict(cls.test_settings):
          raise ValueError(f"{self.what} {name!r} declares test_settings {cls.test_settings} for "
                           f"model.{key}, which {declared_by[key]!r} declares as {out[key]}; "
                           "entries that share settings share their test settings")
        out.setdefault(key, dict(cls.test_settings))
        declared_by.setdefault(key, name)
    return out

  def default_settings(self):
    """{settings key: defaults} for every entry with hyperparameters, for the default config."""
    out = {}
    for name, cls in self.items():
      if cls.hyperparameters:
        out.setdefault(self.settings_key(name), dict(cls.hyperparameters))
    return out
