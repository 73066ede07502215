"""Input-pipeline throughput: preparation (task generation) and train_batch reads, against the
train step that consumes them.

  python -m experiments.bench_data [--names=passkey,binary_addition] [--data_dir=DIR] [--seconds=3]

Prints one JSON object with, per dataset (batch 32 at its sequence length, see DATASETS):
- prepare_s: seconds to prepare it into an empty data dir, generating and writing every example
  of every split (prepared_examples); for the synthetic and needle tasks this is the task
  generation, so generated_batches_per_s = prepared_examples / prepare_s / 32;
- first_batch_s, batches_per_s: the first train_batch (which packs the token stream for language
  modeling), then train_batch calls per second over distinct steps;
- train_step_s: measured in the same run, the step of the reference 2-layer d_model 128 model on
  the same batches (a minimal jitted NNX step);
- step_over_batch_time = train_step_s * batches_per_s and step_over_generation_time =
  train_step_s * generated_batches_per_s (target >= 20 for both: neither reading nor generating
  the data ever bottlenecks CPU training).
"""

import json
import tempfile
import time

from absl import app
from absl import flags

from configs import base
from experiments import cli
from research import data
from research.bench import train as train_bench
from research.data import catalog
from research.data import storage
from research.data import tasks

BATCH_SIZE = 32
# name -> (train.seq_len, data fields); the algorithmic tasks at the protocol's 40 symbols.
DATASETS = {
    "stdlib_bytes": (1024, {}),
    "mqar": (256, {}),
    "passkey": (1024, {"num_train_examples": 4000, "num_eval_examples": 32}),
    "needle_multivalue": (1024, {"num_train_examples": 4000, "num_eval_examples": 32}),
    "stack_manipulation": (tasks.TASKS["stack_manipulation"].inputs_for_size(40), {}),
    "binary_addition": (tasks.TASKS["binary_addition"].inputs_for_size(40), {}),
    "modular_arithmetic": (tasks.TASKS["modular_arithmetic"].inputs_for_size(40), {}),
}


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
  builder = catalog.resolve(config).make_builder(storage.data_dir(config))
  examples = sum(split.num_examples for split in builder.info.splits.values())
  return {"prepare_s": round(prepared - start, 3), "prepared_examples": examples,
          "generated_batches_per_s": round(examples / (prepared - start) / BATCH_SIZE, 1),
          "first_batch_s": round(first - prepared, 3),
          "batches_per_s": round((steps - 1) / (time.perf_counter() - first), 1),
          "batch_shape": list(batch["inputs"].shape)}


_NAMES = flags.DEFINE_list("names", list(DATASETS), f"Datasets, from: {', '.join(DATASETS)}.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Prepared data; default: a fresh temporary "
                                "directory.")
_SECONDS = flags.DEFINE_float("seconds", 3.0, "Seconds of train_batch reads per dataset.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; the flags are --names, --data_dir "
                         "and --seconds")
  names = _NAMES.value
  unknown = [name for name in names if name not in DATASETS]
  if unknown:
    raise app.UsageError(f"unknown --names {unknown}; valid: {', '.join(DATASETS)}")
  if _SECONDS.value <= 0:
    raise app.UsageError(f"--seconds={_SECONDS.value} must be > 0")
  with tempfile.TemporaryDirectory() as tmp:
    results = {}
    for name in names:
      seq_len, fields = DATASETS[name]
      config = base.get_config()
      config.data.update(dict(name=name, dir=_DATA_DIR.value or tmp, **fields))
      config.train.update(dict(batch_size=BATCH_SIZE, seq_len=seq_len, num_steps=6,
                               warmup_steps=1))
      config.eval.lengths = (seq_len, 4 * seq_len)
      config.model.update(dict(num_layers=2, d_model=128, num_heads=4))
      results[name] = bench(config, _SECONDS.value)
      tokens_per_s = train_bench.minimal_tokens_per_second(config)
      step_s = BATCH_SIZE * seq_len / tokens_per_s
      results[name]["train_step_s"] = round(step_s, 4)
      for ratio, rate in [("step_over_batch_time", "batches_per_s"),
                          ("step_over_generation_time", "generated_batches_per_s")]:
        results[name][ratio] = round(step_s * results[name][rate], 1)
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  cli.run(main)
