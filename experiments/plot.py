"""Redraw results.csv, summary.md and the figures of a run or a sweep from its results files
(eval.json), and training_curves.png from its metrics.jsonl, while it trains too.

  python -m experiments.plot --workdir=runs/demo    # a sweep directory (experiments.run)
  python -m experiments.plot --workdir=runs/alibi   # one run (experiments.train + .evaluate)
  python -m experiments.plot runs/demo              # the same, the directory as an argument
"""

from absl import app

from experiments import cli
from research.results import report


_WORKDIR = cli.workdir_flag("A run directory (config.json) or a sweep directory "
                            "(sweep.json).")


def main(argv):
  given = [d for d in (_WORKDIR.value, *argv[1:]) if d]
  if len(given) != 1:
    raise app.UsageError("give one directory: python -m experiments.plot --workdir=DIR (a run or "
                         f"a sweep; DIR alone also works), not {len(given)}")
  workdir = given[0]
  written = report.write(workdir)
  if written.missing:
    print(f"runs left out of the figures ({len(written.missing)}; not evaluated, or for "
          f"training_curves.png no step in metrics.jsonl): {', '.join(written.missing)}")
  print(f"redrew {workdir}/: {', '.join(written.files)}")


if __name__ == "__main__":
  cli.run(main)
