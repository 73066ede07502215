"""CoPE (research/model/positions/cope.py) on mha against a naive float32 port of
ContextPosSelfAttn.forward (facebookresearch/RAM@e6f051f, projects/cope/src/cope/
context_position.py, its defaults: gates from the attention keys, the position logits added
before the division by sqrt(d)), one head at a time with a multiplicative mask as the reference
takes it; outputs and gradients w.r.t. the input and every parameter, in packed rows, with a
count that passes the table's end (the clamp). Decode, causality and sharding: the conformance
suite (mha-cope-xla). The backends and the window that cannot run it refuse it by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import research
from research.model import attention, positions
from tests.conftest import tiny_model_config
from tests.test_kernels import SEGMENTS_37, _normal

MAX_POSITIONS = 6  # below the counts of the 37-token rows: the clamp at 5 is reached


def _mha_with_cope(name="mha"):
  """The mixer of the tiny config with CoPE, its position table off zero (a fresh table adds
  nothing, so it would test nothing)."""
  config = tiny_model_config(attention=name, position="cope", attention_backend="xla",
                             cope=dict(max_positions=MAX_POSITIONS))
  cls = attention.REGISTRY[name]
  settings = attention.REGISTRY.settings(name, config)
  scheme = positions.build(config, cls.position_geometry(settings, config), rngs=nnx.Rngs(1))
  scheme.table[...] = _normal(5, scheme.table.shape, 2.0)
  return cls(settings, config, scheme, rngs=nnx.Rngs(0))


def _context_pos_self_attn(q_LxH, k_LxH, v_LxH, table_HxP, mask_LxL):
  """ContextPosSelfAttn.forward for one head, written as the reference writes it."""
  head_dim, npos = q_LxH.shape[-1], table_HxP.shape[-1]
  gate_logits = q_LxH @ k_LxH.T
  gates = jax.nn.sigmoid(gate_logits / np.sqrt(head_dim)) * mask_LxL
  counted = jnp.flip(jnp.cumsum(jnp.flip(gates, -1), axis=-1), -1)
  counted = jnp.minimum(counted, npos - 1)
  pos_logits_fixed = q_LxH @ table_HxP
  ceil = jnp.ceil(counted).astype(jnp.int32)
  floor = jnp.floor(counted).astype(jnp.int32)
  pos_logits_ceil = jnp.take_along_axis(pos_logits_fixed, ceil, -1)
  pos_logits_floor = jnp.take_along_axis(pos_logits_fixed, floor, -1)
  ceil_weight = counted - floor
  pos_logits = pos_logits_ceil * ceil_weight + pos_logits_floor * (1 - ceil_weight)
  attn_logits = (gate_logits + pos_logits) / np.sqrt(head_dim) + jnp.log(mask_LxL)
  return jax.nn.softmax(attn_logits, axis=-1) @ v_LxH


def _naive(mixer, x_BxLxD, segments_BxL):
  """The mixer's projections, then the reference per row and head, then the output projection."""
  length = x_BxLxD.shape[1]
  q = jnp.einsum("bld,dnh->bnlh", x_BxLxD, mixer.query.kernel[...])
  k = jnp.einsum("bld,dnh->bnlh", x_BxLxD, mixer.key.kernel[...])
  v = jnp.einsum("bld,dnh->bnlh", x_BxLxD, mixer.value.kernel[...])
  k, v = (jnp.repeat(a, mixer.kv_group_size(), axis=1) for a in (k, v))  # head n reads n // G
  causal = jnp.tril(jnp.ones((length, length), bool))
  masks_BxLxL = (causal & (segments_BxL[:, :, None] == segments_BxL[:, None, :])).astype(
      jnp.float32)
  one_head = lambda q, k, v, mask: _context_pos_self_attn(q, k, v, mixer.position.table[...], mask)
  over_heads = jax.vmap(one_head, in_axes=(0, 0, 0, None))
  o_BxNxLxH = jax.vmap(over_heads)(q, k, v, masks_BxLxL)
  return jnp.einsum("bnlh,nhd->bld", o_BxNxLxH, mixer.out.kernel[...])


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_cope_equals_the_reference_with_gradients(name):
  mixer = _mha_with_cope(name)
  graphdef, state = nnx.split(mixer)
  x = _normal(2, (2, 37, 32))
  positions_BxL = jnp.arange(37)[None]
  cotangent = _normal(3, (2, 37, 32))

  def lab(state, x):
    return nnx.merge(graphdef, state)(x, positions_BxL, SEGMENTS_37)

  def naive(state, x):
    return _naive(nnx.merge(graphdef, state), x, SEGMENTS_37)

  expected = naive(state, x)
  np.testing.assert_allclose(lab(state, x), expected, atol=2e-5, rtol=2e-5)
  loss = lambda f: lambda s, x: jnp.sum(f(s, x) * cotangent)
  got = jax.grad(loss(lab), argnums=(0, 1))(state, x)
  want = jax.grad(loss(naive), argnums=(0, 1))(state, x)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)
  # The table is used, and its gradient reaches it; counts pass its end (the clamp).
  assert float(jnp.abs(got[0]["position"]["table"][...]).max()) > 1e-3
  q = jnp.einsum("bld,dnh->bnlh", x, mixer.query.kernel[...])
  k = jnp.einsum("bld,dnh->bnlh", x, mixer.key.kernel[...])
  k = k[:, jnp.arange(mixer.num_heads) // mixer.kv_group_size()]
  gates = jax.nn.sigmoid(jnp.einsum("bnlh,bnsh->bnls", q, k) / np.sqrt(q.shape[-1]))
  assert float(jnp.sum(jnp.tril(gates[1, 0]), -1).max()) > MAX_POSITIONS


def test_a_fresh_table_attends_as_without_positions():
  """The reference starts its table at zeros: a fresh CoPE layer equals mha with no scheme."""
  def mixer(position):
    config = tiny_model_config(position=position, attention_backend="xla")
    settings = attention.REGISTRY.settings("mha", config)
    return attention.REGISTRY["mha"](settings, config,
                                     attention.position_scheme(config, rngs=nnx.Rngs(1)),
                                     rngs=nnx.Rngs(0))
  x, positions_BxL = _normal(2, (2, 37, 32)), jnp.arange(37)[None]
  np.testing.assert_allclose(mixer("cope")(x, positions_BxL, SEGMENTS_37),
                             mixer("none")(x, positions_BxL, SEGMENTS_37), atol=1e-6, rtol=0)


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_backend="blockwise"), "needs each query's whole row.*valid: 'auto', 'xla'"),
    (dict(softmax=dict(window=8)), "rolling cache.*model.softmax.window=0"),
    (dict(attention="linear"), "position"),
    (dict(cope=dict(max_positions=1)), "model.cope.max_positions must be >= 2"),
])
def test_what_cannot_run_cope_refuses_it_by_name(overrides, message):
  with pytest.raises(ValueError, match=message):
    research.build_model(tiny_model_config(position="cope", **overrides), rngs=nnx.Rngs(0))
