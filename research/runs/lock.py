"""Advisory locks (fcntl.flock) of a workdir: one writer, and one rewrite of its results at a time.

DIR/writer.lock: one writer per workdir. A process holds it for as long as it trains in DIR; a
second process that tries fails at once with WorkdirBusyError naming the holder (pid, host, start
time, written into the lock file). Evaluation does not take it: it reads only complete
checkpoints (research.runs.checkpoints.restore_params) and writes only its results, so a run is
evaluated while it trains. The OS releases a lock when its holder exits, a crash or SIGKILL
included, so a stale lock never outlives a run. Within one thread a lock is re-entrant: a sweep
member holds the writer lock around training and evaluation, and the trainer's own `hold`
inside is a no-op; another thread of the process waits or is refused as another process is.

DIR/eval.lock: held for each rewrite of DIR's evaluation results (eval.json, and the report files
drawn from them), a read-modify-write of milliseconds, never for a whole evaluation; another
process waits for it (`hold_results`). So two evaluators of one run never lose each other's rows.
"""

import contextlib
import datetime
import fcntl
import os
import socket
import threading
import time
from typing import Iterator

LOCK_NAME = "writer.lock"
RESULTS_LOCK_NAME = "eval.lock"
RESULTS_WAIT_SECONDS = 120  # a results lock held longer than this is a holder that hangs
_THIS_THREAD = threading.local()  # .held: real paths of the lock files this thread holds


class WorkdirBusyError(RuntimeError):
  """Another process is writing in the workdir."""


def _holder_description() -> str:
  started = datetime.datetime.now().isoformat(timespec="seconds")
  return f"pid {os.getpid()} on {socket.gethostname()} (since {started})"


@contextlib.contextmanager
def _flock(workdir: str, name: str, wait_seconds: float, what: str, busy: str) -> Iterator[None]:
  """Hold DIR/name (created if missing), waiting up to `wait_seconds` for another holder;
  WorkdirBusyError ("<what> is in use by <holder><busy>") after that."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.realpath(os.path.join(workdir, name))
  held = _THIS_THREAD.__dict__.setdefault("held", set())
  if path in held:
    yield
    return
  open(path, "a").close()
  # flock needs no write access; a descriptor held open for writing for the whole run would
  # keep the workdir's file system from being remounted read-only.
  with open(path) as lock_file:
    deadline = time.monotonic() + wait_seconds
    while True:
      try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        if time.monotonic() >= deadline:
          holder = lock_file.read().strip() or "another process"
          raise WorkdirBusyError(f"{what} is in use by {holder}{busy}") from None
        time.sleep(0.02)
    with open(path, "w") as holder_file:
      holder_file.write(_holder_description() + "\n")
    held.add(path)
    try:
      yield
    finally:
      held.discard(path)
      fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
  """Hold the writer lock of `workdir` (created if missing) for the body of the `with`;
  WorkdirBusyError at once if another process holds it."""
  with _flock(workdir, LOCK_NAME, 0, f"workdir {workdir}", busy=(
      "; wait for that run to finish or stop it (its lock is released when it exits), or use "
      "another --workdir")):
    yield


@contextlib.contextmanager
def hold_results(workdir: str) -> Iterator[None]:
  """Hold the results lock of `workdir` (created if missing) for one rewrite of its results,
  waiting for another holder (WorkdirBusyError after RESULTS_WAIT_SECONDS)."""
  with _flock(workdir, RESULTS_LOCK_NAME, RESULTS_WAIT_SECONDS,
              f"the results of {workdir} ({RESULTS_LOCK_NAME})", busy=(
      f" for over {RESULTS_WAIT_SECONDS} s, longer than a rewrite of its results takes; if "
      "that process hangs, stop it")):
    yield
