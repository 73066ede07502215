"""What decoding packed documents costs: a decode step from a document cache against one from a
plain cache, per mixer.

  python -m research.bench.document_decode [--context 4096] [--repeats 15] [--only moba,nsa]

Every registered mixer (gqa at 4 and 2 key/value heads) at the decode suite's model
(research.bench.decode.model_config: 2 layers, d_model 256, 8 heads, no positions, float32),
batch 2, one new token after `context` cached ones. Plain: model.init_cache(2, context + 1).
Documents: init_cache(..., documents=True), row 0 in a document that started at token 0 and
row 1 in one that started at token context / 4 + 3 (a block-routed mixer's blocks then do not
line up with the cache's fixed blocks); the new token continues each row's document. The caches
hold zeros (a step's time does not depend on the values). After a warm-up call of each, rounds
that time one step of each in turn (timing.interleaved_seconds); the table gives medians and
minima, and the ratio documents / plain of the medians.
"""

import argparse
import statistics

import jax
import jax.numpy as jnp
from flax import nnx

import research
from research.bench import decode
from research.bench import report
from research.bench import timing

BATCH = 2
CONTEXT, REPEATS = 4096, 15


def step_calls(variant, context):
  """{"plain": fn, "documents": fn}: zero-argument calls of one jitted decode step each."""
  model = research.build_model(decode.model_config(variant, "float32"), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  token_Bx1 = jnp.zeros((BATCH, 1), jnp.int32)
  segments_Bx1 = jnp.asarray([[0], [1]], jnp.int32)

  @jax.jit
  def step(state, cache, segments_Bx1=None):
    return nnx.merge(graphdef, state).decode(token_Bx1, cache, segments_Bx1)[0]

  plain = model.init_cache(BATCH, context + 1)
  documents = model.init_cache(BATCH, context + 1, documents=True)
  plain["index"] = documents["index"] = jnp.asarray(context, jnp.int32)
  documents["documents"] = {"segment": segments_Bx1[:, 0],
                            "start": jnp.asarray([0, context // 4 + 3], jnp.int32)}
  return {"plain": lambda: step(state, plain),
          "documents": lambda: step(state, documents, segments_Bx1)}


def measure(variants, context, repeats):
  rows = []
  for variant in variants:
    times = timing.interleaved_seconds(step_calls(variant, context), repeats)
    row = {"variant": variant, "context": context}
    for kind, seconds in times.items():
      row[f"{kind}_ms"] = 1e3 * statistics.median(seconds)
      row[f"{kind}_min_ms"] = 1e3 * min(seconds)
    row["ratio"] = report.ratio(row["documents_ms"], row["plain_ms"])
    rows.append(row)
    print(f"{variant}: plain {row['plain_ms']:.2f} ms, documents {row['documents_ms']:.2f} ms",
          flush=True)
  return rows


def table(rows):
  lines = ["| mixer | plain ms, median (min) | documents ms, median (min) | documents / plain |",
           "|---|---|---|---|"]
  for row in rows:
    lines.append(f"| {row['variant']} | {row['plain_ms']:.2f} ({row['plain_min_ms']:.2f}) | "
                 f"{row['documents_ms']:.2f} ({row['documents_min_ms']:.2f}) | "
                 f"{row['ratio']:.2f}x |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--context", type=int, default=CONTEXT, help="cached tokens before the step")
  parser.add_argument("--repeats", type=int, default=REPEATS,
                      help="timed rounds after the warm-up call of each")
  parser.add_argument("--only", default="", help="comma-separated variants (default: all: "
                      f"{', '.join(decode.variants())})")
  args = parser.parse_args(argv)
  variants = [v for v in decode.variants() if not args.only or v in args.only.split(",")]
  unknown = sorted(set(filter(None, args.only.split(","))) - set(decode.variants()))
  if unknown:
    parser.error(f"unknown variants {unknown}; valid: {', '.join(decode.variants())}")
  command = (f"python -m research.bench.document_decode --context {args.context} "
             f"--repeats {args.repeats}" + (f" --only {args.only}" if args.only else ""))
  meta = report.metadata(command)
  print(f"{meta['date']}  {meta['hardware']}  backend {meta['backend']}  "
        f"jax {meta['jax_version']}  commit {meta.get('commit')}")
  print(f"one decode step after {args.context} cached tokens, batch {BATCH}, "
        f"{decode.LAYERS} layers, d_model {decode.D_MODEL}, {decode.HEADS} heads, float32; "
        f"medians (minima) of {args.repeats} alternating steps\n")
  rows = measure(variants, args.context, args.repeats)
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
