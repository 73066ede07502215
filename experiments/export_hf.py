"""Write a run of the lab as a Hugging Face checkpoint directory that transformers loads.

  python -m experiments.train --config=configs/base.py --workdir=runs/llama_like \
      --config.model.attention=gqa --config.model.num_kv_heads=2 --config.model.feed_forward=swiglu
  python -m experiments.export_hf --workdir=runs/llama_like --checkpoint=/tmp/llama_like_hf
  python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('/tmp/gqa_hf')"

The compatible subset: mha / mqa / gqa with rope (its scalings but static_ntk), swiglu and
rms_norm; projection biases none or all (LlamaForCausalLM), qkv (Qwen2ForCausalLM), or a sliding
window without biases (MistralForCausalLM). Anything else is refused, naming it, before anything
is written. Exports the newest readable checkpoint, or --step, with what transformers needs
besides: the run's tokenizer (an equivalent tokenizer.json for the lab's bytes), the special-token
ids in config.json and generation_config.json, and max_position_embeddings = the positions the
model was imported or trained with (docs/pretrained.md, research/pretrained/hf_tokenizer.py).
"""

from absl import flags
from absl import logging

from experiments import cli
from research.pretrained import convert

_CHECKPOINT = flags.DEFINE_string("checkpoint", None,
                                  "The new checkpoint directory (absent or empty).")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step to export; default: the newest.")
_WORKDIR = cli.workdir_flag("A trained run's directory (config.json and checkpoints/).")
flags.mark_flags_as_required(["checkpoint", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  convert.export_run(_WORKDIR.value, _CHECKPOINT.value, step=_STEP.value)


if __name__ == "__main__":
  cli.run(main)
