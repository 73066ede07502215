"""A name -> class table whose lookup errors list the valid names."""


class Registry(dict):

  def __init__(self, what, config_field):
    super().__init__()
    self.what = what
    self.config_field = config_field

  def register(self, name, cls):
    if name in self:
      raise ValueError(f"{self.what} {name!r} is already registered (to {self[name].__name__})")
    self[name] = cls
    return cls

  def lookup(self, name, config_field=None):
    if name not in self:
      raise ValueError(f"unknown {self.what} {name!r} in {config_field or self.config_field}; "
                       f"valid: {', '.join(sorted(self))}")
    return self[name]
