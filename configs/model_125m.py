"""A ~125M-parameter byte-level language model at 2048 context: the accelerator MFU check.

18 layers of d_model 768 (GPT-2 small's width; 12 heads of 64), MLP ratio 4: 127M parameters
(byte vocabulary, so depth stands in for GPT-2's 38M of token embeddings). bfloat16 compute,
the attention backend `auto` (cuDNN on a GPU, Splash on a TPU), 16 x 2048 tokens per step on the
embedded corpus.

  python -m experiments.train --config=configs/model_125m.py:mfu --workdir=runs/mfu_125m
      60 steps, metrics every 20: the mfu of metrics.jsonl's last line (compilation excluded).
      For an accelerator (make accelerator-check runs it).
  python -m experiments.train --config=configs/model_125m.py:smoke --workdir=/tmp/smoke
      the same code path at 2 layers, d_model 128, 256 context, float32, the default backend
      (auto: xla at this length): a CPU dry run.
"""

from configs import base


def get_config(preset="mfu"):
  base.check_preset(preset, valid=("mfu", "smoke"))
  config = base.get_config()
  if preset == "mfu":
    config.model.update(dict(num_layers=18, d_model=768, num_heads=12, position="rope",
                             compute_dtype="bfloat16", attention_backend="auto"))
    config.train.update(dict(seq_len=2048, batch_size=16))
  else:
    config.train.update(dict(seq_len=256, batch_size=8))
  config.train.update(dict(num_steps=60, warmup_steps=10, log_every=20, checkpoint_every=60,
                           eval_batches=1))
  config.eval.update(dict(lengths=(config.train.seq_len,), modes=("nonoverlapping",),
                          num_tokens=config.train.seq_len * 4, bootstrap_samples=10))
  return config
