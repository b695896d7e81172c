"""Device meshes with axes (data, fsdp, tensor), readable partition rules, and the checks that keep NVFP4 blocks
inside shards.

Parallelism: batches are split over (data, fsdp); parameters and optimizer state are split over `fsdp` (FSDP: each
device holds a slice, XLA all-gathers before use; the step gathers the GATHER_AT_USE leaves itself); the attention
and MLP projections are Megatron-style tensor-parallel over `tensor` (q/k/v/up/gate column-parallel, o/down
row-parallel).

Mesh-independent numerics: quantization runs inside `jax.jit` on the global (logical) array, so the per-tensor amax
is the global max over all shards (XLA inserts an all-reduce-max: one scalar per quantized operand, the only
collective quantization adds), and stochastic-rounding bits are a function of the key and the global element index
(fp4jax.prng; threefry, `sr_bits="threefry"`, is partitionable), identical however the tensor is split.
`check_divisibility` makes sure every scaling block of the Fprop weight format (NVFP4: 16 elements, 16x16 weight
tiles) and Wgrad's RHT tile along tokens lies within one shard, so none straddles a shard boundary. Coarser units
of other recipes are not checked (TetraJet-v2's 1x128 scale groups, Quartet II's RHT tiles along K or N): since
quantization sees the global array, one that straddles a shard changes no bits, only adds communication.

Multi-process runs (fp4jax.pretrain.distributed): the mesh spans every process's devices; each process reads only
the rows of the batch its devices hold (`batch_block`) and `global_batch` assembles the global arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Partition rules: (regex searched in the parameter path "blocks.3.attn.q.kernel", PartitionSpec). First match wins;
# optimizer-state leaves match through their parameter path suffix (e.g. "0.mu.blocks.3.attn.q.kernel").
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"blocks\.\d+\.attn\.(q|k|v)\.kernel$", P("fsdp", "tensor")),  # column-parallel [D, heads*hd]
    (r"blocks\.\d+\.attn\.o\.kernel$", P("tensor", "fsdp")),  # row-parallel [heads*hd, D]
    (r"blocks\.\d+\.mlp\.(up|gate)\.kernel$", P("fsdp", "tensor")),  # column-parallel [D, F]
    (r"blocks\.\d+\.mlp\.down\.kernel$", P("tensor", "fsdp")),  # row-parallel [F, D]
    (r"embed\.embedding$", P(None, "fsdp")),  # [V, D]
    (r"lm_head\.kernel$", P("fsdp", None)),  # [D, V]
    (r".*", P()),  # norms, scalars, counters: replicated
)

# Leaves the step all-gathers over `fsdp` itself, before the forward (`gather_at_use`). XLA's partitioner gathers an
# FSDP-sharded GEMM operand by itself, but a lookup from an embedding table sharded along D over `fsdp` yields
# activations sharded along D over `fsdp`, which clash with the batch's split over (data, fsdp): the partitioner then
# replicates an activation-sized tensor in the backward (its "Involuntary full rematerialization" warning) instead
# of gathering the table, which is what FSDP does with every weight. Measured in benchmarks/RESULTS.md.
GATHER_AT_USE: tuple[str, ...] = (r"embed\.embedding$",)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the (data, fsdp, tensor) mesh axes; their product must equal the device count."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    for axis in AXES:
      size = getattr(self, axis)
      if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"mesh axis {axis!r} must be a positive int; got {size!r}.")

  @property
  def shape(self) -> tuple[int, int, int]:
    """(data, fsdp, tensor)."""
    return (self.data, self.fsdp, self.tensor)

  @property
  def size(self) -> int:
    """Devices the mesh needs."""
    return math.prod(self.shape)

  @classmethod
  def parse(cls, spec: str | None) -> "MeshConfig":
    """From "data=2,fsdp=2,tensor=2" (missing axes are 1); None or "" means all devices on `data`."""
    if spec is not None and not isinstance(spec, str):  # e.g. a jax Mesh, which would fail on .split
      raise ValueError(f"mesh must be a string like 'data=2,fsdp=2,tensor=2' or a MeshConfig; got {spec!r}.")
    if not spec:
      return cls(data=jax.device_count())
    sizes = {}
    for item in spec.split(","):
      name, eq, value = item.partition("=")
      name = name.strip()
      if not eq or name not in AXES:
        raise ValueError(f"bad mesh entry {item!r} in {spec!r}: expected axis=size with axis in {AXES}.")
      if name in sizes:  # else the last one silently wins
        raise ValueError(f"mesh axis {name!r} given more than once in {spec!r}.")
      try:
        sizes[name] = int(value)
      except ValueError:
        raise ValueError(f"mesh axis {name!r} size must be an int; got {value!r}.") from None
    return cls(**sizes)

  def __str__(self) -> str:
    return ",".join(f"{a}={getattr(self, a)}" for a in AXES)


def make_mesh(config: MeshConfig | str | None = None, devices: Sequence[Any] | None = None) -> Mesh:
  """A Mesh with axes (data, fsdp, tensor) over `devices` (default: all devices)."""
  if not isinstance(config, MeshConfig):
    config = MeshConfig.parse(config)
  devices = list(jax.devices() if devices is None else devices)
  if config.size != len(devices):
    raise ValueError(f"mesh {config} has {config.size} devices but {len(devices)} are available; the product of "
                     f"the axis sizes must equal the device count: pass --mesh with sizes whose product is "
                     f"{len(devices)}, or --mesh None for one device (a --resume keeps the stored run's mesh unless "
                     f"--mesh names another).")
  return Mesh(np.asarray(devices).reshape(config.shape), AXES)


def path_str(path) -> str:
  """'blocks.3.attn.q.kernel' from a jax key path (an NNX Variable's trailing '.value' is dropped)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  if parts and parts[-1] == "value":
    parts.pop()
  return ".".join(parts)


def spec_for(path: str, ndim: int, rules=PARTITION_RULES) -> P:
  """The PartitionSpec of the first rule whose regex is found in `path`, truncated/padded to the leaf's rank."""
  for pattern, spec in rules:
    if re.search(pattern, path):
      if len(spec) > ndim:
        return P(*spec[:ndim]) if ndim else P()
      return spec
  return P()


def check_rules(mesh: Mesh, rules=PARTITION_RULES) -> None:
  """Every axis a rule names must be a mesh axis."""
  for pattern, spec in rules:
    for entry in spec:
      for name in (entry if isinstance(entry, tuple) else (entry,)):
        if name is not None and name not in mesh.axis_names:
          raise ValueError(f"partition rule {pattern!r} names axis {name!r}, not in the mesh axes {mesh.axis_names}.")


def _shards(mesh: Mesh, entry) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names if n is not None)


def tree_shardings(tree, mesh: Mesh, rules=PARTITION_RULES):
  """NamedShardings for every leaf of `tree` (params or optimizer state) from the partition rules.

  A sharded dimension that does not divide by its shard count raises a ValueError naming the leaf.
  """
  check_rules(mesh, rules)

  def one(path, leaf):
    name = path_str(path)
    shape = getattr(leaf, "shape", ())
    spec = spec_for(name, len(shape), rules)
    for dim, entry in enumerate(spec):
      n = _shards(mesh, entry)
      if n > 1 and shape[dim] % n:
        raise ValueError(f"parameter {name!r} dim {dim} has size {shape[dim]}, not divisible by the {n} shards of "
                         f"mesh axis {entry!r} (mesh {dict(mesh.shape)}).")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, tree)


def _without(entry, axis: str):
  """A PartitionSpec entry with mesh axis `axis` removed."""
  names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None and n != axis)
  return None if not names else names[0] if len(names) == 1 else names


def gather_at_use(params, mesh: Mesh, rules=PARTITION_RULES, gathered: Sequence[str] = GATHER_AT_USE):
  """`params` (inside jit) with the leaves whose path matches a `gathered` regex constrained to their rule's sharding
  without `fsdp`: XLA all-gathers them there, and reduce-scatters their gradients on the way back."""

  def one(path, leaf):
    name = path_str(path)
    if not any(re.search(pattern, name) for pattern in gathered):
      return leaf
    spec = spec_for(name, leaf.ndim, rules)
    return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, P(*(_without(e, "fsdp") for e in spec))))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [B, T] split over (data, fsdp) along B."""
  return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
  """A sharding that keeps a full copy on every device of `mesh`."""
  return NamedSharding(mesh, P())


def recipe_block_sizes(recipe) -> dict[str, Any]:
  """check_divisibility's block_size / weight_2d / rht_size for a recipe (its Fprop weight format and RHT)."""
  fmt = recipe.fprop.rhs.fmt
  return {"block_size": fmt.block_size if fmt is not None else 1, "weight_2d": recipe.fprop.rhs.block_2d,
          "rht_size": recipe.rht_size if recipe.wgrad.rht else 1}


def check_divisibility(params, mesh: Mesh, *, block_size: int, weight_2d: bool, batch_size: int, seq_len: int,
                       rht_size: int, rules=PARTITION_RULES, quantized=r"blocks\.\d+\..*kernel$",
                       grad_accum: int = 1):
  """Raises ValueError unless quantization blocks stay inside shards.

  - each sharded dim of a quantized kernel holds a whole number of blocks per shard (`block_size` elements, or
    block_size x block_size tiles when `weight_2d`);
  - each batch shard holds a whole number of token blocks and `rht_size` RHT tiles (Wgrad blocks run along tokens),
    in each of the step's `grad_accum` micro-batches (batch_size / grad_accum sequences each).
  block_size and rht_size come from the recipe (its weight format's block size; 1 for unquantized recipes).
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = path_str(path)
    if not re.search(quantized, name):
      continue
    spec = spec_for(name, leaf.ndim, rules)
    for dim, entry in enumerate(spec):
      n = _shards(mesh, entry)
      per_shard, rem = divmod(leaf.shape[dim], n)
      if rem or (n > 1 and per_shard % block_size):
        layout = f"{block_size}x{block_size} weight tiles" if weight_2d else f"{block_size}-element blocks"
        raise ValueError(f"parameter {name!r} dim {dim} (size {leaf.shape[dim]}) split over {n} shards of mesh axis "
                         f"{entry!r} gives {leaf.shape[dim] / n:g} per shard, not a multiple of {block_size}: the "
                         f"recipe's {layout} would straddle shard boundaries.")
  n_batch = _shards(mesh, BATCH_AXES)
  if batch_size % grad_accum:
    raise ValueError(f"grad_accum {grad_accum} does not divide batch_size {batch_size}.")
  micro = batch_size // grad_accum
  if micro % n_batch:
    what = (f"batch_size {batch_size}" if grad_accum == 1 else
            f"the micro-batch size {micro} (batch_size {batch_size} / grad_accum {grad_accum})")
    raise ValueError(f"{what} is not divisible by the {n_batch} batch shards (data x fsdp).")
  tokens = micro // n_batch * seq_len
  multiple = math.lcm(block_size, rht_size)
  if n_batch > 1 and tokens % multiple:
    where = "each batch shard" if grad_accum == 1 else "each batch shard of a micro-batch"
    raise ValueError(f"{where} holds {tokens} tokens ({micro // n_batch} x {seq_len}), not a multiple "
                     f"of {multiple}: Wgrad's token blocks / RHT tiles would straddle shards.")


def batch_block(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
  """(index, count): the process's devices hold block `index` of the batch cut into `count` equal row blocks.

  With one process this is (0, 1). A process whose batch shards are not one contiguous block of rows (a mesh whose
  device order interleaves processes along data/fsdp) raises ValueError: build the mesh from jax.devices() order.
  """
  process_index = jax.process_index() if process_index is None else process_index
  n_fsdp, n_batch = mesh.shape["fsdp"], _shards(mesh, BATCH_AXES)
  axes = [mesh.axis_names.index(a) for a in BATCH_AXES]
  shards = sorted({idx[axes[0]] * n_fsdp + idx[axes[1]] for idx, device in np.ndenumerate(mesh.devices)
                   if device.process_index == process_index})
  if not shards:
    raise ValueError(f"process {process_index} has no device in the mesh {dict(mesh.shape)}.")
  m = len(shards)
  if shards != list(range(shards[0], shards[0] + m)) or shards[0] % m or n_batch % m:
    raise ValueError(f"process {process_index} holds batch shards {shards} of {n_batch}: not one contiguous block "
                     "of rows, so it cannot read its rows of the batch alone; order the mesh's data/fsdp axes by "
                     "process (jax.devices() order).")
  return shards[0] // m, n_batch // m


def global_batch(local_batch: dict, mesh: Mesh, count: int = 1) -> dict:
  """Global sharded arrays from each process's block of rows (`count` blocks in all, see `batch_block`)."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * count, *v.shape[1:]))
          for k, v in local_batch.items()}


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the train state and batches live: one device, or a (data, fsdp, tensor) mesh.

  Quantization runs on global arrays inside jit, so its numerics do not depend on the placement; the mesh only
  decides which device computes which slice (see the module docstring).
  """

  state: Any  # a sharding, or a TrainState-shaped pytree of shardings
  params: Any
  batch: Any
  replicated: Any
  mesh: Any = None
  key: str = "single"

  @classmethod
  def single_device(cls) -> "Placement":
    """Everything on the first local device (runs without --mesh)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return cls(state=device, params=device, batch=device, replicated=device)

  @classmethod
  def for_mesh(cls, mesh_spec: str | None, state, *, recipe, batch_size: int, seq_len: int,
               grad_accum: int = 1, quantized_layers: Sequence[str] | None = None) -> "Placement":
    """One device when `mesh_spec` is empty; else a mesh, after checking `recipe`'s blocks fit its shards (those
    of each of the step's `grad_accum` micro-batches).

    `quantized_layers` (names such as "blocks.0.attn.k") are the layers that run `recipe`, when a precision policy
    keeps others in BF16: only their kernels are checked, and the token blocks only if there is one. None: every
    block's kernels."""
    if not mesh_spec:
      if jax.process_count() > 1:
        raise ValueError(f"this is one of {jax.process_count()} processes: pass a --mesh over all "
                         f"{jax.device_count()} devices (e.g. data={jax.device_count()}).")
      return cls.single_device()
    mesh = make_mesh(mesh_spec)
    sizes, quantized = recipe_block_sizes(recipe), {}
    if quantized_layers is not None:
      quantized = {"quantized": "^(" + "|".join(map(re.escape, quantized_layers)) + r")\.kernel$"}
      if not quantized_layers:  # nothing runs the recipe: no weight or token block to keep inside a shard
        sizes = {"block_size": 1, "weight_2d": False, "rht_size": 1}
    check_divisibility(state.params, mesh, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                       **sizes, **quantized)
    state_sh = tree_shardings(state, mesh)
    return cls(state=state_sh, params=state_sh.params, batch=batch_sharding(mesh), replicated=replicated(mesh),
               mesh=mesh, key=str(mesh_spec))

  def traced_on_mesh(self, fn: Callable) -> Callable:
    """`fn` (a step to jit) traced with this mesh as JAX's abstract mesh when the mesh has an `fsdp` axis, so
    that library code which adapts its graph to a mesh sees it; `fn` itself otherwise.

    What adapts: fp4jax.random_hadamard runs as one dot. With FSDP, XLA's partitioner reshards the Wgrad operands
    of the loop form term by term (16 resharding kernels and an all-to-all per term), and the dot once; on one
    device, data-only and tensor-only meshes there is no such resharding and the loop form is faster (measured in
    benchmarks/RESULTS.md).
    """
    if self.mesh is None or self.mesh.shape["fsdp"] == 1:
      return fn
    abstract = self.mesh.abstract_mesh

    @functools.wraps(fn)
    def traced(*args):
      with jax.sharding.use_abstract_mesh(abstract):
        return fn(*args)

    return traced

  def gather_params(self, params):
    """`params` as the forward should read them (inside jit): `gather_at_use` on a mesh, unchanged on one device."""
    return params if self.mesh is None else gather_at_use(params, self.mesh)

  def batch_block(self) -> tuple[int, int]:
    """(index, count) of this process's rows: pass them to data.get_batch as (process_index, process_count)."""
    return (0, 1) if self.mesh is None else batch_block(self.mesh)

  def put_batch(self, batch: dict[str, np.ndarray]):
    """Global batch arrays from this process's rows (block `batch_block()` of the global batch)."""
    if self.mesh is None:
      return jax.device_put(batch, self.batch)
    return global_batch(batch, self.mesh, self.batch_block()[1])
