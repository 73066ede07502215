"""Print the attention x position compatibility table with parameter counts, and the
feed-forwards with theirs (for the README).

  python -m experiments.variants [--config.model.d_model=256 ...]
"""

from absl import app
from flax import nnx
from ml_collections import config_flags

from research import attention
from research import feed_forward
from research import model as model_lib
from research import positions

_CONFIG = config_flags.DEFINE_config_file("config", "configs/base.py", "Config for the sizes.")


def main(argv):
  del argv
  config = _CONFIG.value.model
  print(f"Parameters at num_layers={config.num_layers}, d_model={config.d_model}, "
        f"num_heads={config.num_heads}, num_kv_heads={config.num_kv_heads} (gqa), "
        f"vocab_size={config.vocab_size}; KV cache / state bytes per sequence at 1024 tokens "
        f"(float32).\n")
  names = list(positions.REGISTRY)
  print("| attention | " + " | ".join(names) + " | parameters | cache bytes @1024 |")
  print("|---" * (len(names) + 3) + "|")
  for name, mixer_cls in attention.REGISTRY.items():
    supported = model_lib.compatible_positions(mixer_cls)
    config.attention = name
    config.position = supported[0]
    model = nnx.eval_shape(lambda: model_lib.build_model(config, rngs=nnx.Rngs(0)))
    marks = ["yes" if p in supported else "-" for p in names]
    print(f"| {name} | " + " | ".join(marks) +
          f" | {model_lib.count_params(model):,} | {model.cache_bytes(1, 1024):,} |")
  print("\nPosition schemes: the hooks each uses and the parameters it adds to that model (mha).\n")
  print("| position | hooks | parameters added | per layer |")
  print("|---|---|---|---|")
  config.attention, config.position = "mha", "none"
  plain = model_lib.count_params(nnx.eval_shape(lambda: model_lib.build_model(config, rngs=nnx.Rngs(0))))
  for name, scheme_cls in positions.REGISTRY.items():
    config.position = name
    model = nnx.eval_shape(lambda: model_lib.build_model(config, rngs=nnx.Rngs(0)))
    hooks = ", ".join(sorted(scheme_cls.hooks())) or "-"
    per_layer = "no" if scheme_cls.shared_across_layers else "yes"
    print(f"| {name} | {hooks} | {model_lib.count_params(model) - plain:,} | {per_layer} |")
  print("\nFeed-forwards (model.feed_forward, every layer; mha, no position scheme): parameters, "
        "and those a token's matmuls use (a mixture of experts runs top_k of its experts).\n")
  print("| feed-forward | hyperparameters | parameters | per token |")
  print("|---|---|---|---|")
  for name in feed_forward.REGISTRY:
    config.position, config.feed_forward = "none", name
    model = nnx.eval_shape(lambda: model_lib.build_model(config, rngs=nnx.Rngs(0)))
    settings = feed_forward.REGISTRY.settings(name, config)
    hyperparameters = ", ".join(f"{k}={v}" for k, v in settings.items()) or "-"
    print(f"| {name} | {hyperparameters} | {model_lib.count_params(model):,} | "
          f"{model_lib.count_params(model, embeddings=False):,} |")



if __name__ == "__main__":
  app.run(main)
