"""Block-sparse attention (research/model/attention/sparse.py) and MoBA's routed blocks
(research/model/attention/moba.py) against full causal attention, fwd + bwd: does the time fall with
the share of the keys attended?

  python -m research.bench.sparse [--length 8192] [--block-size 128] [--repeats 3]
                                  [--routed-lengths 4096,8192,16384]

One kernel per mask, at [batch 1, length, 8 heads, head_dim 64] float32 (the mixers suite's
reference shape, research/bench/mixers.py):
  loss = <core.attend(q, k, v, mask, backend="blockwise"), cotangent>,  jax.grad w.r.t. q, k, v,
jitted and compiled once (temporary memory from XLA's analysis), then timed as the median of
`repeats` interleaved calls after a warm-up call of each (research.bench.timing: every call ends
with block_until_ready; a busy machine's drift falls on all masks alike). Masks: full causal, and
the sparse mixer's three patterns at two sizes each, in multiples of the tile b: fixed
(l = 4b, 8b; c = b), strided (l = 4b, 8b), local_global (W = 2b, 8b; G = b). density = the
tiles the schedule visits / the causal tiles (sparse.tile_density); kept = the share of the
causal (query, key) pairs the pattern keeps. The last column, time / (density x causal time), is
1 where the cost is proportional to the visited tiles; above 1, a fixed cost per call or per
visited tile (the loop, the schedule's gathers) weighs more as the tiles get fewer.

Routed attention (`--routed-lengths`): at each length, the same shapes through MoBA's efficient
form (its `blockwise` backend: the gates, the top-k routing, the own block and the routed blocks'
tiles, merged by log-sum-exp) at its defaults, blocks of 512 and top-3, and through NSA's three
branches (research/model/attention/nsa.py `attend` on `blockwise`, gates 1, its output projection
included) at its defaults, blocks of 64, 16 selected, a window of 512, against full causal
blockwise attention; MoBA's share of the keys attended is about 3 x 512 / ((L + 1) / 2), NSA's
about (16 x 64 + 512 + L / 64) / ((L + 1) / 2).
"""

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from research.model import attention
from research import defaults
from research.model import positions
from research.model.attention import core
from research.model.attention import masks
from research.model.attention import moba
from research.model.attention import sparse
from research.bench import report
from research.bench import timing

BATCH, HEADS, HEAD_DIM = 1, 8, 64
LENGTH, BLOCK_SIZE, REPEATS = 8192, 128, 3
MOBA_CHUNK, MOBA_TOPK = moba.MoBA.hyperparameters["chunk_size"], moba.MoBA.hyperparameters["topk"]


def masks_to_compare(block):
  """[(pattern, sizes, MaskSpec)]: full causal, then each pattern at two sizes (tiles of b)."""
  table = [("causal", "-", masks.CAUSAL)]
  for stride in (4 * block, 8 * block):
    table.append(("fixed", f"l={stride}, c={block}", sparse.Fixed(stride, block).mask()))
  for stride in (4 * block, 8 * block):
    table.append(("strided", f"l={stride}", sparse.Strided(stride).mask()))
  for window in (2 * block, 8 * block):
    table.append(("local_global", f"W={window}, G={block}",
                  sparse.LocalGlobal(window, block).mask()))
  return table


def forward_backward(mask, block):
  """grad of <blockwise attention under `mask`, cotangent> w.r.t. q, k and v."""

  def loss(q, k, v, cotangent):
    out = core.attend(q, k, v, mask=mask, backend="blockwise", block_size=block)
    return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def moba_forward_backward(chunk=MOBA_CHUNK, topk=MOBA_TOPK, tile=BLOCK_SIZE):
  """grad of <MoBA's efficient form, cotangent> w.r.t. q, k and v (no position scheme)."""

  def loss(q, k, v, cotangent):
    length = q.shape[1]
    layout = moba.blocks(length, chunk)
    routed = moba.route(q, k, layout, chunk, topk)
    out = moba.sparse_attention(q, k, v, layout, routed, jnp.arange(length)[None],
                                scale=q.shape[-1] ** -0.5, bias_fn=None, chunk=chunk, tile=tile)
    return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def nsa_forward_backward(tile=BLOCK_SIZE):
  """grad of <NSA's gated branches, cotangent> w.r.t. q, k and v (its defaults, K = N heads, no
  position scheme, the selected branch on `blockwise`)."""
  config = defaults.get_config().model
  config.update(dict(attention="nsa", position="none", d_model=HEADS * HEAD_DIM,
                     num_heads=HEADS, num_kv_heads=HEADS, attention_backend="blockwise"))
  config.nsa.tile_size = tile
  cls = attention.REGISTRY["nsa"]
  settings = attention.REGISTRY.settings("nsa", config)
  scheme = positions.build(config, cls.position_geometry(settings, config), rngs=nnx.Rngs(0))
  mixer = cls(settings, config, scheme, rngs=nnx.Rngs(0))

  def loss(q, k, v, cotangent):
    b, length, n, _ = q.shape
    gates = jnp.ones((b, length, n, 3), jnp.float32)
    out = mixer.attend(q, {"key": k, "value": v}, gates, jnp.arange(length)[None])
    return jnp.vdot(out.astype(jnp.float32), cotangent.reshape(out.shape).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def routed_kernels():
  """{label: fwd+bwd function} of the routed mixers at their defaults."""
  nsa = attention.REGISTRY["nsa"].hyperparameters
  return {f"moba C={MOBA_CHUNK} top-{MOBA_TOPK}": moba_forward_backward(),
          f"nsa l={nsa['block_size']} n={nsa['num_selected']} w={nsa['window']}":
              nsa_forward_backward()}


def measure_routed(lengths, block=BLOCK_SIZE, repeats=REPEATS, dtype=jnp.float32):
  """Per length: full causal blockwise attention, MoBA's efficient form and NSA, median fwd+bwd
  ms, compiled temp bytes, and time / causal time."""
  rows = []
  for length in lengths:
    keys = jax.random.split(jax.random.key(length), 4)
    args = tuple(jax.random.normal(key, (BATCH, length, HEADS, HEAD_DIM), dtype) for key in keys)
    calls, memory = {}, {}
    for kernel, fn in {"causal": forward_backward(masks.CAUSAL, block),
                       **routed_kernels()}.items():
      compiled = timing.compile_fn(fn, *args)
      calls[kernel] = lambda compiled=compiled: compiled(*args)
      memory[kernel] = timing.memory_bytes(compiled)
    times = timing.interleaved_seconds(calls, repeats)
    causal_ms = 1e3 * statistics.median(times["causal"])
    for kernel in calls:
      time_ms = 1e3 * statistics.median(times[kernel])
      rows.append({"kernel": kernel, "length": length, "time_ms": time_ms, **memory[kernel],
                   "relative": time_ms / causal_ms, "repeats": repeats})
  return rows


def routed_table(rows):
  body = [[str(row["length"]), row["kernel"], f"{row['time_ms']:.1f}",
           f"{row['temp_bytes'] / report.MIB:.1f}", f"{row['relative']:.2f}"] for row in rows]
  return report.markdown_table(["length", "kernel", "fwd+bwd ms", "temp MiB",
                                "time / causal time"], body)


def kept_pairs(mask, length):
  """The share of the causal (query, key) pairs that `mask` keeps, one row of queries at a time."""
  index = np.arange(length)
  kept = sum(int(np.asarray(mask.visible(index[start:start + 1024], index)).sum())
             for start in range(0, length, 1024))
  return kept / (length * (length + 1) / 2)


def measure(length=LENGTH, block=BLOCK_SIZE, repeats=REPEATS, dtype=jnp.float32):
  """One row per mask: density, kept pairs, median fwd+bwd ms, compiled temp bytes, and time /
  (density x causal time)."""
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (BATCH, length, HEADS, HEAD_DIM)
  args = tuple(jax.random.normal(key, shape, dtype) for key in keys)  # q, k, v, cotangent
  rows, calls = [], {}
  for pattern, sizes, mask in masks_to_compare(block):
    visited, causal = sparse.tile_density(mask, length, block)
    compiled = timing.compile_fn(forward_backward(mask, block), *args)
    label = pattern if pattern == "causal" else f"{pattern} {sizes}"
    calls[label] = lambda compiled=compiled: compiled(*args)
    rows.append({"mask": label, "pattern": pattern, "sizes": sizes, "length": length,
                 "block": block, "visited_tiles": visited, "causal_tiles": causal,
                 "density": visited / causal, "kept": kept_pairs(mask, length),
                 **timing.memory_bytes(compiled)})
  times = timing.interleaved_seconds(calls, repeats)
  for row in rows:
    row["time_ms"] = 1e3 * statistics.median(times[row["mask"]])
    row["repeats"] = repeats
  causal_ms = rows[0]["time_ms"]
  for row in rows:
    row["time_per_density"] = row["time_ms"] / (row["density"] * causal_ms)
  return rows


def table(rows):
  """Markdown: one line per mask."""
  body = [[row["mask"], f"{row['density']:.3f}", f"{row['kept']:.3f}",
           f"{row['time_ms']:.1f}", f"{row['temp_bytes'] / report.MIB:.1f}",
           f"{row['time_per_density']:.2f}"] for row in rows]
  return report.markdown_table(["mask", "density (tiles)", "kept pairs", "fwd+bwd ms",
                                "temp MiB", "time / (density x causal time)"], body)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--length", type=int, default=LENGTH)
  parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="the tile b")
  parser.add_argument("--repeats", type=int, default=REPEATS,
                      help="timed rounds after the warm-up call (median)")
  parser.add_argument("--routed-lengths", default="",
                      help="comma-separated lengths for MoBA and NSA against causal attention "
                           "(none: skip)")
  args = parser.parse_args(argv)
  if args.length < 8 * args.block_size:
    parser.error(f"--length {args.length} is shorter than the largest pattern size "
                 f"(8 x --block-size = {8 * args.block_size}); use a longer length or a "
                 "smaller block")
  meta = report.metadata(f"python -m research.bench.sparse --length {args.length} "
                         f"--block-size {args.block_size} --repeats {args.repeats}")
  print(f"{meta['date']}  {meta['hardware']}  backend {meta['backend']}  "
        f"jax {meta['jax_version']}")
  print(f"blockwise fwd+bwd, batch {BATCH}, length {args.length}, {HEADS} heads, head_dim "
        f"{HEAD_DIM}, float32, tiles of {args.block_size}, median of {args.repeats} "
        "interleaved calls\n")
  rows = measure(args.length, args.block_size, args.repeats)
  print(table(rows))
  if args.routed_lengths:
    lengths = [int(x) for x in args.routed_lengths.split(",")]
    print("\nMoBA's efficient form and NSA at their defaults against causal blockwise "
          "attention, the same shapes\n")
    routed_rows = measure_routed(lengths, args.block_size, args.repeats)
    print(routed_table(routed_rows))
    rows = rows + routed_rows
  return rows


if __name__ == "__main__":
  main()
