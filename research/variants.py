"""The variant registries together: mixers, position schemes, feed-forwards, norms.

Everything that enumerates variants across registries (the default config's sub-dicts, the
conformance suite's small settings, the generated variant tables of README.md and docs/) reads
them from here.
"""

import os
import re
import sys

from research.model import attention
from research.model import feed_forward
from research.model import norms
from research.model import positions

REGISTRIES = (attention.REGISTRY, positions.REGISTRY, feed_forward.REGISTRY, norms.REGISTRY)


def registry_state() -> tuple:
  """What the default config depends on: every registered (name, class), hashable, so that a
  value derived from the defaults can be kept until a variant is (un)registered."""
  return tuple((name, cls) for registry in REGISTRIES for name, cls in registry.items())


def default_settings() -> dict:
  """{settings key: defaults} of every registered variant with hyperparameters."""
  out = {}
  for registry in REGISTRIES:
    out.update(registry.default_settings())
  return out


def test_settings() -> dict:
  """{settings key: small settings for the conformance suite} (each variant's test_settings)."""
  out = {}
  for registry in REGISTRIES:
    out.update(registry.test_settings())
  return out


def summary(cls) -> str:
  """The first sentence of the docstring of the module that defines `cls` (its paper and what it
  is), for the generated variant tables: up to the first full stop, or a colon that ends a line
  (an equation follows), outside parentheses."""
  text = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().split("\n\n")[0]
  depth = 0
  for i, char in enumerate(text):
    depth += {"(": 1, ")": -1}.get(char, 0)
    after = text[i + 1:i + 2]
    ends = (char == "." and after in ("", " ", "\n")) or (char == ":" and after in ("", "\n"))
    if depth == 0 and ends:
      text = text[:i]
      break
  return " ".join(text.split())


def _cell(value) -> str:
  if isinstance(value, (set, frozenset)):
    return ", ".join(sorted(value))
  return ", ".join(value) if isinstance(value, tuple) else str(value)


def markdown_tables(model_config) -> dict[str, str]:
  """{block name: markdown} of the tables that README.md and docs/ embed between
  `<!-- generated:NAME -->` markers, computed from the registries at `model_config`'s sizes
  (`python -m experiments.variants --write` rewrites them; tests/test_docs.py checks them)."""
  from flax import nnx  # noqa: PLC0415 (the model only when tables are drawn)
  from research.model import transformer as model_lib  # noqa: PLC0415

  def build(**fields):
    config = model_config.copy_and_resolve_references()
    config.update(fields)
    return nnx.eval_shape(lambda: model_lib.build_model(config, rngs=nnx.Rngs(0)))

  sizes = (f"num_layers={model_config.num_layers}, d_model={model_config.d_model}, "
           f"num_heads={model_config.num_heads}, num_kv_heads={model_config.num_kv_heads} (gqa), "
           f"vocab_size={model_config.vocab_size}, {model_config.compute_dtype}")
  mixers = ["| mixer | what it is | position hooks | backends | parameters | cache bytes @1024 "
            "| decodes packed documents |", "|---|---|---|---|---|---|---|"]
  for name, cls in attention.REGISTRY.items():
    compatible = model_lib.compatible_positions(cls)
    model = build(attention=name, position=compatible[0])
    mixers.append(f"| `{name}` | {summary(cls)} | {_cell(cls.position_hooks) or '-'} | "
                  f"{_cell(cls.backends) if cls.backends else '-'} | "
                  f"{model_lib.count_params(model):,} | {model.cache_bytes(1, 1024):,} | "
                  f"{'no' if cls.document_decode_refusal(cls.hyperparameters) else 'yes'} |")
  mixers.append(f"\nAt {sizes}; cache bytes: the decode cache or state of one sequence; decodes "
                "packed documents: at its default settings, from "
                "`init_cache(..., documents=True)` (a mixer that cannot says why when asked).")
  plain = model_lib.count_params(build(attention="mha", position="none"))
  schemes = ["| scheme | what it is | hooks | per layer | parameters added (mha) |",
             "|---|---|---|---|---|"]
  for name, cls in positions.REGISTRY.items():
    added = model_lib.count_params(build(attention="mha", position=name)) - plain
    schemes.append(f"| `{name}` | {summary(cls)} | {_cell(cls.hooks()) or '-'} | "
                   f"{'no' if cls.shared_across_layers else 'yes'} | {added:,} |")
  names = list(positions.REGISTRY)
  compatibility = ["| mixer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for name, cls in attention.REGISTRY.items():
    compatible = model_lib.compatible_positions(cls)
    compatibility.append(f"| `{name}` | " + " | ".join("yes" if p in compatible else "-"
                                                       for p in names) + " |")
  feed_forwards = ["| feed-forward | what it is | parameters | per token |", "|---|---|---|---|"]
  for name, cls in feed_forward.REGISTRY.items():
    model = build(attention="mha", position="none", feed_forward=name)
    feed_forwards.append(f"| `{name}` | {summary(cls)} | {model_lib.count_params(model):,} | "
                         f"{model_lib.count_params(model, embeddings=False):,} |")
  users = {}
  for registry in REGISTRIES:
    for name in registry:
      users.setdefault(registry.settings_key(name), []).append(name)
  defaults = ["| sub-dict | used by | fields (defaults) |", "|---|---|---|"]
  for key, fields in default_settings().items():
    defaults.append(f"| `model.{key}` | {', '.join(users[key])} | "
                    + ", ".join(f"`{field}` {value!r}" for field, value in fields.items()) + " |")
  names = "\n".join(
      f"- {what} (`--config.{registry.config_field}=NAME`): "
      + ", ".join(f"`{name}`" for name in registry)
      for what, registry in (("mixers", attention.REGISTRY), ("position schemes", positions.REGISTRY),
                             ("feed-forwards", feed_forward.REGISTRY), ("norms", norms.REGISTRY)))
  return {"names": names, "mixers": "\n".join(mixers), "positions": "\n".join(schemes),
          "compatibility": "\n".join(compatibility), "feed-forwards": "\n".join(feed_forwards),
          "config-defaults": "\n".join(defaults)}


def embed(text: str, tables: dict[str, str], kind: str = "generated") -> str:
  """`text` with each `<!-- KIND:NAME ... -->` ... `<!-- /KIND:NAME -->` block's body replaced by
  tables[NAME]; blocks of other names are left alone (`make results` fills its `made:...` blocks
  one entry at a time; tests/test_docs.py checks that no generated block names an unknown
  table)."""
  def replace(match):
    if match.group(2) not in tables:
      return match.group(0)
    return f"{match.group(1)}\n{tables[match.group(2)]}\n{match.group(3)}"

  return re.sub(rf"(<!-- {kind}:([\w./-]+)[^>]*-->)\n.*?(<!-- /{kind}:\2 -->)", replace, text,
                flags=re.S)


# The files that embed generated tables (relative to the repository's root, ROOT).
DOC_FILES = ("README.md", "docs/variants.md", "docs/positions.md", "docs/architecture.md")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The sizes the tables are computed at: the default model, with GQA at 2 key/value heads.
DOCS_MODEL_OVERRIDES = {"num_kv_heads": 2}


def blocks(text: str, kind: str = "generated") -> list[str]:
  """The names of the `kind` blocks in `text`."""
  return re.findall(rf"<!-- {kind}:([\w./-]+)", text)


def stale_files(tables: dict[str, str]) -> list[str]:
  """The doc files whose generated blocks differ from `tables`."""
  stale = []
  for name in DOC_FILES:
    with open(os.path.join(ROOT, name)) as f:
      text = f.read()
    if embed(text, tables) != text:
      stale.append(name)
  return stale
