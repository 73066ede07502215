"""Input-pipeline throughput: cold preparation time and train_batch calls per second.

  python -m experiments.bench_data [--data_dir=DIR] [--seconds=3]

Prints one JSON object: for stdlib_bytes (batch 32 x 1024 bytes) and mqar (batch 32 x 256,
base num_train_examples), the seconds to prepare the dataset into an empty data dir, the seconds
of the first train_batch (which packs the token stream for language modeling), and batches per
second after that, over distinct steps. On a 2-core CPU a 2-layer d_model 128 model takes about
0.2-1 s per step on these batches, so the pipeline needs >= 100 batches/s to stay under 5%.
"""

import argparse
import json
import tempfile
import time

from configs import base
from research import data


def bench(config, seconds):
  start = time.perf_counter()
  data.prepare(config)
  prepared = time.perf_counter()
  batch = data.train_batch(config, 0)
  first = time.perf_counter()
  steps = 1
  while time.perf_counter() - first < seconds:
    data.train_batch(config, steps)
    steps += 1
  return {"prepare_s": round(prepared - start, 3), "first_batch_s": round(first - prepared, 3),
          "batches_per_s": round((steps - 1) / (time.perf_counter() - first), 1),
          "batch_shape": list(batch["inputs"].shape)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default="", help="default: a fresh temporary directory")
  parser.add_argument("--seconds", type=float, default=3.0)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    results = {}
    for name, seq_len in [("stdlib_bytes", 1024), ("mqar", 256)]:
      config = base.get_config()
      config.data.name, config.data.dir = name, args.data_dir or tmp
      config.train.batch_size, config.train.seq_len = 32, seq_len
      config.eval.lengths = (seq_len, 4 * seq_len)
      results[name] = bench(config, args.seconds)
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
