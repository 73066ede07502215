"""Benchmarks: each suite measures rows, then writes DIR/<suite>.json, .md and .png.

  python -m experiments.bench --suite=mixers --workdir=DIR [--lengths=256,512,...]
      [--dtype=float32|bfloat16] [--quick]
  python -m experiments.bench --suite=decode --workdir=DIR
  python -m experiments.bench --suite=train --workdir=DIR
  python -m experiments.bench --suite=state --workdir=DIR
  python -m experiments.bench --suite=recurrent --workdir=DIR
  python -m experiments.bench --suite=peers --workdir=DIR [--threads=N]
  ... --benchmarks=BENCHMARKS.md       also rewrite the suite's block there (`make bench` does)
  ... --from_json                      report DIR/<suite>.json's run again, measuring nothing

mixers: forward + backward time and compiled temp memory of each mixer kernel against length
(about 6 minutes on a 2-core CPU); decode: per-token decode latency and cache bytes against
context length (about 3 minutes); train: tokens/s and MFU of the training loop against a
minimal NNX step, and the loop with packed documents against concatenated windows
(data.packing; --only=packing runs that comparison alone) (about 5 minutes); state:
sliding-window against full blockwise attention, a rolling window + sinks cache against the full
KV cache, one prefill against token-by-token decoding (research/bench/state.py; fixed lengths,
no --lengths); recurrent: each recurrent mixer's chunked fwd+bwd against its own token-by-token
recurrence, and its memory growth (research/bench/recurrent.py); peers: the project against PyTorch
on the same CPU with the same thread count (training step, attention, decode, linear attention,
Mamba scan, matmul; research/bench/peers.py; needs `pip install -r requirements-peers.txt`;
about 4.5 minutes on 2 cores). --quick: short lengths and fewer repeats, a smoke test.
The markdown file lists the performance targets as ratios computed from the same run.
--benchmarks=FILE replaces the suite's block of FILE (research/bench/benchmarks_file.py) with
that markdown's targets and main table, and copies the markdown and the figure to docs/bench/.
"""

import os
import shlex
import sys
import time
import types

from absl import app
from absl import flags

from experiments import cli
from research.bench import benchmarks_file
from research.bench import decode
from research.bench import mixers
from research.bench import peers
from research.bench import recurrent
from research.bench import report
from research.bench import state
from research.bench import train

# name -> research.bench.report.Suite. To add one (e.g. `train`): a module with
# `run(args) -> rows`, tables, summary and panels packed into a Suite, and one entry here.
SUITES = {
    "mixers": mixers.SUITE,
    "decode": decode.SUITE,
    "train": train.SUITE,
    "state": state.SUITE,
    "recurrent": recurrent.SUITE,
    "peers": peers.SUITE,
}

_SUITE = flags.DEFINE_string("suite", None, f"The suite to run: {', '.join(SUITES)}.")
_WORKDIR = cli.workdir_flag("Output directory (for a benchmark: <suite>.json, .md, .png).")
if "out" not in flags.FLAGS:
  flags.DEFINE_alias("out", "workdir")  # the name of earlier commands in BENCHMARKS.md
_LENGTHS = flags.DEFINE_list("lengths", [], "Lengths (context lengths for decode); default: "
                             "256..16384, or two short ones with --quick.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_QUICK = flags.DEFINE_bool("quick", False, "Short lengths, fewer repeats.")
_ONLY = flags.DEFINE_list(
    "only", [], "Kernels (mixers) or attention/position variants (train, decode; state: its "
    "prefill part; recurrent: mixer names; peers: cases, research.bench.peers.CASES) to run, or "
    "`packing` (train: the data.packing comparison); default: every one the registries give.")
_BENCHMARKS = flags.DEFINE_string(
    "benchmarks", "", "A markdown file (BENCHMARKS.md) whose '<!-- make bench: SUITE -->' block "
    "to rewrite from this run, its figure copied to docs/bench/ beside it.")
_FROM_JSON = flags.DEFINE_bool("from_json", False, "Measure nothing: report the run saved in "
                               "<workdir>/<suite>.json again (its files, --benchmarks).")
_THREADS = flags.DEFINE_integer("threads", 0, "peers: threads of each framework (default: "
                                "os.cpu_count()).")


def _settings() -> types.SimpleNamespace:
  """The parsed flags as the suites read them; app.UsageError for a combination that is not
  valid, naming what is."""
  if _SUITE.value not in SUITES:
    raise app.UsageError(f"--suite={_SUITE.value} is not a suite; valid: {', '.join(SUITES)}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required: the directory for <suite>.json, .md and .png")
  try:
    lengths = tuple(int(x) for x in _LENGTHS.value if x.strip())
  except ValueError:
    raise app.UsageError(f"--lengths={','.join(_LENGTHS.value)} must be comma-separated "
                         "integers, e.g. 256,1024") from None
  suite = SUITES[_SUITE.value]
  if lengths and not suite.takes_lengths:
    takes = "|".join(name for name, s in SUITES.items() if s.takes_lengths)
    raise app.UsageError(f"--suite={_SUITE.value} measures at its own lengths (--quick: short "
                         f"ones); --lengths applies to --suite={takes}")
  if _THREADS.value and suite.configure is None:
    raise app.UsageError(f"--threads applies to --suite=peers, not --suite={_SUITE.value}")
  if _BENCHMARKS.value:
    try:
      benchmarks_file.check(_BENCHMARKS.value, _SUITE.value)
    except ValueError as error:
      raise app.UsageError(f"--benchmarks: {error}") from None
  saved = os.path.join(_WORKDIR.value, f"{_SUITE.value}.json")
  if _FROM_JSON.value and not os.path.isfile(saved):
    raise app.UsageError(f"--from_json: {saved} does not exist (run the suite into --workdir "
                         "first)")
  return types.SimpleNamespace(suite=_SUITE.value, out=_WORKDIR.value, lengths=lengths,
                               dtype=_DTYPE.value, quick=_QUICK.value, threads=_THREADS.value,
                               only=tuple(x.strip() for x in _ONLY.value if x.strip()),
                               benchmarks=_BENCHMARKS.value, from_json=_FROM_JSON.value)


def parse_args(argv: list[str]) -> types.SimpleNamespace:
  """The settings of a command line's flags (e.g. ["--suite=mixers", "--workdir=DIR"])."""
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["experiments.bench", *argv])
  return _settings()


def measure(args: types.SimpleNamespace, command: str) -> dict:
  """Runs the suite (or reads its saved run) and writes its files; returns their paths."""
  suite = SUITES[args.suite]
  if args.from_json:
    rows, meta = report.read_json(os.path.join(args.out, f"{suite.name}.json"))
  else:
    if suite.configure is not None:
      suite.configure(args)
    meta = report.metadata(command)
    print(f"{suite.name}: {meta['hardware']}, jax {meta['jax_version']}", flush=True)
    started = time.monotonic()
    rows = suite.run(args)
    meta["minutes"] = (time.monotonic() - started) / 60
  paths = report.write_all(args.out, suite, rows, meta)
  if args.benchmarks:
    paths["benchmarks"], paths["report"], paths["figure"] = benchmarks_file.update(
        args.benchmarks, suite, rows, meta, paths)
  print("\n".join(suite.summary(rows)))
  print("wrote " + ", ".join(paths.values()))
  return paths


def _command(argv) -> str:
  return shlex.join(["python", "-m", "experiments.bench", *argv])


def main(argv: list[str]) -> dict:
  """In-process: measure the suite of these flags."""
  return measure(parse_args(argv), _command(argv))


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; every setting is a flag, e.g. "
                         "--suite=mixers --workdir=DIR")
  measure(_settings(), _command(sys.argv[1:]))


if __name__ == "__main__":
  cli.run(_main)
