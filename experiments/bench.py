"""Benchmarks: each suite measures rows, then writes DIR/<suite>.json, .md and .png.

  python -m experiments.bench --suite=mixers --out=DIR [--lengths=256,512,...]
      [--dtype=float32|bfloat16] [--quick]
  python -m experiments.bench --suite=decode --out=DIR
  python -m experiments.bench --suite=train --out=DIR
  python -m experiments.bench --suite=state --out=DIR
  python -m experiments.bench --suite=recurrent --out=DIR
  python -m experiments.bench --suite=peers --out=DIR [--threads=N]

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
"""

import argparse
import shlex
import sys

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


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--suite", required=True, choices=sorted(SUITES))
  parser.add_argument("--out", required=True, help="directory for <suite>.json, .md and .png")
  parser.add_argument("--lengths", default="",
                      help="comma-separated lengths (context lengths for decode); default: "
                           "256..16384, or two short ones with --quick")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--quick", action="store_true", help="short lengths, fewer repeats")
  parser.add_argument("--only", default="",
                      help="comma-separated kernels (mixers) or attention/position variants "
                           "(train, decode; state: its prefill part; recurrent: mixer names; "
                           "peers: cases, research.bench.peers.CASES) to run, or `packing` "
                           "(train: the data.packing comparison); default: every one the "
                           "registries give")
  parser.add_argument("--threads", type=int, default=0,
                      help="peers: threads of each framework (default: os.cpu_count())")
  args = parser.parse_args(argv)
  args.lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
  if args.lengths and not SUITES[args.suite].takes_lengths:
    takes = "|".join(name for name, suite in SUITES.items() if suite.takes_lengths)
    parser.error(f"--suite={args.suite} measures at its own lengths (--quick: short ones); "
                 f"--lengths applies to --suite={takes}")
  if args.threads and SUITES[args.suite].configure is None:
    parser.error(f"--threads applies to --suite=peers, not --suite={args.suite}")
  args.only = tuple(x.strip() for x in args.only.split(",") if x.strip())
  return args


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  suite = SUITES[args.suite]
  if suite.configure is not None:
    suite.configure(args)
  command = shlex.join(["python", "-m", "experiments.bench"] + argv)
  meta = report.metadata(command)
  print(f"{suite.name}: {meta['hardware']}, jax {meta['jax_version']}", flush=True)
  rows = suite.run(args)
  paths = report.write_all(args.out, suite, rows, meta)
  print("\n".join(suite.summary(rows)))
  print("wrote " + ", ".join(paths.values()))
  return paths


if __name__ == "__main__":
  main()
