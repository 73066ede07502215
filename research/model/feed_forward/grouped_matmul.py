"""A grouped matmul by fixed-size row blocks: jax.lax.ragged_dot's function at the routed cost.

  y_i = x_i W_{g(i)}   for rows i sorted by group: rows 0 .. s_0 - 1 are group 0, the next s_1
                       group 1, ...; rows past sum(s) give 0 (ragged_dot's contract).

ragged_dot runs as a grouped matmul on TPU; JAX's CPU lowering (and XLA:GPU's default rewrite)
expands it into a masked dense matmul over every group, X times the routed FLOPs. This module
computes the same function with ops every backend runs at the routed cost, as MegaBlocks'
block-sparse formulation does (Gale et al., arXiv:2211.15841): each group's rows are padded to a
multiple of BLOCK_ROWS and scattered into blocks of BLOCK_ROWS rows, every block belonging to one
group; a loop over the blocks multiplies each by its group's matrix. The number of blocks has a
static bound, ceil((M + X (BLOCK_ROWS - 1)) / BLOCK_ROWS) for M rows and X groups, so the padding
costs at most X (BLOCK_ROWS - 1) rows of FLOPs whatever the routing. The backward is written out
(a custom VJP): dx_b = dy_b W_{g(b)}^T per block, and dW_g accumulated in place from x_b^T dy_b,
where autodiff of the loop would add a full [X, D, F] zero-padded cotangent at every block.
tests/test_grouped_matmul.py checks outputs and gradients against ragged_dot, empty groups and
rows past the groups included.
"""

import functools

import jax
import jax.numpy as jnp

# Rows per block: large enough for an efficient [BLOCK_ROWS, D] x [D, F] matmul per loop step,
# small enough that padding every group to a multiple of it stays cheap (fewer than X blocks).
BLOCK_ROWS = 128


def grouped_matmul(x_MxD, w_XxDxF, group_sizes_X, *, block_rows=BLOCK_ROWS, precision=None,
                   preferred_element_type=None):
  """[M, F]: row i of x (sorted by group, group_sizes_X rows each) times W of its group."""
  rows, _ = x_MxD.shape
  groups, _, width = w_XxDxF.shape
  out_dtype = preferred_element_type or jnp.result_type(x_MxD.dtype, w_XxDxF.dtype)
  num_blocks = -(-(rows + groups * (block_rows - 1)) // block_rows)
  sizes_X = group_sizes_X.astype(jnp.int32)
  padded_X = -(-sizes_X // block_rows) * block_rows
  group_end_X, padded_end_X = jnp.cumsum(sizes_X), jnp.cumsum(padded_X)
  # Row i: its group, and its row in the padded layout (past every group: out of range, dropped).
  row_M = jnp.arange(rows, dtype=jnp.int32)
  group_M = jnp.minimum(jnp.searchsorted(group_end_X, row_M, side="right"), groups - 1)
  offset_M = row_M - (group_end_X - sizes_X)[group_M]
  slot_M = jnp.where(row_M < group_end_X[-1], (padded_end_X - padded_X)[group_M] + offset_M,
                     num_blocks * block_rows)
  x_blocks = (jnp.zeros((num_blocks * block_rows, x_MxD.shape[1]), x_MxD.dtype)
              .at[slot_M].set(x_MxD, mode="drop", unique_indices=True)
              .reshape(num_blocks, block_rows, -1))
  # Block b belongs to the group whose padded rows hold row b * block_rows (trailing blocks,
  # past every group, hold zeros: any group will do).
  block_group = jnp.minimum(
      jnp.searchsorted(padded_end_X, jnp.arange(num_blocks, dtype=jnp.int32) * block_rows,
                       side="right"), groups - 1)
  y_blocks = _block_matmul(x_blocks, w_XxDxF, block_group, precision, out_dtype)
  return jnp.take(y_blocks.reshape(-1, width), slot_M, axis=0, mode="fill", fill_value=0)


def _one_block(x_SxD, w_DxF, precision, out_dtype):
  return jnp.matmul(x_SxD, w_DxF, precision=precision, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _block_matmul(x_NxSxD, w_XxDxF, group_N, precision, out_dtype):
  """[N, S, F]: block n times W of its group n, one block per loop step."""
  return jax.lax.map(lambda block: _one_block(block[0], w_XxDxF[block[1]], precision, out_dtype),
                     (x_NxSxD, group_N))


def _block_matmul_fwd(x_NxSxD, w_XxDxF, group_N, precision, out_dtype):
  return _block_matmul(x_NxSxD, w_XxDxF, group_N, precision, out_dtype), (x_NxSxD, w_XxDxF,
                                                                            group_N)


def _block_matmul_bwd(precision, out_dtype, residuals, dy_NxSxF):
  x_NxSxD, w_XxDxF, group_N = residuals
  del out_dtype

  def step(dw_XxDxF, block):
    x_SxD, dy_SxF, group = block
    w_DxF = w_XxDxF[group]
    dx_SxD = jnp.matmul(dy_SxF, w_DxF.T.astype(dy_SxF.dtype), precision=precision,
                        preferred_element_type=jnp.float32).astype(x_SxD.dtype)
    dw_DxF = jnp.matmul(x_SxD.T.astype(dy_SxF.dtype), dy_SxF, precision=precision,
                        preferred_element_type=jnp.float32)
    return dw_XxDxF.at[group].add(dw_DxF), dx_SxD

  dw_XxDxF, dx_NxSxD = jax.lax.scan(step, jnp.zeros(w_XxDxF.shape, jnp.float32),
                                    (x_NxSxD, dy_NxSxF, group_N))
  return dx_NxSxD, dw_XxDxF.astype(w_XxDxF.dtype), None


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)
