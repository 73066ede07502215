"""Every result figure and table of README.md and docs/ from one command on the current code.

  make results                                          # all of them (hours on 2 CPU cores)
  python -m experiments.results --only=demo,mad         # some of them
  python -m experiments.results --dry_run               # what it would run and copy

Each entry of RESULTS runs its commands (a quick preset through experiments.run, then any head
analyses) in a directory of its own under --workdir (default runs/results; rerunning does only
what is not done, as experiments.run does), then copies the files it names into docs/ and
records in docs/made.md which command made each file, from which commit, when, on what
hardware and in how long. A Markdown file gets that line at its top too. An entry whose command
fails, or whose sweep has a run that is not done, copies nothing and the others go on; the
command exits with status 1 naming them.
BENCHMARKS.md's tables come from `make bench`, not from here.
"""

import datetime
import os
import subprocess
import time

from absl import flags
from absl import logging

from experiments import cli
from research.results import made
from research.runs import provenance

_WORKDIR = cli.workdir_flag("Where the entries' sweeps are run (one directory each).")
_ONLY = flags.DEFINE_list("only", None, "Entries to make (default: all): "
                          f"{', '.join(made.BY_NAME)}.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands and copies; run nothing.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  results = made.selected(_ONLY.value)
  workdir = os.path.abspath(_WORKDIR.value or os.path.join("runs", "results"))
  failed = []
  for result in results:
    lines, directory = made.commands(result, workdir)
    shown = " && ".join(" ".join(["python", *line[1:]]) for line in lines)
    if _DRY_RUN.value:
      print(f"{result.name}: {shown}")
      for source, destination in result.copies.items():
        print(f"  {os.path.join(directory, source)} -> docs/{destination}")
      continue
    print(f"{result.name}: {shown}", flush=True)
    started, code = time.monotonic(), provenance.commit()
    status = 0
    for line in lines:
      status = subprocess.run(line, cwd=made.ROOT).returncode
      if status:
        break
    unfinished = made.unfinished_runs(directory)
    if status or unfinished:
      why = f"exit status {status}" if status else f"runs not done: {', '.join(unfinished)}"
      print(f"{result.name}: FAILED ({why}); nothing copied", flush=True)
      failed.append(result.name)
      continue
    entry = {"command": f"python -m experiments.results --only={result.name}",
             "runs": shown, "commit": code, "run_commits": made.run_sources(directory, "commit"),
             "run_hardware": made.run_sources(directory, "hardware"),
             "date": datetime.date.today().isoformat(), "hardware": provenance.hardware(),
             "minutes": (time.monotonic() - started) / 60}
    files = made.copy(result, directory, os.path.join(made.ROOT, "docs"), entry)
    made.record(os.path.join(made.ROOT, made.MADE), files, entry)
    print(f"{result.name}: copied {', '.join(files)}", flush=True)
  if failed:
    raise SystemExit(f"error: {len(failed)} result(s) failed: {', '.join(failed)} (their own "
                     "output says why); the others were copied")


if __name__ == "__main__":
  cli.run(main)
