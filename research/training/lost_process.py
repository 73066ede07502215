"""A lost process in a multi-process run: every process stops with one line naming it, instead of
waiting in its next collective (JAX 0.10 on CPU/gloo mostly waits for its heartbeat timeout, then
aborts with a C++ stack trace; docs/training.md says what happens in each case).

  with lost_process.watchdog(workdir):   # research/training/loop.py, around the whole run
    ...
"""

import contextlib
import os
import sys
import threading
import time

import jax

from research.runs import checkpoints
from research.training import preemption


class LostProcessError(ConnectionError):
  """Another process of a multi-process run is gone (killed, crashed, or unreachable)."""


# Seconds without a sign of life after which a process of a multi-process run counts as lost
# (docs/training.md). JAX's own heartbeat timeout is set to at least twice this, so that the
# watchdog's one line comes first.
LOST_PROCESS_SECONDS = float(os.environ.get("RESEARCH_LOST_PROCESS_SECONDS", "60"))


def heartbeat_timeout_seconds() -> int:
  """JAX's own heartbeat timeout for jax.distributed.initialize: at least twice the watchdog's,
  so that the watchdog's line comes first."""
  return max(100, int(2 * LOST_PROCESS_SECONDS))


class Watchdog:
  """Stops this process with one line naming the lost one when another process of the run is
  gone, instead of leaving it blocked in its next collective.

  On CPU (gloo), a process whose peer was killed mostly waits in a collective until JAX's
  heartbeat timeout aborts it with a C++ stack trace; sometimes gloo reports the closed
  connection as an error of whatever ran (a checkpoint's all-gather, which would blame the disk).
  So every process beats once per `interval` in the coordination service's key-value store
  (research/alive/<process>: a counter, then "done" or "failed"), from a thread, and reads the
  others' entries. A peer whose entry stands still for `timeout` seconds is lost: print one line,
  mark this process failed and exit with status 1 (os._exit: JAX's shutdown would wait for the
  lost peer). A peer marked failed has printed its own error: the others stop too, naming it.

  A stop on a signal (research.training.preemption.Stopped, raised by every process at the same
  step) ends the run as its end does: this process is marked done. An error in this process
  first waits for the verdict on its peers (each alive, done, failed or lost; a lost peer
  explains the error better, and replaces it), then marks this process failed; once the main
  thread has finished (its error printed), the process exits without waiting for its other
  threads or JAX's shutdown barrier. Process 0 holds the coordination
  service, whose end makes JAX abort every process still connected to it: before it exits, it
  waits (at most `timeout`) until every other process is marked done or failed, or is lost.
  """

  PREFIX = "research/alive/"

  def __init__(self, workdir, client, me, count, timeout=LOST_PROCESS_SECONDS):
    self.workdir, self.client, self.me, self.count, self.timeout = (
        workdir, client, me, count, timeout)
    self.interval = min(1.0, timeout / 5)
    now = time.monotonic()
    # Per peer: its entry, when this process saw it change, and how many changes it saw.
    self.seen = {p: (None, now, 0) for p in range(self.count) if p != self.me}
    self.answered = now  # when the key-value store last answered
    self.failing = False  # this process raised: its main thread decides, not the watchdog
    self.exiting = False  # ... and has decided: exit once the main thread has finished
    self.lock = threading.Lock()
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._run, name="research-watchdog", daemon=True)

  def __enter__(self):
    self._set("0")
    self.thread.start()
    return self

  def __exit__(self, kind, error, traceback):
    if kind is None or issubclass(kind, preemption.Stopped):  # every process stopped at a step
      self.stopped.set()
      self.thread.join()
      with contextlib.suppress(Exception):  # the coordination service may be gone with process 0
        self._set("done")
      return False
    self.failing = True
    deadline = time.monotonic() + self.timeout + 3 * self.interval
    changes = {peer: seen[2] for peer, seen in self.seen.items()}
    # A peer is alive once its entry changed twice since (the first change seen may be a beat
    # it made before it died).
    while ((lost := self.lost(failed_too=False)) is None and time.monotonic() < deadline
           and any(value not in ("done", "failed") and count < changes[peer] + 2
                   for peer, (value, _, count) in self.seen.items())):
      time.sleep(self.interval / 2)
    with self.lock:
      self.exiting = True
      with contextlib.suppress(Exception):
        self._set("failed")
    if lost is not None:
      raise LostProcessError(lost) from error
    return False

  def _set(self, value):
    self.client.key_value_set(f"{self.PREFIX}{self.me}", value, allow_overwrite=True)

  def _read(self):
    """Read the others' entries (noting which changed); False if the service did not answer."""
    try:
      values = dict(self.client.key_value_dir_get(self.PREFIX))
    except Exception:  # noqa: BLE001 (any RPC error: the service did not answer)
      return False
    self.answered = now = time.monotonic()
    for peer, (value, _, count) in self.seen.items():
      if (new := values.get(f"{self.PREFIX}{peer}")) != value:
        self.seen[peer] = (new, now, count + 1)
    return True

  def _run(self):
    beat = 0
    while not self.stopped.wait(0.05 if self.exiting else self.interval):
      with self.lock:
        if self.exiting:
          if not threading.main_thread().is_alive():
            self._exit()
          continue
        beat += 1
        with contextlib.suppress(Exception):
          self._set(str(beat))
        self._read()
      if not self.failing and (lost := self.lost()) is not None:
        print(f"error: {lost}", file=sys.stderr)
        with contextlib.suppress(Exception):
          self._set("failed")
        self._exit()

  def _exit(self):
    """Exit with status 1; process 0 first lets the others see that the run stops."""
    deadline = time.monotonic() + self.timeout
    while (self.me == 0 and time.monotonic() < deadline and self._read() and any(
        value not in ("done", "failed") and time.monotonic() - since <= self.timeout
        for value, since, _ in self.seen.values())):
      time.sleep(self.interval / 2)
    _exit_now(1)

  def lost(self, failed_too=True):
    """The line naming a lost process (or one that failed), or None."""
    now = time.monotonic()
    if now - self.answered > self.timeout:
      return self._line(0, f"(the coordination service) has not answered for {self.timeout:g} s")
    for peer, (value, since, _) in self.seen.items():
      if value == "failed" and failed_too and now - since > 3 * self.interval:
        return (f"process {peer} of {self.count} stopped with an error (its own output says "
                f"which); stopping process {self.me} too")
      if value not in ("done", "failed") and now - since > self.timeout:
        return self._line(peer, f"gave no sign of life for {self.timeout:g} s (killed, crashed, "
                                "or its host is unreachable)")
    return None

  def _line(self, peer, why):
    saved = checkpoints.steps(self.workdir)
    resume = f"its last complete checkpoint (step {saved[-1]})" if saved else "step 0"
    return (f"process {peer} of {self.count} {why}; stopping process {self.me} too, which would "
            f"wait for it. Rerun the same command on every process to resume from {resume}")


def _exit_now(status):
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


def watchdog(workdir):
  """The watchdog of a multi-process run (nothing for one process)."""
  if jax.process_count() == 1:
    return contextlib.nullcontext()
  from jax._src import distributed  # noqa: PLC0415 (the coordination service's key-value store)
  return Watchdog(workdir, distributed.global_state.client, jax.process_index(),
                   jax.process_count())
