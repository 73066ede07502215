"""A tiny sweep for the runner tests: one good run, one incompatible pair, one that diverges."""

from tests import tiny_config


def get_config(arg=""):
  config = tiny_config.get_config(arg)
  config.model.num_kv_heads = 2  # the gqa member's
  config.train.update(dict(num_steps=4, checkpoint_every=4, log_every=2))
  config.eval.update(dict(lengths=(32, 64), num_tokens=256, sliding_stride=16))
  return config


def get_sweep(arg=""):
  del arg
  return [
      {"model.attention": "mha", "model.position": "alibi"},
      {"model.attention": "linear", "model.position": "alibi"},  # incompatible: skipped
      {"model.attention": "gqa", "model.position": "rope", "train.learning_rate": 1e30},  # fails
  ]
