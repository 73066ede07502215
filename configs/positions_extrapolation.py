"""Position schemes for length extrapolation: MHA with every registered scheme, byte LM.

Train at L = 128 bytes, evaluate perplexity at L..16L with non-overlapping and sliding windows
(the protocol of configs/lm_extrapolation.py, whose presets this file starts from). The sweep
enumerates research.model.positions.REGISTRY, so a new scheme joins it with no edit here, plus
randomized positions (arXiv:2305.16843, model.randomize_max_length = 16L) over RoPE and learned
positions.

  python -m experiments.run --config=configs/positions_extrapolation.py:quick --workdir=runs/positions
      12 runs, 2 layers, d_model 128: about 20 minutes on 2 CPU cores.
  python -m experiments.run --config=configs/positions_extrapolation.py:full --workdir=runs/positions_full
      8 layers, d_model 512, bf16, 3 seeds each: for one GPU.
"""

from configs import base
from configs import lm_extrapolation
from research.model import positions

RANDOMIZED = ("rope", "learned")  # schemes also run with randomized training positions


def get_config(preset="quick"):
  base.check_preset(preset)
  config = lm_extrapolation.get_config(preset)
  config.eval.rope_scalings = ()  # configs/lm_extrapolation.py has the RoPE-scaling rows
  config.model.num_kv_heads = base.get_config().model.num_kv_heads  # no GQA member reads it
  return config


def get_sweep(preset="quick"):
  longest = max(get_config(preset).eval.lengths)
  seeds = (0,) if preset == "quick" else (0, 1, 2)
  runs = [{"model.position": p} for p in positions.REGISTRY]
  runs += [{"model.position": p, "model.randomize_max_length": longest} for p in RANDOMIZED]
  return [{"model.attention": "mha", **run, "train.seed": seed}
          for run in runs for seed in seeds]
