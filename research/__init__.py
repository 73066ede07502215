"""A JAX/Flax NNX lab for attention variants and length extrapolation.

`research.load_run(workdir)` opens a trained run in a notebook (research/analysis/loaded.py). It
is imported on first use: it brings in the evaluation and analysis code (orbax, TFDS, matplotlib:
about 1.8 s), which `import research` and so every `import research.<module>` would otherwise pay
for."""

from research import xla_workarounds

xla_workarounds.apply()  # before anything below can start a JAX backend

from research.model.transformer import build_model, count_params  # noqa: E402


def __getattr__(name: str):
  """research.load_run, imported when it is first asked for (PEP 562)."""
  if name == "load_run":
    from research.analysis.loaded import load_run  # noqa: PLC0415 (on first use, above)
    return load_run
  raise AttributeError(f"module 'research' has no attribute {name!r}")
