"""Redraw results.csv, summary.md and the figures of a run or a sweep from its results files.

  python -m experiments.plot runs/demo        # a sweep directory (experiments.run)
  python -m experiments.plot runs/alibi       # one run (experiments.train + experiments.evaluate)
"""

from absl import app

from experiments import cli
from research.results import report


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("give one directory: python -m experiments.plot DIR (a run or a sweep)")
  workdir = argv[1]
  written = report.write(workdir)
  if written.missing:
    print(f"runs without results ({len(written.missing)}), left out of the figures: "
          f"{', '.join(written.missing)}")
  print(f"redrew {workdir}/: {', '.join(written.files)}")


if __name__ == "__main__":
  cli.run(main)
