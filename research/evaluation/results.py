"""A run's evaluation results, RUN/eval.json: a list of rows, appended and never overwritten.

A row holds the metrics of one evaluation and the settings that produced them, its key: the
checkpoint step, the held-out split (eval.splits), the eval length, mode and RoPE scaling, the
number of scored tokens (eval.num_tokens), the sliding-window stride (0 for non-overlapping
windows), the bootstrap samples and seed of its intervals and, for a needle task, the evaluated
depths and the row's depth (none on the row that pools them). Evaluating a run again computes only
the settings it has no row for, so a run trained further or evaluated at new lengths keeps its
earlier rows beside the new ones. Summaries and figures use `latest`: per run, length, mode,
scaling and depth, the row of the newest step (the last one evaluated, on a tie).

Several processes may evaluate a run at once (one while it trains, a sweep's evaluation, a
researcher's): each appends under the run's results lock (research.runs.lock.hold_results),
rereading eval.json there, so none loses another's rows; a row whose key is there already (the
same checkpoint and settings, evaluated by both) is not added twice.
"""

import json
import os
from typing import Iterable

from research.runs import lock

KEY = ("step", "split", "eval_length", "eval_mode", "rope_scaling", "num_tokens", "sliding_stride",
       "bootstrap_samples", "bootstrap_seed", "depths", "depth")
# what a figure plots one value for
POINT = ("split", "eval_length", "eval_mode", "rope_scaling", "depth")
DEFAULT_SPLIT = "validation"  # the split of rows written before rows recorded theirs
FILE_NAME = "eval.json"


def split(row: dict) -> str:
  """The held-out split a row evaluated (eval.splits)."""
  return row.get("split") or DEFAULT_SPLIT


def key(row: dict) -> tuple:
  """The settings of a row (None for settings that rows written before them do not record, but
  the validation split, and for the depths of other tasks than needle tasks)."""
  return tuple(split(row) if name == "split" else
               tuple(value) if isinstance(value := row.get(name), list) else value
               for name in KEY)


def read(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, FILE_NAME)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)


def append(run_dir: str, rows: Iterable[dict]) -> list[dict]:
  """Add the rows whose keys RUN/eval.json does not hold yet, under its results lock, atomically
  (a reader sees the old list or the new one); returns the rows added."""
  path = os.path.join(run_dir, FILE_NAME)
  with lock.hold_results(run_dir):
    existing = read(run_dir)
    done = {key(row) for row in existing}
    new = []
    for row in rows:
      if key(row) not in done:
        done.add(key(row))
        new.append(row)
    if new:
      tmp = f"{path}.tmp.{os.getpid()}"
      with open(tmp, "w") as f:
        json.dump(existing + new, f, indent=1)
      os.replace(tmp, path)
  return new


def latest(rows: Iterable[dict]) -> list[dict]:
  """Per (run, split, eval length, mode, scaling, depth), the row of the newest step, the last one
  on a tie."""
  chosen = {}
  for row in rows:
    point = (row.get("run"), *(split(row) if name == "split" else row.get(name) for name in POINT))
    if point not in chosen or (row.get("step") or 0) >= (chosen[point].get("step") or 0):
      chosen[point] = row
  return list(chosen.values())
