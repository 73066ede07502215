"""Timing and compiled-memory helpers shared by the benchmark suites.

Time: compile once, warm up, then the median wall time of repeated calls, each ended by
`block_until_ready`. Memory: XLA's compiled memory analysis, which needs no allocation, so it
is deterministic and can be read at lengths too large to run.
"""

import dataclasses
import math
import statistics
import time

import jax

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Budget:
  """Limits that decide whether a point is run or only compiled.

  repeats: timed calls at most; fewer when one call is slow, so a point takes about
    `seconds_per_point` after warm-up (but at least one call).
  max_call_seconds: skip a point whose forecast single call is slower than this.
  max_temp_bytes: skip a point whose compiled temporary memory is larger than this.
  """
  repeats: int = 5
  seconds_per_point: float = 10.0
  max_call_seconds: float = 20.0
  max_temp_bytes: int = 8 * GIB


def compile_fn(fn, *args):
  """`fn` jitted, lowered for `args` (arrays or jax.ShapeDtypeStruct) and compiled, not run."""
  return jax.jit(fn).lower(*args).compile()


def memory_bytes(compiled):
  """Temporary, argument and output bytes from XLA's analysis of a compiled function."""
  stats = compiled.memory_analysis()
  return {"temp_bytes": int(stats.temp_size_in_bytes),
          "argument_bytes": int(stats.argument_size_in_bytes),
          "output_bytes": int(stats.output_size_in_bytes)}


def time_call(fn, *args):
  """Seconds of one call of `fn(*args)` until its outputs are ready, and those outputs."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, out


def median_seconds(fn, *args, budget=Budget()):
  """Median seconds per call after one warm-up call, and the number of timed calls.

  Slow calls are repeated fewer times, so one point stays near budget.seconds_per_point.
  """
  warmup, _ = time_call(fn, *args)
  repeats = max(1, min(budget.repeats, int(budget.seconds_per_point / max(warmup, 1e-9))))
  times = [time_call(fn, *args)[0] for _ in range(repeats)]
  return statistics.median(times), repeats


def forecast_seconds(history, length):
  """One call's seconds at `length`, extrapolated from the timed (length, seconds) so far.

  The growth exponent is the one between the last two timed lengths (at least 1), or 2
  (quadratic) from a single point, so a point is skipped before it runs far over budget.
  """
  if not history:
    return 0.0
  last_length, last_seconds = history[-1]
  exponent = 2.0
  if len(history) > 1:
    first_length, first_seconds = history[-2]
    growth = math.log(last_seconds / first_seconds) / math.log(last_length / first_length)
    exponent = max(1.0, growth)
  return last_seconds * (length / last_length) ** exponent


def interleaved_seconds(calls, repeats):
  """{name: seconds of each timed call} of zero-argument `calls` {name: fn}: one warm-up call of
  each, then `repeats` rounds that call each once in turn, so that a shared machine's drift
  falls on all of them alike (take the median of each list)."""
  return turns_seconds(calls, repeats)[0]


def idle_load(seconds):
  """CPU seconds this process (all its threads) used per wall second while it slept `seconds`:
  0 when every thread of every runtime in it is parked, 1 for one core kept busy (spinning)."""
  cpu, wall = time.process_time(), time.perf_counter()
  time.sleep(seconds)
  return (time.process_time() - cpu) / (time.perf_counter() - wall)


def turns_seconds(calls, repeats, idle_seconds=0.0, probe_seconds=0.1):
  """interleaved_seconds with an idle gap of `idle_seconds` before every timed call, so that one
  runtime's worker threads (XLA's, PyTorch's OpenMP pool) stop spinning before another runtime
  runs: returns ({name: seconds of each call}, [idle_load of the gap's last `probe_seconds`,
  one per gap]); no gap and no loads when idle_seconds is 0."""
  for fn in calls.values():
    time_call(fn)
  times, loads = {name: [] for name in calls}, []
  for _ in range(repeats):
    for name, fn in calls.items():
      if idle_seconds > 0:
        time.sleep(max(idle_seconds - probe_seconds, 0.0))
        loads.append(idle_load(min(probe_seconds, idle_seconds)))
      times[name].append(time_call(fn)[0])
  return times, loads
