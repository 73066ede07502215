"""The code base's layout: no import cycles between modules, the config schema imported one way
(configs/ -> research/, never back), and research/ organised in packages by stage."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGES = ("research", "configs", "experiments")


def _modules():
  """{dotted module name: path} of every Python file under research/, configs/, experiments/."""
  found = {}
  for package in PACKAGES:
    for directory, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(directory, name)
          dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          found[dotted.removesuffix(".__init__")] = path
  return found


def _imports(path, modules):
  """The modules of `modules` that the file at `path` imports (`from a import b` imports the
  module a.b when there is one, else a)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imported.update(alias.name for alias in node.names if alias.name in modules)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        imported.add(full if full in modules else node.module)
  return imported & modules.keys()


def _cycles(graph):
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        components.append(sorted(component))

  for v in graph:
    if v not in index:
      visit(v)
  return components


@pytest.fixture(scope="module")
def import_graph():
  modules = _modules()
  return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_no_module_imports_itself_through_others(import_graph):
  assert _cycles(import_graph) == []


def test_the_cycle_check_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_research_never_imports_configs(import_graph):
  """The config schema lives in research/defaults.py; configs/ builds on it, not the reverse."""
  back = {name: sorted(d for d in deps if d.split(".")[0] == "configs")
          for name, deps in import_graph.items() if name.split(".")[0] == "research"}
  assert {name: deps for name, deps in back.items() if deps} == {}


def test_the_stages_import_one_way(import_graph):
  """research/'s packages (model, data, training, runs, evaluation, analysis, results, bench,
  pretrained) and modules form no cycle when each is taken as one node: a stage imports only
  the stages before it. Inside a stage, the model and its variant packages may import each
  other (nn, registry); a cycle between modules is still refused by the test above."""

  def stage(name):
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "research" and len(parts) > 1 else parts[0]

  stages = {}
  for name, deps in import_graph.items():
    stages.setdefault(stage(name), set()).update(stage(d) for d in deps)
  assert _cycles({s: deps - {s} for s, deps in stages.items()}) == []


def test_research_holds_packages_and_a_handful_of_modules():
  flat = sorted(name for name in os.listdir(os.path.join(ROOT, "research"))
                if name.endswith(".py") and name != "__init__.py")
  assert len(flat) <= 3, (f"research/ has {len(flat)} flat modules ({', '.join(flat)}); put a "
                          "new one in the package of its stage")
