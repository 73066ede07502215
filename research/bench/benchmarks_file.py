"""The suites' sections of BENCHMARKS.md, rewritten by `make bench` (experiments.bench).

Each suite's section holds one block between two marker lines,

  <!-- make bench: mixers -->
  ...
  <!-- end make bench: mixers -->

which a run with --benchmarks=BENCHMARKS.md replaces with that run's description, date, commit,
hardware, command, targets and main table (research.bench.report.body), its whole report (every
table) and figure copied to docs/bench/<suite>.md and .png beside the file. Text outside the
markers (what the numbers mean) is kept as written, so a section always shows one run, never a
patchwork of runs.
"""

import os
import shutil

from research.bench import report


def markers(name):
  """The begin and end lines of suite `name`'s block."""
  return f"<!-- make bench: {name} -->", f"<!-- end make bench: {name} -->"


def _span(text, name):
  """(start, end) of the block's inner text, or a ValueError saying what is wrong with it."""
  begin, end = markers(name)
  if text.count(begin) != 1 or text.count(end) != 1:
    found = sorted({line.split(":", 1)[1].strip(" ->") for line in text.splitlines()
                    if line.startswith("<!-- make bench:")})
    raise ValueError(f"needs exactly one block for suite {name!r}, the lines '{begin}' and "
                     f"'{end}' (found {text.count(begin)} and {text.count(end)}); blocks there: "
                     f"{', '.join(found) or 'none'}")
  start, stop = text.index(begin) + len(begin), text.index(end)
  if stop < start:
    raise ValueError(f"the end line of suite {name!r}'s block comes before its begin line")
  return start, stop


def check(path, name):
  """Raises ValueError, naming the problem, unless `path` exists with one block for `name`;
  called before a suite runs, so that a measured run is never lost to a bad file."""
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist (the file whose '{markers(name)[0]}' block to "
                     "rewrite, e.g. BENCHMARKS.md)")
  with open(path) as f:
    try:
      _span(f.read(), name)
    except ValueError as error:
      raise ValueError(f"{path} {error}") from None


def replace_block(text, name, block):
  """`text` with suite `name`'s block replaced by `block`."""
  start, stop = _span(text, name)
  return f"{text[:start]}\n{block.strip()}\n{text[stop:]}"


def update(path, suite, rows, meta, outputs):
  """Rewrites suite's block of the file at `path` from one run, and copies the run's report and
  figure (`outputs`: {"md": path, "png": path}) to docs/bench/<suite>.md and .png beside it;
  returns the paths written."""
  copies = {}
  for ext in ("md", "png"):
    relative = os.path.join("docs", "bench", f"{suite.name}.{ext}")
    destination = os.path.join(os.path.dirname(os.path.abspath(path)), relative)
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.copyfile(outputs[ext], destination)
    copies[ext] = (relative, destination)
  block = (f"{report.body(suite, rows, meta, level=3, max_tables=1)}\n\n"
           f"Every table of this run: [{copies['md'][0]}]({copies['md'][0]}).\n\n"
           f"![{suite.name}]({copies['png'][0]})")
  with open(path) as f:
    text = replace_block(f.read(), suite.name, block)
  partial = f"{path}.partial"
  with open(partial, "w") as f:
    f.write(text)
  os.replace(partial, path)  # a reader sees the old file or the new one, never half of one
  return [path, copies["md"][1], copies["png"][1]]
