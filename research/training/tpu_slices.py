"""TPU slices as Cloud TPU names them, and the devices of each for compiling on a host without one.

  v4-8, v5p-8      count TensorCores (2 a chip): v4-8 is 4 chips, a 2x2x1 torus
  v5e-8, v6e-8     count chips (1 TensorCore each): v5e-8 is a 2x4 grid
  v5litepod-8      Cloud TPU's other name for v5e-8

`devices(name)` gives the slice's devices from libtpu's topology description
(jax.experimental.topologies.get_topology_desc, no TPU needed: requirements-tpu.txt); jax.jit
lowers and compiles for them on a CPU host, and `memory_analysis()` then says what a device
would hold. `hbm_bytes(device)` is its high-bandwidth memory: the chip's datasheet capacity,
split between the TensorCores a device does not span (v4's topology description gives one device
per TensorCore; v5p's one per chip, megacore).
"""

import dataclasses
import math
import os
import re

from research.training import aot

# Per chip: (TensorCores, HBM in GiB, datasheet), for the device kinds libtpu reports.
CHIPS = {
    "TPU v4": (2, 32),
    "TPU v5": (2, 95),  # v5p
    "TPU v5 lite": (1, 16),  # v5e
    "TPU v6 lite": (1, 32),  # v6e (Trillium)
}
# Slice name prefix -> (libtpu's topology prefix, torus dimensions, counts TensorCores).
GENERATIONS = {
    "v4": ("v4", 3, True),
    "v5p": ("v5p", 3, True),
    "v5e": ("v5e", 2, False),
    "v5litepod": ("v5e", 2, False),
    "v6e": ("v6e", 2, False),
}
# Set on a CPU host before libtpu starts: without the first three it prints five lines of
# warnings about the TPU VM it cannot find (compiling needs none); the last lets several
# processes compile at once (libtpu otherwise takes /tmp/libtpu_lockfile for the one process
# that may drive a TPU's chips, and the others fail).
CPU_HOST_LIBTPU = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5litepod-4",
                   "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
# Cloud TPU's slice shapes: 2-D grids of 1 to 256 chips, 3-D tori of 4 chips and up.
GRID_CHIPS = (1, 4, 8, 16, 32, 64, 128, 256)
TORUS_CHIPS = tuple(4 * 2 ** i for i in range(10))  # 4 .. 2048 chips


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str  # as given, e.g. "v5e-8"
  topology: str  # libtpu's topology name, e.g. "v5e:2x4"
  chips: int


def _grid(chips: int) -> tuple[int, ...]:
  """A v5e / v6e slice's chip grid: 2x4 for 8, 4x8 for 32, 16x16 for 256."""
  if chips == 1:
    return (1, 1)
  x = 2 ** (int(math.log2(chips)) // 2)
  return (x, chips // x)


def _torus(chips: int) -> tuple[int, ...]:
  """A v4 / v5p slice's chip torus: 2x2x1 for 4 chips, then the last of its smallest sides
  doubles (2x2x2, 2x2x4, 2x4x4, 4x4x4, ...)."""
  dims = [2, 2, 1]
  while math.prod(dims) < chips:
    smallest = max(i for i, d in enumerate(dims) if d == min(dims))
    dims[smallest] *= 2
  return tuple(dims)


def parse(name: str) -> Slice:
  """The slice `name` names (ValueError naming the valid ones otherwise)."""
  match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip())
  if match:
    prefix, count = match.group(1), int(match.group(2))
    topology_prefix, ndim, counts_cores = GENERATIONS[prefix]
    chips, odd = divmod(count, 2) if counts_cores else (count, 0)
    if not odd and chips in (TORUS_CHIPS if ndim == 3 else GRID_CHIPS):
      shape = _torus(chips) if ndim == 3 else _grid(chips)
      return Slice(name, f"{topology_prefix}:{'x'.join(map(str, shape))}", chips)
  raise ValueError(f"unknown TPU slice {name!r}; valid: v4-N and v5p-N with N TensorCores (N = 8, "
                   f"16, 32, ... 4096), v5e-N and v6e-N with N chips (N = "
                   f"{', '.join(map(str, GRID_CHIPS))}), e.g. v4-8, v5p-8, v5e-8, v6e-8, v5e-256")


def devices(tpu_slice: Slice) -> list:
  """The slice's devices (libtpu's topology description: no TPU needed, requirements-tpu.txt)."""
  import jax  # noqa: PLC0415
  if jax.config.jax_platforms == "cpu":  # a CPU host: libtpu need not look for its own TPU
    for variable, value in CPU_HOST_LIBTPU.items():
      os.environ.setdefault(variable, value)
  # A one-chip slice is one host's only chip (the default host is 2x2x1 chips).
  options = {"chips_per_host_bounds": [1, 1, 1]} if tpu_slice.chips == 1 else {}
  return aot.described_devices("tpu", f"TPU slice {tpu_slice.name} ({tpu_slice.topology})",
                               "libtpu", "requirements-tpu.txt",
                               topology_name=tpu_slice.topology, **options)


def hbm_bytes(device) -> int:
  """The high-bandwidth memory one device of `device`'s kind holds (CHIPS)."""
  if device.device_kind not in CHIPS:
    raise ValueError(f"no HBM size known for {device.device_kind!r}; known: {', '.join(CHIPS)}")
  cores_per_chip, gib = CHIPS[device.device_kind]
  cores = getattr(device, "num_cores", 1) or 1
  return int(gib * 2**30 * min(cores, cores_per_chip) // cores_per_chip)
