"""The docs are current: the tables README.md and docs/ embed from the registries are what
`python -m experiments.variants --write` would write, and every relative link reaches its file
and heading."""

import functools
import os
import re

from research import defaults, variants
from research.model import attention, positions


def test_generated_tables_in_the_docs_are_current():
  model_config = defaults.get_config().model
  model_config.update(variants.DOCS_MODEL_OVERRIDES)
  tables = defaults.doc_tables(model_config)
  assert variants.stale_files(tables) == [], (
      "run `python -m experiments.variants --write` and commit the docs it rewrites")
  embedded = set()
  for name in variants.DOC_FILES:
    with open(os.path.join(variants.ROOT, name)) as f:
      embedded.update(variants.blocks(f.read()))
  assert embedded == set(tables)  # every table is shown, and no block names an unknown one
  for name in list(attention.REGISTRY) + list(positions.REGISTRY):
    assert f"| `{name}` |" in tables["mixers"] + tables["positions"]


def test_every_config_field_says_what_it_is_in_defaults_py():
  """The generated config table takes each field's comment from research/defaults.py: a field
  added without one fails here, naming it."""
  rows = defaults.config_fields()
  assert {name for name, _, _ in rows} >= {"version", "model.d_model", "train.seq_len",
                                           "eval.lengths", "mesh.shape"}
  assert [name for name, _, what in rows if not what] == []


def test_embed_replaces_only_the_body_of_a_generated_block():
  text = "a\n<!-- generated:x (note) -->\nold\nrows\n<!-- /generated:x -->\nb"
  assert variants.embed(text, {"x": "new"}) == (
      "a\n<!-- generated:x (note) -->\nnew\n<!-- /generated:x -->\nb")


def _slug(heading):
  """GitHub's anchor of a Markdown heading: lower case, punctuation but - and _ dropped, each
  space a hyphen."""
  text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code(path):
  """A Markdown page without its fenced code blocks (no headings or links in them)."""
  with open(os.path.join(variants.ROOT, path)) as f:
    return re.sub(r"```.*?```", "", f.read(), flags=re.S)


@functools.cache  # a page is read once, however many links point into it
def _anchors(path):
  return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _without_code(path), flags=re.M)}


def test_relative_links_in_the_docs_reach_a_file_and_a_heading():
  """Every relative link of README.md, BENCHMARKS.md and docs/ names a file that exists and,
  with #anchor into a Markdown page, a heading of it (links inside fenced code are not links)."""
  pages = ["README.md", "BENCHMARKS.md"] + [
      os.path.relpath(os.path.join(folder, name), variants.ROOT)
      for folder, _, names in os.walk(os.path.join(variants.ROOT, "docs"))
      for name in names if name.endswith(".md")]
  broken, checked = [], 0
  for page in pages:
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page)):
      if re.match(r"[a-z]+:", target):  # http(s), mailto
        continue
      checked += 1
      path, _, anchor = target.partition("#")
      resolved = (os.path.normpath(os.path.join(os.path.dirname(page), path)) if path
                  else page)
      if not os.path.exists(os.path.join(variants.ROOT, resolved)):
        broken.append(f"{page}: {target} (no file {resolved})")
      elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
        broken.append(f"{page}: {target} (no heading with anchor #{anchor})")
  assert checked > 100 and broken == [], broken


def test_variants_fields_lists_every_config_field_with_its_default(capsys):
  from experiments import variants as variants_command  # noqa: PLC0415
  variants_command.print_fields()
  lines = capsys.readouterr().out.splitlines()
  names = [line.split()[0] for line in lines]
  assert sorted(names) == sorted(defaults.flatten(defaults.get_config()))
  window = next(line for line in lines if line.startswith("model.softmax.window "))
  assert "read by mha, mqa, gqa" in window, window
