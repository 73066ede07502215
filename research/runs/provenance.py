"""Which code made a result: the checkout's commit, written beside what it makes (a sweep run's
status.json, a benchmark's metadata, docs/made.json)."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = ("research", "configs", "experiments", "requirements.txt")  # what makes the results


def commit():
  """The checkout's commit (short), with "+changes" when its code (CODE) differs from it."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
  head = git("rev-parse", "--short", "HEAD") or "unknown"
  changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
  return head + ("+changes" if changed else "")
