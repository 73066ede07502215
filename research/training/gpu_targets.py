"""NVIDIA GPU targets for compiling on a host without a GPU: `h100-8` is eight H100s on one host,
`h200-16` sixteen H200s on two hosts of eight.

`devices(target)` describes them to XLA with a target config (XLA's GpuTargetConfigProto, as
text: the device's streaming multiprocessors, memories, clock and compute capability, from
NVIDIA's datasheets) through the CUDA PJRT plugin's topology description
(jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology=
"<partitions>x<hosts>x<devices per host>")); jax.jit then lowers and compiles for them on a CPU.
It needs the CUDA plugin and cuDNN (requirements-gpu.txt) but no GPU and no driver. Measured
with jax 0.10.2 (docs/accelerators.md): XLA's memory analysis is there, its cost analysis (the
FLOPs) is not, and cuDNN's attention compiles.
"""

import dataclasses
import re

from research.training import aot

# Per GPU: streaming multiprocessors, HBM bytes, bandwidth (bytes/s), boost clock (GHz), from
# NVIDIA's H100 SXM5 80GB and H200 SXM 141GB datasheets; Hopper's shared memory and L2 alike.
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, 80 * 10**9, 3.35e12, 1.98),
    "h200": ("NVIDIA H200", 132, 141 * 10**9, 4.8e12, 1.98),
}
DEVICES_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # as given, e.g. "h100-8"
  gpu: str  # a key of GPUS
  hosts: int
  devices_per_host: int


def parse(name: str) -> Target:
  """The GPUs `name` names (ValueError naming the valid ones otherwise)."""
  match = re.fullmatch(r"(h100|h200)-(\d+)", name.strip())
  if match:
    count = int(match.group(2))
    if count in (1, 2, 4, 8):
      return Target(name, match.group(1), 1, count)
    if count > DEVICES_PER_HOST and count % DEVICES_PER_HOST == 0:
      return Target(name, match.group(1), count // DEVICES_PER_HOST, DEVICES_PER_HOST)
  raise ValueError(f"unknown GPU target {name!r}; valid: h100-N or h200-N with N = 1, 2, 4, 8 on "
                   "one host or a multiple of 8 over hosts of 8 (h100-8, h200-16, ...)")


def target_config(gpu: str) -> str:
  """XLA's GpuTargetConfigProto of `gpu`, as text."""
  description, multiprocessors, memory, bandwidth, clock = GPUS[gpu]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {48 * 1024}
  shared_memory_per_core: {228 * 1024}
  shared_memory_per_block_optin: {227 * 1024}
  threads_per_core_limit: 2048
  core_count: {multiprocessors}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)}
  l2_cache_size: {50 * 2**20}
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{description}"
"""


def devices(target: Target) -> list:
  """The target's devices (the CUDA plugin's topology description: no GPU needed)."""
  return aot.described_devices(
      "cuda", f"GPU target {target.name}", "JAX's CUDA plugin and cuDNN", "requirements-gpu.txt",
      target_config=target_config(target.gpu),
      topology=f"1x{target.hosts}x{target.devices_per_host}")


def hbm_bytes(target: Target) -> int:
  return GPUS[target.gpu][2]
