"""One writer per workdir: an advisory lock (fcntl.flock) on DIR/writer.lock.

A process holds it for as long as it trains or evaluates in DIR; a second process that tries
fails at once with WorkdirBusyError naming the holder (pid, host, start time, written into the
lock file). The OS releases the lock when its holder exits, a crash or SIGKILL included, so a
stale lock never outlives a run. Within one process the lock is re-entrant: a sweep member holds
it around training and evaluation, and the trainer's own `hold` inside is a no-op.
"""

import contextlib
import datetime
import fcntl
import os
import socket
from typing import Iterator

LOCK_NAME = "writer.lock"
_HELD = set()  # real paths of the lock files this process holds


class WorkdirBusyError(RuntimeError):
  """Another process is writing in the workdir."""


def _holder_description() -> str:
  started = datetime.datetime.now().isoformat(timespec="seconds")
  return f"pid {os.getpid()} on {socket.gethostname()} (since {started})"


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
  """Hold the writer lock of `workdir` (created if missing) for the body of the `with`."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.realpath(os.path.join(workdir, LOCK_NAME))
  if path in _HELD:
    yield
    return
  open(path, "a").close()
  # flock needs no write access; a descriptor held open for writing for the whole run would
  # keep the workdir's file system from being remounted read-only.
  with open(path) as lock_file:
    try:
      fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = lock_file.read().strip() or "another process"
      raise WorkdirBusyError(
          f"workdir {workdir} is in use by {holder}; wait for that run to finish or stop it "
          "(its lock is released when it exits), or use another --workdir") from None
    with open(path, "w") as holder_file:
      holder_file.write(_holder_description() + "\n")
    _HELD.add(path)
    try:
      yield
    finally:
      _HELD.discard(path)
      fcntl.flock(lock_file, fcntl.LOCK_UN)
