"""A Hugging Face checkpoint directory -> a run directory of the lab, and back.

  import_checkpoint(CHECKPOINT, RUN)   RUN/config.json (the lab's config with the checkpoint's
                                       model fields), RUN/checkpoints/0 (its parameters, orbax),
                                       RUN/tokenizer (its tokenizer, if any: data.tokenizer,
                                       stored as "tokenizer", relative to the run) and
                                       RUN/imported.json (where they came from, and what an
                                       export gives back: the position limit, special-token
                                       ids and generation settings)
  export_run(RUN, CHECKPOINT)          CHECKPOINT/config.json, model.safetensors (float32),
                                       generation_config.json and the tokenizer's files

The source's config and the destination are checked before anything is written, and a
destination that holds anything is refused, so nothing already there is lost. An import writes
the run's tokenizer first (checking the config reads it), config.json last (a directory without
it is no run); on any error what it wrote is removed.
"""

import glob
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
from flax import nnx

from research import data
from research import defaults
from research.data import tokenizer
from research.model import transformer as model_lib
from research.evaluation import generate
from research.pretrained import hf_config
from research.pretrained import hf_tokenizer
from research.pretrained import hf_weights
from research.runs import checkpoints
from research.runs import config_fields
from research.training import init_from

IMPORTED_FILE = "imported.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_DIR = "tokenizer"


def read_config(checkpoint_dir: str) -> dict:
  path = os.path.join(checkpoint_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{checkpoint_dir} has no config.json: give a Hugging Face "
                            "checkpoint directory (config.json and *.safetensors)")
  with open(path) as f:
    return json.load(f)


def read_tensors(checkpoint_dir: str) -> dict:
  """{name: numpy float32 array} of every *.safetensors file of the directory (bfloat16 ones
  read through JAX, which numpy cannot hold)."""
  from safetensors import flax as safetensors_flax  # noqa: PLC0415 (only when converting)
  files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"{checkpoint_dir} has no *.safetensors file (a PyTorch .bin "
                            "checkpoint: save it again with safe_serialization=True)")
  tensors = {}
  for path in files:
    for name, value in safetensors_flax.load_file(path).items():
      tensors[name] = np.asarray(value.astype(jnp.float32))
  return tensors


def lab_config(hf: dict, overrides=None, tokenizer_dir=""):
  """The lab's default config with the checkpoint's model fields, its context as train.seq_len
  (the length evaluations scale from), data.tokenizer = `tokenizer_dir` if given, and then
  `overrides` ({dotted field: value} of data.*, train.* and eval.*), validated."""
  config = defaults.get_config()
  config.update_from_flattened_dict(hf_config.to_lab(hf))
  context = hf_config.context_length(hf)
  if context:
    config.train.seq_len = context
  config.train.num_steps = 0  # trained as far as it will be: train.init_from reads it as finished
  if tokenizer_dir:
    config.data.tokenizer = tokenizer_dir
  overrides = dict(overrides or {})
  fixed = sorted(name for name in overrides if name.split(".")[0] not in ("data", "train", "eval"))
  if fixed:
    raise ValueError(f"an import may set data.*, train.* and eval.* fields, not {', '.join(fixed)}"
                     " (the checkpoint gives the model)")
  config.update_from_flattened_dict(overrides)
  model_lib.validate(config.model)
  data.validate(config)
  if data.vocab_size(config) > config.model.vocab_size:
    raise ValueError(f"the data's {data.vocab_size(config)} token ids (data.tokenizer="
                     f"{config.data.tokenizer!r}) exceed the checkpoint's vocab_size "
                     f"{config.model.vocab_size}")
  return config


def _check_destination(directory: str):
  if os.path.exists(directory) and os.listdir(directory):
    raise FileExistsError(f"{directory} is not empty; give a new directory (nothing in it is "
                          "overwritten)")


def lab_state(model_config, params_by_path: dict):
  """The model's nnx.State with every parameter from `params_by_path` ({path: array}), whose
  shapes must match; ValueError names any parameter missing, extra or of another shape."""
  abstract = nnx.eval_shape(lambda: model_lib.build_model(model_config, rngs=nnx.Rngs(0)))
  flat = nnx.to_flat_state(nnx.state(abstract))
  wanted = {path for path, _ in flat}
  missing = sorted(map(str, wanted - set(params_by_path)))
  extra = sorted(map(str, set(params_by_path) - wanted))
  if missing or extra:
    raise ValueError(f"the converted parameters do not fit the lab's model: missing "
                     f"{missing[:6]}, extra {extra[:6]}")
  for path, variable in flat:
    value = params_by_path[path]
    if tuple(value.shape) != tuple(variable.get_value().shape):
      raise ValueError(f"parameter {'/'.join(map(str, path))}: the checkpoint gives shape "
                       f"{value.shape}, the lab's model has {variable.get_value().shape}")
    variable.set_value(jnp.asarray(value, jnp.float32))
  return nnx.from_flat_state(flat)


def import_checkpoint(checkpoint_dir: str, workdir: str, overrides=None, log=print):
  """Convert the checkpoint directory into the run directory `workdir` (new or empty), with the
  checkpoint's tokenizer (if it has a tokenizer.json) in RUN/tokenizer as data.tokenizer.
  On any error nothing of the run is left (an empty `workdir` stays)."""
  hf = read_config(checkpoint_dir)
  family = hf_config.family(hf)
  hf_config.to_lab(hf)  # refuses what the lab cannot hold before anything else
  tokenizer_files = hf_tokenizer.checkpoint_files(checkpoint_dir, hf)
  _check_destination(workdir)
  created = not os.path.exists(workdir)
  os.makedirs(workdir, exist_ok=True)
  try:
    config, count = _import(checkpoint_dir, workdir, hf, family, tokenizer_files, overrides)
  except BaseException:
    _remove_contents(workdir)
    if created:
      os.rmdir(workdir)
    raise
  log(f"imported {hf['model_type']} ({family} family, {count:,} parameters) from "
      f"{checkpoint_dir} into {workdir}")
  return config


def _remove_contents(directory):
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _import(checkpoint_dir, workdir, hf, family, tokenizer_files, overrides):
  tokenizer_dir = ""
  if tokenizer_files:  # in place first: checking the config reads the run's tokenizer
    tokenizer_dir = os.path.abspath(os.path.join(workdir, TOKENIZER_DIR))
    os.makedirs(tokenizer_dir)
    for name, content in tokenizer_files.items():
      with open(os.path.join(tokenizer_dir, name), "w") as f:
        f.write(content)
  config = lab_config(hf, overrides, tokenizer_dir)
  params = hf_weights.to_lab(family, read_tensors(checkpoint_dir), config.model)
  state = lab_state(config.model, params)
  manager = checkpoints.manager(workdir, keep=1)
  checkpoints.save(manager, 0, {"params": state})
  checkpoints.wait(manager)
  manager.close()
  with open(os.path.join(workdir, IMPORTED_FILE), "w") as f:
    json.dump(_record(checkpoint_dir, hf, family), f, indent=2)
  with open(os.path.join(workdir, "config.json"), "w") as f:  # its tokenizer relative to the run
    f.write(config_fields.as_saved(config, workdir).to_json(indent=2, sort_keys=True))
  return config, sum(value.size for value in params.values())


def _record(checkpoint_dir, hf, family) -> dict:
  """RUN/imported.json: where the run came from, and what of the checkpoint's config the lab's
  config does not hold and an export gives back (export_run): max_position_embeddings, the
  special-token ids and generation_config.json (null where the checkpoint has none)."""
  generation = None
  if os.path.exists(os.path.join(checkpoint_dir, GENERATION_FILE)):
    with open(os.path.join(checkpoint_dir, GENERATION_FILE)) as f:
      generation = json.load(f)
  return {"checkpoint": os.path.abspath(checkpoint_dir), "model_type": hf["model_type"],
          "family": family, "transformers_version": hf.get("transformers_version"),
          "max_position_embeddings": hf.get("max_position_embeddings"),
          "special_tokens": {key: hf.get(key) for key in hf_tokenizer.SPECIAL_TOKEN_IDS},
          "generation_config": generation}


def export_run(workdir: str, checkpoint_dir: str, step: int | None = None, log=print):
  """Write the run's newest readable checkpoint (or checkpoint `step`) as a Llama-family
  Hugging Face checkpoint directory (new or empty) that transformers loads: config.json with
  max_position_embeddings = position_limit and the special-token ids, model.safetensors,
  generation_config.json, and the run's tokenizer (hf_tokenizer; none for a synthetic task's
  symbols). An imported run (or one fine-tuned from it: `imported_record`) gives back the
  checkpoint's special-token ids and generation_config.json; another run its tokenizer's."""
  from safetensors import numpy as safetensors_numpy  # noqa: PLC0415 (only when exporting)
  config = config_fields.load_saved(workdir)
  record = imported_record(config, workdir)
  hf = hf_config.from_lab(config.model, position_limit(config, record))
  tokens = tokenizer.get(config) if data.is_text(config) else None
  if "special_tokens" in record:
    special = record["special_tokens"]
  else:
    special = hf_tokenizer.special_ids(tokens) if tokens else {}
  special = {key: value for key, value in special.items() if value is not None}
  hf.update(special)
  generation = record.get("generation_config") or special
  files = {GENERATION_FILE: json.dumps(generation, indent=2)} if generation else {}
  files.update(hf_tokenizer.export_files(tokens) if tokens else {})
  _check_destination(checkpoint_dir)
  step, model = generate.restore(config, workdir, log=log, step=step)
  params = {path: np.asarray(variable.get_value())
            for path, variable in nnx.to_flat_state(nnx.state(model))}
  tensors = hf_weights.from_lab(params, config.model)
  os.makedirs(checkpoint_dir, exist_ok=True)
  safetensors_numpy.save_file(tensors, os.path.join(checkpoint_dir, "model.safetensors"),
                              metadata={"format": "pt"})
  files["config.json"] = json.dumps(hf, indent=2)
  for name, content in files.items():
    with open(os.path.join(checkpoint_dir, name), "w") as f:
      f.write(content)
  log(f"exported step {step} of {workdir} as a {hf['model_type']} checkpoint in "
      f"{checkpoint_dir} ({', '.join(sorted(files))}, model.safetensors)")
  return hf


def imported_record(config, workdir: str) -> dict:
  """RUN/imported.json of the run, or of the run it was fine-tuned from (train.init_from,
  followed while the tokenizer stays the same and the source is there); {} for a run that no
  import began."""
  while not os.path.exists(os.path.join(workdir, IMPORTED_FILE)):
    if not config.train.init_from:
      return {}
    source = init_from.source_directory(config, workdir)
    if not os.path.exists(os.path.join(source, "config.json")):
      return {}
    source_config = config_fields.load_saved(source)
    if source_config.data.tokenizer != config.data.tokenizer:
      return {}
    config, workdir = source_config, source
  with open(os.path.join(workdir, IMPORTED_FILE)) as f:
    return json.load(f)


def position_limit(config, record: dict) -> int:
  """The positions the model was made for: the longer of its training length (train.seq_len)
  and the imported checkpoint's max_position_embeddings (`record`, imported_record's). Not
  the evaluation lengths: a rotary model is evaluated beyond what it was trained for."""
  return max(config.train.seq_len, record.get("max_position_embeddings") or 0)
