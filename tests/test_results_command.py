"""`make results` (experiments/results.py): every result figure of README.md and docs/ has an entry
that makes it, each entry's commands name a preset and analyses that exist, and the copy step
puts the files in docs/ with how they were made."""

import json
import os
import re

import pytest

from research.results import made as results
from research.analysis import analyze
from research.results import sweep

ROOT = results.ROOT


def _pages():
  docs = os.path.join(ROOT, "docs")
  return [os.path.join(ROOT, "README.md")] + [
      os.path.join(docs, name) for name in sorted(os.listdir(docs)) if name.endswith(".md")]


def test_every_result_figure_in_the_docs_is_made_by_an_entry():
  """Each image README.md and docs/*.md show, but the benchmark suites' (make bench), is a
  destination of RESULTS; each destination is linked from a page."""
  destinations = {f"docs/{d}" for r in results.RESULTS for d in r.copies.values()}
  shown, linked = set(), set()
  for page in _pages():
    with open(page) as f:
      text = f.read()
    base = os.path.relpath(os.path.dirname(page), ROOT)
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
      shown.add(os.path.normpath(os.path.join(base, image)))
    for target in re.findall(r"\]\(([^)#]+)\)", text):
      linked.add(os.path.normpath(os.path.join(base, "".join(target.split()))))
  shown = {path for path in shown if not path.startswith("docs/bench/")}
  assert shown - destinations == set(), "figures no entry makes"
  assert destinations - linked == set(), "entries whose files no page links"


@pytest.mark.parametrize("result", results.RESULTS, ids=lambda r: r.name)
def test_each_entry_runs_a_preset_and_analyses_that_exist(result, tmp_path):
  lines, directory = results.commands(result, str(tmp_path))
  assert directory.startswith(str(tmp_path))
  for line in lines:
    module, args = line[2], dict(a.split("=", 1) for a in line[3:])
    assert args["--workdir"].startswith(directory)
    if module == "experiments.run":
      path, preset = args["--config"].split(":")
      assert sweep.load_module(os.path.join(ROOT, path)).get_sweep(preset)
    else:
      assert module == "experiments.analyze"
      assert set(args["--analysis"].split(",")) <= set(analyze.ANALYSES)


def test_unknown_names_are_refused_before_any_work():
  assert [r.name for r in results.selected(["mad", "demo"])] == ["mad", "demo"]
  assert len(results.selected(None)) == len(results.RESULTS)
  with pytest.raises(ValueError, match="unknown result dmeo; valid: demo, demo_heads"):
    results.selected(["demo", "dmeo"])


def test_copies_carry_how_they_were_made_and_a_missing_file_copies_nothing(tmp_path):
  result = results.Result("toy", (), {"summary.md": "toy/summary.md", "fig.png": "toy/fig.png"})
  run, docs = tmp_path / "run", tmp_path / "docs"
  run.mkdir()
  (run / "summary.md").write_text("| a |\n")
  entry = {"command": "python -m experiments.results --only=toy", "runs": "python -m x",
           "commit": "abc1234", "date": "2026-12-03", "hardware": "a CPU, 2 cores",
           "minutes": 1.25}
  with pytest.raises(FileNotFoundError, match="did not write fig.png"):
    results.copy(result, str(run), str(docs), entry)
  assert not docs.exists()
  (run / "fig.png").write_bytes(b"\x89PNG")
  files = results.copy(result, str(run), str(docs), entry)
  assert files == ["docs/toy/summary.md", "docs/toy/fig.png"]
  assert (docs / "toy" / "summary.md").read_text() == (
      "Made by `python -m experiments.results --only=toy` from commit abc1234 on 2026-12-03, "
      "a CPU, 2 cores, in 1.2 min.\n\n| a |\n")
  assert (docs / "toy" / "fig.png").read_bytes() == b"\x89PNG"
  made = docs / "made.json"
  results.record(str(made), files, entry)
  results.record(str(made), ["docs/other.png"], dict(entry, commit="def5678"))
  assert json.loads(made.read_text())["docs/toy/fig.png"]["commit"] == "abc1234"
  table = (docs / "made.md").read_text().splitlines()
  assert table[-3:] == [
      "| docs/other.png | `python -m experiments.results --only=toy` | def5678 | 2026-12-03 | "
      "a CPU, 2 cores | 1.2 |",
      "| docs/toy/fig.png | `python -m experiments.results --only=toy` | abc1234 | 2026-12-03 | "
      "a CPU, 2 cores | 1.2 |",
      "| docs/toy/summary.md | `python -m experiments.results --only=toy` | abc1234 | "
      "2026-12-03 | a CPU, 2 cores | 1.2 |"]


def test_a_sweep_with_a_failed_or_lost_run_is_not_copied(tmp_path):
  for name, status in (("a", {"state": "done"}), ("b", {"state": "skipped", "reason": "x"}),
                       ("c", {"state": "failed", "error": "ValueError"}), ("d", None)):
    (tmp_path / "runs" / name).mkdir(parents=True)
    if status:
      (tmp_path / "runs" / name / "status.json").write_text(json.dumps(status))
  assert results.unfinished_runs(str(tmp_path)) == ["c", "d"]
  assert results.unfinished_runs(str(tmp_path / "no_sweep")) == []


def test_a_page_shows_an_embedded_table_in_its_block_and_a_missing_block_writes_nothing(
    tmp_path):
  result = results.Result("toy", (), {"fig.png": "toy/fig.png"}, embeds={"width.md": "page.md"})
  run, docs = tmp_path / "run", tmp_path / "docs"
  run.mkdir()
  docs.mkdir()
  (run / "fig.png").write_bytes(b"\x89PNG")
  (run / "width.md").write_text("# Accuracy by width\n\nSeeds 0, 1.\n\n## Width 64\n\n| a |\n")
  page = "# Results\n\n## Toy\n\nProse.\n\n<!-- made:toy/width.md -->\nold table\n" \
         "<!-- /made:toy/width.md -->\n\nMore prose.\n"
  (docs / "page.md").write_text(page.replace("made:toy/width.md", "made:toy/other.md"))
  entry = {"command": "python -m experiments.results --only=toy", "commit": "abc1234",
           "date": "2026-12-05", "hardware": "a CPU", "minutes": 1.0}
  with pytest.raises(ValueError, match="docs/page.md has no block <!-- made:toy/width.md -->"):
    results.copy(result, str(run), str(docs), entry)
  assert not (docs / "toy").exists()  # nothing copied before every block was found
  (docs / "page.md").write_text(page)
  files = results.copy(result, str(run), str(docs), entry)
  assert files == ["docs/toy/fig.png", "docs/page.md (block toy/width.md)"]
  assert (docs / "page.md").read_text() == (
      "# Results\n\n## Toy\n\nProse.\n\n<!-- made:toy/width.md -->\n"
      "Made by `python -m experiments.results --only=toy` from commit abc1234 on 2026-12-05, "
      "a CPU, in 1.0 min.\n\nSeeds 0, 1.\n\n#### Width 64\n\n| a |\n"
      "<!-- /made:toy/width.md -->\n\nMore prose.\n")


def test_every_embedded_table_has_its_block_in_its_page():
  for result in results.RESULTS:
    for source, page in result.embeds.items():
      with open(os.path.join(ROOT, "docs", page)) as f:
        assert results.block(result, source) in results.variants.blocks(f.read(), kind="made")


def test_the_record_names_the_commits_and_machines_that_trained_runs_from_earlier_sittings(
    tmp_path):
  for name, status in (("a", {"state": "done", "commit": "abc1234", "hardware": "CPU X"}),
                       ("b", {"state": "done", "commit": "abc1234", "hardware": "a CPU"}),
                       ("c", {"state": "done"}), ("d", {"state": "skipped", "reason": "x"})):
    (tmp_path / "runs" / name).mkdir(parents=True)
    (tmp_path / "runs" / name / "status.json").write_text(json.dumps(status))
  runs = results.run_sources(str(tmp_path), "commit")
  assert runs == {"abc1234": 2, "not recorded": 1}
  machines = results.run_sources(str(tmp_path), "hardware")
  assert machines == {"CPU X": 1, "a CPU": 1, "not recorded": 1}
  entry = {"command": "python -m experiments.results --only=toy", "commit": "def5678",
           "run_commits": runs, "run_hardware": machines, "date": "2026-12-05",
           "hardware": "a CPU", "minutes": 2.0}
  assert results.provenance_line(entry) == (
      "Made by `python -m experiments.results --only=toy` from commit def5678 (runs: abc1234 x2, "
      "not recorded x1) on 2026-12-05, a CPU (runs: CPU X x1, a CPU x1, not recorded x1), in "
      "2.0 min (runs kept from earlier sittings not counted).")
  assert results.provenance_line(dict(entry, run_commits={"def5678": 3})).endswith(" in 2.0 min.")
  assert results.commit_cell(dict(entry, run_commits={"def5678": 3})) == "def5678"
  assert results.hardware_cell(dict(entry, run_hardware={"a CPU": 3})) == "a CPU"
  assert results.hardware_cell({"hardware": "a CPU"}) == "a CPU"  # entries made before
  assert results.commit_cell({"commit": "def5678"}) == "def5678"  # entries made before
