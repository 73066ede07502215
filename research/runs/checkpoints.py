"""Orbax checkpoints of a run in DIR/checkpoints/<step>/: saved only when the disk can take them,
restored from the newest one that reads.

Saving: orbax writes each checkpoint asynchronously into a temporary directory and renames it
into place, so a crash never leaves a partial checkpoint under a step's name. Before each save a
probe file is written and synced in DIR/checkpoints and the free space is compared with the
state's size: a read-only or full disk stops the run at once with CheckpointWriteError (orbax
itself would wait out its 5-minute timeout for a step directory it cannot create), and an error
of an earlier asynchronous save is reported the same way. Either way the last complete
checkpoint is left as it was. orbax's writing thread also logs that earlier error, with its
traceback; the manager's log filter keeps the line and drops the traceback, so a full disk reads
as one error line, not a stack from another thread.

Kept: the latest `keep` checkpoints, and those of the steps `keep_at` whatever their age
(train.keep_checkpoints and train.keep_checkpoints_at: checkpoints over training, for
research.analysis.analyze).

Restoring walks back from the latest step to the newest checkpoint that restores. Unreadable
ones newer than it (a truncated or damaged file) are moved to DIR/checkpoints_unreadable/, kept
for inspection, and one line says which steps were unreadable and which one is used. If none
restores, nothing is moved (the checkpoints may be fine for the code that wrote them) and
CheckpointError says so.

Reading a run's parameters (`restore_params`: evaluation, generation, analyses, init_from) writes
nothing and takes no lock, so it works while the run trains: it sees only complete checkpoints
(orbax writes each into DIR/checkpoints/<step>.orbax-checkpoint-tmp and renames it to <step>
once every process has written its part; on object stores, which cannot rename, a
commit_success.txt file marks it: `steps` lists only those). The trainer may delete the checkpoint
being read (rotation, train.keep_checkpoints) or write a newer one meanwhile: a read that fails
on a checkpoint that has since vanished or changed, or that succeeds while it changed, is
retried from the newest again (a few times; then CheckpointError says the checkpoints kept
changing), and so is a listing with no complete checkpoint while the directory holds something
(the last one rotated out as its successor completes). An unreadable one is skipped, not moved
(that is the trainer's job), with one line.
"""

import contextlib
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

UNREADABLE_DIR = "checkpoints_unreadable"


class CheckpointError(RuntimeError):
  """No checkpoint of the run restores."""


class CheckpointWriteError(OSError):
  """The disk cannot take a checkpoint (read-only, full, or an earlier save failed)."""


def directory(workdir: str) -> str:
  """The absolute checkpoint directory of `workdir` (orbax refuses relative paths)."""
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def steps(workdir: str) -> list[int]:
  """Steps of the complete checkpoints in `workdir`, oldest first; creates nothing."""
  return sorted(ocp.utils.checkpoint_steps(directory(workdir)))


# What orbax's background threads log, with the traceback, when an asynchronous save fails;
# `save` or `wait` then raise the same error here as CheckpointWriteError. Each phrase is checked
# against the installed orbax's source (tests/test_train.py).
ASYNC_FAILURE_LOG = "_SignalingThread.run() raised an exception"  # _src/futures/future.py
METADATA_FAILURE_LOG = "Failed to write metadata="  # _src/metadata/checkpoint.py
COMMIT_FAILURE_LOG = "Handler Commit operations"  # _src/checkpointers/async_checkpointer.py
FAILURE_LOGS = (ASYNC_FAILURE_LOG, METADATA_FAILURE_LOG, COMMIT_FAILURE_LOG)


class _WithoutAsyncTraceback(logging.Filter):
  """Keeps orbax's lines about a failed asynchronous save (FAILURE_LOGS), drops their
  tracebacks."""

  def filter(self, record):
    if record.exc_info and any(phrase in str(record.msg) for phrase in FAILURE_LOGS):
      record.exc_info, record.exc_text = None, None
    return True


def _quiet_async_failures():
  logger = logging.getLogger("absl")  # orbax logs through absl.logging
  if not any(isinstance(f, _WithoutAsyncTraceback) for f in logger.filters):
    logger.addFilter(_WithoutAsyncTraceback())


def manager(workdir: str, keep: int, keep_at: Sequence[int] = ()) -> ocp.CheckpointManager:
  """The manager of `workdir`'s checkpoints, keeping the latest `keep` and those of the steps
  `keep_at` (never deleted), saving asynchronously."""
  _quiet_async_failures()
  policies = ocp.checkpoint_managers
  return ocp.CheckpointManager(
      directory(workdir), options=ocp.CheckpointManagerOptions(
          preservation_policy=policies.AnyPreservationPolicy(
              [policies.LatestN(n=keep), policies.CustomSteps(list(keep_at))]),
          enable_async_checkpointing=True))


def _one_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def _check_room(checkpoint_dir: str, state_bytes: int):
  """Raise OSError unless a file can be written and synced in `checkpoint_dir` and its disk has
  room for a checkpoint of `state_bytes` (uncompressed: an upper bound)."""
  with tempfile.TemporaryFile(dir=checkpoint_dir, prefix=".write-probe-") as probe:
    probe.write(b"\0" * 4096)
    probe.flush()
    os.fsync(probe.fileno())
  free = shutil.disk_usage(checkpoint_dir).free
  if free < state_bytes:
    raise OSError(f"the disk is full: {free / 2**20:.1f} MiB free, a checkpoint needs up to "
                  f"{state_bytes / 2**20:.1f} MiB")


def _write_error(checkpoint_manager, step, error) -> CheckpointWriteError:
  last = checkpoint_manager.latest_step()
  kept = (f"the last complete checkpoint (step {last}) is intact" if last is not None
          else "no checkpoint was written")
  return CheckpointWriteError(
      f"cannot write checkpoint {step} in {checkpoint_manager.directory} ({_one_line(error)}); "
      f"stopped, {kept}. Make room or make it writable, then rerun the same command to resume")


def save(checkpoint_manager: ocp.CheckpointManager, step: int, state: Any):
  """Start saving `state` as checkpoint `step`; CheckpointWriteError if the disk cannot take it."""
  state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  try:
    _check_room(str(checkpoint_manager.directory), state_bytes)
    checkpoint_manager.save(step, args=ocp.args.StandardSave(state))
  except Exception as e:  # noqa: BLE001 (orbax and TensorStore raise many types for I/O errors)
    raise _write_error(checkpoint_manager, step, e) from e


def wait(checkpoint_manager: ocp.CheckpointManager):
  """Wait for the pending save; CheckpointWriteError if it failed."""
  try:
    checkpoint_manager.wait_until_finished()
  except Exception as e:  # noqa: BLE001 (as in save)
    raise _write_error(checkpoint_manager, checkpoint_manager.latest_step(), e) from e


def _move_aside(checkpoint_manager, bad_steps):
  """Move unreadable checkpoints to DIR/checkpoints_unreadable/<step> (process 0 does it)."""
  root = os.path.dirname(str(checkpoint_manager.directory))
  aside = os.path.join(root, UNREADABLE_DIR)
  if jax.process_index() == 0:
    os.makedirs(aside, exist_ok=True)
    for step in bad_steps:
      target = os.path.join(aside, str(step))
      suffix = 1
      while os.path.exists(target):  # the same step may go bad twice
        target, suffix = os.path.join(aside, f"{step}.{suffix}"), suffix + 1
      shutil.move(os.path.join(str(checkpoint_manager.directory), str(step)), target)
  multihost_utils.sync_global_devices("research.runs.checkpoints.move_aside")
  checkpoint_manager.reload()
  return aside


def _restore_newest(checkpoint_manager, restore_step: Callable[[int], Any],
                    log: Callable[[str], None]) -> tuple[int, Any] | None:
  """(step, restored) of the newest checkpoint that `restore_step` reads; None if there is none."""
  unreadable = []  # (step, error), newest first
  for step in sorted(checkpoint_manager.all_steps(), reverse=True):
    try:
      restored = restore_step(step)
    except Exception as e:  # noqa: BLE001 (a damaged file surfaces as any of many error types)
      unreadable.append((step, e))
      continue
    if unreadable:
      aside = _move_aside(checkpoint_manager, [s for s, _ in unreadable])
      bad = ", ".join(str(s) for s, _ in unreadable)
      log(f"checkpoint {bad} of {checkpoint_manager.directory} is unreadable "
          f"({_one_line(unreadable[0][1])}); moved it to {aside}/ and using step {step}")
    return step, restored
  if unreadable:
    bad = ", ".join(str(s) for s, _ in unreadable)
    raise CheckpointError(
        f"no checkpoint in {checkpoint_manager.directory} restores (steps {bad}; newest: "
        f"{_one_line(unreadable[0][1])}); they are left in place. If the code changed since they "
        "were written, use that version; if they are damaged, move the directory aside to "
        "train from step 0")
  return None


def restore_latest(checkpoint_manager: ocp.CheckpointManager, abstract_state: Any,
                   log: Callable[[str], None] = print) -> Any | None:
  """The newest readable train state, laid out as `abstract_state` (ShapeDtypeStructs with
  shardings); None if there is no checkpoint yet."""
  found = _restore_newest(
      checkpoint_manager,
      lambda step: checkpoint_manager.restore(step, args=ocp.args.StandardRestore(abstract_state)),
      log)
  return None if found is None else found[1]


# How many times a read of a run's parameters restarts because the trainer deleted or changed the
# checkpoint it read (evidence of a concurrent change each time) before it gives up.
READ_RESTARTS = 8


def _files(step_dir: str) -> tuple:
  """What a checkpoint directory holds: (path, size) of every file, sorted; () if it is gone."""
  found = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      with contextlib.suppress(OSError):  # deleted between the listing and the stat
        found.append((os.path.relpath(path, step_dir), os.path.getsize(path)))
  return tuple(sorted(found))


def _in_flux(workdir: str) -> bool:
  """Whether the checkpoint directory of `workdir` holds anything. Where it lists no complete
  checkpoint, what it holds is being written, finalised or deleted (a trainer that keeps one
  checkpoint rotates the last out around the completion of its successor), or was left
  half-written by a crash."""
  try:
    return bool(os.listdir(directory(workdir)))
  except OSError:
    return False


def restore_params(workdir: str, abstract_params: Any, log: Callable[[str], None] = print,
                   step: int | None = None) -> tuple[int, Any]:
  """(step, parameters) of the newest readable complete checkpoint in `workdir`, or of checkpoint
  `step`: the `params` entry of the train state alone, laid out as `abstract_params`. Writes
  nothing, so it may run while the run trains (the module's docstring). FileNotFoundError if there
  is no checkpoint (or no checkpoint `step`); CheckpointError if none reads."""
  item = {"params": abstract_params}
  args = ocp.args.PyTreeRestore(
      item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)
  unreadable = {}  # step: error, of checkpoints that stayed as they were while they failed
  restarts = 0
  while restarts <= READ_RESTARTS:
    saved = steps(workdir)
    if not saved:
      if _in_flux(workdir) and restarts < READ_RESTARTS:  # rotated out as its successor completes
        restarts += 1
        time.sleep(0.25)
        continue
      raise FileNotFoundError(f"no checkpoint in {directory(workdir)}; train the run first "
                              "(python -m experiments.train with this --workdir)")
    if step is not None and step not in saved:
      raise FileNotFoundError(f"no checkpoint of step {step} in {directory(workdir)}; its "
                              f"steps: {', '.join(map(str, saved))}")
    candidates = [s for s in ([step] if step is not None else reversed(saved))
                  if s not in unreadable]
    if not candidates:
      break
    chosen = candidates[0]
    step_dir = os.path.join(directory(workdir), str(chosen))
    before = _files(step_dir)
    try:
      # Without create, cleanup_tmp_directories or custom metadata, a manager writes nothing
      # until it saves (read_only=True would say so in three warning lines per read).
      with ocp.CheckpointManager(directory(workdir), options=ocp.CheckpointManagerOptions(
          create=False, lightweight_initialize=True)) as reader:
        restored = reader.restore(chosen, args=args)["params"]
    except Exception as e:  # noqa: BLE001 (a damaged or vanishing file surfaces as many types)
      if _files(step_dir) == before and chosen in steps(workdir):
        unreadable[chosen] = e  # as it was: damaged, not rotated out or rewritten meanwhile
      else:
        restarts += 1  # deleted (rotated out) while it was read: read the newest again
      continue
    if _files(step_dir) != before:
      restarts += 1  # changed while it was read (being deleted): read the newest again
      continue
    if unreadable:
      bad = ", ".join(str(s) for s in sorted(unreadable, reverse=True))
      log(f"checkpoint {bad} of {directory(workdir)} is unreadable "
          f"({_one_line(next(iter(unreadable.values())))}); using step {chosen} (left in place; "
          "the run's trainer moves unreadable checkpoints aside when it resumes)")
    return chosen, restored
  if unreadable:
    bad = ", ".join(str(s) for s in sorted(unreadable, reverse=True))
    raise CheckpointError(
        f"no checkpoint in {directory(workdir)} restores (steps {bad}; newest: "
        f"{_one_line(unreadable[max(unreadable)])}); they are left in place. If the code changed "
        "since they were written, use that version")
  raise CheckpointError(
      f"the checkpoints of {directory(workdir)} kept changing while they were read "
      f"({READ_RESTARTS} times): the run's trainer writes and rotates them faster than one is "
      "read; keep more (train.keep_checkpoints) or evaluate when it has finished")
