"""The worked examples of adding a variant, executed as written: README's "Add a variant" (a
softmax-family mixer with a normaliser of its own, ReLU attention) and docs/architecture.md's
"How to add a variant" (a mixer with values wider than its queries and keys, and a position
scheme with parameters that reads its geometry from the mixer), each one file and one registry
line, get the conformance suite, both CPU backends, windows with sinks, packed documents and
decoding (packed documents too) with no other edit."""

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention, positions
from tests import test_conformance
from tests.conftest import tiny_model_config

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
EXAMPLES = {"README.md": "## Add a variant", "docs/architecture.md": "## How to add a variant"}
REGISTRIES = {"research/model/attention/__init__.py": attention.REGISTRY,
              "research/model/positions/__init__.py": positions.REGISTRY}


def _readme_blocks():
  """[(path, code)] of the python blocks that start with a `# research/...` line in the sections
  of EXAMPLES."""
  blocks = []
  for page, heading in EXAMPLES.items():
    with open(os.path.join(ROOT, page)) as f:
      text = f.read()
    section = text[text.index(heading):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    blocks += [(match.group(1), match.group(2)) for match in
               re.finditer(r"```python\n# (research/\S+\.py)[^\n]*\n(.*?)```", section, re.S)]
  return blocks


@pytest.fixture(scope="module")
def readme_variants():
  """Executes the examples' variant files as modules and their registry lines against the real
  registries; unregisters them afterwards."""
  blocks = _readme_blocks()
  files = [(path, code) for path, code in blocks if path not in REGISTRIES]
  assert len(files) == 3 and len(blocks) == 6, [path for path, _ in blocks]
  classes = {}
  for path, code in files:
    module = types.ModuleType(path[:-3].replace("/", "."))
    exec(compile(code, path, "exec"), module.__dict__)  # noqa: S102 (the docs' own code)
    classes.update({name: value for name, value in vars(module).items()
                    if isinstance(value, type) and value.__module__ == module.__name__})
  added = []
  for path, code in blocks:
    if path in REGISTRIES:
      registry = REGISTRIES[path]
      before = set(registry)
      exec(code, {"REGISTRY": registry, **classes})  # noqa: S102
      added += [(registry, name) for name in set(registry) - before]
  assert {name for _, name in added} == {"split_heads", "learned_slopes", "relu_attention"}
  yield
  for registry, name in added:
    registry.unregister(name)


CASES = [("split_heads", "rope", "xla", None), ("split_heads", "learned_slopes", "blockwise", None),
         ("split_heads", "alibi", "blockwise", (5, 2)), ("mha", "learned_slopes", "xla", (5, 2)),
         ("relu_attention", "rope", "blockwise", None), ("relu_attention", "alibi", "xla", (5, 2)),
         ("relu_attention", "t5", "blockwise", (5, 2))]
CONFORMANCE = [test_conformance.test_shapes_causality_and_gradients,
               test_conformance.test_prefill_in_chunks_then_decode_matches_full_forward,
               test_conformance.test_packed_documents_equal_each_document_alone,
               test_conformance.test_packed_documents_decode_as_the_packed_forward,
               test_conformance.test_sharded_equals_unsharded]


@pytest.mark.parametrize("check", CONFORMANCE, ids=lambda f: f.__name__.removeprefix("test_"))
@pytest.mark.parametrize("name,position,backend,window", CASES,
                         ids=["-".join(str(x) for x in case if x) for case in CASES])
def test_readme_variants_pass_the_conformance_suite(readme_variants, check, name, position,
                                                    backend, window):
  check(name, position, backend, window, "mlp")


def test_the_scheme_is_built_for_the_mixers_geometry_and_both_backends_agree(readme_variants):
  """learned_slopes holds one slope per head of the mixer that uses it (2N with split_heads, N
  with mha), the values are twice the query width, and blockwise == xla in the logits and in
  every gradient, the slopes' included."""
  tokens = jax.random.randint(jax.random.key(0), (2, 19), 0, 61)
  grads = {}
  for backend in ("xla", "blockwise"):
    config = tiny_model_config(attention="split_heads", position="learned_slopes",
                               attention_backend=backend)
    model = research.build_model(config, rngs=nnx.Rngs(0))
    mixer = model.blocks[0].mixer
    assert mixer.position.slopes.shape == (2 * config.num_heads,)
    assert mixer.value_head_dim == 2 * mixer.head_dim
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2)
    grads[backend] = jax.jit(jax.value_and_grad(loss))(state)
  slopes = grads["xla"][1]["blocks"][0]["mixer"]["position"]["slopes"][...]
  assert float(jnp.abs(slopes).max()) > 0
  for got, want in zip(jax.tree.leaves(grads["blockwise"]), jax.tree.leaves(grads["xla"])):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  mha = research.build_model(tiny_model_config(position="learned_slopes"), rngs=nnx.Rngs(0))
  assert mha.blocks[0].mixer.position.slopes.shape == (4,)


def test_the_normaliser_example_weighs_each_key_by_relu_over_the_length(readme_variants):
  """relu_attention's layer == sum_j relu(q_i . k_j / sqrt(H)) / L v_j over the causal keys, on
  both backends (L = model.relu_attention.length)."""
  for backend in ("xla", "blockwise"):
    config = tiny_model_config(attention="relu_attention", position="rope",
                               attention_backend=backend, relu_attention=dict(length=16))
    mixer = research.build_model(config, rngs=nnx.Rngs(0)).blocks[0].mixer
    x = jax.random.normal(jax.random.key(1), (2, 19, config.d_model))
    positions_1xT = jnp.arange(19)[None]
    q = mixer.position.queries(mixer.query(x), positions_1xT)
    k = mixer.position.keys(mixer.key(x), positions_1xT)
    z = jnp.einsum("btnh,bsnh->bnts", q, k) / q.shape[-1] ** 0.5
    weights = jnp.where(jnp.tril(jnp.ones((19, 19), bool)), jax.nn.relu(z) / 16, 0.0)
    expected = mixer.out(jnp.einsum("bnts,bsnv->btnv", weights, mixer.value(x)))
    np.testing.assert_allclose(mixer(x, positions_1xT), expected, atol=2e-5, rtol=2e-5)
