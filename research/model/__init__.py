"""The model and everything it is built from.

  transformer.py   the decoder LM: embeddings, the layer stack, the head (build_model, apply)
  attention/       the token mixers (softmax family on one attention core; recurrent family)
  positions/       the position schemes (told their geometry by the mixer that calls them)
  feed_forward/    MLP, SwiGLU, mixture of experts, RWKV channel mixes
  norms/           RMSNorm, LayerNorm
  nn.py            the shared layers (Dense with its initialisers)
  registry.py      the name -> class table every variant registers in
  flops.py         parameter and FLOP counts of a built model

Nothing is imported here: `from research.model import transformer` builds the model,
`from research.model import attention` reaches the mixers.
"""
