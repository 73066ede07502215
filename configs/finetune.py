"""Fine-tune a run, an imported pretrained checkpoint's included: the run's own model, data and
evaluation settings, starting from its newest checkpoint (train.init_from) with a fresh
optimizer for train.num_steps steps.

  python -m experiments.train --config=configs/finetune.py:runs/smollm2 --workdir=runs/smollm2_ft \
      --config.train.num_steps=500 --config.train.seq_len=512 --config.train.learning_rate=3e-4

Every field can be overridden as usual; model fields that change the parameters are refused by
train.init_from's check (research/training/init_from.py), except fewer key/value heads (GQA
uptraining). train.num_steps starts at the default (200), not at the source's.
"""

import os

from configs import base
from research.runs import config_fields


def get_config(run_dir=""):
  if not run_dir:
    raise ValueError("give the run to fine-tune: --config=configs/finetune.py:RUN_DIR")
  config = config_fields.load_saved(os.path.expanduser(run_dir))
  config.train.init_from = os.path.abspath(os.path.expanduser(run_dir))
  config.train.num_steps = base.get_config().train.num_steps
  return config
