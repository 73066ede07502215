"""A tiny language-modeling config for the training-loop tests (seconds per run on CPU)."""

from configs import base


def get_config(arg=""):
  del arg
  config = base.get_config()
  config.model.update(dict(num_layers=1, d_model=32, num_heads=4, mlp_ratio=2,
                           position="rope", rope=dict(original_length=32)))
  config.train.update(dict(num_steps=8, batch_size=8, seq_len=32, warmup_steps=2, log_every=1,
                           checkpoint_every=4, eval_batches=1, learning_rate=1e-2))
  config.eval.update(dict(lengths=(32, 64), batch_size=8, num_tokens=512))
  return config
