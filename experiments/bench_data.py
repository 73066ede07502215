"""Input-pipeline throughput: cold preparation time and train_batch calls per second.

  python -m experiments.bench_data [--data_dir=DIR] [--seconds=3]

Prints one JSON object: for stdlib_bytes (batch 32 x 1024 bytes) and mqar (batch 32 x 256,
base num_train_examples), the seconds to prepare the dataset into an empty data dir, the seconds
of the first train_batch (which packs the token stream for language modeling), batches per
second after that over distinct steps, and, measured in the same run, the train step time of
the reference 2-layer d_model 128 model on the same batches (a minimal jitted NNX step), with
the ratio step time / batch time (target >= 20: the pipeline never bottlenecks CPU training).
"""

import argparse
import json
import tempfile
import time

from configs import base
from research import data
from research.bench import train as train_bench


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
      config.model.update(dict(num_layers=2, d_model=128, num_heads=4))
      config.train.update(dict(num_steps=6, warmup_steps=1))
      results[name] = bench(config, args.seconds)
      tokens_per_s = train_bench.minimal_tokens_per_second(config)
      step_s = config.train.batch_size * seq_len / tokens_per_s
      results[name]["train_step_s"] = round(step_s, 4)
      results[name]["step_over_batch_time"] = round(step_s * results[name]["batches_per_s"], 1)
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
