"""Jamba-style hybrids (arXiv:2403.19887): Mamba layers with an attention layer among them and a
mixture of experts in every other layer's feed-forward, against the same stack with dense MLPs.

The paper's Jamba block is 8 layers, attention:Mamba 1:7 (the attention layer fifth), with a
mixture of experts (16 experts, top-2) in place of the MLP every other layer (e = 2: layers 1,
3, 5, 7), grouped-query attention and no position scheme: the `full` preset's pattern. Jamba's
experts are SwiGLU MLPs; its routing weights are the top-2 router probabilities, not
renormalised (model.moe.renormalize = False, as here; Mixtral renormalises). `quick` shrinks it
to 4 layers at 1:3 and 4 experts for CPUs. Each preset sweeps the feed-forward pattern: dense
MLPs in every layer, and an MoE every other layer.

  python -m experiments.run --config=configs/jamba.py:quick --workdir=runs/jamba
      2 runs of 300 steps (8 x 128 bytes each) on the embedded corpus: 2 min 52 s on 2 CPU
      cores with --parallel=2 (2026-12-01). Validation perplexity at 128 / 512 bytes: dense
      6.18 / 6.19, MoE 6.08 / 6.05 (one seed). The MoE run's metrics.jsonl also logs
      load_balancing_loss (top_k = 2 at balance; 2.02 at the end) and router_z_loss.
  python -m experiments.run --config=configs/jamba.py:full --workdir=runs/jamba_full
      the paper's block twice (16 layers, d_model 512, 16 experts, top-2), for one GPU.
"""

from configs import base

MAMBA_AND_ATTENTION = {"quick": ("mamba", "mamba", "mha", "mamba"),
                       "full": ("mamba",) * 4 + ("gqa",) + ("mamba",) * 3}


def get_config(preset="quick"):
  base.check_preset(preset)
  config = base.get_config()
  config.data.name = "stdlib_bytes"
  config.model.update(dict(layer_pattern=MAMBA_AND_ATTENTION[preset], position="none",
                           feed_forward_pattern=("mlp", "moe")))
  if preset == "quick":
    config.model.update(dict(num_layers=4, d_model=128, num_heads=4, num_kv_heads=4,
                             mlp_ratio=2))
    config.model.moe.update(dict(num_experts=4, top_k=2))
    config.model.mamba.update(dict(state_size=8, chunk_size=32))
    config.train.update(dict(num_steps=300, batch_size=8, seq_len=128, learning_rate=3e-3,
                             warmup_steps=30, log_every=50, checkpoint_every=300))
    config.eval.update(dict(lengths=(128, 512), modes=("nonoverlapping",), num_tokens=4096))
  else:
    config.model.update(dict(num_layers=16, d_model=512, num_heads=8, num_kv_heads=2))
    config.model.moe.update(dict(num_experts=16, top_k=2))
    config.train.update(dict(num_steps=20000, batch_size=32, seq_len=1024, learning_rate=1e-3,
                             warmup_steps=1000, log_every=200, checkpoint_every=2000))
    config.eval.update(dict(lengths=(1024, 4096, 16384), num_tokens=65536))
  return config


def get_sweep(preset="quick"):
  del preset
  return [{"model.feed_forward_pattern": ("mlp",)},
          {"model.feed_forward_pattern": ("mlp", "moe")}]
