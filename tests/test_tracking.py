"""Trackers (research/training/trackers.py): TensorBoard events hold every step a run logged, a
SIGKILL included, and a resumed run's replace those it logs again; an offline Weights & Biases
run holds the logged steps and a resumed run continues it; a saved train.tensorboard=True loads
as trackers=("tensorboard",); a bad tracker is refused in one line before any work."""

import glob
import json
import os
import shutil
import signal
import struct
import subprocess

import pytest

from research import defaults
from research.runs import config_fields
from research.training import checks
from research.training import loop as train
from research.training import trackers
from tests import forked_commands
from tests import tiny_config
from tests.test_train import ROOT, CONFIG, _env, _train_command

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "run_e4f910a")


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _tensorboard_events(workdir):
  """The Event protos of WORKDIR/tensorboard's files, in the order TensorBoard reads them (by
  file name), each file read as TFRecords (length, its CRC, data, its CRC)."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  events = []
  for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
      offset += 12 + length + 4
  return events


def _tensorboard_scalars(events):
  """[(step, {tag: value})] of the events that log scalars, as TensorBoard shows them: a session
  start at step s hides what earlier events logged at s and after (steps a resumed run logs
  again)."""
  scalars = []
  for event in events:
    if event.HasField("session_log"):
      scalars = [(step, values) for step, values in scalars if step < event.step]
    values = {v.tag: v.simple_value for v in event.summary.value if v.HasField("simple_value")}
    if values:
      scalars.append((event.step, values))
  return scalars


def _assert_scalars_hold(scalars, records):
  by_step = dict(scalars)
  for record in records:
    logged = {key: value for key, value in record.items() if key != "step"}
    assert by_step.get(record["step"], {}).keys() == logged.keys(), record["step"]
    for key, value in logged.items():
      assert by_step[record["step"]][key] == pytest.approx(value, rel=1e-6), (record["step"], key)


def test_a_sigkilled_run_leaves_every_logged_step_in_its_events_and_a_resume_replaces_them(
    tmp_path):
  workdir = str(tmp_path / "run")
  command = _train_command(workdir, "--config.train.num_steps=24",
                           "--config.train.checkpoint_every=4",
                           "--config.train.trackers=tensorboard")
  process = subprocess.Popen(command, env=_env(1), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
  for line in process.stdout:
    if line.startswith("step 10/"):
      process.send_signal(signal.SIGKILL)
      break
  process.wait()
  assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
  killed = _records(workdir)
  assert [r["step"] for r in killed][:10] == list(range(1, 11))
  events = _tensorboard_events(workdir)
  _assert_scalars_hold(_tensorboard_scalars(events), killed)
  # The config, once: the fields that make the run as the HParams session, the whole as text.
  tags = {value.tag: value for event in events for value in event.summary.value}
  assert b"model.attention" in tags["_hparams_/session_start_info"].metadata.plugin_data.content
  assert b'"num_steps": 24' in tags["config/text_summary"].tensor.string_val[0]

  result = subprocess.run(command, env=_env(1), cwd=ROOT, check=True, capture_output=True,
                          text=True)
  assert "resuming" in result.stdout
  resumed = _records(workdir)
  assert [r["step"] for r in resumed] == list(range(1, 25))
  scalars = _tensorboard_scalars(_tensorboard_events(workdir))
  assert [step for step, _ in scalars] == list(range(1, 25))  # each once: the killed run's hidden
  _assert_scalars_hold(scalars, resumed)


def _wandb_records(path):
  """The Record protos of a .wandb file: LevelDB-log framing (32 KiB blocks; each chunk a 7-byte
  header: CRC, length, type: 1 whole, 2 first, 3 middle, 4 last) after a 7-byte file header."""
  from wandb.proto import wandb_internal_pb2  # noqa: PLC0415
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  records, pending, offset = [], b"", 7
  while offset + 7 <= len(data):
    if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
      offset += 32768 - offset % 32768
      continue
    _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
    pending += data[offset + 7:offset + 7 + length]
    offset += 7 + length
    if kind in (1, 4):
      records.append(wandb_internal_pb2.Record.FromString(pending))
      pending = b""
  return records


def _wandb_run(run_dir):
  """(run id, project, name, {step: {key: value}}) of an offline W&B run directory."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  history, run = {}, None
  for record in _wandb_records(path):
    kind = record.WhichOneof("record_type")
    if kind == "run":
      run = record.run
    elif kind == "history":
      items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for item in record.history.item}
      history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
  return run.run_id, run.project, run.display_name, history


def test_an_offline_wandb_run_holds_the_logged_steps_and_a_resumed_run_continues_it(
    tmp_path, monkeypatch):
  pytest.importorskip("wandb")  # requirements-tracking.txt, installed by .ci/run
  for name, value in dict(WANDB_MODE="offline", WANDB_SILENT="true",
                          WANDB_CONFIG_DIR=str(tmp_path / "config"),
                          WANDB_CACHE_DIR=str(tmp_path / "cache"),
                          WANDB_DATA_DIR=str(tmp_path / "data")).items():
    monkeypatch.setenv(name, value)
  monkeypatch.delenv("WANDB_PROJECT", raising=False)
  workdir = tmp_path / "sweep" / "member"
  config = tiny_config.get_config()
  config.train.trackers = ("wandb",)
  train.train_and_evaluate(config, str(workdir))
  (first,) = glob.glob(str(workdir / "wandb" / "offline-run-*"))
  run_id, project, name, history = _wandb_run(first)
  assert (run_id, project, name) == ((workdir / "wandb" / "run_id").read_text(), "sweep", "member")
  records = _records(workdir)
  assert sorted(history) == [r["step"] for r in records] == list(range(1, 9))
  for record in records:
    assert history[record["step"]] == {k: v for k, v in record.items() if k != "step"}

  shutil.rmtree(workdir / "checkpoints" / "8")  # the run resumes from step 4
  train.train_and_evaluate(config, str(workdir))
  (second,) = set(glob.glob(str(workdir / "wandb" / "offline-run-*"))) - {first}
  resumed_id, _, _, resumed_history = _wandb_run(second)
  assert resumed_id == run_id
  assert sorted(resumed_history) == [5, 6, 7, 8]  # only the steps after the checkpoint


def test_a_saved_config_with_tensorboard_loads_with_the_tensorboard_tracker():
  with open(os.path.join(FIXTURE, "config.json")) as f:
    saved = json.load(f)  # version 1, train.tensorboard=false
  assert config_fields.merge_saved(saved, "fixture").train.trackers == ()
  for version in (1, 2):
    saved["version"], saved["train"]["tensorboard"] = version, True
    loaded = config_fields.merge_saved(saved, "saved.json")
    assert (loaded.version, loaded.train.trackers) == (defaults.VERSION, ("tensorboard",))
    assert "tensorboard" not in loaded.train
    assert config_fields.training_differences(saved, loaded) == []
  saved["train"]["trackers"] = ["tensorboard"]
  with pytest.raises(ValueError, match="has both 'train.tensorboard' and 'train.trackers'"):
    config_fields.merge_saved(saved, "both.json")


def test_bad_trackers_are_refused_in_one_line_naming_what_is_valid(tmp_path, monkeypatch):
  config = tiny_config.get_config()
  config.train.trackers = ("tensorboard", "mlflow")
  with pytest.raises(ValueError, match=r"^unknown train.trackers \['mlflow'\]; valid: "
                                       r"tensorboard, wandb$"):
    checks.validate_config(config, 1)
  config.train.trackers = ("tensorboard", "tensorboard")
  with pytest.raises(ValueError, match=r"names \['tensorboard'\] more than once"):
    checks.validate_config(config, 1)
  config.train.trackers = ("wandb",)
  monkeypatch.setattr(trackers.WandB, "module", "wandb_not_installed")
  with pytest.raises(ValueError, match=r"needs the wandb_not_installed package: "
                                       r"\.venv/bin/pip install -r requirements-tracking\.txt"):
    checks.validate_config(config, 1)
  config = tiny_config.get_config()
  config.train.tensorboard = True  # the field train.trackers replaced
  with pytest.raises(ValueError, match="train.tensorboard was replaced by train.trackers"):
    checks.validate_config(config, 1)

  workdir = str(tmp_path / "new")
  unknown, replaced = forked_commands.run([
      ("train", [f"--config={CONFIG}", f"--workdir={workdir}", "--config.train.trackers=mlflow"]),
      ("train", [f"--config={CONFIG}", f"--workdir={workdir}",
                 "--config.train.tensorboard=True"])])
  for result, message in ((unknown, "error: unknown train.trackers ['mlflow']; valid: "
                                    "tensorboard, wandb"),
                          (replaced, "error: unknown config field 'train.tensorboard'; did you "
                                     "mean 'train.trackers'?")):
    assert (result.returncode, result.stderr.strip()) == (1, message)
  assert not os.path.exists(workdir)
