"""Continue a prompt with a trained byte-level run, from its newest readable checkpoint.

  python -m experiments.generate --workdir=runs/demo/runs/mha_rope --prompt='def main(' \
      --max_new_tokens=200 [--temperature=0.8 --top_k=40 --seed=1] [--cache_length=4096]
  python -m experiments.generate --workdir=RUN --prompt=... --config.model.rope.scaling=yarn \
      --config.model.rope.scaling_factor=4

Greedy by default (--temperature=0). The prompt is prefilled in one pass, then each new token
is one jitted decode step (research.evaluation.generate). Prints the prompt and its continuation,
then the prefill and decode tokens/s (compilation excluded). Only settings that apply the same
weights differently may be changed with --config (research.evaluation.generate.GENERATION_FIELDS);
the run's own config.json gives everything else. Every check (the workdir, its checkpoint, the
settings, the lengths) comes before anything is restored or compiled.
"""

from absl import flags
from absl import logging
from ml_collections import config_flags

from configs import base
from experiments import cli
from research.evaluation import generate

_CONFIG = cli.config_flag(
    config_flags.DEFINE_config_dict, base.get_config(),
    f"Settings to change for generation: {', '.join(generate.GENERATION_FIELDS)}.")
_WORKDIR = cli.workdir_flag("A trained run's directory (config.json and "
                            "checkpoints/).")
_PROMPT = flags.DEFINE_string("prompt", None, "The text to continue (UTF-8 bytes).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 100, "Tokens (bytes) to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampling.")
_CACHE_LENGTH = flags.DEFINE_integer(
    "cache_length", 0, "Tokens the decode cache holds; 0: prompt + new tokens.")
flags.mark_flags_as_required(["workdir", "prompt"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  step, result = generate.generate_from_run(
      _WORKDIR.value, _PROMPT.value, _MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value, seed=_SEED.value, cache_length=_CACHE_LENGTH.value,
      overrides=config_flags.get_override_values(flags.FLAGS["config"]))
  print(_PROMPT.value + result.text, flush=True)
  decode = result.decode_tokens_per_second
  print(f"\ncheckpoint step {step}; prefill {len(result.prompt)} tokens in "
        f"{1e3 * result.prefill_seconds:.1f} ms ({result.prefill_tokens_per_second:,.0f} "
        f"tokens/s); decode {len(result.tokens) - 1} tokens in "
        f"{1e3 * result.decode_seconds:.1f} ms ("
        + ("n/a" if decode is None else f"{decode:,.1f} tokens/s")
        + f"); compile {result.compile_seconds:.1f} s", flush=True)


if __name__ == "__main__":
  cli.run(main)
