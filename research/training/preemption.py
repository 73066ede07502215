"""Preemption: SIGTERM or SIGINT stops a run at the end of a step, with a checkpoint of that step.

Preemptible TPU and GPU capacity (spot VMs, Slurm and Kubernetes pods) is reclaimed by sending the
job SIGTERM first and SIGKILL a grace period later; MaxText and levanter checkpoint when the
SIGTERM comes, so that the work since the last periodic checkpoint is not lost. So does this
run, and Ctrl-C (SIGINT) too:

  with preemption.on_signals() as stop:   # research/training/loop.py, section 5
    for step in ...:
      ...train step `done`...
      if stop.at(done, metrics):          # save checkpoint `done`, then break
        ...
    stop.raise_if_stopped(done)           # Stopped(done, signal)

While the block is open, the first SIGTERM or SIGINT only sets a flag: the step in progress
finishes and is checkpointed (and logged, at its cadence), and the loop raises Stopped, which
experiments.cli prints as one line ("stopped at step N; checkpoint N saved; rerun the same
command to resume") with exit status 0 for SIGTERM (a preempted job ended as asked) and 130 for
SIGINT (128 + 2, a shell's status for Ctrl-C). Another SIGTERM while stopping is ignored; another
SIGINT raises KeyboardInterrupt at once, as Ctrl-C twice does elsewhere: the checkpoint being
written is then not completed, and the run resumes from the last complete one. The previous
handlers come back when the block closes (the loop also runs inside tests and sweeps).

Stopped is a BaseException, like KeyboardInterrupt: not an error, so that `except Exception`
(a sweep's per-member failure record, research.results.sweep) lets it through and the whole
command stops, leaving the member to resume when the command is rerun.

Every process of a multi-process run (jax.distributed) must stop at the same step, or the others
would wait for it in their next collective. A process that received a signal proposes, in the
coordination service's key-value store (as research.training.lost_process beats there), to stop
after step `done + 2`, `done` the step it has just started (research/stop/<process> = "<step>
<signal>"); after each step every process reads the proposals and stops when it reaches the
earliest. Two steps suffice: in its check after step k, a process first waits for step k - 1 to
finish, which needs every process to have started step k - 1; the proposer starts step
`done + 1` only after writing its proposal, so every process makes its check after step
`done + 2` after the proposal is written, and stops there at the latest. At the end of training the
processes synchronise once and read the proposals again, so that a signal in the last steps
stops all of them or none. The proposals last as long as the coordination service, one command:
a stop ends it. A single process pays nothing per step but reading its flag. (JAX's own
agreement, multihost_utils.reached_preemption_sync_point, serves multi-process runs and SIGTERM
alone.)
"""

import signal
import threading

import jax
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
  """The run stopped at `step` on a signal, with a complete checkpoint of that step."""

  def __init__(self, step: int, signum: int):
    super().__init__(f"stopped at step {step}; checkpoint {step} saved; rerun the same command "
                     "to resume")
    self.step, self.signal = step, signum

  @property
  def exit_status(self) -> int:
    return exit_status(self.signal)


def exit_status(signum: int) -> int:
  """A command's status when a signal stopped it: 0 for SIGTERM (the job ended as its scheduler
  asked), 128 + the signal otherwise (130 for SIGINT, a shell's status for Ctrl-C)."""
  return 0 if signum == signal.SIGTERM else 128 + signum


class Stop:
  """A run's stop on a signal (the module's docstring): `client` is the coordination service's
  key-value store of a run of many processes, of which this is process `me` (None for one
  process)."""

  PREFIX = "research/stop/"
  AHEAD = 2  # steps between a proposal and the step it proposes (the module's docstring)

  def __init__(self, client=None, me=0):
    self.client, self.me = client, me
    self.signal = None  # the first signal this process received
    self.proposed = False
    self.in_flight = None  # the previous step's metrics (multi-process)
    self.previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signal.signal's requirement
      self.previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      # None: a handler that Python did not install (C code's), which it cannot put back.
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    return False

  def _handle(self, signum, frame):
    del frame
    if self.signal is None:
      self.signal = signum
    elif signum == signal.SIGINT:
      raise KeyboardInterrupt

  def at(self, step: int, metrics) -> bool:
    """Whether the run stops after `step`, just dispatched with these metrics."""
    if self.client is None:
      return self.signal is not None
    jax.block_until_ready(self.in_flight)
    self.in_flight = metrics
    agreed = self._agreed(step + self.AHEAD)
    return agreed is not None and agreed[0] == step

  def raise_if_stopped(self, step: int):
    """After the loop, trained to `step`: raise Stopped if a signal stopped it (or came too late
    to: the run is then trained to its end, and stops all the same)."""
    if self.client is None:
      agreed = None if self.signal is None else (step, self.signal)
    else:
      agreed = self._agreed(step, synchronise=True)
    if agreed is not None:
      raise Stopped(step, agreed[1])

  def _agreed(self, proposal, synchronise=False):
    """(step, signal) of the earliest proposal, after proposing `proposal` if this process
    received a signal and has not proposed; None if no process has. `synchronise`: wait for
    every process to have proposed what it will first."""
    if self.signal is not None and not self.proposed:
      self.client.key_value_set(f"{self.PREFIX}{self.me}", f"{proposal} {self.signal}",
                                allow_overwrite=True)
      self.proposed = True
    if synchronise:
      multihost_utils.sync_global_devices("research.training.preemption")
    proposals = [tuple(map(int, value.split()))
                 for _, value in self.client.key_value_dir_get(self.PREFIX)]
    return min(proposals, default=None)


def on_signals():
  """The stop of this run (a Stop, whose handlers are installed while it is open)."""
  if jax.process_count() == 1:
    return Stop()
  from jax._src import distributed  # noqa: PLC0415 (the coordination service's key-value store)
  return Stop(distributed.global_state.client, jax.process_index())
