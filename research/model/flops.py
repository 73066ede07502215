"""FLOP accounting for throughput and MFU (model FLOPs utilisation).

Training FLOPs per token = 3 x forward (backward is twice the forward), and
  forward = 2 * (parameters used in matmuls) + sum over layers of the mixer's own FLOPs,
where the mixer term is attention's q k^T and p v with causal halving (4 * heads * head_dim *
(L + 1) / 2), the chunked linear-attention products, or the selective scan (see each mixer's
`mixing_flops_per_token`). The embedding lookup is not a matmul and is not counted; the output
head is. MFU = FLOPs per token * tokens per second / peak FLOP/s of the devices used.
"""

import functools
import os
import time

import jax
import jax.numpy as jnp

from research.model.transformer import count_params

# Dense peak FLOP/s per chip from vendor datasheets, for bfloat16 matmuls.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
}


def forward_flops_per_token(model, context_length):
  matmul_params = count_params(model, embeddings=False)
  mixing = sum(block.mixer.mixing_flops_per_token(context_length) for block in model.blocks)
  return 2 * matmul_params + mixing


def train_flops_per_token(model, context_length):
  return 3 * forward_flops_per_token(model, context_length)


def measure_matmul_flops(size=1024, dtype=jnp.float32, repeats=5):
  """FLOP/s of a large square matmul on the default device: the practical peak (used on CPU).
  At 1024 a CPU's matmul runs at the speed it has at 2048 (the median of 5 within the run-to-run
  spread on a 2-core Xeon) in a tenth of the time: every training run measures it."""
  a = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * size ** 3 / sorted(times)[len(times) // 2]


def peak_flops(device=None):
  """Datasheet bf16 peak of an accelerator, or None (then measure, e.g. on CPU)."""
  device = device or jax.devices()[0]
  for name, peak in PEAK_BF16_FLOPS.items():
    if name.lower() in device.device_kind.lower():
      return peak
  return None


# A sweep that runs members at once measures the peak before they share the machine and passes
# it to them here (experiments/run.py): their MFU is then against the idle machine's peak.
PEAK_ENV = "RESEARCH_PEAK_FLOPS"


@functools.cache  # once per process: runs in one process (a sweep, the tests) share it
def total_peak_flops():
  """Peak FLOP/s of all devices: $RESEARCH_PEAK_FLOPS if set, else datasheet x devices, else a
  measured matmul (x devices on accelerators; on CPU the fake devices share the same cores, so
  the matmul is the machine)."""
  if os.environ.get(PEAK_ENV):
    return float(os.environ[PEAK_ENV])
  peak = peak_flops()
  if peak:
    return peak * jax.device_count()
  measured = measure_matmul_flops()
  return measured if jax.default_backend() == "cpu" else measured * jax.device_count()


def mfu(flops_per_token, tokens_per_second, peak_flops_per_second):
  return flops_per_token * tokens_per_second / peak_flops_per_second
