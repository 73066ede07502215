"""BENCHMARKS.md's suite blocks: `make bench` rewrites each from one run, and keeps the rest."""

import os
import re

import pytest
from absl import app

from experiments import bench
from research.bench import benchmarks_file

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)

_FILE = """# Benchmarks

## mixers

Before the block.

<!-- make bench: mixers -->
an old run's tables
<!-- end make bench: mixers -->

What the numbers mean (kept).
"""


def test_replace_block_keeps_the_text_around_it():
  text = benchmarks_file.replace_block(_FILE, "mixers", "the new run")
  assert "an old run" not in text and "\nthe new run\n" in text
  assert text.startswith(_FILE.split("<!--")[0]) and text.endswith(_FILE.split("-->")[-1])
  assert benchmarks_file.replace_block(text, "mixers", "the new run") == text


@pytest.mark.parametrize("text, match", [
    (_FILE.replace("mixers -->", "decode -->", 1), r"found 0 and 1\); blocks there: decode"),
    (_FILE + "<!-- make bench: mixers -->\n", "found 2 and 1"),
    ("<!-- end make bench: mixers -->\n<!-- make bench: mixers -->\n", "comes before"),
])
def test_a_bad_block_is_refused_saying_what_is_wrong(tmp_path, text, match):
  path = tmp_path / "BENCHMARKS.md"
  path.write_text(text)
  with pytest.raises(ValueError, match=match):
    benchmarks_file.check(str(path), "mixers")


def test_bench_refuses_a_file_without_the_suites_block_before_measuring(tmp_path):
  path = tmp_path / "BENCHMARKS.md"
  path.write_text(_FILE)
  with pytest.raises(app.UsageError, match="block for suite 'decode'.*blocks there: mixers"):
    bench.parse_args(["--suite=decode", f"--workdir={tmp_path}", f"--benchmarks={path}"])
  with pytest.raises(app.UsageError, match="does not exist"):
    bench.parse_args(["--suite=decode", f"--workdir={tmp_path}",
                      f"--benchmarks={tmp_path / 'missing.md'}"])
  with pytest.raises(app.UsageError, match="--from_json: .*decode.json does not exist"):
    bench.parse_args(["--suite=decode", f"--workdir={tmp_path}", "--from_json"])


def test_a_run_rewrites_its_block_and_figure_and_from_json_reproduces_them(tmp_path):
  path = tmp_path / "BENCHMARKS.md"
  path.write_text(_FILE)
  workdir = tmp_path / "run"
  argv = ["--suite=mixers", f"--workdir={workdir}", "--quick", "--lengths=16", "--only=linear",
          f"--benchmarks={path}"]
  paths = bench.main(argv)
  text = path.read_text()
  block = text.split(benchmarks_file.markers("mixers")[0])[1].split("<!-- end")[0]
  assert "an old run" not in text and "What the numbers mean (kept)." in text
  assert re.search(r"- date: \S+ \(commit \w+", block) and "minutes" in block
  assert f"`python -m experiments.bench {' '.join(argv)}`" in block
  assert "### Targets (ratios from this run)" in block and "| linear |" in block
  assert "![mixers](docs/bench/mixers.png)" in block
  assert "### fwd+bwd time, ms (median)" in block and "### compiled temp memory" not in block
  assert "Every table of this run: [docs/bench/mixers.md](docs/bench/mixers.md)" in block
  figure = tmp_path / "docs" / "bench" / "mixers.png"
  assert figure.read_bytes() == open(paths["png"], "rb").read()
  full = (tmp_path / "docs" / "bench" / "mixers.md").read_text()
  assert full == open(paths["md"]).read() and "## compiled temp memory" in full
  figure.unlink()
  bench.main(["--suite=mixers", f"--workdir={workdir}", "--from_json", f"--benchmarks={path}"])
  assert path.read_text() == text and figure.exists()


def test_the_shipped_file_has_a_block_for_every_suite_that_make_bench_rewrites():
  with open(os.path.join(ROOT, "Makefile")) as f:
    makefile = f.read()
  assert "--suite=$$suite --workdir=runs/bench --benchmarks=BENCHMARKS.md" in makefile
  rewritten = re.search(r"^BENCH_SUITES := (.*)$", makefile, re.MULTILINE).group(1).split()
  assert rewritten and set(rewritten) <= set(bench.SUITES)
  for name in bench.SUITES:
    benchmarks_file.check(os.path.join(ROOT, "BENCHMARKS.md"), name)
