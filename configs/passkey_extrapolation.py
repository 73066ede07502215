"""Passkey retrieval beyond the training length for the mixers and position schemes whose papers
claim length extrapolation, beside MHA with RoPE: ALiBi (arXiv:2108.12409), CoPE
(arXiv:2405.18719), FoX (arXiv:2503.02130), stick-breaking attention (arXiv:2410.17980) and
PaTH attention (arXiv:2505.16381).

The passkey task and protocol of configs/long_context.py (byte models trained on the retrieval
task itself at random lengths up to train.seq_len and random depths, then evaluated at every
eval length x needle depth; exact match = every digit right), with CoPE's table at its
reference's training length + 1 (configs/attention_extrapolation.py `scaled_settings`).

  python -m experiments.run --config=configs/passkey_extrapolation.py:quick --workdir=runs/passkey
      6 variants, 1 seed, long_context's quick budget: 800 steps at 256 bytes, evaluation at
      256, 512 and 1024 bytes x 5 depths x 64 examples.
  python -m experiments.run --config=configs/passkey_extrapolation.py:full --workdir=runs/passkey
      3 seeds, 5000 steps at 1024, evaluation up to 16384 (for a GPU).
"""

from configs import attention_extrapolation
from configs import base
from configs import long_context

# (mixer, position): the claims, and MHA with RoPE as the baseline they are measured against.
VARIANTS = (("mha", "rope"), ("mha", "alibi"), ("mha", "cope"), ("fox", "none"),
            ("stickbreaking", "none"), ("path", "none"))


def get_config(preset="quick"):
  config = long_context.get_config(preset)
  config.model.learned.max_length = base.get_config().model.learned.max_length  # no member reads
  return config


def get_sweep(preset="quick"):
  base.check_preset(preset)
  seeds = (0,) if preset == "quick" else (0, 1, 2)
  settings = attention_extrapolation.scaled_settings(get_config(preset).train.seq_len)
  return [{"data.name": "passkey", "model.attention": mixer, "model.position": position,
           **settings.get(position, {}), "train.seed": seed}
          for mixer, position in VARIANTS for seed in seeds]
