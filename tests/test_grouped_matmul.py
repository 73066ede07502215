"""research.model.feed_forward.grouped_matmul against jax.lax.ragged_dot (the function it computes),
in float32: outputs and gradients w.r.t. the rows and every group's matrix, with empty groups
(first, between others, last), a group spanning several blocks, and rows past the groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model.feed_forward import grouped_matmul

CASES = {
    "uneven": [5, 0, 9, 3],  # an empty group between others; 17 of 19 rows: two past the groups
    "empty-ends": [0, 11, 8, 0],  # 19 rows exactly
    "one-group-many-blocks": [0, 19, 0, 0],
}


@pytest.mark.parametrize("sizes", list(CASES.values()), ids=list(CASES))
def test_grouped_matmul_equals_ragged_dot_outputs_and_gradients(sizes):
  rows, d, f = 19, 6, 5
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (rows, d))
  w = jax.random.normal(keys[1], (len(sizes), d, f))
  cotangent = jax.random.normal(keys[2], (rows, f))
  sizes = jnp.array(sizes, jnp.int32)

  def reference(x, w):
    return jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)

  def blocked(x, w):  # blocks of 4 rows: groups span several blocks and pad their last one
    return grouped_matmul.grouped_matmul(x, w, sizes, block_rows=4,
                                         precision=jax.lax.Precision.HIGHEST)

  def value_and_grads(fn):
    y, vjp = jax.vjp(jax.jit(fn), x, w)
    return y, vjp(cotangent)

  (want, want_grads), (got, got_grads) = value_and_grads(reference), value_and_grads(blocked)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  past_groups = int(sizes.sum())
  np.testing.assert_array_equal(got[past_groups:], 0.0)
  for name, g, w_ in zip(("dx", "dw"), got_grads, want_grads, strict=True):
    assert float(jnp.abs(w_).max()) > 0, name
    np.testing.assert_allclose(g, w_, atol=1e-5, rtol=1e-5, err_msg=name)
  empty = [e for e, s in enumerate(sizes.tolist()) if s == 0]
  np.testing.assert_array_equal(got_grads[1][jnp.array(empty, jnp.int32)], 0.0)


def _equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs in its equations' parameters (loops, calls)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)
      if hasattr(inner, "eqns"):
        yield from _equations(inner)


def test_grouped_matmul_runs_one_block_per_step_within_the_padding_bound():
  """The routed cost: a loop of at most ceil((M + X (S - 1)) / S) steps of one [S, D] x [D, F]
  matmul, and no matmul over all groups (XLA's cost analysis counts a loop body once, so the
  structure is checked, not a FLOP count)."""
  rows, d, f, groups, block = 256, 32, 64, 8, 16
  x, w = jnp.ones((rows, d)), jnp.ones((groups, d, f))
  sizes = jnp.full((groups,), rows // groups, jnp.int32)
  jaxpr = jax.make_jaxpr(lambda x, w: grouped_matmul.grouped_matmul(x, w, sizes,
                                                                     block_rows=block))(x, w)
  def dots(jaxpr):
    return [e for e in _equations(jaxpr) if e.primitive.name == "dot_general"]

  loops = [e for e in _equations(jaxpr.jaxpr)
           if e.primitive.name == "scan" and dots(e.params["jaxpr"].jaxpr)]
  assert [loop.params["length"] for loop in loops] == [-(-(rows + groups * (block - 1)) // block)]
  assert [tuple(v.aval.shape for v in dot.invars) for dot in dots(jaxpr.jaxpr)] == [
      ((block, d), (d, f))]
