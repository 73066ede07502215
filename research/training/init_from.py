"""Training that starts from another run's final parameters (train.init_from), converted where
the architectures differ only in key/value heads: MHA (or GQA) to GQA with fewer key/value heads
by mean-pooling each group's key and value heads (Ainslie et al., arXiv:2305.13245, section 2.1;
research.model.attention.convert), then uptrained with a fresh optimizer for train.num_steps steps
(0: the converted model alone, saved as checkpoint 0 to be evaluated as it is).

train.init_from is a run directory; a relative path is taken from the directory that holds
this run's workdir, so in a sweep it is the name of another member. The source must have
finished training (its newest checkpoint is at its train.num_steps). Everything that shapes the
model must match, except model.attention and model.num_kv_heads (and model.layer_pattern, when
each layer keeps its mixer's code): each layer's mixer must be the same code (mha, mqa and gqa
are one), and each softmax layer's new key/value heads must divide its old ones. Fields that
do not change the parameters (the attention backend, compute dtype, rotary context extension)
may differ too.
"""

import os

from flax import nnx

from research.model import attention
from research.runs import checkpoints
from research.runs import config_fields
from research.model import transformer as model_lib
from research.model import sharding
from research.model.attention import convert

# Model fields that may differ between the source and this run, besides those that do not
# change training (research.runs.config_fields: the rotary context extensions, the softmax backend):
# the key/value heads, and the compute dtype the same parameters are applied in.
CONVERTIBLE_FIELDS = ("model.attention", "model.num_kv_heads", "model.layer_pattern",
                      "model.compute_dtype")


def source_directory(config, workdir: str) -> str:
  return os.path.join(os.path.dirname(os.path.abspath(workdir)), config.train.init_from)


def _kv_heads(model_config) -> list[int | None]:
  """Per layer, the key/value heads of a softmax layer (None for other mixers)."""
  heads = []
  for name in model_lib.layer_types(model_config):
    cls = attention.REGISTRY.lookup(name)
    heads.append(cls.kv_heads(model_config))
  return heads


def _family(name: str) -> str:
  return attention.REGISTRY.variant_of(name) or name


def check(config, workdir: str):
  """Raise ValueError (FileNotFoundError for a missing source) unless train.init_from names a
  finished run whose model converts into this config's; returns the source config."""
  source = source_directory(config, workdir)
  if not os.path.exists(os.path.join(source, "config.json")):
    raise FileNotFoundError(
        f"train.init_from={config.train.init_from!r}: {source} holds no run (no config.json); "
        "give a run directory, relative to the directory that holds this workdir (in a sweep: "
        "another member's name), or an absolute path")
  source_config = config_fields.load_saved(source)
  saved = checkpoints.steps(source)
  if not saved or saved[-1] < source_config.train.num_steps:
    raise ValueError(
        f"train.init_from={config.train.init_from!r} has not finished training (newest "
        f"checkpoint: {saved[-1] if saved else 'none'}, train.num_steps="
        f"{source_config.train.num_steps}); train it first")
  ours, theirs = config_fields.flatten(config.model), config_fields.flatten(source_config.model)
  differences = [f"model.{name}: {theirs.get(name)!r} (source) vs {ours.get(name)!r}"
                 for name in sorted(ours.keys() | theirs.keys())
                 if ours.get(name) != theirs.get(name)
                 and f"model.{name}" not in CONVERTIBLE_FIELDS
                 and config_fields.changes_training(f"model.{name}")]
  source_types = model_lib.layer_types(source_config.model)
  our_types = model_lib.layer_types(config.model)
  differences += [f"layer {i}: {theirs_type!r} (source) vs {our_type!r}, another mixer's code"
                  for i, (theirs_type, our_type) in enumerate(zip(source_types, our_types))
                  if _family(theirs_type) != _family(our_type)]
  differences += [f"layer {i}: {our_kv} key/value heads do not divide the source's {their_kv}"
                  for i, (their_kv, our_kv) in enumerate(zip(_kv_heads(source_config.model),
                                                             _kv_heads(config.model)))
                  if our_kv is not None and their_kv % our_kv]
  if differences:
    raise ValueError(
        f"train.init_from={config.train.init_from!r} cannot initialise this model: "
        f"{'; '.join(differences)}. Only the key/value heads may change (MHA or GQA to GQA with "
        "a divisor of the source's key/value heads); everything else that shapes the model "
        "must match")
  return source_config


def initial_params(config, workdir: str, mesh, log=print):
  """This run's initial parameters (nnx.State laid out on `mesh`): the source's final ones,
  key/value heads mean-pooled where this model has fewer."""
  source_config = check(config, workdir)
  source = source_directory(config, workdir)
  abstract = nnx.state(nnx.eval_shape(
      lambda: model_lib.build_model(source_config.model, rngs=nnx.Rngs(0))))
  step, params = checkpoints.restore_params(source, sharding.sharded_abstract(abstract, mesh),
                                            log=log)
  pooled = {}  # (source kv heads, new kv heads) -> layers
  for layer, (their_kv, our_kv) in enumerate(zip(_kv_heads(source_config.model),
                                                 _kv_heads(config.model))):
    if our_kv is not None and our_kv != their_kv:
      pooled.setdefault((their_kv, our_kv), []).append(layer)
  for (their_kv, our_kv), layers in pooled.items():
    params = convert.mha_to_gqa(params, their_kv, our_kv, layers=layers)
  log(f"initialised from {source} (step {step})"
      + "".join(f"; layers {', '.join(map(str, layers))}: {their_kv} -> {our_kv} key/value "
                "heads by mean-pooling" for (their_kv, our_kv), layers in pooled.items()))
  return params
