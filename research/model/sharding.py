"""Mesh and logical axis rules: one table maps the model's axis names to mesh axes.

The mesh has three axes: `data` (pure data parallelism), `fsdp` (data parallelism with
parameters sharded over it too) and `tensor` (heads, MLP hidden units and the experts of a mixture
of experts split across devices).
A logical axis maps to its mesh axes only where the dimension divides evenly, so for example
MQA's single key/value head stays replicated when `tensor` > 1.
"""

import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis name -> mesh axes it is split over (None: replicated)
RULES = {
    "batch": ("data", "fsdp"),
    "length": None,
    "vocab": None,
    "embed": "fsdp",
    "mlp": "tensor",
    # A mixture of experts' stacked expert weights: its hidden units then stay whole per device.
    "expert": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "state": None,
    "conv": None,
    "ssm_proj": None,
    # Position schemes' parameters are small: replicated.
    "max_positions": None,
    "position_embed": None,
    "relative_buckets": None,
    "position_heads": None,
    "fire_hidden": None,
}


def mesh_shape(shape, num_devices):
  """Resolve a (data, fsdp, tensor) shape whose one -1 fills the remaining devices."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES) or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh.shape={shape} must give sizes of the axes {MESH_AXES}: positive "
                     f"integers, at most one -1 to fill the rest")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh.shape={shape}: {num_devices} devices cannot be split with fixed "
                       f"axes of product {known}; the fixed sizes must divide {num_devices}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh.shape={shape} needs {math.prod(shape)} devices but there are "
                     f"{num_devices}; use sizes whose product is {num_devices}, or -1 for one axis")
  return shape


def fitting_mesh_shape(shape, num_devices, batch_size):
  """(mesh shape, note) for reading a saved run on the devices present: its own `shape`, resolved,
  with note None where it fits (uses all `num_devices` devices, and a batch of `batch_size` rows
  splits evenly over data*fsdp); else (d, 1, num_devices // d) with d = gcd(num_devices,
  batch_size), as much data parallelism as the batch splits into and the other devices on
  `tensor` (which shards what divides and replicates the rest), with a one-line note saying which
  mesh and why. A run trained on 8 devices is so evaluated on 1: the mesh is a layout, not a
  setting of the run, and a checkpoint restores into any (research.runs.checkpoints)."""
  try:
    resolved = mesh_shape(shape, num_devices)
  except ValueError:
    problem = f"does not fit {num_devices} device{'s' * (num_devices > 1)}"
  else:
    if batch_size % (resolved[0] * resolved[1]) == 0:
      return resolved, None
    problem = (f"splits the batch of {batch_size} rows unevenly (data*fsdp="
               f"{resolved[0] * resolved[1]})")
  data = math.gcd(num_devices, batch_size)
  fitting = (data, 1, num_devices // data)
  return fitting, (f"mesh {fitting} (data, fsdp, tensor) instead of the run's mesh.shape="
                   f"{tuple(shape)}, which {problem}: data={data} (the most devices that split "
                   f"the batch of {batch_size} evenly), tensor the rest; --config.mesh.shape sets "
                   "another")


def make_mesh(shape, devices=None):
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(shape, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def partition_spec(logical_axes, shape, mesh):
  """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes` names."""
  spec, used = [], set()
  for name, size in zip(logical_axes, shape):
    if name is None:  # replicated
      spec.append(None)
      continue
    if name not in RULES:
      raise ValueError(f"logical axis {name!r} has no sharding rule; known: {', '.join(RULES)}")
    mesh_axes = RULES[name]
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
    if mesh_axes and size % math.prod(mesh.shape[a] for a in mesh_axes) == 0:
      used.update(mesh_axes)
      spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    else:
      spec.append(None)
  return PartitionSpec(*spec)


def state_shardings(tree, mesh):
  """NamedShardings for a pytree (abstract or concrete) holding nnx Variables, from each
  Variable's logical_axes; leaves that are not Variables (step counters) are replicated."""
  from flax import nnx  # local: keep this module importable without building models

  def sharding(leaf):
    if not isinstance(leaf, nnx.Variable):
      return NamedSharding(mesh, PartitionSpec())
    axes = leaf.get_metadata().get("logical_axes")
    spec = PartitionSpec() if axes is None else partition_spec(axes, np.shape(leaf.value), mesh)
    return leaf.replace(NamedSharding(mesh, spec))

  return jax.tree.map(sharding, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharded_abstract(tree, mesh):
  """`tree` as ShapeDtypeStructs carrying the shardings of state_shardings (restore targets)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, state_shardings(tree, mesh))


def batch_sharding(mesh, ndim=2):
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def constrain(x, logical_axes):
  """Sharding constraint on an activation, when traced under a mesh (no-op otherwise)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, partition_spec(logical_axes, x.shape, mesh))
