"""Convert a local Hugging Face checkpoint directory into a run directory of the lab.

  python -m experiments.import_hf --checkpoint=~/models/SmolLM2-135M --workdir=runs/smollm2 \
      [--config.data.name=text_dir --config.data.corpus_path='~/text/*.txt']

Reads config.json and *.safetensors (numpy and safetensors only; no torch) of a Llama-family
(llama, mistral, qwen2), GPT-2 or Mamba checkpoint and writes RUN/config.json, RUN/checkpoints/0,
RUN/imported.json and, when the checkpoint has a tokenizer.json, RUN/tokenizer (the run's
data.tokenizer, stored relative to the run: the run may be copied or moved) (research/pretrained).
train.seq_len is the checkpoint's context (what rotary scalings scale from); --config may set
data.*, train.* and eval.* fields. The run is then read as any run: experiments.evaluate,
generate, analyze and export_hf, and train.init_from. A setting the lab cannot represent
(another head_dim, a partial rotary factor, a window on some layers only) is refused, naming it,
before anything is written; so is a --workdir that holds anything.
"""

from absl import flags
from absl import logging
from ml_collections import config_flags

from configs import base
from experiments import cli
from research.pretrained import convert

_CONFIG = cli.config_flag(config_flags.DEFINE_config_dict, base.get_config(),
                          "data.*, train.* and eval.* settings of the new run.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A Hugging Face checkpoint directory.")
_WORKDIR = cli.workdir_flag("The new run directory (absent or empty).")
flags.mark_flags_as_required(["checkpoint", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  convert.import_checkpoint(_CHECKPOINT.value, _WORKDIR.value,
                            overrides=config_flags.get_override_values(flags.FLAGS["config"]))


if __name__ == "__main__":
  cli.run(main)
