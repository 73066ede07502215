"""Running the analyses (research.analysis.REGISTRY) on a run, or on every finished run of a
sweep and then side by side: python -m experiments.analyze --workdir=DIR --analysis=NAME[,NAME].
"""

import os
from typing import Callable

from research.analysis import REGISTRY
from research.analysis import base
from research.analysis import trained
from research.analysis.base import Settings
from research.runs import checkpoints
from research.runs import config_fields
from research.runs import workdirs

ANALYSES = REGISTRY


def problem(name: str, config) -> str | None:
  """Why analysis `name` cannot run on a run of `config`, naming what can; None if it can."""
  return ANALYSES[name].problem(config)


def check_names(names: list[str]):
  unknown = [n for n in names if n not in ANALYSES]
  if unknown or not names:
    raise ValueError(f"unknown analysis {', '.join(unknown) or '(none given)'}; valid: "
                     f"{', '.join(ANALYSES)}")


def _finished(run: workdirs.Run) -> bool:
  saved = checkpoints.steps(run.directory)
  if not saved:
    return False
  return saved[-1] >= config_fields.load_saved(run.directory).train.num_steps


def analyze(workdir: str, names: list[str], settings: Settings = Settings(),
            log: Callable[[str], None] = print) -> list[str]:
  """Run the analyses `names` on the run in `workdir`, or on every finished run of the sweep in
  `workdir` (then compare them in DIR/analysis/<name>/); returns the directories written."""
  check_names(names)
  sweep = workdirs.is_sweep(workdir)
  runs = workdirs.runs(workdir)
  if sweep:
    unfinished = [run.name for run in runs if not _finished(run)]
    runs = [run for run in runs if run.name not in unfinished]
    if unfinished:
      log(f"not finished, left out: {', '.join(unfinished)}")
    if not runs:
      raise FileNotFoundError(f"no run of the sweep {workdir} is finished; run it first "
                              f"(python -m experiments.run with this --workdir)")
  written = []
  for analysis in names:
    rows, skipped = [], {}  # skipped: {reason: the runs it excludes}
    for run in runs:
      reason = problem(analysis, config_fields.load_saved(run.directory))
      if reason and not sweep:
        raise ValueError(f"{run.name}: {reason}")
      if reason:
        skipped.setdefault(reason, []).append(run.name)
        log(f"{run.name}: {analysis} skipped: {reason}")
        continue
      checkpointed = trained.Checkpoints(run.directory, log)
      out = os.path.join(run.directory, "analysis", analysis)
      os.makedirs(out, exist_ok=True)
      log(f"{run.name}: {analysis}")
      rows += ANALYSES[analysis].run(checkpointed, run.name, out, settings)
      written.append(out)
    if sweep:
      if not rows:
        raise ValueError(f"{analysis}: no run of {workdir} could be analysed: "
                         f"{_skipped_text(skipped)}")
      out = os.path.join(workdir, "analysis", analysis)
      os.makedirs(out, exist_ok=True)
      _compare(analysis, rows, skipped, out)
      written.append(out)
  return written


def _skipped_text(skipped: dict[str, list[str]]) -> str:
  """Each reason once, with the runs it excludes."""
  return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in skipped.items())


def _compare(name: str, rows: list[dict], skipped: dict[str, list[str]], out: str):
  """A sweep's runs side by side: all their rows, one figure, a summary."""
  cls = ANALYSES[name]
  rows = cls.compared_rows(rows)
  base.write_csv(os.path.join(out, cls.csv_name), rows)
  runs = list(dict.fromkeys(r["run"] for r in rows))
  lines = [f"# {name} across the sweep", "", f"Runs: {', '.join(runs)}; each run's own "
           f"figures and summary are in runs/<name>/analysis/{name}/.", ""]
  lines += cls.compare(rows, out)
  if skipped:
    lines += ["", "Skipped: " + _skipped_text(skipped)]
  base.write_summary(os.path.join(out, "summary.md"), lines)
