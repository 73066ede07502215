"""Multi-query associative recall (Zoology, arXiv:2312.04927): recall against model width.

Key-value pairs, then queries of earlier keys at power-law gaps; accuracy over the answers.
Sweep (Zoology's Figure 2 axes): every mixer in research.model.attention.REGISTRY (with RoPE where
it takes it; the quick preset leaves out mqa and gqa, registered as head-count variants of mha;
sigmoid attention with its bias at -log of the training length), MHA with each length-aware
scheme (SSMax) x
model width x (sequence length, number of key-value pairs), evaluated at the training length;
width.png draws accuracy against width, one panel per (length, pairs), with 95% bootstrap
intervals. Published trend: attention near 1.0 at every width; linear attention and
SSMs need more width as the number of pairs grows.

  python -m experiments.run --config=configs/mqar.py:quick --workdir=runs/mqar
      each mixer's code once x widths 32, 64 x (length, pairs) in (64, 4), (128, 8): 4 runs of 400
      steps of 128 examples (learning rate 3e-3) per mixer, one head, 32 symbols (16 keys, 16
      values). 104 runs (26 mixers and schemes): the 84 of the 21 older ones took about 160
      minutes with --parallel=2 on 2 CPU cores (1.9 minutes a run, 2026-12-01 and -02), the 20
      added on 2026-12-05 62 minutes (log_linear_mamba2 and mamba3 the slowest). Attention solves (64, 4) at both widths and (128, 8) at
      width 64; the delta-rule mixers, RWKV-6 and RWKV-7 solve both; the other fixed-state
      mixers need width and lose accuracy at (128, 8) (results in docs/results.md).
      The small vocabulary is what lets recall form within a CPU budget: with 128 symbols MHA
      at width 64 was still far from recall after 400 such steps (loss 3.31), with 32 it solves
      (64, 4) by step 200 (probes of 2026-12-01, README). One head follows Zoology's attention
      baseline.
  python -m experiments.run --config=configs/mqar.py:full --workdir=runs/mqar   (one GPU)
      widths 64..512 x lengths 64..512 x pairs length / 16 and length / 8; 128 symbols, 4 heads
      (so that mqa and gqa differ from mha), 10,000 steps of 64.
"""

from configs import base
from configs import sweeps
from research.model import positions

CELLS = {"quick": ((64, 4), (128, 8)),
         "full": tuple((length, length // k) for length in (64, 128, 256, 512) for k in (16, 8))}
WIDTHS = {"quick": (32, 64), "full": (64, 128, 256, 512)}


def get_config(preset="quick"):
  base.check_preset(preset)
  quick = preset == "quick"
  config = base.get_config()
  task_vocab_size = 32 if quick else 128
  config.data.update(dict(name="mqar", task_vocab_size=task_vocab_size, num_kv_pairs=8,
                          num_train_examples=20_000 if quick else 100_000,
                          num_eval_examples=256 if quick else 512))
  config.model.update(dict(num_layers=2, d_model=64, num_heads=1 if quick else 4,
                           vocab_size=task_vocab_size + 2))
  # The mixers that read model.num_kv_heads (gqa, nsa, path): one in quick's one head, two of
  # full's four (so that gqa differs from mha and mqa).
  config.model.num_kv_heads = 1 if quick else 2
  config.train.update(dict(seq_len=64, batch_size=128 if quick else 64,
                           learning_rate=3e-3 if quick else 1e-3,
                           warmup_steps=40 if quick else 100,
                           num_steps=400 if quick else 10_000, log_every=100,
                           checkpoint_every=400 if quick else 1000))
  config.eval.update(dict(lengths=(64,), batch_size=64))
  return config


def mixers(preset):
  return sweeps.every_mixer_family() if preset == "quick" else sweeps.every_mixer()


def length_schemes():
  """(mha, position) for every position scheme that scales each row of logits by a function of
  its length (SSMax): a scheme, not a mixer, so every_mixer does not list it."""
  return [("mha", name) for name, cls in sorted(positions.REGISTRY.items())
          if positions.LENGTH in cls.hooks()]


def member_settings(attention, length):
  """A member's settings that follow its training length: sigmoid attention's bias -log L."""
  return {"model.sigmoid.bias_length": length} if attention == "sigmoid" else {}


def get_sweep(preset="quick"):
  base.check_preset(preset)
  return [{"model.attention": attention, "model.position": position, "model.d_model": width,
           "train.seq_len": length, "data.num_kv_pairs": pairs, "eval.lengths": (length,),
           **member_settings(attention, length)}
          for attention, position in mixers(preset) + length_schemes()
          for width in WIDTHS[preset] for length, pairs in CELLS[preset]]
