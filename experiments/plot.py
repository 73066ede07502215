"""Redraw a sweep's summary.md and figures from its results files alone.

  python -m experiments.plot runs/demo
"""

import os
import sys

from research import report


def main():
  if len(sys.argv) != 2:
    sys.exit("usage: python -m experiments.plot DIR  (a sweep directory with sweep.json)")
  workdir = sys.argv[1]
  if not os.path.exists(os.path.join(workdir, "sweep.json")):
    sys.exit(f"{workdir} holds no sweep (no sweep.json); run experiments.run there first")
  missing = report.redraw(workdir)
  if missing:
    print(f"runs without results ({len(missing)}), left out of the figures: {', '.join(missing)}")
  print(f"redrew {workdir}/summary.md and the figures")


if __name__ == "__main__":
  main()
