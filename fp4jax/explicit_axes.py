"""Inputs sharded over Explicit mesh axes: fp4jax's numerics run with those axes made Auto, then reshard.

`jax.make_mesh` makes Explicit axes by default (JAX 0.10). Over them, every reshape, reduction and dot must know
its output's sharding, and JAX refuses to infer it when a reshape splits a sharded axis, as cutting an axis into
blocks of 16 does. The public entry points (`dot_general` and OutControl's, the Flax layers' contractions,
`quantize`, `dequantize`, `fake_quant`, `random_hadamard`) check whether an input is sharded over an Explicit axis.
If so, they run their bodies under `jax.sharding.auto_axes`, where XLA's partitioner places the intermediates as it
does on an Auto mesh. The result is then resharded to the sharding JAX's own operation would give: lax.dot_general's
for a GEMM, the input's for elementwise maps. The bits are the Auto mesh's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _sharding_of(leaf):
  if not isinstance(leaf, jax.Array):  # NumPy arrays, Python scalars: unsharded
    return None
  sharding = getattr(jax.typeof(leaf), "sharding", None)
  return sharding if isinstance(sharding, NamedSharding) else None


def _axis_names(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def explicit_axes(*trees: Any) -> tuple[str, ...]:
  """The Explicit mesh axes that some array leaf of `trees` is sharded over (empty when there are none)."""
  found = set()
  for leaf in jax.tree.leaves(trees):
    sharding = _sharding_of(leaf)
    if sharding is None:
      continue
    explicit = set(getattr(sharding.mesh, "explicit_axes", ()))
    found.update(n for entry in sharding.spec for n in _axis_names(entry) if n in explicit)
  return tuple(sorted(found))


def like(shape, sharding: NamedSharding) -> NamedSharding:
  """`sharding`'s spec for an array of `shape` with the same rank, dropping the axes that do not divide their
  dimension; replicated when the ranks differ (a per-tensor scalar, say)."""
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  if len(spec) != len(shape):
    return NamedSharding(sharding.mesh, P())
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
  kept = [entry if entry is not None and dim % math.prod(sizes[n] for n in _axis_names(entry)) == 0 else None
          for dim, entry in zip(shape, spec)]
  return NamedSharding(sharding.mesh, P(*kept))


def dot_general_sharding(lhs, rhs, dimension_numbers, preferred_element_type=None):
  """The sharding lax.dot_general gives its output for these operands (JAX's error when that is ambiguous: then
  pass out_sharding=, as to lax.dot_general)."""
  out = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers,
                                                        preferred_element_type=preferred_element_type), lhs, rhs)
  return out.sharding


def run_auto(fn: Callable, args: tuple, out_sharding) -> Any:
  """fn(*args) with the Explicit mesh axes made Auto, its outputs resharded to `out_sharding` (a pytree prefix of
  them; a PartitionSpec refers to the arguments' mesh). Manual axes (inside a partial-manual jax.shard_map) stay
  Manual: JAX cannot make them Auto."""
  mesh = first_sharding(args).mesh
  if isinstance(out_sharding, P):  # auto_axes finds the mesh in the sharding, or in a jax.set_mesh context
    out_sharding = NamedSharding(mesh, out_sharding)
  return jax.sharding.auto_axes(fn, axes=tuple(mesh.explicit_axes), out_sharding=out_sharding)(*args)


def run_gemm(gemm: Callable, args: tuple, lhs, rhs, dimension_numbers, out_dtype, out_sharding=None) -> Any:
  """gemm(*args), a GEMM of `lhs` and `rhs`: with the mesh axes made Auto when an operand is sharded over Explicit
  ones (`out_sharding` defaulting to lax.dot_general's), else constrained to `out_sharding` when it is given."""
  if explicit_axes(lhs, rhs):
    if out_sharding is None:
      out_sharding = dot_general_sharding(lhs, rhs, dimension_numbers, out_dtype)
    return run_auto(gemm, args, out_sharding)
  y = gemm(*args)
  return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)


def run_auto_like(fn: Callable, args: tuple, sharding: NamedSharding) -> Any:
  """fn(*args) with every mesh axis Auto; each output of `sharding`'s rank is resharded to its spec (`like`), the
  others (per-tensor scalars) replicated."""
  plain = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) if isinstance(a, jax.Array) else a, args)
  out_sharding = jax.tree.map(lambda s: like(s.shape, sharding), jax.eval_shape(fn, *plain))
  return run_auto(fn, args, out_sharding)


def varying_axes(leaf) -> frozenset[str]:
  """The manual mesh axes `leaf` varies over inside jax.shard_map (empty outside one)."""
  if not isinstance(leaf, jax.Array):
    return frozenset()
  aval = jax.typeof(leaf)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10; earlier versions: aval.vma
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def vary_alike(*arrays):
  """`arrays` (a tuple), each cast with lax.pcast to vary over every manual mesh axis that any of them varies over
  inside jax.shard_map; unchanged outside one. lax.dot_general widens its operands so, and the cast's transpose
  sums the cotangent of a less varying one (a replicated weight's) over those axes, as fp4jax's custom_vjp rules
  need. None entries pass through."""
  axes = frozenset().union(*(varying_axes(a) for a in arrays))
  if not axes:
    return arrays
  return tuple(a if a is None or not isinstance(a, jax.Array) or varying_axes(a) == axes
               else jax.lax.pcast(a, tuple(sorted(axes - varying_axes(a))), to="varying") for a in arrays)


def first_sharding(*trees: Any) -> NamedSharding:
  """The sharding of the first array leaf of `trees` sharded over an Explicit axis."""
  for leaf in jax.tree.leaves(trees):
    if explicit_axes(leaf):
      return _sharding_of(leaf)
  raise ValueError("no array is sharded over an Explicit mesh axis")
