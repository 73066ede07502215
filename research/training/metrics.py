"""Metrics output: metrics.jsonl (one JSON object per logged step), a progress line with the
elapsed time and the ETA,
and the trackers of train.trackers (research.training.trackers: TensorBoard, Weights & Biases)."""

import json
import os
import time

from research.training import trackers


class MetricWriter:
  """One interface for every output of the logged steps: each record goes to the trackers, then
  to metrics.jsonl, then to the progress line, so a run killed at any point leaves a tracker
  that writes as it is called (TensorBoard's) holding every step metrics.jsonl holds. `enabled`:
  whether this process writes (one of a multi-process run does); `resume_step`: the step the run
  resumes from (records after it in metrics.jsonl are dropped: the run logs them again)."""

  def __init__(self, workdir, config, *, enabled=True, resume_step=0):
    self.enabled = enabled
    self.started = time.perf_counter()  # this process's start: the progress line's elapsed time
    self.path = os.path.join(workdir, "metrics.jsonl")
    if enabled and os.path.exists(self.path):
      self._drop_records_after(resume_step)
    self.trackers = [trackers.REGISTRY[name](workdir, config, resume_step)
                     for name in config.train.trackers] if enabled else []

  def _drop_records_after(self, step):
    """Records logged after the checkpoint a run resumes from are logged again: drop them."""
    with open(self.path) as f:
      kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(kept)

  def write(self, record, *, eta_seconds, num_steps):
    if not self.enabled:
      return
    for tracker in self.trackers:
      tracker.write(record)
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    extra = f" val {record['validation_loss']:.4f}" if "validation_loss" in record else ""
    print(f"step {record['step']}/{num_steps}  loss {record['loss']:.4f}{extra}  "
          f"lr {record['learning_rate']:.2e}  {record['tokens_per_second']:,.0f} tok/s  "
          f"mfu {100 * record['mfu']:.1f}%  elapsed {duration(time.perf_counter() - self.started)}"
          f"  eta {duration(eta_seconds)}", flush=True)

  def close(self):
    for tracker in self.trackers:
      tracker.close()


def duration(seconds):
  minutes, seconds = divmod(int(seconds), 60)
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
