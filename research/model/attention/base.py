"""The interface every sequence mixer implements, and the helpers the mixers share.

Shape letters used in names throughout research/model/attention and research/model/positions:
  B batch   L, T length of the sequence / of the new tokens   S key length   D d_model
  N query heads   K key/value heads   G query heads per key/value head (N / K)   H head dim
  E inner width (Mamba)   F feature or hidden width   C chunk or block length.

A mixer maps [batch, length, d_model] to the same shape, causally. It supports
  * full-sequence forward `__call__(x, positions)` for training and evaluation,
  * incremental decode `decode(x, cache, index)` from `init_cache(batch, max_length)`, for one or
    more new tokens at sequence positions index, index + 1, ..., and with `documents` for packed
    documents where `document_decode_refusal` gives None,
  * (rarely) `call_with_carry` / `decode_with_carry`, for what a layer leaves to later layers,
  * `cache_bytes(batch, context_length)`: the size of that cache, read off its shapes,
  * `mixing_flops_per_token(context_length)`: forward FLOPs per token that are not parameter
    matmuls (those are counted as 2 per parameter by `research.model.flops`).
It calls the position scheme's hooks unconditionally (research/model/positions/base.py) and declares
in `position_hooks` which of {qk, bias, context} it can honour (the embedding hook is the
model's; context: a contextual score over each query's whole row, CoPE); its
hyperparameters are `hyperparameters` (defaults), read from the config sub-dict given at
registration (research/model/registry.py) and checked by `validate`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from research.model import nn
from research.model import positions


class Mixer(nnx.Module):
  """Base of every sequence mixer. Its class attributes and classmethods are the mixer's
  capabilities, read by the model, the benchmarks, the analyses and the conformance suite (none
  of them tests a mixer's class or attributes otherwise); each has a default here."""

  hyperparameters = {}
  # Small settings for the conformance suite (tests/): a subset of hyperparameters that keeps a
  # tiny model fast, and a chunked form's chunk small enough that the test length spans at
  # least three chunks (see `chunk_length`).
  test_settings = {}
  # Position hooks this mixer applies besides the model's embedding term: a subset of
  # {qk, bias, context}.
  position_hooks = frozenset()
  # Values of model.attention_backend this mixer implements; () if it has a single path.
  backends = ()
  # A recurrent mixer carries order in its state, so in a hybrid it can sit beside layers that
  # take a qk or bias position scheme, and runs without it.
  recurrent = False
  # Whether `attention_weights` gives the mixer's attention probabilities (the attention-map,
  # induction and explanation analyses need them).
  has_attention_weights = False
  # Whether model.<settings>.window / .sinks give it a sliding window with a rolling cache.
  supports_sliding_window = False
  # Whether it reads model.num_kv_heads (GQA); others fix their key/value heads themselves.
  reads_num_kv_heads = False

  @classmethod
  def validate(cls, settings, model_config):
    """Raise ValueError, naming what is valid, if this mixer cannot be built from the config.

    The model checks what all mixers share (names, head counts, position support) first.
    """
    del settings, model_config

  @classmethod
  def position_geometry(cls, settings, model_config, layer_index=0):
    """The geometry of the queries and keys this mixer hands its position scheme (heads, head
    dim, rotary dims, layer index); the scheme is built and validated for it. By default
    model.num_heads heads of d_model / num_heads dims, all of them rotating."""
    del settings
    d, heads = model_config.d_model, model_config.num_heads
    return positions.Geometry(d, heads, d // heads, d // heads, layer_index)

  @classmethod
  def kv_heads(cls, model_config):
    """Key/value heads of a layer (softmax attention), or None for a mixer without them."""
    del model_config
    return None

  @classmethod
  def cache_bytes_per_token(cls, model_config):
    """Decode-cache bytes per token and layer for a cache that grows with the context (a KV
    cache), or None for a state of fixed size."""
    del model_config
    return None

  @classmethod
  def document_decode_refusal(cls, settings):
    """Why `decode` cannot take packed documents (`documents`, masks.DecodeDocuments: a new
    document may start at any token of any row), or None where it can. The model refuses a
    document cache naming the mixers that give a reason (LanguageModel.init_cache)."""
    del settings
    return "its decode has no document boundaries"

  @classmethod
  def chunk_length(cls, settings):
    """Tokens per chunk (or block) of the chunked form that carries a state from chunk to chunk,
    or None for a mixer without one: the conformance suite runs >= 3 of them."""
    size = settings.get("chunk_size")
    return None if size is None else int(size)

  def __call__(self, x_BxLxD, positions_BxL, segments_BxL=None):
    raise NotImplementedError

  def attention_weights(self, x_BxLxD, positions_BxL, segments_BxL=None):
    """The attention probabilities [B, N, L, L] of `__call__` (has_attention_weights)."""
    raise NotImplementedError(f"{type(self).__name__} has no attention weights")

  def head_output_projection(self):
    """The output projection if it mixes heads (a kernel [N, H, D] whose first logical axis is
    "heads"), else None: head importance and pruning mask its rows."""
    out = getattr(self, "out", None)
    axes = None if out is None else out.kernel.get_metadata().get("logical_axes")
    return out if axes and axes[0] == "heads" else None

  def kv_group_size(self):
    """Query heads that share each key/value head (N / K), 1 for a mixer without them."""
    return 1

  def init_cache(self, batch_size, max_length):
    raise NotImplementedError

  def decode(self, x_BxTxD, cache, index, documents=None):
    """(outputs [B, T, D], the cache) of T new tokens at indices index.. index + T - 1; with
    `documents` (only where document_decode_refusal gives None), of packed documents."""
    raise NotImplementedError

  # Values that one layer leaves for the later layers of the same forward pass or decode step
  # (RWKV-7's value residual reads the first layer's values): the model threads a dict, the
  # carry, through its blocks, which call these two; a mixer that shares nothing keeps the
  # defaults, which pass the carry on untouched. Called alone (__call__, decode), a mixer
  # computes as it would as the first layer to use the carry.
  def call_with_carry(self, x_BxLxD, positions_BxL, segments_BxL, carry):
    return self(x_BxLxD, positions_BxL, segments_BxL), carry

  def decode_with_carry(self, x_BxTxD, cache, index, carry, documents=None):
    kept = {} if documents is None else {"documents": documents}
    return (*self.decode(x_BxTxD, cache, index, **kept), carry)

  def mixing_flops_per_token(self, context_length):
    raise NotImplementedError

  def cache_bytes(self, batch_size, context_length):
    return nn.tree_bytes(nn.cache_shapes(self, batch_size, context_length))


def check_kv_heads(num_heads, num_kv_heads):
  """Raise ValueError, naming the valid counts, unless num_kv_heads divides num_heads (GQA)."""
  if num_kv_heads < 1 or num_heads % num_kv_heads:
    divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}; "
                     f"valid: {divisors}")


def states_entering_chunks(h0, decays, added, axis):
  """h_z = decays_z * h_{z-1} + added_z over the chunks z along `axis` of `added`, from h0 (the
  state entering chunk 0); `decays` has added's rank, with its chunk axis at `axis` too, and
  broadcasts against it. A scan of the small state alone, for chunked forms that compute every
  chunk at once. Returns (the state entering each chunk, shaped like `added`; the state after
  the last chunk)."""

  def step(h, decay_and_added):
    decay, add = decay_and_added
    return decay * h + add, h

  final, entering = jax.lax.scan(step, h0, (jnp.moveaxis(decays, axis, 0),
                                            jnp.moveaxis(added, axis, 0)))
  return jnp.moveaxis(entering, 0, axis), final


def head_projection(d_model, heads, head_dim, heads_axis, *, rngs, dtype,
                    init=nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)), bias=False):
  """x [B, L, D] -> [B, L, heads, H], the kernel's axes (embed, heads_axis, head_dim); with
  `bias` plus a [heads, H] bias (zeros at init).

  The default init is LeCun normal with fan-in d_model (the kernel's first axis), as a
  [D, heads * H] dense layer; plain lecun_normal() would read the [D, heads, H] kernel as fan-in
  heads * D and start every head sqrt(heads) too small."""
  return nn.dense("BLD,DNH->BLNH", (d_model, heads, head_dim), ("embed", heads_axis, "head_dim"),
                  rngs=rngs, dtype=dtype, init=init,
                  bias_shape=(heads, head_dim) if bias else None,
                  bias_axes=(heads_axis, "head_dim") if bias else None)


def output_projection(heads, head_dim, d_model, *, rngs, dtype,
                      init=nnx.initializers.lecun_normal(), bias=False):
  """[B, L, N, H] -> [B, L, D] (with `bias`, plus a [D] bias)."""
  return nn.dense("BLNH,NHD->BLD", (heads, head_dim, d_model), ("heads", "head_dim", "embed"),
                  rngs=rngs, dtype=dtype, init=init, bias_shape=(d_model,) if bias else None,
                  bias_axes=("embed",) if bias else None)


def new_positions(index, num_tokens):
  """Positions [1, T] of T new tokens that follow `index` cached ones."""
  return (index + jnp.arange(num_tokens))[None]


def no_refusal(cls, settings):
  """`document_decode_refusal` of a mixer whose decode takes packed documents."""
  del cls, settings


def decode_positions(index, num_tokens, documents=None):
  """(token indices [1, T], positions [B | 1, T], segment ids [B, T] or None) of T new tokens
  at `index`: the positions are the token indices, or with `documents` (masks.DecodeDocuments)
  their indices within their documents."""
  index_1xT = new_positions(index, num_tokens)
  if documents is None:
    return index_1xT, index_1xT, None
  return index_1xT, documents.positions_BxT, documents.segments_BxT


def decode_inputs(mixer, x_BxTxD, cache, index, documents=None):
  """(cache, positions [B | 1, T], segment ids [B, T] or None) with which a recurrent mixer's
  chunked form decodes T new tokens at `index` (`decode_positions`); with `documents` the cache
  restarted (init_cache's) in the rows whose first new token starts a document: the chunked
  form restarts at the later starts, its cache belonging to the first token's segment."""
  _, positions_BxT, segments_BxT = decode_positions(index, x_BxTxD.shape[1], documents)
  if documents is not None:
    cache = documents.restarted(cache, mixer.init_cache(x_BxTxD.shape[0], 0))
  return cache, positions_BxT, segments_BxT
