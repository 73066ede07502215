"""Training curves of a run or a sweep from each run's metrics.jsonl (research.training.metrics:
one record per logged step with its `loss`, and `validation_loss` at the evaluation steps and the
last), which research.results.plots.training_curves draws as training_curves.png. A run still
training is read as far as it has logged, so the curves show progress before any evaluation."""

import json
import os
from typing import NamedTuple

METRICS_FILE = "metrics.jsonl"
FIGURE = "training_curves.png"


class Curve(NamedTuple):
  run: str
  label: str  # the run's variant, as the other figures' legends name it
  steps: list[int]
  loss: list[float]  # the training loss (cross-entropy over the scored tokens) at each step
  validation_steps: list[int]
  validation_loss: list[float]
  tokens_per_step: int  # train.batch_size * train.seq_len


def records(directory: str) -> list[dict]:
  """The records of DIR/metrics.jsonl ([] without it). A last line without its newline is being
  appended by a run still training: it is left out, not read half-written."""
  path = os.path.join(directory, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def curve(run: str, label: str, directory: str, config) -> Curve | None:
  """The run's curve from its metrics.jsonl and its config; None if it has logged no step."""
  logged = records(directory)
  if not logged:
    return None
  validated = [r for r in logged if "validation_loss" in r]
  return Curve(run, label, [r["step"] for r in logged], [r["loss"] for r in logged],
               [r["step"] for r in validated], [r["validation_loss"] for r in validated],
               config.train.batch_size * config.train.seq_len)


def _span(values) -> str:
  """'128', '64/128' or '16-2048': the values of one setting over the plotted runs."""
  values = sorted(set(values))
  if len(values) <= 3:
    return "/".join(map(str, values))
  return f"{values[0]}-{values[-1]}"


def title(workdir: str, configs: list, is_sweep: bool) -> str:
  """What was trained: the run or sweep (its directory's name), the data and the training length
  of the plotted runs' configs."""
  name = os.path.basename(os.path.abspath(workdir))
  what = f"sweep {name} ({len(configs)} runs)" if is_sweep else f"run {name}"
  tasks = sorted({c.data.name for c in configs})
  data_text = ", ".join(tasks) if len(tasks) <= 3 else f"{len(tasks)} tasks"
  steps, batch, length = (_span(c.train[k] for c in configs)
                          for k in ("num_steps", "batch_size", "seq_len"))
  return (f"Training loss of {what} on {data_text}: {steps} steps of {batch} sequences x "
          f"{length} tokens")
