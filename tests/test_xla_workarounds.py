"""research.xla_workarounds: `import research` sets the flags before JAX's backend starts, and the
smallest program found for the jaxlib 0.10.2 YNNPACK bug computes the right values after it."""

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from research import xla_workarounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# sum(z * (m @ z)) with z a broadcast scalar, the pattern of log_linear_mamba2's gradient. On
# jaxlib 0.10.2 (x86-64) without the flag every output is NaN at these shapes (finite garbage
# near 1e33 at others); with it, exact.
_BROADCAST_DOT_REDUCE = textwrap.dedent("""
    import os
    import research  # applies the workarounds: nothing else in this program sets XLA_FLAGS
    import jax
    import jax.numpy as jnp
    import numpy as np

    @jax.jit
    def f(m, value):
      z = jnp.broadcast_to(value, (8, 4, 256))
      return jnp.sum(z * jnp.einsum("bvw,bwx->bvx", m, z), axis=(1, 2))

    m = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4))), (8, 4, 4))
    got = np.asarray(f(m, jnp.float32(1.0)))
    print(os.environ.get("XLA_FLAGS", ""))
    print(" ".join(str(x) for x in got))
""")


def test_flags_follow_the_jaxlib_version():
  assert xla_workarounds.flags_for("0.10.2") == [xla_workarounds.YNN_REDUCE_FLAG]
  assert xla_workarounds.flags_for("0.11.0") == [xla_workarounds.YNN_REDUCE_FLAG]
  assert xla_workarounds.flags_for("0.10.1") == []


def test_import_research_fixes_the_broadcast_dot_reduce():
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _BROADCAST_DOT_REDUCE], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  flags, values = done.stdout.strip().splitlines()[-2:]
  expected_flags = xla_workarounds.flags_for(importlib.metadata.version("jaxlib"))
  assert all(flag in flags for flag in expected_flags)
  # Each of the 8 rows: ones(4, 256) . (tril(ones(4, 4)) @ ones(4, 256)) = 10 * 256.
  assert [float(x) for x in values.split()] == [10.0 * 256] * 8


def test_a_flag_already_set_is_kept(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
  monkeypatch.setattr(xla_workarounds.importlib.metadata, "version", lambda _: "0.10.2")
  xla_workarounds.apply()
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="


def test_too_late_warns(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(xla_workarounds.importlib.metadata, "version", lambda _: "0.10.2")
  import jax  # noqa: PLC0415
  jax.devices()  # the backend of this test process has started
  with pytest.warns(UserWarning, match="does not apply in this process"):
    xla_workarounds.apply()
  assert os.environ["XLA_FLAGS"] == xla_workarounds.YNN_REDUCE_FLAG
