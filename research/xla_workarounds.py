"""Workarounds for known bugs of the pinned jaxlib, set in XLA_FLAGS before JAX starts a backend.

`import research` (so any `import research.<module>`) applies them; XLA reads XLA_FLAGS once, when
the first backend starts, so a process that ran JAX computations before importing research gets
a warning instead.

YNNPACK reductions, jaxlib 0.10.2 and 0.11.0 on x86-64 (jax-ml/jax#39257, #40412; a regression
from 0.10.1): XLA:CPU hands a reduction, fused with the dots and elementwise ops that produce its
operand, to YNNPACK (an `__ynn_fusion` in the compiled HLO), and such a fusion whose operands
include a broadcast reads it as if it were a full array: NaN, garbage or SIGSEGV. It met this
lab as log_linear_mamba2's non-finite gradients (the transpose of its chunk scan: a dot of the
level-merge matrices with a broadcast zero, times another, summed), jitted only, two or more
heads, chunks of 32 or 64. tests/test_xla_workarounds.py holds the smallest program found
(`sum(z * (m @ z))` with z a broadcast scalar: every output NaN without the flag).
`--xla_cpu_experimental_ynn_fusion_type=-reduce` keeps reductions off YNNPACK (dots and
elementwise fusions stay on it); training is no slower with it (docs/training.md, "A known
XLA:CPU bug": the numbers).
"""

import importlib.metadata
import os
import warnings

YNN_REDUCE_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-reduce"
YNN_REDUCE_AFFECTED = ("0.10.2", "0.11.0")


def flags_for(jaxlib_version):
  """The XLA flags this lab adds on a jaxlib of that version."""
  return [YNN_REDUCE_FLAG] if jaxlib_version in YNN_REDUCE_AFFECTED else []


def apply():
  """Adds flags_for(the installed jaxlib) to XLA_FLAGS, unless a flag of that name is there."""
  current = os.environ.get("XLA_FLAGS", "")
  missing = [flag for flag in flags_for(importlib.metadata.version("jaxlib"))
             if flag.split("=")[0] not in current]
  if not missing:
    return
  os.environ["XLA_FLAGS"] = " ".join([current] + missing).strip()
  from jax._src import xla_bridge  # noqa: PLC0415 (jax is imported only where a flag is added)
  if xla_bridge.backends_are_initialized():
    warnings.warn(f"JAX's backend started before `import research`: {' '.join(missing)} (a "
                  "workaround for an XLA:CPU bug, research/xla_workarounds.py) does not apply "
                  "in this process; import research first, or set it in XLA_FLAGS.")
