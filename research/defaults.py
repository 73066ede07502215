"""The config schema: every field the library reads, with its default (configs/base.py serves it
to the command line; research/ reads it from here, so configs/ imports research and never the
other way round).

Experiment files start from `get_config()` and change what they need. Any field can be
overridden on the command line, e.g.

  python -m experiments.train --config=configs/base.py --workdir=/tmp/run \
      --config.model.attention=gqa --config.model.num_kv_heads=2
"""

import inspect
import re
from typing import Any, Hashable, Mapping

import ml_collections

from research import variants

# The schema's version, saved with every run; a change that renames, moves or reshapes a field
# bumps it and says how to read the older schema (research/runs/migrations.py).
VERSION = 3


def get_config():
  config = ml_collections.ConfigDict()
  config.version = VERSION  # the schema's version (research/runs/migrations.py); set by the code

  config.model = ml_collections.ConfigDict()
  m = config.model
  m.attention = "mha"  # research.model.attention.REGISTRY (`python -m experiments.variants`)
  m.position = "rope"  # research.model.positions.REGISTRY
  m.layer_pattern = ()  # hybrids, e.g. ("mamba", "mamba", "mha"), tiled to num_layers
  m.num_layers = 2  # blocks of mixer + feed-forward
  m.d_model = 128  # the residual stream's width
  m.num_heads = 4  # query heads; head dim d_model / num_heads unless a mixer sets its own
  m.num_kv_heads = 4  # read by gqa, nsa and path (Mixer.reads_num_kv_heads); mha: num_heads, mqa: 1
  m.feed_forward = "mlp"  # research.model.feed_forward.REGISTRY: mlp, swiglu, moe, rwkv ones
  m.feed_forward_pattern = ()  # per layer, tiled to num_layers: Jamba's ("mlp", "moe")
  m.mlp_ratio = 4  # hidden width / d_model of the MLP and of each expert; 0 drops the feed-forward
  m.vocab_size = 258  # 256 bytes + end-of-document + padding
  m.norm = "rms_norm"  # research.model.norms.REGISTRY: rms_norm | layer_norm (model.<norm>)
  m.tie_embeddings = False  # the output head is the embedding table transposed (GPT-2, Llama 3.2)
  # the attention core's backend: auto (by length and device) | xla | blockwise | cudnn | pallas
  # | splash
  m.attention_backend = "auto"
  m.compute_dtype = "float32"  # parameters stay float32; bfloat16 on GPU/TPU
  # what each block keeps for the backward pass: none | full | dots | dots_no_batch
  # (research.model.transformer.REMAT_POLICIES): memory for recomputation, the same numbers
  m.remat = "none"
  m.randomize_max_length = 0  # > 0: randomized positions in [0, M) in training (arXiv:2305.16843)
  # Each registered mixer, position scheme and feed-forward declares its own hyperparameters;
  # they appear here as sub-dicts under their names, e.g. model.rope.scaling, model.fire.hidden,
  # model.softmax.block_size, model.linear.chunk_size, model.mamba.state_size, model.moe.top_k.
  for key, settings in variants.default_settings().items():
    m[key] = ml_collections.ConfigDict(settings)

  config.data = ml_collections.ConfigDict()
  d = config.data
  d.name = "stdlib_bytes"  # research.data.NAMES: corpora, synthetic tasks, needle tasks
  d.dir = ""  # prepared datasets; "" means $RESEARCH_DATA_DIR or ~/.cache/research_data
  d.corpus_path = ""  # text_dir: a directory or glob of text files
  # Corpora: "bytes", or a directory with a Hugging Face tokenizer.json (research/data/tokenizer.py;
  # experiments.import_hf sets it to RUN/tokenizer for a checkpoint that has one).
  d.tokenizer = "bytes"
  d.task_vocab_size = 16  # synthetic tasks: number of symbol tokens
  d.train_min_length = 1  # synthetic tasks: training lengths U(min, max) in symbols
  d.train_max_length = 40  # synthetic tasks: see train_min_length
  d.num_kv_pairs = 8  # mqar: key-value pairs per example
  d.num_train_examples = 100_000  # synthetic tasks: examples drawn for training
  d.num_eval_examples = 256  # synthetic and needle tasks, per evaluation length (and depth)
  d.needle_value_digits = 5  # needle tasks: digits of the pass key / magic numbers
  d.num_distractors = 3  # needle_multikey: needles of other keys
  d.num_values = 4  # needle_multivalue: values of the asked key
  # MAD tasks (research.data.mad; defaults: mad-lab's baselines), each read only by its task:
  d.mad_frac_noise = 0.2  # mad_noisy_in_context_recall: probability a pair is noise
  d.mad_noise_vocab_size = 16  # mad_noisy_in_context_recall: noise ids, the last of the vocab
  d.mad_k_motif_size = 3  # mad_fuzzy_in_context_recall: longest key motif
  d.mad_v_motif_size = 3  # mad_fuzzy_in_context_recall: longest value motif
  d.mad_num_tokens_to_copy = 16  # mad_selective_copying: tokens to copy
  # Language modeling: "concat" cuts training and evaluation windows from the token stream across
  # document boundaries; "documents" adds per-token segment ids and positions so that a token
  # sees only its own document, and leaves END_OF_DOCUMENT unscored (research/data/packing.py).
  d.packing = "concat"

  config.train = ml_collections.ConfigDict()
  t = config.train
  t.num_steps = 200  # optimizer steps
  t.batch_size = 32  # global, over all processes
  t.seq_len = 128  # the training length (tokens per row)
  t.learning_rate = 3e-3  # AdamW's peak: linear warmup, then cosine decay
  t.warmup_steps = 50  # linear warmup from 0 to learning_rate
  t.end_learning_rate_fraction = 0.1  # the final learning rate / the peak
  t.weight_decay = 0.1  # AdamW, on the parameters that declare weight_decay
  t.grad_clip_norm = 1.0  # gradients clipped to this global norm
  t.grad_accum_steps = 1  # micro-batches per step (batch_size split into them)
  t.seed = 0  # initialisation and data order
  t.log_every = 20  # steps between log lines and metrics.jsonl rows
  t.eval_every = 0  # validation loss every N steps; 0: only at the end
  t.eval_batches = 4  # batches of each validation during training
  t.checkpoint_every = 100  # steps between checkpoints (orbax, asynchronous)
  t.keep_checkpoints = 2  # the latest checkpoints kept
  # Steps whose checkpoints are never rotated out (saved even off checkpoint_every), e.g.
  # log-spaced to watch heads form over training (python -m experiments.analyze
  # --analysis=induction reads every kept checkpoint).
  t.keep_checkpoints_at = ()
  # Trackers fed every logged step and the config (research/training/trackers.py), e.g.
  # ("tensorboard", "wandb"): TensorBoard event files in RUN/tensorboard; a Weights & Biases run
  # (requirements-tracking.txt; WANDB_MODE=offline keeps it in RUN/wandb).
  t.trackers = ()
  # Start from another run's final parameters with a fresh optimizer
  # (research/training/init_from.py):
  # a run directory, relative to the one that holds this workdir (in a sweep: a member's name).
  # MHA converts to GQA with fewer key/value heads by mean-pooling (arXiv:2305.13245); with
  # num_steps = 0 the converted model is saved as checkpoint 0 and evaluated as it is.
  t.init_from = ""

  config.mesh = ml_collections.ConfigDict()
  config.mesh.shape = (-1, 1, 1)  # sizes of the (data, fsdp, tensor) axes; -1 fills

  config.distributed = ml_collections.ConfigDict()
  config.distributed.coordinator_address = ""  # "host:port" turns on jax.distributed
  config.distributed.num_processes = 1  # with coordinator_address
  config.distributed.process_id = 0  # with coordinator_address

  config.eval = ml_collections.ConfigDict()
  e = config.eval
  e.lengths = (128, 256, 512, 1024)  # evaluation lengths (tokens per window)
  e.modes = ("nonoverlapping", "sliding")  # windows side by side | overlapping, stride below
  e.sliding_stride = 0  # 0: half the training length
  e.num_tokens = 16384  # scored tokens per (length, mode), taken from the same text
  e.batch_size = 8  # windows per evaluation batch
  # Extra rows for runs with a rotary scheme, each scaling at s = eval length / train length:
  # any of research.model.positions.SCALINGS, e.g. ("pi", "static_ntk", "dynamic_ntk", "yarn").
  e.rope_scalings = ()
  e.depths = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle tasks: where the needle sits, 0 first, 1 last
  e.bootstrap_samples = 1000  # resamples of the 95% intervals over windows / examples
  e.bootstrap_seed = 0  # the resampling's seed
  # Held-out splits evaluated, each a row: "validation" (the default; what summaries and figures
  # show) and "test" (MAD's protocol selects on test; research/results/mad_table.py shows both).
  e.splits = ("validation",)
  return config


_SECTIONS = {"config": "", "m": "model.", "d": "data.", "t": "train.", "e": "eval."}


def field_comments() -> dict[str, str]:
  """{dotted field: what get_config's source says of it}: the comment lines just above its
  assignment and the comment after it (for the generated config table of docs/architecture.md)."""
  comments, pending = {}, []
  for line in inspect.getsource(get_config).splitlines():
    line = line.strip()
    if line.startswith("#"):
      pending.append(line[1:].strip())
      continue
    match = re.match(r"(config|m|d|t|e)\.([\w.]+) = (.*?)(?:  # (.*))?$", line)
    if match and not match.group(3).startswith("ml_collections.ConfigDict"):
      section, name, _, inline = match.groups()
      comments[_SECTIONS[section] + name] = " ".join(pending + [inline or ""]).strip()
    pending = []
  return comments


def config_fields() -> list[tuple[str, object, str]]:
  """(dotted name, default, what field_comments says of it) for every field of the config
  outside the variants' sub-dicts (model.<key>), in the order of get_config."""
  config, comments = get_config(), field_comments()
  variant_sections = tuple(f"model.{key}." for key in variants.default_settings())
  rows = []
  for name in flatten(config):
    if name.startswith(variant_sections):
      continue
    value = config
    for part in name.split("."):
      value = value[part]
    rows.append((name, value, comments.get(name, "").replace("|", "\\|")))
  return rows


def doc_tables(model_config) -> dict[str, str]:
  """{block name: markdown} of every generated table of the docs: the registries' tables
  (research.variants.markdown_tables, at `model_config`'s sizes) and the config fields'."""
  fields = ["| field | default | what it is |", "|---|---|---|"]
  fields += [f"| `{name}` | `{value!r}` | {what} |" for name, value, what in config_fields()]
  return {**variants.markdown_tables(model_config), "config-fields": "\n".join(fields)}


_FLAT_DEFAULTS = {}  # {registry state: flatten(get_config())}


def flat_defaults() -> dict[str, Any]:
  """flatten(get_config()), a new dict each call but computed once for each state of the
  registries (checks call it for every member of a sweep of thousands)."""
  state = variants.registry_state()
  if state not in _FLAT_DEFAULTS:
    _FLAT_DEFAULTS.clear()
    _FLAT_DEFAULTS[state] = flatten(get_config())
  return dict(_FLAT_DEFAULTS[state])


def flatten(config: ml_collections.ConfigDict | Mapping) -> dict[str, Any]:
  """{"train.seq_len": 128, ...}: every leaf by dotted name, as JSON values (tuples as lists), in
  the order of `config.to_json()`. Walks the tree directly: checks flatten every member of sweeps
  of thousands, where a JSON round trip took most of the time."""
  flat = {}
  _flatten_into(flat, "", config)
  return flat


def _flatten_into(flat, prefix, node):
  # A ConfigDict's fields in insertion order, as ml_collections' own JSON encoder reads them.
  fields = node._fields if isinstance(node, ml_collections.ConfigDict) else node  # noqa: SLF001
  for key, value in fields.items():
    if isinstance(value, ml_collections.FieldReference):
      value = value.get()
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      _flatten_into(flat, f"{prefix}{key}.", value)
    else:
      flat[f"{prefix}{key}"] = as_json(value)


def as_json(value):
  """The value as a JSON round trip returns it: tuples as lists, a type as its name."""
  if isinstance(value, (tuple, list)):
    return [as_json(v) for v in value]
  return str(value) if isinstance(value, type) else value


class _NotFrozen(Exception):
  """A value of a kind that `frozen` does not vouch for."""


def frozen(value) -> Hashable | None:
  """A hashable form of a config value (a leaf, a tuple, a list or a dict of them), equal only
  for values that any check treats alike, or None for a value of another kind: memos of checks
  key on it. Python's equality is too loose for that (1 == 1.0 == True and 0.0 == -0.0, which a
  check or its message may tell apart), so the type is part of it at every level, and a float
  goes by its repr."""
  try:
    return _frozen(value)
  except _NotFrozen:
    return None


def _frozen(value):
  kind = type(value)
  if kind is float:
    return kind, repr(value)
  if kind in (str, int, bool, type(None)):
    return kind, value
  if kind in (tuple, list):
    return kind, tuple(map(_frozen, value))
  if kind is dict:
    return kind, tuple((_frozen(k), _frozen(v)) for k, v in value.items())
  raise _NotFrozen(kind)
