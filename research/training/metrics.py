"""Metrics output: metrics.jsonl (one JSON object per logged step), a progress line with ETA,
and optional TensorBoard event files (tensorboardX: no TensorFlow needed)."""

import json
import os


class MetricWriter:

  def __init__(self, workdir, *, enabled=True, tensorboard=False, resume_step=0):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    if enabled and os.path.exists(self.path):
      self._drop_records_after(resume_step)
    self.tensorboard = None
    if enabled and tensorboard:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional; checked in research.training.checks)

      self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def _drop_records_after(self, step):
    """Records logged after the checkpoint a run resumes from are logged again: drop them."""
    with open(self.path) as f:
      kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(kept)

  def write(self, record, *, eta_seconds, num_steps):
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tensorboard is not None:
      for key, value in record.items():
        if key != "step":
          self.tensorboard.add_scalar(key, value, record["step"])
    extra = f" val {record['validation_loss']:.4f}" if "validation_loss" in record else ""
    print(f"step {record['step']}/{num_steps}  loss {record['loss']:.4f}{extra}  "
          f"lr {record['learning_rate']:.2e}  {record['tokens_per_second']:,.0f} tok/s  "
          f"mfu {100 * record['mfu']:.1f}%  eta {_duration(eta_seconds)}", flush=True)

  def close(self):
    if self.tensorboard is not None:
      self.tensorboard.close()


def _duration(seconds):
  minutes, seconds = divmod(int(seconds), 60)
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
