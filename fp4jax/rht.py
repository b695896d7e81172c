"""Random Hadamard Transform (RHT): H = diag(s) H_d / sqrt(d); each run t of d elements along an axis becomes t @ H.

H is orthonormal, so transforming both GEMM operands along their shared contraction axis leaves the exact product
unchanged while spreading outliers across each tile, which shrinks block amaxes relative to typical values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import arg_checks
from fp4jax import explicit_axes
from fp4jax import grids
from fp4jax import keys

# The sign vector hard-coded by the NVFP4 reference implementation (d = 16), shared by all layers for the run.
REFERENCE_SIGNS_16 = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
MIN_SIZE, MAX_SIZE = 2, 256
# The tile size whose transform runs as elementwise multiply-adds instead of a dot (off a mesh), see mix_fixed_order.
FUSED_SIZE = 16
# The tile sizes whose transform along a non-minor axis runs as a dot batched over the tiles, see _tile_batched_dot.
TILE_BATCHED_SIZES = (64, 128)


def check_size(size: int) -> None:
  """Raises ValueError unless `size` is a power of two in [MIN_SIZE, MAX_SIZE]."""
  if not isinstance(size, (int, np.integer)) or size < MIN_SIZE or size > MAX_SIZE or size & (size - 1):
    raise ValueError(f"RHT size must be a power of two in [{MIN_SIZE}, {MAX_SIZE}]; got {size!r}.")


@functools.lru_cache(maxsize=None)
def sylvester_hadamard(size: int) -> np.ndarray:
  """The unnormalised Sylvester Hadamard matrix H_d (entries +-1), in scipy.linalg.hadamard's ordering."""
  check_size(size)
  h = np.ones((1, 1), np.float64)
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  return h


@functools.lru_cache(maxsize=None)
def default_signs(size: int) -> tuple[int, ...]:
  """The fixed sign vector used when `signs=None`.

  size 16: the reference implementation's vector. Other sizes: bit 16 of a 31-bit linear congruential sequence
  (x <- 1103515245 x + 12345 mod 2^31, seeded with `size`): fixed forever, independent of any library's RNG.
  """
  check_size(size)
  if size == 16:
    return REFERENCE_SIGNS_16
  x, signs = size, []
  for _ in range(size):
    x = (1103515245 * x + 12345) % 2**31
    signs.append(1 if (x >> 16) & 1 else -1)
  return tuple(signs)


def resolve_signs(size: int, signs=None) -> jax.Array:
  """Sign vector as float32 [size]: None -> default_signs, a PRNG key -> random +-1, an array -> as given.

  An array with an element other than +-1 raises ValueError; traced (inside jit or vmap), such elements become NaN.
  """
  check_size(size)
  if signs is None:
    return jnp.asarray(default_signs(size), jnp.float32)
  if isinstance(signs, jax.Array) and jax.dtypes.issubdtype(signs.dtype, jax.dtypes.prng_key):
    return jax.random.rademacher(signs, (size,), dtype=jnp.float32)
  signs = jnp.asarray(signs)
  if signs.dtype == jnp.bool_:  # True/False would pass as 1/0, and a 0 is no sign
    raise ValueError("RHT signs must be numbers +1 or -1 (or a PRNG key); got a bool array: pass e.g. "
                     "jnp.where(mask, 1.0, -1.0).")
  if keys.is_key(signs):  # raw (legacy) key data, of the configured PRNG's width (no sign vector is uint32)
    return jax.random.rademacher(signs, (size,), dtype=jnp.float32)
  if signs.shape != (size,):
    raise ValueError(f"RHT signs must have shape ({size},) or be a PRNG key; got shape {signs.shape}.")
  try:
    values = np.asarray(signs, np.float64)
  except jax.errors.TracerArrayConversionError:  # traced signs (inside jit or vmap): no error can be raised
    signs = signs.astype(jnp.float32)
    # A sign that is not +-1 is NaN, so the transform's output is NaN rather than silently scaled.
    return jnp.where(jnp.abs(signs) == 1, signs, jnp.float32(jnp.nan))
  if not np.all(np.abs(values) == 1):
    raise ValueError(f"RHT signs must all be +1 or -1 (else the transform is not orthonormal); got {values}.")
  return signs.astype(jnp.float32)


def hadamard_matrix(size: int = 16, signs=None) -> jax.Array:
  """H = diag(s) @ H_d / sqrt(size) as float32 [size, size]."""
  s = resolve_signs(size, signs)
  h = jnp.asarray(sylvester_hadamard(size) / np.sqrt(size), jnp.float32)
  return s[:, None] * h


def random_hadamard(x, *, size: int = 16, axis: int = -1, signs=None, inverse: bool = False):
  """Maps every run t of `size` consecutive elements of `x` along `axis` to t @ H (or t @ H^T with inverse=True).

  Computed in float32 (size 16 as elementwise multiply-adds, other sizes as a HIGHEST-precision dot) and returned
  in x's dtype (so a bf16 operand's RHT output is rounded to bf16, as in the reference, which runs the RHT as a bf16
  matmul with float32 accumulation), except float16, which comes back as float32: mixing can grow an element by up
  to sqrt(size), past float16's largest finite 65504.

  Traced under a mesh of several devices (`jax.set_mesh`, or `jax.sharding.use_abstract_mesh` inside jit, as the
  trainer traces its steps on FSDP meshes), size 16 runs as the dot too: XLA's partitioner reshards the dot's
  operand once, but each of the 16 multiply-add terms on its own (on an FSDP mesh: 16 resharding kernels and an
  all-to-all per term). The two forms agree up to float32 summation order: the loop adds in a fixed order on every
  machine, the dot in its backend's (on XLA:CPU the same bits on an AVX-512 machine from two tiles on, others in
  the last bits on AVX2, where the dot adds sequentially; tested to that bound; docs/numerics.md, "Summation
  order", has the orders measured for every size).
  """
  check_size(size)
  x = jnp.asarray(x)
  if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):  # float64 too: the transform is float32 arithmetic
    raise ValueError(f"random_hadamard takes float32, bfloat16 or float16 input; got dtype {x.dtype.name}.")
  axis = arg_checks.axis_index(axis, x.ndim)
  arg_checks.flag("inverse", inverse)
  n = x.shape[axis]
  if n % size:
    raise ValueError(f"RHT size {size} does not divide the length {n} of axis {axis} (shape {x.shape}).")
  # None stays None (the default signs are then constants of the compiled loop); keys and arrays become the vector.
  signs = None if signs is None else resolve_signs(size, signs)
  if explicit_axes.explicit_axes(x):  # blocking the axis would split a sharded one: run with the axes made Auto
    run = lambda x, signs: random_hadamard(x, size=size, axis=axis, signs=signs, inverse=inverse)
    return explicit_axes.run_auto_like(run, (x, signs), explicit_axes.first_sharding(x))
  as_dot = size != FUSED_SIZE or _traced_for_a_mesh()
  return _random_hadamard_jit(x, signs, size=size, axis=axis, inverse=inverse, as_dot=as_dot)


def _traced_for_a_mesh() -> bool:
  """Whether the caller traces under a mesh of more than one device (JAX's abstract mesh context)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1


# Jitted once per shape and settings, as the quantizers are (fp4jax.quantize): called outside jit, the 16-term
# expression would otherwise dispatch op by op. Inlined inside a trace.
@functools.partial(jax.jit, static_argnames=("size", "axis", "inverse", "as_dot"))
def _random_hadamard_jit(x, signs, *, size, axis, inverse, as_dot):
  n = x.shape[axis]
  h = hadamard_matrix(size, signs)
  h = h.T if inverse else h
  # Row-vector convention of the reference implementation: each tile t becomes t @ H = (H_d diag(s) t^T)^T / sqrt(d),
  # i.e. the signs flip first, then the Hadamard mixes. The inverse is y @ H^T.
  # float16 would overflow (an RHT sum can exceed 65504): its output stays float32.
  out_dtype = jnp.float32 if x.dtype == jnp.float16 else x.dtype
  if axis == x.ndim - 1:
    tiles = x.reshape(*x.shape[:-1], n // size, size)
    if not as_dot:
      y = mix_fixed_order(tiles, h, tiles.ndim - 1)
    else:
      y = jnp.einsum("...j,ji->...i", grids.exact_float32(tiles), h, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape).astype(out_dtype)
  # Another axis (Wgrad's token axis): H^T applied to [P, size, Q] tiles in place. Moving the axis last instead costs
  # two full transposes (~3x slower on XLA:CPU); both forms add the same products in the same order (bit-identical,
  # tested against the moved-axis form).
  p = math.prod(x.shape[:axis]) * (n // size)
  tiles = x.reshape(p, size, -1)
  if not as_dot:
    y = mix_fixed_order(tiles, h, 1)
  elif size in TILE_BATCHED_SIZES:
    y = _tile_batched_dot(grids.exact_float32(tiles), h)
  else:
    y = jnp.einsum("ji,ajk->aik", h, grids.exact_float32(tiles), precision=jax.lax.Precision.HIGHEST)
  return y.reshape(x.shape).astype(out_dtype)


def _tile_batched_dot(tiles, h):
  """H^T applied to every [size, Q] tile of float32 `tiles` [P, size, Q]: one dot batched over the P tiles.

  XLA:CPU runs the einsum form as a transpose of the tiles to [P, Q, size], a dot, and a transpose back that it
  fuses into every reader of the result (whose reads are then strided). This form is one dot of its own that writes
  [P, size, Q] directly: ~2x faster alone (size 64 along axis 0 of [1024, 512]: 1.26 against 2.46 ms). Both add each
  output's products in one sequential chain of fused multiply-adds for sizes 64 and 128, so the bits are the same
  (tested); for size 32 (the einsum's dot adds in two chains) and 256 (another order on narrow tiles) they are not,
  and those sizes keep the einsum.
  """
  h_pxjxi = jnp.broadcast_to(h, (tiles.shape[0],) + h.shape)
  return jax.lax.dot_general(h_pxjxi, tiles, (((1,), (1,)), ((0,), (0,))), precision=jax.lax.Precision.HIGHEST)


def mix_fixed_order(tiles, h, j_axis):
  """sum_j tiles_j h[j, i] along `j_axis` (length 16): 16 broadcast multiply-adds, an elementwise expression.

  On XLA:CPU one vectorised loop fusion (with the cast to the output dtype) runs ~2x faster than the [.., 16] x
  [16, 16] dot (a YNNPACK call for a product with only 16 columns); it is still its own pass (XLA does not duplicate
  a 16-term expression into both quantizer passes). The products t_j * (+-1/4) are exact; the sum adds them in the
  order XLA:CPU's float32 dot used for a 16-long contraction on the AVX-512 machine this was written on: four partial
  sums over j = 0, 1, 2, 3 mod 4, combined as (p0 + p1) + (p2 + p3). That order is fixed here, on every machine
  (tested against a NumPy sum in it); the dot's is its backend's: the same bits there, but on an AVX2 machine (AMD
  Zen 3) XLA:CPU's dot adds sequentially and the forms differ in the last bits. Other sizes keep the dot.

  Narrower tiles are widened from their bits (grids.exact_float32: on XLA:GPU a cast would let a fused bfloat16
  producer's rounding be dropped). A float32 copy read by 16 slices would be written out as its own pass, because
  XLA:CPU fuses a producer into at most 15 differently-indexed users (its code-duplication limit); so 15 terms slice
  the widened tiles and the last widens its own slice (XLA keeps that one 1/16-size slice in memory).
  """
  wide = grids.exact_float32(tiles)

  def term(j):
    if j == FUSED_SIZE - 1 and tiles.dtype != jnp.float32:
      t_j = grids.exact_float32(jax.lax.slice_in_dim(tiles, j, j + 1, axis=j_axis))
    else:
      t_j = jax.lax.slice_in_dim(wide, j, j + 1, axis=j_axis)
    row = h[j].reshape([-1 if a == j_axis else 1 for a in range(tiles.ndim)])
    return t_j * row
  partial = []
  for k in range(4):
    acc = term(k)
    for j in range(k + 4, FUSED_SIZE, 4):
      acc = acc + term(j)
    partial.append(acc)
  return (partial[0] + partial[1]) + (partial[2] + partial[3])
