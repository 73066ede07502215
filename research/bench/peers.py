"""The project against PyTorch on the same CPU: the same models and kernels, interleaved in one run.

Cases, fp32, the same shapes, parameter counts and batches on both sides (research/bench/
peers_torch.py is the PyTorch side):
  train        one training step of the training suite's reference model (mha + RoPE, 2 layers,
               d_model 128, 4 heads, byte vocabulary, batch 32 x 128): the project's step
               (jax.jit of value_and_grad and research.training.loop.make_optimizer's optax
               chain, global-norm clipping and AdamW, parameters and optimizer state donated:
               research.training.loop's step without its metrics) against a nanoGPT-style
               PyTorch model (F.scaled_dot_product_attention(is_causal=True), clip_grad_norm_,
               torch.optim.AdamW), eager and torch.compile'd (a failure to compile is recorded
               as skipped, with its reason);
  train_large  the same at 4 layers, d_model 512, 8 heads, batch 8 x 512, eager;
  attention    causal softmax attention fwd+bwd at 4096 tokens (batch 1, 8 heads, head_dim 64,
               the mixers suite's kernel shape): the project's xla and blockwise paths against
               SDPA on [batch, heads, length, head_dim] (its layout);
  decode       one decode step at a 4096-token context (the decode suite's model: 2 layers,
               d_model 256, 8 heads, no positions): model.decode in a jitted step with the cache
               donated, against a PyTorch decoder with a preallocated [batch, heads, length,
               head_dim] KV cache (gpt-fast's layout) under torch.inference_mode;
  linear       chunked causal linear attention (elu + 1 features, normalised, chunk 64) fwd+bwd
               at 4096 against the chunk form of fla's naive_chunk_linear_attn in PyTorch;
  mamba        the selective scan fwd+bwd at 4096 (d_inner 1024, N 16): the project's chunked
               scan against a PyTorch port of mamba_ssm's selective_scan_ref (a loop over tokens);
  matmul       one 2048 x 2048 fp32 matmul.
Kernels are differentiated as the mixers suite does: the gradient of <out, cotangent> w.r.t.
every input (torch.autograd.grad with the same cotangent).

Agreement first: every case is run on both sides at a small size, with the project's parameters
copied into the PyTorch model (or the same inputs to a kernel), and the outputs and gradients are
compared; the largest absolute error is recorded, and a tensor off by more than RTOL of its
largest value stops the suite before any timing.

Threads: both frameworks get the same count n (--threads, default os.cpu_count()):
torch.set_num_threads(n), and PJRT_NPROC=n, which sizes the thread pool of XLA's CPU client. It
is read once, when JAX creates that client, so it is set before JAX starts its backend. The
installed jaxlib has no other thread count: XLA_FLAGS' --xla_cpu_multi_thread_eigen only turns
Eigen's threading on or off (left on, its default), and intra_op_parallelism_threads is a field
of XLA's compile options, not a flag.

Host devices: XLA:CPU runs a loop (blockwise attention's tiles, a scan) on one thread, whatever
the pool, so the suite also starts n host devices
(XLA_FLAGS' --xla_force_host_platform_device_count=n, unless set) in that same pool and adds the
rows `... over n devices`: the training step data-parallel over a (data=n) mesh of
research.model.sharding (as the training loop runs on n devices), and blockwise attention with
its heads split over the devices (jax.shard_map). The single-device rows run on device 0; the
n-device rows use the same n cores, not more.

Timing (timing.turns_seconds): after a warm-up call of each implementation of a case, rounds
that take one sample of each in turn, each sample after an idle gap (Settings.idle_seconds) in
which both runtimes' worker threads stop spinning, so that neither slows the other: the rows
record the process's CPU load (all threads) over each gap's last 0.1 s, 0 when every thread is
parked. Reported: median, min and max of each, the ratio PyTorch / project of the medians, of
the minima and of each round (> 1: the project is faster). PyTorch is an optional extra:
pip install -r requirements-peers.txt.
"""

import copy
import dataclasses
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

from research.model import transformer as model_lib
from research.model import sharding
from research.training import loop as train_lib
from research.bench import decode as decode_bench
from research.bench import mixers
from research.bench import report
from research.bench import timing
from research.bench import train as train_bench

INSTALL = "pip install -r requirements-peers.txt"
RTOL = 1e-4  # agreement: max |project - PyTorch| <= RTOL * max |PyTorch| + ATOL, per tensor
ATOL = 1e-6
HOST_DEVICES_FLAG = "xla_force_host_platform_device_count"
REFERENCE = {"num_layers": 2, "d_model": 128, "num_heads": 4}  # train.reference_config's model
LARGE = {"num_layers": 4, "d_model": 512, "num_heads": 8}
# Targets of issue 15 (PyTorch time / project time, at least): case -> (PyTorch, project, target).
TARGETS = {"train": ("eager", "jit", 0.8), "train_large": ("eager", "jit", 0.8),
           "attention": ("sdpa", "blockwise", 0.6), "decode": ("eager", "jit", 1.0),
           "linear": ("chunk", "linear", 1.0)}


@dataclasses.dataclass(frozen=True)
class Settings:
  train_batch: int = 32  # train: batch x length
  train_length: int = 128
  large_batch: int = 8  # train_large
  large_length: int = 512
  kernel_length: int = 4096  # attention, linear, mamba
  decode_context: int = 4096
  matmul_size: int = 2048
  repeats: int = 7  # rounds: one sample of each implementation in turn
  large_repeats: int = 5
  decode_repeats: int = 50
  torch_compile: bool = True
  # before every sample: long enough for both runtimes' worker threads to stop spinning (the
  # rows record the process's CPU load over each gap's last 0.1 s, timing.turns_seconds)
  idle_seconds: float = 0.3


FULL = Settings()
QUICK = Settings(train_batch=2, train_length=32, large_batch=1, large_length=64,
                 kernel_length=256, decode_context=256, matmul_size=256, repeats=1,
                 large_repeats=1, decode_repeats=2, torch_compile=False, idle_seconds=0.02)
CHECK = {"train_batch": 2, "train_length": 16, "kernel_length": 256, "scan_length": 128,
         "decode_context": 16, "decode_steps": 8, "matmul_size": 256}


class AgreementError(RuntimeError):
  """The project and PyTorch compute different results for the same case."""


def require_torch():
  """The torch module, or exit with one line that says how to install it."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    sys.exit(f"--suite=peers compares the project with PyTorch, which is not installed in this "
             f"environment; it is an optional extra: {INSTALL}")
  return torch


def configure(args):
  """Before JAX starts its backend: PyTorch present, both frameworks pinned to args.threads."""
  torch = require_torch()
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  args.threads = args.threads or os.cpu_count()
  args.xla_pool_pinned = not xla_bridge.backends_are_initialized()
  os.environ["PJRT_NPROC"] = str(args.threads)
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if args.xla_pool_pinned and HOST_DEVICES_FLAG not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --{HOST_DEVICES_FLAG}={args.threads}".strip()
  torch.set_num_threads(args.threads)


def settings_row(args, torch):
  pinned = getattr(args, "xla_pool_pinned", False)
  return {"part": "settings", "threads": args.threads, "torch_version": torch.__version__,
          "torch_num_threads": torch.get_num_threads(),
          "pjrt_nproc": os.environ.get("PJRT_NPROC", ""), "xla_pool_pinned": pinned,
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def host_devices(threads):
  """The CPU devices (at most `threads`) that the `... over n devices` rows split work over;
  empty off a CPU or with one device."""
  devices = jax.devices()
  devices = devices[:threads] if devices[0].platform == "cpu" else []
  return devices if len(devices) > 1 else []


def over_devices(name, devices):
  """`name ... over n devices`: the implementation label of a row split over host devices."""
  return f"{name} over {len(devices)} devices"


def heads_over_devices(kernel, devices):
  """(kernel with q, k, v [B, T, N, H] split by heads over `devices`, the inputs' sharding):
  each device runs its heads' loops on its own thread. The mesh is the training loop's, its
  tensor axis (where the model's heads go) over `devices`."""
  mesh = sharding.make_mesh((1, 1, len(devices)), devices)
  spec = jax.sharding.PartitionSpec(None, None, "tensor", None)
  # check_vma=False: blockwise's loop carries start as zeros, not marked as varying over heads.
  fn = jax.shard_map(kernel.fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                     check_vma=False)
  return (dataclasses.replace(kernel, name=over_devices(kernel.name, devices), fn=fn),
          jax.sharding.NamedSharding(mesh, spec))


# ---- The project's models in PyTorch's parameter names.

def torch_weights(model):
  """{PyTorch GPT parameter name: float32 array} of a project LanguageModel (mha, with MLP), or
  of its gradients merged into one (nnx.merge(graphdef, grads))."""
  array = lambda variable: np.asarray(variable[...], np.float32)  # noqa: E731
  d = model.embed.embedding.shape[1]
  named = {"wte.weight": array(model.embed.embedding), "ln_f.weight": array(model.final_norm.scale),
           "lm_head.weight": array(model.head.kernel).T}
  for i, block in enumerate(model.blocks):
    mixer = block.mixer
    if mixer.num_kv_heads != mixer.num_heads or block.mlp is None:
      raise ValueError("torch_weights maps multi-head attention blocks with an MLP only")
    qkv = [array(p.kernel).reshape(d, -1).T for p in (mixer.query, mixer.key, mixer.value)]
    named.update({
        f"h.{i}.ln_1.weight": array(block.mixer_norm.scale),
        f"h.{i}.attn.c_attn.weight": np.concatenate(qkv, axis=0),
        f"h.{i}.attn.c_proj.weight": array(mixer.out.kernel).reshape(-1, d).T,
        f"h.{i}.ln_2.weight": array(block.mlp_norm.scale),
        f"h.{i}.mlp.c_fc.weight": array(block.mlp.up.kernel).T,
        f"h.{i}.mlp.c_proj.weight": array(block.mlp.down.kernel).T})
  return {name: np.array(value, np.float32, order="C") for name, value in named.items()}


def train_config(dims, batch, length):
  config = train_bench.reference_config("mha", "rope", length, 100, "float32")
  config.model.update(**dims)
  config.train.batch_size = batch
  return config


def _torch_gpt(pt, config, model, rope):
  m = config.model
  gpt = pt.GPT(vocab_size=m.vocab_size, num_layers=m.num_layers, d_model=m.d_model,
               num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
               rope_base=m.rope.base if rope else None)
  pt.load_weights(gpt, torch_weights(model))
  ours, theirs = model_lib.count_params(model), sum(p.numel() for p in gpt.parameters())
  if ours != theirs:
    raise AgreementError(f"parameter counts differ: project {ours:,}, PyTorch {theirs:,}")
  return gpt


def _tokens(config, seed=0):
  rng = np.random.default_rng(seed)
  shape = (config.train.batch_size, config.train.seq_len + 1)
  tokens = rng.integers(0, config.model.vocab_size, shape, dtype=np.int64)
  return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])


def _mean_nll(graphdef, state, inputs, targets):
  logits = nnx.merge(graphdef, state)(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), logits


# ---- Agreement at a small size.

def compare(case, size, pairs):
  """A row with the largest errors over (name, project array, PyTorch array) pairs; raises
  AgreementError naming the first tensor off by more than RTOL of its largest value + ATOL."""
  worst, max_abs, max_rel = "", 0.0, 0.0
  for name, ours, theirs in pairs:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
      raise AgreementError(f"{case}: {name} has shape {ours.shape} here and {theirs.shape} in "
                           f"PyTorch")
    error = float(np.abs(ours - theirs).max())
    scale = float(np.abs(theirs).max())
    if error > RTOL * scale + ATOL:
      raise AgreementError(f"{case}: the project and PyTorch disagree on {name} at {size}: max "
                           f"abs error {error:.3g}, largest value {scale:.3g} (allowed "
                           f"{RTOL} x that + {ATOL})")
    if error >= max_abs:
      worst, max_abs = name, error
    max_rel = max(max_rel, error / (scale + ATOL))
  row = {"part": "agreement", "case": case, "size": size, "tensors": len(pairs),
         "max_abs_error": max_abs, "max_relative_error": max_rel, "worst": worst}
  print(report.progress_line(row), flush=True)
  return row


def check_train(case, dims, torch, pt, devices=()):
  """Logits, loss and every gradient of the same model on the same batch: a row for the jitted
  step on one device and, with host `devices` that split the batch, one for it data-parallel
  over them."""
  config = train_config(dims, CHECK["train_batch"], CHECK["train_length"])
  model = model_lib.build_model(config.model, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  inputs, targets = _tokens(config)
  # Jitted: op by op, the gradient of the large model took most of the quick suite's time.
  value_and_grad = jax.jit(jax.value_and_grad(
      lambda state, inputs, targets: _mean_nll(graphdef, state, inputs, targets), has_aux=True))
  gpt = _torch_gpt(pt, config, model, rope=True)
  t_loss, t_logits, t_grads = pt.loss_and_grads(gpt, torch.from_numpy(inputs),
                                                torch.from_numpy(targets))
  size = f"batch {CHECK['train_batch']} x {CHECK['train_length']}"
  batch = jnp.asarray(inputs), jnp.asarray(targets)
  runs = {"jit": lambda: value_and_grad(state, *batch)}
  if devices and CHECK["train_batch"] % len(devices) == 0:
    runs[over_devices("jit", devices)] = _data_parallel(value_and_grad, [state], batch, devices)
  rows = []
  for implementation, run_step in runs.items():
    (loss, logits), grads = run_step()
    ours = torch_weights(nnx.merge(graphdef, grads))
    pairs = [("logits", logits, t_logits.detach().numpy()), ("loss", loss, t_loss.item())]
    pairs += [(f"grad {name}", ours[name], t_grads[name].numpy()) for name in sorted(t_grads)]
    rows.append({**compare(f"{case} {implementation}", size, pairs), "case": case,
                 "implementation": implementation})
  return rows


def check_decode(case, torch, pt):
  """Logits of DECODE_STEPS tokens decoded one at a time from empty caches."""
  config = decode_bench.model_config("mha", "float32")
  model = model_lib.build_model(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  advance = jax.jit(lambda state, token, cache: nnx.merge(graphdef, state).decode(token, cache))
  context, steps = CHECK["decode_context"], CHECK["decode_steps"]
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, steps), dtype=np.int64)
  cache = model.init_cache(1, context)
  gpt = _torch_gpt(pt, base_config(config), model, rope=False)
  gpt.setup_caches(1, context)
  pairs = []
  with torch.inference_mode():
    for t in range(steps):
      logits, cache = advance(state, jnp.asarray(tokens[:, t:t + 1], jnp.int32), cache)
      theirs = gpt(torch.from_numpy(tokens[:, t:t + 1]), start=t)
      pairs.append((f"logits of step {t}", logits, theirs.numpy()))
  return compare(case, f"{steps} steps into a {context}-token cache", pairs)


def base_config(model_config):
  """A full config around `model_config` (what _torch_gpt reads)."""
  config = train_bench.reference_config("mha", "none", 16, 1, "float32")
  config.model = model_config
  return config


def _kernel_inputs(kernel, length):
  inputs, cotangent = mixers.make_inputs(kernel, length, jnp.float32)
  return tuple(np.array(x) for x in inputs), np.array(cotangent)  # writable copies


def _project_kernel(kernel, inputs, cotangent):
  """(output, gradients w.r.t. every input) of the mixers suite's kernel."""
  out = jax.jit(kernel.fn)(*inputs)
  grads = jax.jit(mixers.forward_backward(kernel))(*inputs, cotangent)[1:]
  return out, grads


def check_kernels(case, project_kernels, torch_kernel, length):
  """Every project kernel against the PyTorch kernel: output and input gradients."""
  rows = []
  inputs, cotangent = _kernel_inputs(project_kernels[0], length)
  t_out, t_grads = torch_kernel.run(inputs, cotangent)
  for kernel in project_kernels:
    out, grads = _project_kernel(kernel, inputs, cotangent)
    pairs = [("output", out, t_out)]
    pairs += [(f"grad {name}", g, tg) for name, g, tg in zip(torch_kernel.names, grads, t_grads)]
    rows.append({**compare(f"{case} {kernel.name}", f"length {length}", pairs),
                 "case": case, "implementation": kernel.name})
  return rows


def check_matmul(case, torch):
  size = CHECK["matmul_size"]
  a, b = np.random.default_rng(0).standard_normal((2, size, size), np.float32)
  ours = jax.jit(jnp.matmul)(a, b)
  return compare(case, f"{size} x {size}", [("product", ours,
                                                torch.from_numpy(a) @ torch.from_numpy(b))])


# ---- PyTorch kernels in the project's layouts.

@dataclasses.dataclass(frozen=True)
class TorchKernel:
  """`forward(*tensors) -> out` on tensors made by `to_torch(inputs)` (the project's numpy
  inputs); `swap`: the change between the project's layout of the output and PyTorch's, its own
  inverse; `names`: the differentiated inputs, in the project's argument order."""
  forward: object
  to_torch: object
  swap: object
  names: tuple
  torch: object

  def prepare(self, inputs, cotangent):
    """(tensors requiring grad, cotangent), in PyTorch's layout."""
    tensors = tuple(t.requires_grad_() for t in self.to_torch(inputs))
    return tensors, self.swap(self.torch.from_numpy(cotangent)).contiguous()

  def call(self, tensors, cotangent):
    out = self.forward(*tensors)
    return out, self.torch.autograd.grad(out, tensors, cotangent)

  def run(self, inputs, cotangent):
    """(output, gradients) as numpy arrays in the project's layouts."""
    tensors, cotangent = self.prepare(inputs, cotangent)
    out, grads = self.call(tensors, cotangent)
    back = lambda t: (self.swap(t) if t.dim() >= 3 else t).detach().numpy()  # noqa: E731
    return back(out), [back(g) for g in grads]


def sdpa_kernel(torch):
  """q, k, v [B, L, N, H] -> SDPA on [B, N, L, H]; the transpose is its own inverse."""
  swap = lambda t: t.transpose(1, 2)  # noqa: E731
  return TorchKernel(
      forward=lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
          q, k, v, is_causal=True),
      to_torch=lambda inputs: tuple(swap(torch.from_numpy(x)).contiguous() for x in inputs),
      swap=swap, names=("q", "k", "v"), torch=torch)


def linear_kernel(torch, pt):
  return TorchKernel(
      forward=lambda q, k, v: pt.chunk_linear_attention(q, k, v, mixers.LINEAR_CHUNK),
      to_torch=lambda inputs: tuple(torch.from_numpy(x) for x in inputs),
      swap=lambda t: t, names=("q", "k", "v"), torch=torch)


def scan_kernel(torch, pt):
  """The project's (x, delta, A, B, C, h0) [b, L, E|N] -> mamba_ssm's (u, delta, A, B, C) with
  length last; h0 is 0 in both (the reference starts from zeros)."""
  swap = lambda t: t.transpose(1, 2)  # noqa: E731

  def to_torch(inputs):
    x, delta, A, B, C, _ = (torch.from_numpy(t) for t in inputs)
    return (swap(x).contiguous(), swap(delta).contiguous(), A, swap(B).contiguous(),
            swap(C).contiguous())

  return TorchKernel(forward=pt.selective_scan_reference, to_torch=to_torch, swap=swap,
                     names=("x", "delta", "A", "B", "C"), torch=torch)


# ---- Timing: zero-argument calls of each side, at the full size.

def _kernel(name):
  return next(k for k in mixers.kernels("cpu") if k.name == name)


def kernel_calls(project_kernels, torch_name, torch_kernel, length, shardings=None):
  """{(side, implementation): call} of the project kernels and the PyTorch kernel at `length`;
  shardings: {kernel name: where its inputs live} (default: device 0)."""
  calls = {}
  inputs = cotangent = None
  for kernel in project_kernels:
    inputs, cotangent = _kernel_inputs(kernel, length)
    grads = jax.jit(mixers.forward_backward(kernel))
    sharding = (shardings or {}).get(kernel.name)
    device_inputs = [jnp.asarray(x) if sharding is None else jax.device_put(x, sharding)
                     for x in (*inputs, cotangent)]
    calls["project", kernel.name] = lambda grads=grads, args=device_inputs: grads(*args)
  tensors, t_cotangent = torch_kernel.prepare(inputs, cotangent)
  calls["pytorch", torch_name] = lambda: torch_kernel.call(tensors, t_cotangent)
  return calls


def _data_parallel(fn, state, device_batch, devices, carried=0):
  """call() running jitted fn(*state, *batch) with the batch split over a (data=n) mesh of
  `devices` and the state (parameters, optimizer state) replicated, as the training loop runs
  on n devices; a step that donates its state returns it first (`carried` outputs, which
  replace it; call() then gives the last output)."""
  mesh = sharding.make_mesh((len(devices), 1, 1), devices)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  # Copies first: the single-device step donates the buffers it was given.
  held = [jax.device_put(jax.tree.map(jnp.copy, x), replicated) for x in state]
  batch = [jax.device_put(jnp.copy(x), rows) for x in device_batch]

  def call():
    with jax.set_mesh(mesh):
      out = fn(*held, *batch)
    if not carried:
      return out
    held[:carried] = out[:carried]
    return out[-1]

  return call


def train_calls(dims, batch, length, torch, pt, compile_model, devices=()):
  """{(side, implementation): one training step}, and {(side, implementation): why skipped};
  with host `devices`, also the step data-parallel over them."""
  config = train_config(dims, batch, length)
  model = model_lib.build_model(config.model, rngs=nnx.Rngs(config.train.seed))
  optimizer = train_lib.make_optimizer(config)[0]
  graphdef, params = nnx.split(model)
  t = config.train

  def step(params, opt_state, inputs, targets):
    (loss, _), grads = jax.value_and_grad(_mean_nll, argnums=1, has_aux=True)(
        graphdef, params, inputs, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  inputs, targets = _tokens(config)
  state = [params, optimizer.init(params)]
  device_batch = jnp.asarray(inputs), jnp.asarray(targets)

  skipped = {}
  calls = {}
  if devices and batch % len(devices):
    skipped["project", over_devices("jit", devices)] = (
        f"batch {batch} does not split over {len(devices)} devices")
  elif devices:
    calls["project", over_devices("jit", devices)] = _data_parallel(
        step, [params, optimizer.init(params)], device_batch, devices, carried=2)

  def project():
    state[0], state[1], loss = step(*state, *device_batch)
    return loss

  calls = {("project", "jit"): project, **calls}
  gpt = _torch_gpt(pt, config, model, rope=True)
  batch = torch.from_numpy(inputs), torch.from_numpy(targets)
  models = {"eager": gpt}
  if compile_model:
    models["compile"] = torch.compile(copy.deepcopy(gpt))
  else:
    skipped["pytorch", "compile"] = "not tried (--quick)"
  for name, module in models.items():
    optim = pt.adamw(module, t.learning_rate, t.weight_decay)
    call = lambda module=module, optim=optim: pt.train_step(module, optim, *batch,
                                                             t.grad_clip_norm)
    try:
      call()  # torch.compile compiles here, or fails
    except Exception as error:  # pylint: disable=broad-except
      skipped["pytorch", name] = f"{type(error).__name__}: {str(error)[:200]}".splitlines()[0]
      continue
    calls["pytorch", name] = call
  return calls, skipped


def decode_calls(context, torch, pt):
  """One decode step at `context` (the cache index kept at context - 1) on each side."""
  config = decode_bench.model_config("mha", "float32")
  model = model_lib.build_model(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  step = decode_bench.decode_step(graphdef)
  cache = model.init_cache(1, context)
  cache["index"] = jnp.asarray(context - 1, jnp.int32)
  holder = [cache]
  token = jnp.zeros((1, 1), jnp.int32)

  def project():
    logits, holder[0] = step(state, token, holder[0])
    return logits

  gpt = _torch_gpt(pt, base_config(config), model, rope=False)
  gpt.setup_caches(1, context)
  t_token = torch.zeros((1, 1), dtype=torch.int64)

  def pytorch():
    with torch.inference_mode():
      return gpt(t_token, start=context - 1)

  return {("project", "jit"): project, ("pytorch", "eager"): pytorch}


def matmul_calls(size, torch):
  a, b = np.random.default_rng(0).standard_normal((2, size, size), np.float32)
  matmul = jax.jit(jnp.matmul)
  device = jnp.asarray(a), jnp.asarray(b)
  t_a, t_b = torch.from_numpy(a), torch.from_numpy(b)
  return {("project", "jit"): lambda: matmul(*device), ("pytorch", "mm"): lambda: t_a @ t_b}


def time_rows(case, title, calls, repeats, skipped=None, idle_seconds=0.0):
  """One row per (side, implementation) of `calls`: median, min, max and every round's time, in
  ms, and the process's CPU load during the idle gaps before them; one per entry of `skipped`
  {(side, implementation): reason}."""
  skipped = dict(skipped or {})
  try:
    times, loads = timing.turns_seconds(calls, repeats, idle_seconds)
  except Exception as error:  # pylint: disable=broad-except  # one case must not stop the rest
    reason = report.error_reason(error, 200)
    times, loads = {}, []
    skipped.update({key: reason for key in calls})
  rows = []
  for (side, implementation), seconds in times.items():
    ms = [round(1e3 * s, 4) for s in seconds]
    rows.append({"part": "time", "case": case, "title": title, "side": side,
                 "implementation": implementation, "time_ms": statistics.median(ms),
                 "min_ms": min(ms), "max_ms": max(ms), "times_ms": ms, "repeats": len(ms),
                 "idle_seconds": idle_seconds, "idle_load_max": max(loads, default=None)})
  rows += [{"part": "time", "case": case, "title": title, "side": side,
            "implementation": implementation, "skipped": reason}
           for (side, implementation), reason in skipped.items()]
  for row in rows:
    print(report.progress_line({k: v for k, v in row.items() if k != "times_ms"}), flush=True)
  return rows


# ---- The suite.

CASES = ("train", "train_large", "attention", "decode", "linear", "mamba", "matmul")


def _titles(s):
  return {
      "train": f"training step, 2 layers d_model 128, {s.train_batch} x {s.train_length}",
      "train_large": f"training step, 4 layers d_model 512, {s.large_batch} x {s.large_length}",
      "attention": f"causal attention fwd+bwd at {s.kernel_length}, 8 heads, head_dim 64",
      "decode": f"decode step at {s.decode_context} context, KV cache, 2 layers d_model 256",
      "linear": f"chunked linear attention fwd+bwd at {s.kernel_length}",
      "mamba": f"Mamba selective scan fwd+bwd at {s.kernel_length}, d_inner 1024, N 16",
      "matmul": f"{s.matmul_size}^2 fp32 matmul"}


def run(args):
  torch = require_torch()
  if not hasattr(args, "xla_pool_pinned"):
    configure(args)
  from research.bench import peers_torch as pt  # pylint: disable=import-outside-toplevel
  settings = QUICK if args.quick else FULL
  cases = [case for case in CASES if not args.only or case in args.only]
  rows = [settings_row(args, torch)]
  print(report.progress_line(rows[0]), flush=True)
  devices = host_devices(args.threads)
  sdpa, linear, scan = sdpa_kernel(torch), linear_kernel(torch, pt), scan_kernel(torch, pt)
  attention = [_kernel("xla"), _kernel("blockwise")]
  shardings = {}
  if devices:
    split, shardings[split.name] = heads_over_devices(_kernel("blockwise"), devices)
    attention.append(split)
  kernel_cases = {"attention": (attention, "sdpa", sdpa, CHECK["kernel_length"]),
                  "linear": ([_kernel("linear")], "chunk", linear, CHECK["kernel_length"]),
                  "mamba": ([_kernel("mamba")], "reference", scan, CHECK["scan_length"])}
  for case in cases:  # every agreement check before any timing
    if case in ("train", "train_large"):
      rows += check_train(case, REFERENCE if case == "train" else LARGE, torch, pt, devices)
    elif case == "decode":
      rows.append(check_decode(case, torch, pt))
    elif case == "matmul":
      rows.append(check_matmul(case, torch))
    else:
      project_kernels, _, torch_kernel, length = kernel_cases[case]
      rows += check_kernels(case, project_kernels, torch_kernel, length)
  titles = _titles(settings)
  for case in cases:
    skipped = {}
    repeats = settings.repeats
    if case == "train":
      calls, skipped = train_calls(REFERENCE, settings.train_batch, settings.train_length,
                                   torch, pt, settings.torch_compile, devices)
    elif case == "train_large":
      calls, skipped = train_calls(LARGE, settings.large_batch, settings.large_length, torch,
                                   pt, compile_model=False, devices=devices)
      skipped.pop(("pytorch", "compile"), None)  # not tried at this size
      repeats = settings.large_repeats
    elif case == "decode":
      calls, repeats = decode_calls(settings.decode_context, torch, pt), settings.decode_repeats
    elif case == "matmul":
      calls = matmul_calls(settings.matmul_size, torch)
    else:
      project_kernels, torch_name, torch_kernel, _ = kernel_cases[case]
      calls = kernel_calls(project_kernels, torch_name, torch_kernel, settings.kernel_length,
                           shardings)
    rows += time_rows(case, titles[case], calls, repeats, skipped, settings.idle_seconds)
  return rows


def _agreement(rows, case, implementation):
  """The max abs error of the case's agreement check (of `implementation`, for kernels)."""
  matches = [r for r in rows if r["part"] == "agreement" and r["case"] == case]
  match = [r for r in matches if r.get("implementation") in (None, implementation)]
  return match[0]["max_abs_error"] if match else None


def pairs(rows):
  """Every (project row, PyTorch row) of a case, both timed, in the order of the rows."""
  timed = [r for r in rows if r["part"] == "time" and r.get("time_ms") is not None]
  return [(ours, theirs) for ours in timed if ours["side"] == "project"
          for theirs in timed if theirs["side"] == "pytorch" and theirs["case"] == ours["case"]]


def round_ratios(ours, theirs):
  """PyTorch / project time of each interleaved round."""
  return [t / o for o, t in zip(ours["times_ms"], theirs["times_ms"])]


def summary(rows):
  f = report.fmt_ratio
  lines = []
  for row in rows:
    if row["part"] == "settings":
      pool = (f"PJRT_NPROC={row['pjrt_nproc']} (XLA's CPU client pool, set before the backend "
              f"started)" if row["xla_pool_pinned"] else
              f"PJRT_NPROC={row['pjrt_nproc']} set too late (JAX's backend had started): XLA "
              f"kept its default pool")
      lines.append(f"threads: {row['threads']} each; PyTorch {row['torch_version']} "
                   f"torch.set_num_threads({row['threads']}) (get_num_threads() = "
                   f"{row['torch_num_threads']}); {pool}; XLA_FLAGS="
                   f"{row['xla_flags'] or '(unset)'}")
  for case, (torch_impl, project_impl, target) in TARGETS.items():
    get = lambda side, impl: report.lookup(rows, "time_ms", part="time", case=case,  # noqa: E731
                                           side=side, implementation=impl)
    if not any(r.get("case") == case for r in rows):
      continue
    split = sorted({r["implementation"] for r in rows if r.get("case") == case
                    and r.get("side") == "project"
                    and r["implementation"].startswith(f"{project_impl} over ")})
    for implementation in (project_impl, *split):
      value = report.ratio(get("pytorch", torch_impl), get("project", implementation))
      lines.append(f"{case}: PyTorch {torch_impl} / project {implementation} time = "
                   f"{f(value)} (target >= {target}x): "
                   f"{report.verdict(value, target, at_most=False)}")
  timed = [r for r in rows if r.get("idle_load_max") is not None]
  if timed:
    lines.append(f"turns: one sample of each implementation in turn, each after an idle gap of "
                 f"{timed[0]['idle_seconds']:g} s; the process's largest CPU load over a gap's "
                 f"last 0.1 s: {max(r['idle_load_max'] for r in timed):.3f} cores (0: both "
                 f"runtimes' threads parked)")
  agreement = [r for r in rows if r["part"] == "agreement"]
  if agreement:
    worst = max(agreement, key=lambda r: r["max_relative_error"])
    lines.append(f"agreement before timing: {len(agreement)} checks passed; largest relative "
                 f"error {worst['max_relative_error']:.2g} ({worst['case']}, {worst['worst']})")
  return lines


def _ms(row):
  return f"{row['time_ms']:.2f} [{row['min_ms']:.2f}–{row['max_ms']:.2f}]"


def tables(rows):
  body = []
  for ours, theirs in pairs(rows):
    per_round = round_ratios(ours, theirs)
    error = _agreement(rows, ours["case"], ours["implementation"])
    body.append([ours["title"], ours["implementation"], theirs["implementation"], _ms(ours),
                 _ms(theirs), report.fmt_ratio(theirs["time_ms"] / ours["time_ms"]),
                 report.fmt_ratio(theirs["min_ms"] / ours["min_ms"]),
                 f"{min(per_round):.2f}–{max(per_round):.2f}",
                 "—" if error is None else f"{error:.1e}"])
  result = [("PyTorch time / project time (> 1: the project is faster)", report.markdown_table(
      ["case", "project", "PyTorch", "project ms, median [min–max]",
       "PyTorch ms, median [min–max]", "ratio of medians", "ratio of minima", "ratio per round",
       "max abs error"], body))]
  agreement = [[r["case"], r.get("implementation", ""), r["size"], r["tensors"],
                f"{r['max_abs_error']:.2e}", f"{r['max_relative_error']:.2e}", r["worst"]]
               for r in rows if r["part"] == "agreement"]
  result.append(("agreement at a small size, before timing", report.markdown_table(
      ["case", "implementation", "size", "tensors compared", "max abs error",
       "max abs error / largest value", "worst tensor"], agreement)))
  skipped = [[r["case"], r["side"], r["implementation"], r["skipped"]]
             for r in rows if r.get("skipped")]
  if skipped:
    result.append(("skipped", report.markdown_table(["case", "side", "implementation",
                                                      "reason"], skipped)))
  return result


def figure(path, suite, rows, meta):
  """A bar per pair from parity (1) to its median ratio, whiskers over the rounds' ratios."""
  found = pairs(rows)
  labels = [f"{o['case']}: {o['implementation']} vs {t['implementation']}" for o, t in found]
  ratios = np.array([t["time_ms"] / o["time_ms"] for o, t in found])
  spread = [round_ratios(o, t) for o, t in found]
  whiskers = np.array([[r - min(s) for r, s in zip(ratios, spread)],
                       [max(s) - r for r, s in zip(ratios, spread)]]).reshape(2, len(found))
  fig, ax = plt.subplots(figsize=(8, 0.45 * len(found) + 1.5))
  y = np.arange(len(found))
  ax.barh(y, ratios - 1, left=1, xerr=whiskers,
          color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
  ax.axvline(1.0, color="black", linewidth=1)
  ax.set_xscale("log")
  low, high = (min(map(min, spread)), max(map(max, spread))) if found else (1, 1)
  ticks = [x for x in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20) if low / 2 <= x <= 2 * high]
  ax.set_xticks(ticks, [f"{x:g}x" for x in ticks])
  ax.xaxis.set_minor_formatter(plt.NullFormatter())
  ax.set(yticks=y, yticklabels=labels,
         xlabel="PyTorch time / project time (> 1: the project is faster)")
  ax.invert_yaxis()
  ax.grid(True, axis="x", which="major", alpha=0.3)
  settings = next((r for r in rows if r["part"] == "settings"), {})
  fig.suptitle(f"{suite.name}: {meta['hardware']}, jax {meta['jax_version']}, torch "
               f"{settings.get('torch_version', '?')}, {settings.get('threads', '?')} threads",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


SUITE = report.Suite(
    name="peers",
    description=(
        "The project against PyTorch on the same CPU, fp32, the same shapes, parameter counts "
        "and batches, the same thread count for both (see the thread line below): a training step "
        "(against a nanoGPT-style model with SDPA and AdamW, eager and torch.compile), causal "
        "attention fwd+bwd (xla and blockwise against SDPA), one KV-cache decode step, chunked "
        "linear attention fwd+bwd (against fla's naive chunk form), the Mamba selective scan "
        "fwd+bwd (against mamba_ssm's selective_scan_ref) and a matmul. After a warm-up call "
        "each, rounds of one sample of each in turn, each after an idle gap in which both "
        "runtimes' threads park (the summary gives the CPU load measured in the gaps); ratio = "
        "PyTorch time / project time (> 1: the project is faster). "
        "Outputs and gradients were compared at a small size before any timing "
        "(research/bench/peers.py)."),
    run=run, tables=tables, summary=summary, panels=(), takes_lengths=False,
    configure=configure, figure=figure)
