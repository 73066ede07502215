"""The training loop shared by every variant: pjit-style data and model parallelism.

  jax.jit(train_step, in_shardings=(state, batch), out_shardings=(state, replicated),
          donate_argnums=0)
over a (data, fsdp, tensor) device mesh, parameters sharded by their logical axis names
(research.model.sharding.RULES) and created already sharded; AdamW with warmup + cosine decay and
global-norm clipping (optax); asynchronous, atomic orbax checkpoints (research.runs.checkpoints);
resume by rerunning the same command (the batch of step s is a pure function of seed, s and
process, so resuming needs no data state). One writer per workdir (research.runs.lock). Runs
unchanged on CPU, GPU or TPU, one process or many (jax.distributed); in a run of many processes
a watchdog (research.training.lost_process) stops every process with one line when one is lost.
SIGTERM (preemption) or SIGINT stops every process at the end of one step, with a checkpoint of
it (research.training.preemption).

The objective is the mean next-token cross-entropy over the scored tokens plus the auxiliary
losses the layers sow (a mixture of experts' load balancing; research.model.feed_forward.base); the
logged `loss` is the cross-entropy alone, the auxiliary losses are logged beside it.

Sections: 1 set-up and checks; 2-3 the state, created sharded, and the step (make_train_step,
which experiments.compile compiles for a TPU slice too); 4 checkpoints; 5 the loop.
"""

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from research.runs import checkpoints
from research.runs import config_fields
from research.training import checks
from research import data
from research.data import packing as data_packing
from research.evaluation import evaluate
from research.model import feed_forward
from research.model import flops
from research.training import init_from
from research.training import lost_process
from research.training import preemption
from research.model import transformer as model_lib
from research.model import sharding
from research.runs import lock as workdir_lock
from research.training.metrics import MetricWriter, duration

class NonFiniteLossError(RuntimeError):
  pass


def initialize_distributed(config):
  """jax.distributed for multi-process runs (a no-op for one process)."""
  dist = config.distributed
  if dist.coordinator_address and not jax.distributed.is_initialized():
    jax.distributed.initialize(
        dist.coordinator_address, dist.num_processes, dist.process_id,
        heartbeat_timeout_seconds=lost_process.heartbeat_timeout_seconds())


def make_optimizer(config, abstract_model=None):
  """The optax chain (clipping, AdamW with each parameter's declared weight decay) and the
  learning-rate schedule; `abstract_model` (nnx.eval_shape of the model) saves building one."""
  t = config.train
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.num_steps, t.warmup_steps + 1),  # num_steps 0: never evaluated
      end_value=t.learning_rate * t.end_learning_rate_fraction)

  # Each parameter's own `weight_decay` metadata, declared where it is created (research.model.nn),
  # read once from the abstract model; the mask looks parameters up by their path, so it serves
  # trees of Variables (this loop) and of raw arrays (nnx.Optimizer's update) alike.
  declared = {}
  abstract = abstract_model or nnx.eval_shape(
      lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(0)))
  for path, variable in jax.tree_util.tree_flatten_with_path(
      nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    decay = variable.get_metadata().get("weight_decay")
    if decay is None:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} does not declare weight_decay; "
                       f"create it with research.model.nn.param / nn.dense, or pass "
                       "weight_decay=...")
    declared[jax.tree_util.keystr(path)] = decay

  def decay_mask(params):
    def decays(path, leaf):
      decay = declared[jax.tree_util.keystr(path)]
      return leaf.replace(decay) if isinstance(leaf, nnx.Variable) else decay

    return jax.tree_util.tree_map_with_path(decays, params,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))

  optimizer = optax.chain(
      optax.clip_by_global_norm(t.grad_clip_norm),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay, mask=decay_mask))
  return optimizer, schedule


def loss_sum(model, batch):
  """The objective of a (micro-)batch as a sum over its scored tokens: the summed cross-entropy
  plus the layers' auxiliary losses times the number of scored tokens (so that dividing by the
  tokens of the whole batch gives the mean cross-entropy plus the auxiliary losses). Also
  returns (summed cross-entropy, {name: auxiliary loss}, empty for a model that sows none)."""
  logits, sown = nnx.capture(model_lib.apply_to_batch, feed_forward.AuxiliaryLoss)(model, batch)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  nll_sum = (nll * batch["loss_mask"]).sum()
  auxiliary = feed_forward.auxiliary_losses(sown)
  objective = nll_sum + auxiliary.get(feed_forward.OBJECTIVE, 0.0) * batch["loss_mask"].sum()
  return objective, (nll_sum, auxiliary)


def make_init_state(config, optimizer):
  """The function that creates the train state: step, parameters (nnx.State), optimizer state."""

  def init_state():
    model = model_lib.build_model(config.model, rngs=nnx.Rngs(config.train.seed))
    params = nnx.state(model)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

  return init_state


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """The jitted training step of a config on a mesh, and the state it updates: what the loop runs
  and what experiments.compile compiles for an accelerator, built by one function."""
  train: Callable  # (state, batch) -> (state, metrics), donating the state
  init_state: Callable  # () -> the initial state (jit it with out_shardings=state_shardings)
  abstract_state: Any  # ShapeDtypeStructs (of nnx Variables) of the state
  state_shardings: Any
  batch_sharding: NamedSharding
  graphdef: Any
  schedule: Callable


def make_train_step(config, mesh) -> TrainStep:
  """The training step of `config` on `mesh`: gradient accumulation over train.grad_accum_steps
  micro-batches, then one optimizer update. The model is traced twice here (its structure, then
  the state's shapes) and built by nothing: the caller initialises or restores the state."""
  t = config.train
  abstract_model = nnx.eval_shape(
      lambda: model_lib.build_model(config.model, rngs=nnx.Rngs(t.seed)))
  graphdef = nnx.graphdef(abstract_model)
  optimizer, schedule = make_optimizer(config, abstract_model)
  init_state = make_init_state(config, optimizer)
  abstract_state = jax.eval_shape(init_state)
  state_shardings = sharding.state_shardings(abstract_state, mesh)
  batch_sharding = sharding.batch_sharding(mesh)

  def params_loss_sum(params, batch):
    return loss_sum(nnx.merge(graphdef, params), batch)

  def train_step(state, batch):
    # Packed documents (data.packing="documents") bring their segments and positions in the
    # batch. Otherwise randomized positions (model.randomize_max_length) are drawn for the whole
    # batch, a pure function of (seed, step), before it is split into micro-batches; else 0..L-1
    # (the default). Every key of the batch is split into micro-batches alike.
    if "positions" not in batch:
      key = jax.random.fold_in(jax.random.key(t.seed), state["step"])
      positions = nnx.merge(graphdef, state["params"]).training_positions(
          key, *batch["inputs"].shape)
      if positions.shape[0] > 1:
        batch = dict(batch, positions=positions)
    # Strided micro-batches (rows i, i + k, ...) keep every device's rows on that device.
    micro = jax.tree.map(
        lambda x: x.reshape(-1, t.grad_accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)

    def accumulate(grads_and_nll, micro_batch):
      (_, (nll, auxiliary)), grads = jax.value_and_grad(params_loss_sum, has_aux=True)(
          state["params"], micro_batch)
      return jax.tree.map(jnp.add, grads_and_nll, (grads, nll)), auxiliary

    zeros = (jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros((), jnp.float32))
    (grads, nll), auxiliary = jax.lax.scan(accumulate, zeros, micro)
    tokens = jnp.maximum(batch["loss_mask"].sum(), 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": nll / tokens, "grad_norm": optax.global_norm(grads),
               "param_norm": optax.global_norm(params), "learning_rate": schedule(state["step"]),
               "auxiliary": jax.tree.map(jnp.mean, auxiliary),  # over the micro-batches
               "params_finite": jnp.all(jnp.stack([jnp.isfinite(p).all()
                                                   for p in jax.tree.leaves(params)]))}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  jitted = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, None), donate_argnums=0)
  return TrainStep(jitted, init_state, abstract_state, state_shardings, batch_sharding, graphdef,
                   schedule)


def abstract_batch(config, batch_sharding) -> dict:
  """ShapeDtypeStructs of a global training batch of `config` (research.data.train_batch's keys
  and dtypes), laid out by `batch_sharding`: the step's input for ahead-of-time compilation."""
  shape = (config.train.batch_size, config.train.seq_len)
  keys = {"inputs": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32}
  if data.is_language_modeling(config) and data_packing.documents(config):
    keys.update(segments=jnp.int32, positions=jnp.int32)
  return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
          for key, dtype in keys.items()}


def train_and_evaluate(config, workdir):
  """Train `config` in `workdir` (resuming from its newest readable checkpoint); returns the final
  state. Raises ValueError for a bad config or a workdir of another run, WorkdirBusyError if
  another process writes there, before writing anything."""
  # ---- 1. Set-up and checks: everything that can fail does so before any work is written.
  initialize_distributed(config)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  with lost_process.watchdog(workdir):
    return _check_and_train(config, workdir)


def _check_and_train(config, workdir):
  """The checks, then sections 2-5 holding the workdir's writer lock (process 0)."""
  mesh_shape = checks.validate_config(config, jax.device_count(), jax.process_count())
  checks.check_writable(workdir)
  data.prepare(config)
  is_writer = jax.process_index() == 0
  with workdir_lock.hold(workdir) if is_writer else contextlib.nullcontext():
    checks.check_workdir(workdir, config)
    if config.train.init_from and not checkpoints.steps(workdir):
      init_from.check(config, workdir)
    if is_writer:  # atomically: the other processes read it in check_workdir
      with open(os.path.join(workdir, "config.json.tmp"), "w") as f:
        f.write(config_fields.as_saved(config, workdir).to_json(indent=2, sort_keys=True))
      os.replace(os.path.join(workdir, "config.json.tmp"), os.path.join(workdir, "config.json"))
    return _train(config, workdir, sharding.make_mesh(mesh_shape), is_writer)


def _train(config, workdir, mesh, is_writer):
  """Sections 2-5, run while holding the workdir's writer lock."""
  t = config.train

  # ---- 2-3. Train state (created directly in its sharded layout) and the step.
  step_fn = make_train_step(config, mesh)
  graphdef, state_shardings = step_fn.graphdef, step_fn.state_shardings
  batch_sharding = step_fn.batch_sharding
  eval_step = evaluate.make_eval_step(graphdef)

  # ---- 4. Checkpoints: restore the newest readable one, or initialise.
  manager = checkpoints.manager(workdir, t.keep_checkpoints, t.keep_checkpoints_at)
  with jax.set_mesh(mesh):
    state = checkpoints.restore_latest(manager,
                                       sharding.sharded_abstract(step_fn.abstract_state, mesh),
                                       log=print if is_writer else lambda line: None)
    initialised = state is None
    if initialised:
      state = jax.jit(step_fn.init_state, out_shardings=state_shardings)()
      if t.init_from:  # another run's parameters; the optimizer's state is fresh either way
        params = init_from.initial_params(config, workdir, mesh,
                                          log=print if is_writer else lambda line: None)
        state["params"] = jax.device_put(params, state_shardings["params"])
        checkpoints.save(manager, 0, state)
  start = int(state["step"])

  # ---- 5. The loop.
  model_for_flops = nnx.merge(graphdef, jax.eval_shape(lambda: state["params"]))
  flops_per_token = flops.train_flops_per_token(model_for_flops, t.seq_len)
  peak = flops.total_peak_flops()
  writer = MetricWriter(workdir, config, enabled=is_writer, resume_step=start)
  if is_writer and start < t.num_steps:
    print(f"{workdir}: {model_lib.count_params(model_for_flops) / 1e6:.2f}M parameters, "
          f"{jax.device_count()} {jax.default_backend()} device(s), mesh (data, fsdp, tensor) = "
          f"{tuple(mesh.shape.values())}, steps {start + 1}..{t.num_steps} of {t.batch_size} x "
          f"{t.seq_len} tokens; writes config.json, metrics.jsonl, checkpoints/", flush=True)
  if is_writer and start == t.num_steps and not initialised:
    print(f"{workdir} is trained to step {start} already; to evaluate it at other lengths or "
          f"scalings: python -m experiments.evaluate --workdir={workdir} "
          "--config.eval.lengths=...", flush=True)
  elif is_writer and start:
    print(f"resuming {workdir} from step {start}", flush=True)
  pending = []  # (step, device metrics) not yet checked for a finite loss

  def check_finite():
    """Raise at the first pending step whose loss or updated parameters are not finite."""
    for step, metrics in pending:
      loss, params_finite = float(metrics["loss"]), bool(metrics["params_finite"])
      if not (np.isfinite(loss) and params_finite):
        checkpoints.wait(manager)
        last = manager.latest_step()
        kept = f"the last checkpoint (step {last}) holds finite values" if last else (
            "no checkpoint was written")
        raise NonFiniteLossError(f"non-finite training at step {step} (loss {loss}, parameters "
                                 f"finite: {params_finite}); stopping; {kept}.")
    pending.clear()

  window_start, window_steps = time.perf_counter(), 0
  done = start  # the last step trained
  # SIGTERM or SIGINT: finish the step, checkpoint it, and stop (research.training.preemption).
  with jax.set_mesh(mesh), preemption.on_signals() as stop:
    for step in range(start, t.num_steps):
      local = data.train_batch(config, step, jax.process_index(), jax.process_count())
      batch = {k: jax.make_array_from_process_local_data(batch_sharding, v,
                                                          (t.batch_size,) + v.shape[1:])
               for k, v in local.items()}
      state, metrics = step_fn.train(state, batch)
      done = step + 1
      stopping = stop.at(done, metrics)
      pending.append((done, metrics))
      if step == start:  # keep compilation out of the throughput numbers
        jax.block_until_ready(metrics)
        first_step_time = time.perf_counter() - window_start
        window_start = time.perf_counter()
      else:
        window_steps += 1
      if (done % t.checkpoint_every == 0 or done == t.num_steps or done in t.keep_checkpoints_at
          or stopping):
        check_finite()
        checkpoints.save(manager, done, state)
      if done % t.log_every == 0 or done == t.num_steps:
        last = jax.device_get(metrics)
        check_finite()
        elapsed = time.perf_counter() - window_start
        if window_steps == 0:  # only the first, compiling step so far
          window_steps, elapsed = 1, first_step_time
        tokens_per_second = window_steps * t.batch_size * t.seq_len / elapsed
        record = {"step": done, "loss": float(last["loss"]),
                  "learning_rate": float(last["learning_rate"]),
                  "grad_norm": float(last["grad_norm"]), "param_norm": float(last["param_norm"]),
                  "tokens_per_second": tokens_per_second,
                  "step_time": elapsed / window_steps,
                  "mfu": flops.mfu(flops_per_token, tokens_per_second, peak),
                  **{name: float(value) for name, value in last["auxiliary"].items()}}
        if t.eval_every and done % t.eval_every == 0 or done == t.num_steps:
          record["validation_loss"] = evaluate.validation_loss(eval_step, state["params"], config,
                                                               mesh)
        writer.write(record, eta_seconds=(t.num_steps - done) * elapsed / window_steps,
                     num_steps=t.num_steps)
        window_start, window_steps = time.perf_counter(), 0
      if stopping:
        break
    checkpoints.wait(manager)
    manager.close()
    writer.close()
    stop.raise_if_stopped(done)
  if is_writer and done > start:
    outputs = ", ".join([f"checkpoint {done}", "metrics.jsonl", *t.trackers])
    print(f"trained {workdir} to step {done} in {duration(time.perf_counter() - writer.started)}: "
          f"{outputs}", flush=True)
  return state
