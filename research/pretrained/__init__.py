"""Pretrained checkpoints in the lab: Hugging Face checkpoint directories in and out.

  hf_config   a checkpoint's config.json <-> the lab's model config (per family)
  hf_weights  its tensors (numpy, from *.safetensors) <-> the lab's parameters (per family)
  convert     a checkpoint directory -> a run directory (config.json + orbax checkpoint 0) that
              experiments.evaluate / generate / analyze and train.init_from read as any run,
              and a run -> a checkpoint directory that transformers loads

Families: llama (Llama 2 / 3, Mistral, Qwen2: RoPE and its scalings, MHA / GQA / MQA, SwiGLU,
RMSNorm, optional biases, tied or untied embeddings, Mistral's sliding window), gpt2 (learned
positions, LayerNorm, GELU MLP with biases, fused c_attn) and mamba (MambaForCausalLM). Reading
needs numpy and safetensors only; transformers and torch only for the tests that compare logits.
"""
