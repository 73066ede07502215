"""What a workdir holds: one run (DIR/config.json, written by experiments.train) or a sweep
(DIR/sweep.json, and each member's run in DIR/runs/<name>/, written by experiments.run)."""

import dataclasses
import json
import os

import ml_collections

from research.runs import config_fields

SWEEP_FILE = "sweep.json"


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  directory: str


def is_sweep(workdir: str) -> bool:
  return os.path.exists(os.path.join(workdir, SWEEP_FILE))


def sweep_record(workdir: str) -> dict:
  """DIR/sweep.json: {"config": the sweep's base config, "members": run names}."""
  with open(os.path.join(workdir, SWEEP_FILE)) as f:
    return json.load(f)


def base_config(workdir: str) -> ml_collections.ConfigDict:
  """The config of a run, or a sweep's base config, over the current defaults."""
  if is_sweep(workdir):
    return config_fields.merge_saved(sweep_record(workdir)["config"],
                                     os.path.join(workdir, SWEEP_FILE))
  return config_fields.load_saved(workdir)


def runs(workdir: str) -> list[Run]:
  """The runs of a sweep (in sweep order, finished or not), or the one run of a run directory."""
  if is_sweep(workdir):
    return [Run(name, os.path.join(workdir, "runs", name))
            for name in sweep_record(workdir)["members"]]
  if os.path.exists(os.path.join(workdir, "config.json")):
    return [Run(os.path.basename(os.path.abspath(workdir)), workdir)]
  raise ValueError(f"{workdir} holds neither a run (config.json) nor a sweep (sweep.json); give a "
                   "--workdir that experiments.train or experiments.run wrote")
