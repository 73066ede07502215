"""Experiment trackers, chosen by name in train.trackers: each receives every record that
research.training.metrics.MetricWriter logs, and the run's config once.

A tracker is a class registered here with @register: `name` (what train.trackers says), `module`
and `requirements` (the package it imports and the requirements file that pins it:
research.training.checks refuses a tracker whose package is missing before any work), and
  __init__(workdir, config, resume_step)  opens it; resume_step is the step the run resumes from
                                          (0 for a new run): it logs only steps after it
  write(record)                           one logged step: {"step": s, metric: value, ...}
  close()
Adding another tracker (MLflow, ...) is one such class.
"""

import json
import os
import secrets
import time

from research import defaults
from research.runs import config_fields
from research.runs import unread

REGISTRY = {}


def register(cls):
  """Make a tracker class selectable in train.trackers by its `name`."""
  REGISTRY[cls.name] = cls
  return cls


def hyperparameters(config) -> dict:
  """{dotted name: value} of the fields that make the run what it is: those that change training
  and that the run reads (research.runs.config_fields, research.runs.unread), lists as JSON text.
  Runs compared side by side differ in these; the execution and evaluation settings and the
  settings of variants a run does not use would only add columns."""
  not_read = unread.not_read(config)
  return {name: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
          for name, value in defaults.flatten(config).items()
          if config_fields.changes_training(name)
          and not any(unread.within(name, section) for section in not_read)}


@register
class TensorBoard:
  """TensorBoard event files in WORKDIR/tensorboard (tensorboardX: no TensorFlow needed). Each
  logged line is written and flushed before the line is printed, by tensorboardX's synchronous
  EventsWriter (its SummaryWriter queues events for a thread that flushes every 120 s): a run
  killed with SIGKILL leaves every step it logged, and a live TensorBoard lags by nothing. The
  config goes in once per process: the fields that make the run (hyperparameters()) as the
  HParams dashboard's session of this run, and the whole config as text."""
  name = "tensorboard"
  module = "tensorboardX"
  requirements = "requirements.txt"

  def __init__(self, workdir, config, resume_step):
    from tensorboardX import event_file_writer, summary  # noqa: PLC0415 (checked in checks.py)
    from tensorboardX.proto import event_pb2, summary_pb2  # noqa: PLC0415

    self._summary, self._event_pb2, self._summary_pb2 = summary, event_pb2, summary_pb2
    directory = os.path.join(workdir, "tensorboard")
    os.makedirs(directory, exist_ok=True)
    # A file per process: its name holds the time in seconds, the pid keeps two such apart.
    self._events = event_file_writer.EventsWriter(os.path.join(directory, "events"),
                                                  filename_suffix=f".{os.getpid()}")
    # A resumed run logs again the steps after its checkpoint: TensorBoard hides what earlier
    # files hold from this step on (a session start, as SummaryWriter's purge_step writes).
    self._add(step=resume_step + 1,
              session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
    _, session_start, _ = summary.hparams(hyperparameters(config), {})
    self._add(summary=session_start)
    text = "\n".join("    " + line for line in config.to_json(indent=2).splitlines())
    self._add(summary=summary.text("config", text))  # indented: a code block in markdown
    self._events.flush()

  def _add(self, **fields):
    self._events.write_event(self._event_pb2.Event(wall_time=time.time(), **fields))

  def write(self, record):
    values = [value for key, number in record.items() if key != "step"
              for value in self._summary.scalar(key, number).value]
    self._add(step=record["step"], summary=self._summary_pb2.Summary(value=values))
    self._events.flush()

  def close(self):
    self._events.close()


@register
class WandB:
  """A Weights & Biases run: project the name of the directory that holds the workdir (a sweep's
  members share one), name the workdir's, files in WORKDIR/wandb, mode from the environment
  (WANDB_MODE=offline writes the run there for `wandb sync` and uses no network). The run's id
  is kept in WORKDIR/wandb/run_id, so a resumed run continues the same W&B run; it logs the
  steps after its checkpoint, as metrics.jsonl does. The whole config is the run's config."""
  name = "wandb"
  module = "wandb"
  requirements = "requirements-tracking.txt"

  def __init__(self, workdir, config, resume_step):
    del resume_step  # the loop writes only the steps after it
    import wandb  # noqa: PLC0415 (optional: checked in research/training/checks.py)

    workdir = os.path.abspath(workdir)
    id_path = os.path.join(workdir, "wandb", "run_id")
    if not os.path.exists(id_path):
      os.makedirs(os.path.dirname(id_path), exist_ok=True)
      with open(id_path + ".tmp", "w") as f:
        f.write(secrets.token_hex(6))
      os.replace(id_path + ".tmp", id_path)
    with open(id_path) as f:
      run_id = f.read().strip()
    self._wandb = wandb
    self._run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or os.path.basename(os.path.dirname(workdir)),
        name=os.path.basename(workdir), dir=workdir, id=run_id, resume="allow",
        config=defaults.flatten(config))

  def write(self, record):
    self._run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

  def close(self):
    self._run.finish()
    # finish() may return before W&B's service has written the run's file (wandb 0.31, offline:
    # about one close in twenty): teardown waits for it to write, online to upload, everything.
    self._wandb.teardown()
