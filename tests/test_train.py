"""The training loop: sharding equivalence, exact resume after SIGKILL,
the non-finite guard, bad configs, one writer per workdir, falling back from a damaged
checkpoint, and a disk that turns read-only or full (CPU, 8 fake devices, a tiny model)."""

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from configs import base
from research.runs import checkpoints
from research import data
from research.evaluation import extrapolation
from research.evaluation import generate
from research.training import init_from
from research.model import transformer as model_lib
from research.model import sharding
from research.results import sweep
from research.training import loop as train
from research.runs import lock as workdir_lock
from tests import tiny_config
from tests.conftest import can_mount_in_a_namespace
from tests.conftest import tiny_model_config
from tests.conftest import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "tests", "tiny_config.py")


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["loss"] for line in f]


def _train_command(workdir, *overrides):
  return [sys.executable, "-m", "experiments.train", f"--config={CONFIG}", f"--workdir={workdir}",
          *overrides]


def _env(num_devices):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=xla_flags(num_devices))
  env.pop("JAX_NUM_CPU_DEVICES", None)
  return env


def _run(workdir, *overrides, num_devices=8):
  subprocess.run(_train_command(workdir, *overrides), env=_env(num_devices), cwd=ROOT, check=True,
                 capture_output=True)


def _final_params(workdir):
  with ocp.CheckpointManager(os.path.join(workdir, "checkpoints")) as manager:
    restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore())
  return jax.tree.leaves(restored["params"])


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("one_device"))
  _run(workdir, "--config.mesh.shape=(1,1,1)", num_devices=1)
  return _losses(workdir)


# Pure data parallelism, and every axis at once (fsdp and tensor sharding of the parameters).
@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)])
def test_mesh_shapes_match_one_device(mesh_shape, one_device_losses, tmp_path):
  config = tiny_config.get_config()
  config.mesh.shape = mesh_shape
  train.train_and_evaluate(config, str(tmp_path))
  np.testing.assert_allclose(_losses(tmp_path), one_device_losses, rtol=1e-4)
  assert len(one_device_losses) == config.train.num_steps


def test_sigkill_and_restart_gives_bit_identical_parameters(tmp_path):
  steps = ["--config.train.num_steps=24", "--config.train.checkpoint_every=4"]
  reference, resumed = str(tmp_path / "reference"), str(tmp_path / "resumed")
  _run(reference, *steps)
  process = subprocess.Popen(_train_command(resumed, *steps), env=_env(8), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  for line in process.stdout:
    if line.startswith("step 10/"):
      with pytest.raises(workdir_lock.WorkdirBusyError, match=f"in use by pid {process.pid} on"):
        with workdir_lock.hold(resumed):
          pass
      process.send_signal(signal.SIGKILL)
      break
  process.wait()
  assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
  # The OS released the killed writer's lock: the same command resumes.
  result = subprocess.run(_train_command(resumed, *steps), env=_env(8), cwd=ROOT, check=True,
                          capture_output=True, text=True)
  assert "resuming" in result.stdout
  for got, want in zip(_final_params(resumed), _final_params(reference), strict=True):
    np.testing.assert_array_equal(got, want)
  # Steps logged between the last checkpoint and the kill are logged once, not twice.
  assert _losses(resumed) == _losses(reference)


def test_non_finite_loss_stops_the_run_and_keeps_checkpoints_finite(tmp_path):
  config = tiny_config.get_config()
  config.train.update(dict(learning_rate=1e30, warmup_steps=0, checkpoint_every=1))
  with pytest.raises(train.NonFiniteLossError, match=r"at step \d+"):
    train.train_and_evaluate(config, str(tmp_path))
  with ocp.CheckpointManager(os.path.join(tmp_path, "checkpoints")) as manager:
    assert manager.all_steps()
    for step in manager.all_steps():
      restored = manager.restore(step, args=ocp.args.StandardRestore())
      assert all(np.isfinite(x).all() for x in jax.tree.leaves(restored["params"]))


@pytest.mark.parametrize("overrides,message", [
    (dict(model=dict(attention="flash")), "unknown attention type 'flash'"),
    (dict(data=dict(name="wikitext")), "wikitext"),
    (dict(mesh=dict(shape=(3, 1, 1))), r"needs 3 devices but there are 8"),
    (dict(mesh=dict(shape=(4, 2, 1)), train=dict(batch_size=12)), "multiple of the data-parallel size"),
    (dict(model=dict(vocab_size=100)), "model.vocab_size=100 is smaller than the 258 tokens"),
    (dict(train=dict(warmup_steps=8)), r"warmup_steps=8 must be in \[0, num_steps=8\)"),
    (dict(train=dict(eval_every=3, log_every=2)), "eval_every=3 must be a multiple of train.log_every=2"),
    (dict(eval=dict(lengths=(16,), num_tokens=16)), "eval.num_tokens=16 must be >= train.seq_len=32"),
    (dict(model=dict(position="learned", learned=dict(max_length=40))),
     "the longest of eval.lengths = 64 exceeds the 40 positions of the 'learned' table"),
    (dict(model=dict(randomize_max_length=16)), "model.randomize_max_length=16 must be >= train.seq_len=32"),
    (dict(model=dict(attention="linear", position="t5")), "'linear' does not support position 't5'"),
    (dict(model=dict(position="alibi", rope=dict(scaling="yarn"))),
     "model.rope.scaling='yarn' is read only by a model with model.position=rope"),
    (dict(model=dict(position="t5", t5=dict(num_buckets=0))), "model.t5.num_buckets must be >= 2"),
    (dict(model=dict(mlp_ratio=-1)), "model.mlp_ratio must be >= 0"),
    (dict(model=dict(feed_forward="moe", moe=dict(num_experts=1))), "model.moe.num_experts=1 is below"),
    (dict(eval=dict(rope_scalings=("ntk",))), r"unknown eval.rope_scalings \['ntk'\]; valid: none, pi, static_ntk"),
    (dict(train=dict(grad_clip_norm=0.0)), r"train.grad_clip_norm=0.0 must be > 0"),
    (dict(train=dict(weight_decay=-0.1)), r"train.weight_decay=-0.1 must be >= 0"),
    (dict(train=dict(end_learning_rate_fraction=1.5)),
     r"train.end_learning_rate_fraction=1.5 must be in \[0, 1\]"),
    (dict(train=dict(eval_every=-1)), "train.eval_every=-1 must be >= 0"),
    (dict(train=dict(eval_batches=0)), "train.eval_batches=0 must be >= 1"),
    (dict(eval=dict(sliding_stride=-1)), "eval.sliding_stride=-1 must be >= 0"),
    (dict(eval=dict(num_tokens=0)), "eval.num_tokens=0 must be >= 1"),
    (dict(train=dict(keep_checkpoints_at=(0, 4, 9))),
     r"train.keep_checkpoints_at has steps \[0, 9\] outside 1..train.num_steps=8"),
])
def test_bad_configs_fail_before_training_and_write_nothing(overrides, message, tmp_path):
  config = tiny_config.get_config()
  for section, values in overrides.items():
    config[section].update(values)
  workdir = str(tmp_path / "run")
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(config, workdir)
  assert not os.path.exists(workdir)


def test_checkpoints_at_keep_checkpoints_at_are_kept_while_others_rotate(tmp_path):
  config = tiny_config.get_config()
  config.train.update(dict(checkpoint_every=2, keep_checkpoints=1, keep_checkpoints_at=(1, 3)))
  train.train_and_evaluate(config, str(tmp_path))
  assert checkpoints.steps(str(tmp_path)) == [1, 3, 8]  # 2, 4 and 6 rotated out


def test_unwritable_workdir_fails_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(ValueError, match="is not writable"):
    train.train_and_evaluate(tiny_config.get_config(), str(blocker / "run"))


def test_workdir_of_a_different_config_is_refused_and_kept(tmp_path):
  config = tiny_config.get_config()
  config.train.num_steps = 2
  config.train.warmup_steps = 1
  train.train_and_evaluate(config, str(tmp_path))
  before = open(tmp_path / "metrics.jsonl").read()
  config.model.position = "alibi"  # and its rope settings back at their defaults, as unread
  config.model.rope.original_length = base.get_config().model.rope.original_length
  with pytest.raises(ValueError, match="holds a run of a different config.*model.position"):
    train.train_and_evaluate(config, str(tmp_path))
  assert open(tmp_path / "metrics.jsonl").read() == before


def test_packed_documents_train_and_evaluate(tmp_path):
  """data.packing=documents on a corpus of short files (so that training windows cross documents):
  the loop passes segments and positions through sharding and micro-batches (the first logged
  loss is the model's own on the packed batch), the loss is finite, and evaluation works. The
  feed-forward is a mixture of experts (its experts split over the tensor axis): the logged loss
  stays the cross-entropy, the load-balancing loss is logged beside it."""
  words = "the of attention position rotary linear state length token bytes window".split()
  (tmp_path / "corpus").mkdir()
  for i in range(200):
    rng = np.random.default_rng(i)
    (tmp_path / "corpus" / f"doc{i:03d}.txt").write_text(
        " ".join(rng.choice(words, rng.integers(1, 6))))
  config = tiny_config.get_config()
  config.data.update(dict(name="text_dir", corpus_path=str(tmp_path / "corpus"),
                          packing="documents", dir=str(tmp_path / "data")))
  config.train.update(dict(num_steps=4, grad_accum_steps=2))
  config.model.update(dict(feed_forward="moe", moe=dict(num_experts=4, top_k=2)))
  config.mesh.shape = (2, 2, 2)
  config.eval.num_tokens = 128
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert all(np.isfinite(r["loss"]) and 2 <= r["load_balancing_loss"] <= 4 for r in records)
  assert np.isfinite(records[-1]["validation_loss"])
  batch = data.train_batch(config, 0)
  assert batch["segments"].max() >= 2  # rows hold several documents
  model = model_lib.build_model(config.model, rngs=nnx.Rngs(config.train.seed))
  mean_nll = lambda logits: float((optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]) * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
  packed = mean_nll(model_lib.apply_to_batch(model, batch))
  np.testing.assert_allclose(records[0]["loss"], packed, rtol=1e-4)
  unsegmented = {k: v for k, v in batch.items() if k != "segments"}
  assert abs(mean_nll(model_lib.apply_to_batch(model, unsegmented)) - packed) > 1e-4  # segments matter
  rows = extrapolation.evaluate_run(config, workdir, progress=lambda line: None)
  assert {(r["eval_length"], r["eval_mode"]) for r in rows} == {
      (length, mode) for length in (32, 64) for mode in ("nonoverlapping", "sliding")}
  assert all(np.isfinite(r["loss"]) and r["tokens"] > 0 for r in rows)


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
  config = tiny_config.get_config()
  config.train.update(dict(num_steps=3, batch_size=16))
  train.train_and_evaluate(config, str(tmp_path / "full"))
  config.train.grad_accum_steps = 2
  train.train_and_evaluate(config, str(tmp_path / "accumulated"))
  np.testing.assert_allclose(_losses(tmp_path / "accumulated"), _losses(tmp_path / "full"),
                             rtol=1e-5)


@pytest.mark.parametrize("attention,position,decayed_names", [
    ("mamba", "none", {"kernel", "embedding", "conv_kernel"}),
    ("mha", "fire", {"kernel", "embedding", "hidden_kernel", "out_kernel"}),
    ("mha", "learned", {"kernel", "embedding", "table"}),
    ("mha", "t5", {"kernel", "embedding"}),
])
def test_weight_decay_follows_each_parameters_declaration(attention, position, decayed_names):
  """Norms, biases, Mamba's A_log and D, and the T5/KERPLE/FIRE bias parameters never decay."""
  config = tiny_config.get_config()
  config.model = tiny_model_config(attention=attention, position=position)
  model = model_lib.build_model(config.model, rngs=nnx.Rngs(0))
  config.train.update(dict(learning_rate=1.0, warmup_steps=0, weight_decay=1.0))
  optimizer, _ = train.make_optimizer(config)
  params = nnx.state(model)
  # With zero gradients AdamW's update is the weight decay alone: -lr * wd * param.
  updates, _ = optimizer.update(jax.tree.map(np.zeros_like, params), optimizer.init(params),
                                params)
  decayed = {path[-1] for path, update in nnx.to_flat_state(updates)
             if np.abs(np.asarray(update[...])).sum() > 0}
  assert decayed == decayed_names, decayed


def test_tensorboard_events_are_written_without_tensorflow(tmp_path):
  config = tiny_config.get_config()
  config.train.update(dict(num_steps=2, warmup_steps=1, trackers=("tensorboard",)))
  train.train_and_evaluate(config, str(tmp_path))
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))
  assert "tensorflow" not in sys.modules


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path):
  workdir = str(tmp_path / "run")
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\nfrom research.runs import lock as workdir_lock\n"
       "with workdir_lock.hold(sys.argv[1]):\n  print('held', flush=True)\n  time.sleep(600)",
       workdir], cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir_lock.WorkdirBusyError, match=f"in use by pid {holder.pid} on "):
      train.train_and_evaluate(tiny_config.get_config(), workdir)
  finally:
    holder.kill()
    holder.wait()
  assert os.listdir(workdir) == [workdir_lock.LOCK_NAME]  # the refused writer wrote nothing


def _truncate_data_files(checkpoint_dir):
  """Cut every file of a checkpoint above 1 KB (the arrays' data) to half its size."""
  for path in checkpoint_dir.rglob("*"):
    if path.is_file() and os.path.getsize(path) > 1024:
      os.truncate(path, os.path.getsize(path) // 2)


def test_a_truncated_checkpoint_falls_back_to_the_previous_one(trained_run, tmp_path, capsys):
  config, trained = trained_run
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  _truncate_data_files(tmp_path / "run" / "checkpoints" / "8")
  capsys.readouterr()
  train.train_and_evaluate(config, workdir)
  fallback = [line for line in capsys.readouterr().out.splitlines() if "unreadable" in line]
  assert len(fallback) == 1 and "checkpoint 8 " in fallback[0], fallback
  assert fallback[0].endswith("using step 4")
  assert os.path.isdir(tmp_path / "run" / checkpoints.UNREADABLE_DIR / "8")  # kept aside
  assert checkpoints.steps(workdir) == [4, 8]
  for got, want in zip(_final_params(workdir), _final_params(trained), strict=True):
    np.testing.assert_array_equal(got, want)
  # When no checkpoint restores, one error says so and every checkpoint is left in place.
  for step in (4, 8):
    _truncate_data_files(tmp_path / "run" / "checkpoints" / str(step))
  with pytest.raises(checkpoints.CheckpointError, match="no checkpoint .* restores .steps 8, 4"):
    train.train_and_evaluate(config, workdir)
  assert checkpoints.steps(workdir) == [4, 8]


def test_a_run_that_failed_before_its_first_checkpoint_restarts_with_a_fixed_config(tmp_path):
  config = tiny_config.get_config()
  config.train.update(dict(num_steps=4, warmup_steps=1, checkpoint_every=4, learning_rate=1e30))
  with pytest.raises(train.NonFiniteLossError, match="no checkpoint was written"):
    train.train_and_evaluate(config, str(tmp_path))
  config.train.learning_rate = 1e-2
  train.train_and_evaluate(config, str(tmp_path))
  assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
  assert json.load(open(tmp_path / "config.json"))["train"]["learning_rate"] == 1e-2


_DISK_FAULTS = textwrap.dedent("""
    # In a mount namespace of our own: a 16 MiB tmpfs workdir that turns read-only once
    # checkpoint 20 is complete, then (resumed) full once checkpoint 40 is: the next save is
    # 20 steps away, and the run is stopped (SIGSTOP) while the disk fills so that it does not
    # race ahead of the fill. Prints each run's exit status and the milliseconds from fault to
    # exit.
    set -u
    mount -t tmpfs -o size=16m tmpfs "$DISK"
    train="$PYTHON -m experiments.train --config=$CONFIG --workdir=$DISK/run
           --config.train.num_steps=100000 --config.train.warmup_steps=2
           --config.train.checkpoint_every=20 --config.train.log_every=20"
    $train 2> "$OUT/read_only.err" > /dev/null &
    until [ -d "$DISK/run/checkpoints/20" ] || ! kill -0 $!; do sleep 0.05; done
    mount -o remount,ro "$DISK"; start=$(date +%s%N)
    wait $!; echo "read_only $? $(( ($(date +%s%N) - start) / 1000000 ))"
    mount -o remount,rw "$DISK"
    $train 2> "$OUT/full.err" > /dev/null &
    until [ -d "$DISK/run/checkpoints/40" ] || ! kill -0 $!; do sleep 0.05; done
    kill -STOP $!; cat /dev/zero > "$DISK/filler" 2> /dev/null; kill -CONT $!
    start=$(date +%s%N)
    wait $!; echo "full $? $(( ($(date +%s%N) - start) / 1000000 ))"
    rm "$DISK/filler"; cp -r "$DISK/run" "$OUT/run"
    """)


def test_orbax_async_save_failures_log_one_line_without_a_traceback():
  """A save failing in orbax's writing thread (the disk filled during the write) is logged there
  with its traceback before the run reports it in one line: the manager's filter keeps the log
  line and drops the traceback. The phrases it keys on are in the installed orbax."""
  import inspect
  import logging

  from orbax.checkpoint._src.checkpointers import async_checkpointer
  from orbax.checkpoint._src.futures import future
  from orbax.checkpoint._src.metadata import checkpoint as metadata_checkpoint
  from research.runs import checkpoints

  for phrase, module in zip(checkpoints.FAILURE_LOGS,
                            (future, metadata_checkpoint, async_checkpointer), strict=True):
    source = re.sub(r"'\s*'", "", inspect.getsource(module))  # joins implicit concatenations
    assert phrase in source, (phrase, module.__name__)
  checkpoints._quiet_async_failures()
  checkpoints._quiet_async_failures()  # idempotent: one filter
  absl_logger = logging.getLogger("absl")
  filters = [f for f in absl_logger.filters if isinstance(f, checkpoints._WithoutAsyncTraceback)]
  assert len(filters) == 1
  try:
    raise OSError(28, "No space left on device")
  except OSError:
    exc_info = sys.exc_info()
  records = [logging.LogRecord("absl", logging.ERROR, __file__, 1, message, ("x",), exc_info)
             for message in (f"[thread=1] {checkpoints.ASYNC_FAILURE_LOG}: %s", "another: %s",
                             f"{checkpoints.METADATA_FAILURE_LOG}%s path=%s: %s",
                             f"Failed to run 2 {checkpoints.COMMIT_FAILURE_LOG}: %s")]
  assert all(filters[0].filter(record) for record in records)  # every line is kept
  assert records[0].exc_info is None and records[1].exc_info is exc_info
  assert records[2].exc_info is None and records[3].exc_info is None
  assert "Traceback" not in logging.Formatter().format(records[0])


@pytest.mark.skipif(not can_mount_in_a_namespace(), reason="needs unshare -rm (user namespaces)")
def test_a_disk_that_turns_read_only_or_full_stops_the_run_within_seconds(tmp_path):
  (tmp_path / "disk").mkdir()
  env = dict(_env(8), DISK=str(tmp_path / "disk"), OUT=str(tmp_path), PYTHON=sys.executable,
             CONFIG=CONFIG)
  result = subprocess.run(["unshare", "-rm", "bash", "-c", _DISK_FAULTS], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  outcomes = {name: (int(rc), int(milliseconds) / 1000)
              for name, rc, milliseconds in (line.split() for line in result.stdout.splitlines())}
  for name, step, reason in (("read_only", 40, "Read-only file system"),
                             ("full", 60, "No space left on device")):
    rc, seconds = outcomes[name]
    errors = open(tmp_path / f"{name}.err").read()
    assert rc == 1 and seconds < 30, (name, outcomes, errors[-2000:])
    assert "Traceback" not in errors, errors[-2000:]
    (line,) = [line for line in errors.splitlines() if line.startswith("error:")]
    # The save that meets the fault is `step`, or a later one where the run got past it within
    # the 50 ms between polls (seen in CI before the run was stopped for the fill).
    failed = int(re.match(r"error: cannot write checkpoint (\d+) ", line).group(1))
    assert failed >= step and reason in line, line
    assert f"the last complete checkpoint (step {failed - 20}) is intact" in line
  assert checkpoints.steps(str(tmp_path / "run")) == list(range(20, failed, 20))
  with ocp.CheckpointManager(checkpoints.directory(str(tmp_path / "run"))) as manager:
    restored = manager.restore(40, args=ocp.args.StandardRestore())
  assert int(restored["step"]) == 40


def test_init_from_converts_a_finished_mha_run_to_gqa_and_refuses_other_models(trained_run,
                                                                              tmp_path):
  """A finished MHA run initialises a GQA run with 2 key/value heads by mean-pooling: the
  logits of the MHA model whose key/value heads are made equal within each group (to their
  mean); a model that differs in anything but its key/value heads is refused, naming what
  differs, before anything is written."""
  source_config, source = trained_run  # mha, 4 heads, 1 layer, finished
  config = source_config.copy_and_resolve_references()
  config.model.update(attention="gqa", num_kv_heads=2)
  config.train.update(init_from=source, num_steps=0, warmup_steps=0)  # an absolute path
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  params = init_from.initial_params(config, str(tmp_path / "gqa"), mesh, log=lambda line: None)
  gqa = nnx.merge(nnx.graphdef(nnx.eval_shape(
      lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))), params)
  assert gqa.blocks[0].mixer.key.kernel.shape == (32, 2, 8)
  _, mha = generate.restore(source_config, source)
  for projection in (mha.blocks[0].mixer.key, mha.blocks[0].mixer.value):
    kernel = projection.kernel[...]
    projection.kernel[...] = jnp.repeat((kernel[:, 0::2] + kernel[:, 1::2]) / 2, 2, axis=1)
  logits = jax.jit(lambda model, tokens: model(tokens))
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
  np.testing.assert_allclose(logits(gqa, tokens), logits(mha, tokens), atol=1e-5)

  for overrides, message in (({"model.d_model": 64}, r"model.d_model: 32 \(source\) vs 64"),
                             ({"model.attention": "linear"}, "'mha' .source. vs 'linear'"),
                             ({"train.init_from": "absent"}, "holds no run")):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
      init_from.check(sweep.apply_overrides(config, overrides), str(tmp_path / "bad"))
  with pytest.raises(ValueError, match="d_model"):
    train.train_and_evaluate(sweep.apply_overrides(config, {"model.d_model": 64}),
                             str(tmp_path / "bad"))
  assert not os.path.exists(tmp_path / "bad" / "config.json")


def test_every_failing_check_is_named_in_one_message():
  """Independent checks each name their problem in the one error, not only the first."""
  from research.training import checks  # noqa: PLC0415
  config = tiny_config.get_config()
  config.train.warmup_steps = 100
  config.train.log_every, config.train.eval_every = 2, 3
  config.eval.rope_scalings = ("yarnn",)
  with pytest.raises(ValueError) as raised:
    checks.validate_config(config, num_devices=1)
  message = str(raised.value)
  for phrase in ("train.warmup_steps=100 must be in", "train.eval_every=3 must be a multiple",
                 "unknown eval.rope_scalings ['yarnn']"):
    assert phrase in message, message
