"""Multi-query associative recall (Zoology, arXiv:2312.04927): recall against model width.

Key-value pairs, then queries of earlier keys at power-law gaps; accuracy over the answers.
Sweep: model width x sequence length x attention type, with num_kv_pairs = length / 8 and
evaluation at the training length (Zoology's Figure 2 axes).

  python -m experiments.run --config=configs/mqar.py:quick --workdir=runs/mqar
      widths 64 and 128, lengths 64 and 128, 5 mixers: 20 runs, about an hour on 2 CPU cores.
  python -m experiments.run --config=configs/mqar.py:full --workdir=runs/mqar   (one GPU)
"""

from configs import base

MIXERS = (("mha", "rope"), ("gqa", "rope"), ("linear", "rope"), ("mamba", "none"),
          ("retention", "none"))


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  config.data.update(dict(name="mqar", task_vocab_size=128, num_kv_pairs=8,
                          num_train_examples=100_000, num_eval_examples=512))
  config.model.update(dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, vocab_size=130))
  config.train.update(dict(seq_len=64, batch_size=64, learning_rate=1e-3, warmup_steps=100,
                           num_steps=1000 if preset == "quick" else 10_000, log_every=100,
                           checkpoint_every=1000))
  config.eval.update(dict(lengths=(64,), modes=("nonoverlapping",), batch_size=64))
  return config


def get_sweep(preset="quick"):
  widths = (64, 128) if preset == "quick" else (64, 128, 256, 512)
  lengths = (64, 128) if preset == "quick" else (64, 128, 256, 512)
  return [{"model.attention": attention, "model.position": position, "model.d_model": width,
           "train.seq_len": length,
           "data.num_kv_pairs": length // 8, "eval.lengths": (length,)}
          for attention, position in MIXERS for width in widths for length in lengths]
