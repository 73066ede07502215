"""The tables that README.md and docs/ embed from the registries are current: what
`python -m experiments.variants --write` would write is what is committed."""

import os

from research import defaults, variants
from research.model import attention, positions


def test_generated_tables_in_the_docs_are_current():
  model_config = defaults.get_config().model
  model_config.update(variants.DOCS_MODEL_OVERRIDES)
  tables = variants.markdown_tables(model_config)
  assert variants.stale_files(tables) == [], (
      "run `python -m experiments.variants --write` and commit the docs it rewrites")
  embedded = set()
  for name in variants.DOC_FILES:
    with open(os.path.join(variants.ROOT, name)) as f:
      embedded.update(variants.blocks(f.read()))
  assert embedded == set(tables)  # every table is shown, and no block names an unknown one
  for name in list(attention.REGISTRY) + list(positions.REGISTRY):
    assert f"| `{name}` |" in tables["mixers"] + tables["positions"]


def test_embed_replaces_only_the_body_of_a_generated_block():
  text = "a\n<!-- generated:x (note) -->\nold\nrows\n<!-- /generated:x -->\nb"
  assert variants.embed(text, {"x": "new"}) == (
      "a\n<!-- generated:x (note) -->\nnew\n<!-- /generated:x -->\nb")
