"""Which code and machine made a result: the checkout's commit and the hardware, written beside
what it makes (a sweep run's status.json, a benchmark's metadata, docs/made.json)."""

import os
import platform
import subprocess

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = ("research", "configs", "experiments", "requirements.txt")  # what makes the results


def commit():
  """The checkout's commit (short), with "+changes" when its code (CODE) differs from it."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  head = git("rev-parse", "--short", "HEAD") or "unknown"
  changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
  return head + ("+changes" if changed else "")


def hardware():
  """The CPU model and core count (from lscpu), or the accelerator kind and count."""
  devices = jax.devices()
  if devices[0].platform != "cpu":
    return f"{len(devices)} x {devices[0].device_kind}"
  model = platform.processor() or "unknown CPU"
  try:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                 if line.startswith("Model name"))
  except (OSError, subprocess.CalledProcessError, StopIteration):
    pass
  return f"{model}, {os.cpu_count()} cores"
