"""The prepared accelerator check: one command, under 10 minutes on one GPU, a dated table.

  make accelerator-check     # = python -m experiments.accelerator_check --workdir=runs/accelerator_check
  python -m experiments.accelerator_check --workdir=/tmp/check --dry_run   # the CPU parts, ~3 min

Four steps, each a subprocess with its own time limit (a step that fails or runs out is
reported as such and the next one runs):
  tests      the kernel, conformance, Pallas-backend and MoE-dispatch (sorted ragged_dot,
             blocked grouped matmul) tests on the accelerator (JAX_PLATFORMS=cuda: the Pallas
             kernel compiled by Triton, not interpreted; the 8-device sharding tests need 8
             devices and are left to CPU, where CI runs them)
  mixers     `experiments.bench --suite=mixers --dtype=bfloat16` at 1024, 4096, 16384 tokens:
             xla, blockwise, cudnn, pallas and every bias kernel; the chunked and associative
             scans
  recurrent  `experiments.bench --suite=recurrent --dtype=bfloat16`: each recurrent mixer's
             chunked form (SSD for Mamba-2 when registered) against its token-by-token recurrence
  mfu        60 training steps of configs/model_125m.py:mfu (127M parameters, 2048 context,
             bfloat16, cuDNN attention): the loop's own MFU against the chip's datasheet peak
Writes OUT/accelerator_check.md (date, device, versions, each step's status, the targets of
both benchmarks, tokens/s and MFU) and appends it to BENCHMARKS.md (not with --dry_run).
On a GPU machine install the CUDA build of the pinned jax first: pip install -r
requirements-gpu.txt. --dry_run runs the same steps on CPU at smoke sizes (quick benchmarks, a
2-layer model, a few conformance tests), to check that the script itself works.
"""

import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to the steps
import jax  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKDIR = cli.workdir_flag("Output directory (for the check: its logs, benchmark files and "
                            "accelerator_check.md).")
if "out" not in flags.FLAGS:
  flags.DEFINE_alias("out", "workdir")  # the name of earlier commands
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "CPU, smoke sizes, no BENCHMARKS.md.")


def steps(out, dry_run):
  """(name, command, time limit in seconds, extra environment) of each step."""
  python = sys.executable
  bench = [python, "-m", "experiments.bench", "--dtype=float32" if dry_run else "--dtype=bfloat16"]
  size = ["--quick"] if dry_run else []
  tests = ["tests/test_kernels.py", "tests/test_conformance.py", "tests/test_pallas_backend.py",
           "tests/test_moe_dispatch.py", "tests/test_grouped_matmul.py", "-k",
           "(mha-rope-xla or linear-rope) and not sharded" if dry_run
           else "not sharded and not on_a_mesh"]
  platform = {"JAX_PLATFORMS": "cpu" if dry_run else "cuda",
              "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  return [
      ("tests", [python, "-m", "pytest", "-q", "-n", "2" if dry_run else "8", *tests], 200,
       platform),
      ("mixers", [*bench, "--suite=mixers", f"--workdir={out}/bench", *size,
                  *([] if dry_run else ["--lengths=1024,4096,16384"])], 150, {}),
      ("recurrent", [*bench, "--suite=recurrent", f"--workdir={out}/bench", *size,
                     *(["--only=linear"] if dry_run else [])], 90, {}),
      ("mfu", [python, "-m", "experiments.train",
               f"--config=configs/model_125m.py:{'smoke' if dry_run else 'mfu'}",
               f"--workdir={out}/mfu_125m", *(["--config.train.num_steps=6", "--config.train.warmup_steps=1",
                                               "--config.train.log_every=3"] if dry_run else [])],
       150, {}),
  ]


def run_step(name, command, limit, env, log_dir):
  """Runs one step; returns (status, seconds, last lines of its output)."""
  start = time.time()
  log_path = os.path.join(log_dir, f"{name}.log")
  with open(log_path, "w") as log:
    try:
      code = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, timeout=limit, check=False).returncode
      status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
      status = f"stopped at its {limit} s limit"
  with open(log_path) as log:
    tail = log.read().strip().splitlines()[-3:]
  print(f"{name}: {status} in {time.time() - start:.0f} s", flush=True)
  return status, time.time() - start, tail


def _targets(md_path):
  if not os.path.exists(md_path):
    return ["(no output)"]
  with open(md_path) as f:
    text = f.read()
  section = text.split("## Targets (ratios from this run)", 1)[-1].split("\n## ", 1)[0]
  return [line for line in section.splitlines() if line.startswith("- ")]


def _last_metrics(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  return next((line for line in reversed(lines) if "mfu" in line), {})


def report(out, results, dry_run):
  device = jax.devices()[0]
  lines = [f"## Accelerator check ({datetime.date.today().isoformat()}"
           f"{', CPU dry run' if dry_run else ''})", "",
           f"`python -m experiments.accelerator_check{' --dry_run' if dry_run else ''}` on "
           f"{getattr(device, 'device_kind', device.platform)} ({device.platform}), jax "
           f"{jax.__version__}.", "", "| step | status | seconds | last output |", "|---|---|---|---|"]
  for name, (status, seconds, tail) in results.items():
    last = (tail[-1] if tail else "").replace("|", "/")[:120]
    lines.append(f"| {name} | {status} | {seconds:.0f} | {last} |")
  metrics = _last_metrics(os.path.join(out, "mfu_125m"))
  if metrics:
    lines += ["", f"Training (configs/model_125m.py): {metrics['tokens_per_second']:,.0f} tokens/s, "
              f"MFU {100 * metrics['mfu']:.1f}% (target >= 40% on a GPU), step "
              f"{metrics['step']}."]
  for suite in ("mixers", "recurrent"):
    lines += ["", f"Targets of the {suite} suite (OUT/bench/{suite}.md has the tables):", ""]
    lines += _targets(os.path.join(out, "bench", f"{suite}.md"))
  return "\n".join(lines) + "\n"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; the flags are --workdir and "
                         "--dry_run")
  dry_run = _DRY_RUN.value
  if not dry_run and jax.default_backend() == "cpu":
    raise app.UsageError("no accelerator visible to jax (jax.default_backend() is cpu): install "
                         "the CUDA build (pip install -r requirements-gpu.txt), or pass --dry_run")
  out = os.path.abspath(_WORKDIR.value or "runs/accelerator_check")
  if os.path.exists(os.path.join(out, "mfu_125m")):
    raise app.UsageError(f"{out}/mfu_125m exists (a finished run would only resume): choose a "
                         "new --workdir")
  os.makedirs(out, exist_ok=True)
  results = {name: run_step(name, command, limit, env, out)
             for name, command, limit, env in steps(out, dry_run)}
  text = report(out, results, dry_run)
  with open(os.path.join(out, "accelerator_check.md"), "w") as f:
    f.write(text)
  if not dry_run:
    with open(os.path.join(ROOT, "BENCHMARKS.md"), "a") as f:
      f.write("\n" + text)
  print(text)
  return results


if __name__ == "__main__":
  cli.run(main)
