"""Conformance suite: every registered attention type x compatible position x CPU backend, and
every feed-forward.

Adding a variant to research.model.attention.REGISTRY (or a scheme to
research.model.positions.REGISTRY) adds it here: shapes and dtypes, causality, finite gradients,
prefill in chunks then decode == full forward (state carried across chunks), a packed row of
documents == each document alone (and, where the mixer's decode takes documents, == the row
decoded from a document cache), and the same logits under an 8-device mesh with the sharding
rules (for each mixer, each scheme and each feed-forward: what sharding depends on). Every mixer
that supports a sliding window also runs with one, with and without sinks (the rolling decode
cache), and so does every scheme the model accepts with a window (`_windowed`: derived from the
capabilities, no list of schemes kept here). Each feed-forward besides the MLP (research.model.feed_forward.REGISTRY) runs once, with
the first mixer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention, positions
from research.model import transformer as model_lib
from research.model import sharding
from research.model.attention import core
from research.model import feed_forward as feed_forward_lib
from tests.conftest import tiny_model_config

# Not multiples of the block / chunk size 8; the second chunk (6 tokens, written at index 6) is
# longer than the window of 5, so it wraps the rolling cache within one write. The two chunks
# have one shape: one scan step serves both (an empty cache takes the sequence path inside it),
# another the single tokens, in one compiled program.
BATCH, LENGTH, PREFILL, SECOND_CHUNK = 4, 19, 6, 6
ONE_DOCUMENT = np.zeros((BATCH, LENGTH), np.int32)  # segment ids of rows of one document each
CPU_BACKENDS = ("xla", "blockwise")
# Packed documents of lengths 6, 9, 4 / 3, 16 / 11, 8 / 8, 1, 10: they start inside chunks of 8,
# span chunk boundaries, and one is a single token; decoded (two prefill chunks of 6, then single
# tokens), one starts at a chunk's first token (6), inside the prefill into an empty cache (3),
# inside a chunk after cached tokens (8, 9), at the last token of a chunk, going on in the next
# call (11), and at a single token (15).
SEGMENTS = np.array([[0] * 6 + [1] * 9 + [2] * 4, [0] * 3 + [1] * 16, [0] * 11 + [1] * 8,
                     [0] * 8 + [1] + [2] * 10], np.int32)
# A sliding window of 5 keys (with 2 sinks or none): whole tiles of 8 are skipped, and the
# rolling decode cache of sinks + window slots wraps around.
WINDOW = 5


def _builds(name, position, backend, window):
  """Whether the model validates this combination (research.model.transformer.validate): the
  capabilities the mixer and the scheme declare decide, not a list kept here."""
  settings = {attention.REGISTRY.settings_key(name): dict(window=window[0], sinks=window[1])}
  try:
    model_lib.validate(tiny_model_config(attention=name, position=position,
                                         attention_backend=backend or "xla", **settings))
  except ValueError:
    return False
  return True


def _windowed():
  """(mixer, scheme, backend, (window, sinks)) derived from the capabilities: every mixer that
  supports a sliding window (Mixer.supports_sliding_window) with 2 sinks and with none, its
  applied schemes (none, and one per set of hooks it applies) and CPU backends in turn; and the
  first such mixer (mha) with every scheme it is compatible with, with sinks, on every CPU
  backend that runs the scheme where the scheme enters the score path: a new scheme runs with
  windows, sinks and, through every test of VARIANTS, packed documents and decoding in the
  rolling cache, wherever the model accepts the combination."""
  cases = []
  names = [name for name, cls in attention.REGISTRY.items() if cls.supports_sliding_window]
  for index, name in enumerate(names):
    cls = attention.REGISTRY[name]
    schemes = _applied_positions(1, cls)  # none and the schemes whose hooks it applies
    backends = [b for b in cls.backends if b in CPU_BACKENDS] or [None]
    for turn, sinks in enumerate((2, 0)):
      cases.append((name, schemes[(index + turn) % len(schemes)],
                    backends[(index + turn) % len(backends)], (WINDOW, sinks)))
  first = attention.REGISTRY[names[0]]
  backends = [b for b in first.backends if b in CPU_BACKENDS] or [None]
  for turn, position in enumerate(model_lib.compatible_positions(first)):
    runs_on = _backends_for(position, backends)
    for backend in (runs_on if _in_score_path(position) else runs_on[turn % len(runs_on):][:1]):
      case = (names[0], position, backend, (WINDOW, 2))
      if case not in cases:
        cases.append(case)
  return [case for case in cases if _builds(*case)]



def _applies(mixer_cls, position):
  """Whether the mixer itself applies one of the scheme's hooks (the embedding term is added by
  the model, the same for every mixer)."""
  return bool(positions.REGISTRY[position].hooks() & mixer_cls.position_hooks)


def _applied_positions(index, mixer_cls):
  """The schemes a mixer runs with: every compatible one for the first mixer, `none` and each
  scheme whose hooks it applies for the others (the embedding-only schemes, sinusoidal and
  learned, are the model's term, the same for every mixer)."""
  return [p for p in model_lib.compatible_positions(mixer_cls)
          if not index or p == "none" or _applies(mixer_cls, p)]


def _backends_for(position, backends):
  """The mixer's backends that run the scheme: a contextual one (CoPE) needs whole rows of
  logits, which blockwise does not give (research.model.attention.core.CONTEXTUAL_BACKENDS)."""
  if positions.CONTEXT not in positions.REGISTRY[position].hooks():
    return backends
  return [b for b in backends if b in core.CONTEXTUAL_BACKENDS]


def _in_score_path(position):
  """Whether the scheme's hooks enter the backend's score computation (a bias, CoPE's
  contextual positions, a length-aware scale), where each backend has code of its own for it;
  an embedding term and a rotation of q and k happen before the backend, the same for every
  backend."""
  return bool(positions.REGISTRY[position].hooks() & positions.SCORE_HOOKS)


WINDOWED = _windowed()


def _variants():
  """The first mixer (mha) x every compatible scheme, on every CPU backend where the scheme
  enters the score path (_in_score_path), on the first otherwise; every other mixer x `none` x
  CPU backend, and x one scheme per set of hooks it applies (the first registered: rope for qk,
  alibi for bias) on its first CPU backend: the schemes' own code runs in full with mha, a
  mixer's use of a hook does not depend on which scheme fills it or on the backend (the core's
  backends compute the same attention for every score function and mask: test_kernels.py; a
  mixer's own per-backend code is tested on each backend by its reference test).
  test_every_scheme_a_mixer_applies_builds_and_traces builds and traces every other pair."""
  for index, (name, mixer_cls) in enumerate(attention.REGISTRY.items()):
    backends = [b for b in mixer_cls.backends if b in CPU_BACKENDS] or [None]
    seen_hooks = set()
    for position in _applied_positions(index, mixer_cls):
      hooks = positions.REGISTRY[position].hooks()
      if index and hooks in seen_hooks:
        continue
      seen_hooks.add(hooks)
      runs_on = _backends_for(position, backends)
      every_backend = position == "none" or (not index and _in_score_path(position))
      for backend in (runs_on if every_backend else runs_on[:1]):
        yield pytest.param(name, position, backend, None, "mlp",
                           id="-".join(x for x in (name, position, backend) if x))
  for name, position, backend, (window, sinks) in WINDOWED:
    yield pytest.param(name, position, backend, (window, sinks), "mlp",
                       id=f"{name}-{position}-{backend or 'xla'}-window{window}-sinks{sinks}")
  for name in feed_forward_lib.REGISTRY:
    if name != "mlp":
      yield pytest.param("mha", "rope", "xla", None, name, id=f"mha-rope-xla-{name}")


VARIANTS = list(_variants())
PARAMETERS = "name,position,backend,window,feed_forward"


# One variant's programs at a time (tests/conftest.py runs a variant's tests one after the
# other): every compiled program keeps its machine code in memory maps of its own, and the
# suite's ~400 programs kept alive together came near the kernel's limit of 65530 maps per
# process (vm.max_map_count), past which XLA crashed the test process with a segmentation fault.
@functools.lru_cache(maxsize=1)
def _compiled(name, position, backend, window=None, feed_forward="mlp"):
  """The variant's state and jitted functions: (gradient, logits) of a batch with segment ids;
  the forward pass (compiled on the mesh by the SHARDED variants only); and decoding a whole
  batch from an empty cache, in two prefill chunks then one token at a time (logits, final cache
  index), of rows of one document each, or of packed documents (compiled by the
  DOCUMENT_DECODED variants only). Two programs per variant on one device, three for the
  DOCUMENT_DECODED ones (compiling dominates the suite's time)."""
  settings = ({} if window is None else
              {attention.REGISTRY.settings_key(name): dict(window=window[0], sinks=window[1])})
  config = tiny_model_config(attention=name, position=position, feed_forward=feed_forward,
                             attention_backend=backend or "xla", **settings)
  graphdef, state = nnx.split(research.build_model(config, rngs=nnx.Rngs(0)))

  def forward(state, tokens, segments):
    return nnx.merge(graphdef, state)(tokens, segments_BxL=segments)

  def loss_and_logits(state, tokens, segments):
    logits = forward(state, tokens, segments)
    loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                         tokens[:, 1:, None], -1))
    return loss, logits

  def decode(state, tokens, segments=None):
    """Without segments a plain cache; with them (packed documents) a document cache."""
    model = nnx.merge(graphdef, state)

    def step(cache, chunk):
      logits, cache = model.decode(*chunk, cache) if segments is None else model.decode(
          chunk[0], cache, chunk[1])
      return cache, logits

    middle = PREFILL + SECOND_CHUNK
    per_token = (tokens,) if segments is None else (tokens, segments)
    chunks = [x[:, :middle].reshape(BATCH, 2, PREFILL).swapaxes(0, 1) for x in per_token]
    cache = model.init_cache(BATCH, LENGTH, documents=segments is not None)
    cache, chunk_logits = jax.lax.scan(step, cache, chunks)
    cache, token_logits = jax.lax.scan(step, cache, [x[:, middle:].T[:, :, None]
                                                     for x in per_token])
    logits = [jnp.concatenate(list(chunk_logits), axis=1)] + list(token_logits)
    return jnp.concatenate(logits, axis=1), cache["index"]

  grad_and_logits = jax.jit(jax.grad(loss_and_logits, has_aux=True))
  return state, grad_and_logits, jax.jit(forward), jax.jit(decode)


def _tokens(seed=0, vocab=61):
  return jax.random.randint(jax.random.key(seed), (BATCH, LENGTH), 0, vocab)


@pytest.mark.parametrize(PARAMETERS, VARIANTS)
def test_shapes_causality_and_gradients(name, position, backend, window, feed_forward):
  state, grad_and_logits, _, _ = _compiled(name, position, backend, window, feed_forward)
  tokens = _tokens()
  grads, logits = grad_and_logits(state, tokens, ONE_DOCUMENT)
  assert logits.shape == (BATCH, LENGTH, 61) and logits.dtype == jnp.float32
  assert bool(jnp.isfinite(logits).all())
  # Causality: changing token j changes no logits before j, and does change logits from j on.
  j = 11
  _, changed = grad_and_logits(state, tokens.at[:, j].set((tokens[:, j] + 1) % 61), ONE_DOCUMENT)
  np.testing.assert_allclose(changed[:, :j], logits[:, :j], atol=1e-5, rtol=0)
  assert float(jnp.abs(changed[:, j:] - logits[:, j:]).max()) > 1e-4
  grads = jax.tree.leaves(grads)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)
  assert sum(float(jnp.abs(g).sum()) for g in grads) > 0


@pytest.mark.parametrize(PARAMETERS, VARIANTS)
def test_prefill_in_chunks_then_decode_matches_full_forward(name, position, backend, window,
                                                            feed_forward):
  """forward([a; b; c...]) == prefill(a), prefill(b) from a's state, then one token at a time
  (decoding passes no segment ids; the forward pass, rows of one document each)."""
  state, grad_and_logits, _, decode = _compiled(name, position, backend, window, feed_forward)
  tokens = _tokens(1)
  expected = grad_and_logits(state, tokens, ONE_DOCUMENT)[1]
  logits, index = decode(state, tokens)
  np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=2e-4)
  assert int(index) == LENGTH


# Sharding depends on the parameters' logical axes: each mixer's own (run with `none`), each
# scheme's own (run with the first mixer) and each feed-forward's. These variants run their
# forward pass on an 8-device mesh with the sharding rules: the packed-documents test below, and
# the sharded == unsharded check against the unsharded gradient program's logits.
def _sharded():
  """The first variant (without a window) of each mixer with `none`, of the first mixer with
  each scheme, and of each feed-forward."""
  first, seen = VARIANTS[0].values[0], set()
  for variant in VARIANTS:
    name, position, _, window, feed_forward = variant.values
    if window is not None:
      continue
    if feed_forward != "mlp":
      key = ("feed_forward", feed_forward)
    elif position == "none":
      key = ("mixer", name)
    elif name == first:
      key = ("scheme", position)
    else:
      continue
    if key not in seen:
      seen.add(key)
      yield variant


SHARDED = list(_sharded())
_SHARDED_VALUES = {tuple(v.values) for v in SHARDED}


def _on_mesh(state, forward):
  """forward(tokens, segments) on the mesh with the sharding rules, and the sharded state (to
  check that something was sharded)."""
  mesh = sharding.make_mesh((2, 2, 2))
  sharded_state = jax.device_put(state, sharding.state_shardings(state, mesh))

  def run(tokens, segments):
    with jax.set_mesh(mesh):
      return forward(sharded_state, jax.device_put(tokens, sharding.batch_sharding(mesh)),
                     jax.device_put(jnp.asarray(segments), sharding.batch_sharding(mesh)))

  return run, sharded_state


@pytest.mark.parametrize(PARAMETERS, VARIANTS)
def test_packed_documents_equal_each_document_alone(name, position, backend, window, feed_forward):
  """A row of packed documents (segment ids, positions restarting per document) gives each
  document the logits it gets alone, at the start of a row (causality makes what follows it in
  that row irrelevant, so one compiled shape serves every document; a row of one segment is a
  document alone). On the mesh for the SHARDED variants, the gradient program's logits for the
  others: no program is compiled for this test alone."""
  state, grad_and_logits, forward, _ = _compiled(name, position, backend, window, feed_forward)
  if (name, position, backend, window, feed_forward) in _SHARDED_VALUES:
    run, _ = _on_mesh(state, forward)
  else:
    run = lambda tokens, segments: grad_and_logits(state, tokens, segments)[1]  # noqa: E731
  tokens = _tokens(3)
  packed = run(tokens, SEGMENTS)
  for row, segments in enumerate(SEGMENTS):
    starts = [int(np.argmax(segments == s)) for s in np.unique(segments)]
    alone = run(jnp.stack([jnp.roll(tokens[row], -start) for start in starts]
                          + [tokens[row]] * (BATCH - len(starts))), ONE_DOCUMENT)
    for i, start in enumerate(starts):
      end = start + int((segments == segments[start]).sum())
      np.testing.assert_allclose(packed[row, start:end], alone[i, :end - start],
                                 atol=2e-5, rtol=2e-5)
  unpacked = run(tokens, ONE_DOCUMENT)  # the segments made a difference
  assert float(jnp.abs(unpacked[0, 6:] - packed[0, 6:]).max()) > 1e-4


def _decodes_documents(name, window):
  """Whether the mixer's decode takes packed documents with these window settings."""
  settings = ({} if window is None else
              {attention.REGISTRY.settings_key(name): dict(window=window[0], sinks=window[1])})
  config = tiny_model_config(attention=name, **settings)
  return attention.REGISTRY[name].document_decode_refusal(
      attention.REGISTRY.settings(name, config)) is None


# Packed documents decoded (Mixer.document_decode_refusal is None): each such mixer with `none`,
# the first mixer with each scheme (positions restart at each document), each feed-forward (a
# feed-forward with a cache keeps each document's), and each window, with sinks (each row's
# rolling cache keeps its open document's) and without.
DOCUMENT_DECODED = [v for v in SHARDED + [w for w in VARIANTS if w.values[3]]
                    if _decodes_documents(v.values[0], v.values[3])]


@pytest.mark.parametrize(PARAMETERS, DOCUMENT_DECODED)
def test_packed_documents_decode_as_the_packed_forward(name, position, backend, window,
                                                       feed_forward):
  """forward(tokens, SEGMENTS) == the same rows decoded in two prefill chunks then one token at
  a time from a document cache (init_cache(..., documents=True)), documents starting where
  SEGMENTS says (a chunk's first or last token, inside one, at a single token)."""
  state, grad_and_logits, _, decode = _compiled(name, position, backend, window, feed_forward)
  tokens = _tokens(3)
  expected = grad_and_logits(state, tokens, SEGMENTS)[1]
  logits, index = decode(state, tokens, jnp.asarray(SEGMENTS))
  np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=2e-4)
  assert int(index) == LENGTH


def test_every_mixer_that_decodes_documents_is_decoded_with_them():
  """Each mixer whose decode takes packed documents (at its test settings) runs the test above;
  each other one says why not (tests/test_decode_documents.py: it refuses a document cache by
  name)."""
  decoded = {v.values[0] for v in DOCUMENT_DECODED}
  for name, mixer_cls in attention.REGISTRY.items():
    if name not in decoded:
      config = tiny_model_config(attention=name)
      reason = mixer_cls.document_decode_refusal(attention.REGISTRY.settings(name, config))
      assert isinstance(reason, str) and reason, name


@pytest.mark.parametrize(PARAMETERS, SHARDED)
def test_sharded_equals_unsharded(name, position, backend, window, feed_forward):
  """The forward pass on the mesh (one document per row) gives the unsharded logits (of the
  gradient program)."""
  state, grad_and_logits, forward, _ = _compiled(name, position, backend, window, feed_forward)
  tokens = _tokens(2)
  expected = grad_and_logits(state, tokens, ONE_DOCUMENT)[1]
  run, sharded_state = _on_mesh(state, forward)
  logits = run(tokens, ONE_DOCUMENT)
  specs = [x.sharding.spec for x in jax.tree.leaves(sharded_state)]
  assert any(any(axis is not None for axis in spec) for spec in specs), "nothing was sharded"
  np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=2e-5)


def test_every_registered_name_is_covered():
  covered = {v.values[0] for v in VARIANTS}
  assert covered == set(attention.REGISTRY)
  assert {"mha", "mqa", "gqa", "linear", "mamba"} <= covered
  for index, (name, mixer_cls) in enumerate(attention.REGISTRY.items()):
    run = {v.values[1] for v in VARIANTS if v.values[0] == name}
    applied = _applied_positions(index, mixer_cls)
    assert ({positions.REGISTRY[p].hooks() for p in run}
            == {positions.REGISTRY[p].hooks() for p in applied}), name
  first = next(iter(attention.REGISTRY))
  embedding_only = {p for p, cls in positions.REGISTRY.items() if cls.hooks() == {positions.EMBED}}
  assert embedding_only <= {v.values[1] for v in VARIANTS if v.values[0] == first}
  sharded = [v.values for v in SHARDED]  # what sharding depends on, each once
  assert {v[0] for v in sharded} == set(attention.REGISTRY)
  assert {v[1] for v in sharded} == set(model_lib.compatible_positions(attention.REGISTRY[first]))
  assert {v[4] for v in sharded} == set(feed_forward_lib.REGISTRY)
  blockwise = {v.values[1] for v in VARIANTS if v.values[2] == "blockwise"}
  # `none` and every scheme of the score path through the blockwise backend, but those it
  # refuses (whole rows: CoPE); the others act before the backend (_in_score_path).
  assert blockwise >= {p for p in positions.REGISTRY
                       if (p == "none" or _in_score_path(p)) and _backends_for(p, ["blockwise"])}
  # Every scheme with a window and sinks on the first windowed mixer, but where the model
  # refuses the pair (CoPE: positions counted over keys in token order).
  windowed = [n for n, cls in attention.REGISTRY.items() if cls.supports_sliding_window][0]
  with_window = {v.values[1] for v in VARIANTS if v.values[0] == windowed and v.values[3]}
  refused = {p for p in model_lib.compatible_positions(attention.REGISTRY[windowed])
             if not any(_builds(windowed, p, b, (WINDOW, 2)) for b in CPU_BACKENDS)}
  assert with_window == set(model_lib.compatible_positions(attention.REGISTRY[windowed])) - refused
  assert refused == {"cope"}


@pytest.mark.parametrize("name", list(attention.REGISTRY))
def test_every_scheme_a_mixer_applies_builds_and_traces(name):
  """Each pair of a mixer and a scheme whose hooks it applies that the tests above do not run
  builds, and its forward over packed rows and a decode step trace to the right shapes (no
  compile): a scheme is told the mixer's geometry (research/model/positions/base.py), and a pair
  that cannot run must be refused when the model is built, not fail inside a trace."""
  index = list(attention.REGISTRY).index(name)
  run = {v.values[1] for v in VARIANTS if v.values[0] == name}
  for position in _applied_positions(index, attention.REGISTRY[name]):
    if position in run:
      continue
    config = tiny_model_config(attention=name, position=position)
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda config=config: research.build_model(config, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    forward = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(
        t, segments_BxL=jnp.asarray(SEGMENTS)), state, tokens)
    assert forward.shape == (BATCH, LENGTH, 61), position

    def decode(state, token_Bx1):
      model = nnx.merge(graphdef, state)
      return model.decode(token_Bx1, model.init_cache(BATCH, LENGTH))[0]

    step = jax.eval_shape(decode, state, jax.ShapeDtypeStruct((BATCH, 1), jnp.int32))
    assert step.shape == (BATCH, 1, 61), position


@pytest.mark.parametrize("name", list(attention.REGISTRY))
def test_chunked_mixers_run_at_least_three_chunks(name):
  """Each mixer's own test settings (Mixer.test_settings) give a chunked form (a chunk size,
  or softmax's blockwise tile) at least three chunks of the test length, so a state is carried
  from chunk to chunk within one call (and the last chunk is partial)."""
  mixer_cls = attention.REGISTRY[name]
  config = tiny_model_config(attention=name)
  chunk = mixer_cls.chunk_length(attention.REGISTRY.settings(name, config))
  if chunk is not None:
    assert -(-LENGTH // chunk) >= 3 and LENGTH % chunk, (
        f"{name}: test_settings give chunks of {chunk} tokens, {-(-LENGTH // chunk)} for the "
        f"test length {LENGTH}; declare a chunk of at most {LENGTH // 3} in its test_settings")


def test_variants_that_share_settings_must_share_their_test_settings():
  """The suite builds every variant of one settings key from one sub-dict: a subclass of
  softmax attention declaring other test settings than mha's is refused, naming both."""
  from research.model.registry import Registry  # noqa: PLC0415

  class Smaller(attention.MHA):
    test_settings = {"block_size": 4}

  registry = Registry("attention type", "model.attention")
  registry.register("mha", attention.MHA, settings="softmax")
  registry.register("smaller", Smaller, settings="softmax")
  with pytest.raises(ValueError, match=r"'smaller' declares test_settings \{'block_size': 4\} "
                                       r"for model.softmax, which 'mha' declares as"):
    registry.test_settings()
  Smaller.test_settings = dict(attention.MHA.test_settings)
  assert registry.test_settings() == {"softmax": attention.MHA.test_settings}


@pytest.mark.parametrize("name", list(attention.REGISTRY))
def test_every_mixer_builds_the_train_state(name):
  """The optimizer's weight-decay mask covers the whole model state (an array attribute of a
  module that is not a declared parameter would fail here, not in the first training run)."""
  from configs import base  # noqa: PLC0415
  from research.training import loop as train  # noqa: PLC0415
  config = base.get_config()
  config.model = tiny_model_config(attention=name, position="none")
  optimizer, _ = train.make_optimizer(config)
  state = jax.eval_shape(train.make_init_state(config, optimizer))
  assert jax.tree.leaves(state["opt_state"])
