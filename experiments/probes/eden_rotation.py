"""Quartet II's Wgrad floor: MS-EDEN's output-gradient operand behind the RHT vs behind a uniformly random rotation.

    python -m experiments.probes.eden_rotation [--checkpoint RUN_DIR] [--draws 256] [--layers a,b]

Wgrad against the quantized forward's gradient, Q(x)^T dY, with only dY quantized (along the tokens, as Quartet II's
Wgrad does: rotation tiles of `n` tokens, `formats.NVFP4(scale_rule="eden", eden_group=n)`: the correction over
each tile, stochastically rounded scales), the dequantized estimate rotated back. EDEN's correction makes the
estimate unbiased in expectation over a uniformly random (Haar) rotation; the recipe's RHT (Hadamard times random
signs, one sign vector for every tile) only approximates one. The bias floor (noise removed, as in the recipes
probe) shows which: if the Haar rotation has no floor where the RHT has one, the floor belongs to the method, not
to fp4jax's quantizer. Default: the layers and BF16 base run of
`python -m experiments.probes recipes --preset cpu --out runs/recipe_probes_cpu`.
"""

from __future__ import annotations

import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import cli_values
from fp4jax import formats
from fp4jax import rht
from fp4jax.quantize import dequantize, quantize

ROTATIONS = ("rht", "haar")


def eden_format(n: int) -> formats.NVFP4:
  """Quartet II's backward format for rotation tiles of n: the EDEN correction over each tile (eden_group = n)."""
  return formats.NVFP4(scale_rule="eden", eden_group=n)


def _rotation(kind: str, n: int, key) -> jax.Array:
  """[n, n] orthogonal: rows e_i H D (the RHT with random signs) or a Haar-random orthogonal matrix."""
  if kind == "rht":
    return rht.random_hadamard(jnp.eye(n, dtype=jnp.float32), size=n, axis=1, signs=key)
  if kind == "haar":
    return jax.random.orthogonal(key, n)
  raise ValueError(f"rotation must be one of {ROTATIONS}; got {kind!r}.")


def _apply(v_MxN, rot_nxn, inverse: bool) -> jax.Array:
  """The same rotation on every run of n tokens (axis 0)."""
  n = rot_nxn.shape[0]
  t = v_MxN.reshape(v_MxN.shape[0] // n, n, -1)
  r = rot_nxn.T if inverse else rot_nxn
  return jnp.einsum("ji,bjk->bik", r, t, precision=jax.lax.Precision.HIGHEST).reshape(v_MxN.shape)


def dy_estimate(dy_MxN, kind: str, n: int, key) -> jax.Array:
  """dY rotated along the tokens, quantized as Quartet II's Wgrad operand, dequantized and rotated back."""
  if dy_MxN.shape[0] % n:
    raise ValueError(f"tokens {dy_MxN.shape[0]} must be a multiple of the rotation size {n}.")
  rot = _rotation(kind, n, jax.random.fold_in(key, 0))
  q = quantize(_apply(dy_MxN.astype(jnp.float32), rot, False), eden_format(n), axis=0, rounding="stochastic",
               key=jax.random.fold_in(key, 1), random_bits=32)
  return _apply(dequantize(q, jnp.float32), rot, True)


def wgrad_floor(x_MxK, dy_MxN, kind: str, n: int, key, *, num_draws: int = 256) -> dict[str, float]:
  """Relative error of one draw (rms) and of the mean of `num_draws`, and the bias floor, of x^T dY_est vs x^T dY."""
  x = np.asarray(jnp.asarray(x_MxK, jnp.float32), np.float64)
  ref = x.T @ np.asarray(jnp.asarray(dy_MxN, jnp.float32), np.float64)
  ref_norm = np.linalg.norm(ref)
  est = jax.jit(lambda k: dy_estimate(dy_MxN, kind, n, k))
  total, e1 = np.zeros_like(ref), []
  for d in range(num_draws):
    g = x.T @ np.asarray(est(jax.random.fold_in(key, d)), np.float64)
    total += g
    e1.append(np.linalg.norm(g - ref) / ref_norm)
  e_k = np.linalg.norm(total / num_draws - ref) / ref_norm
  e1_ms = float(np.mean(np.square(e1)))
  floor = np.sqrt(max(num_draws * e_k ** 2 - e1_ms, 0.0) / (num_draws - 1))
  return {"err": float(np.sqrt(e1_ms)), "bias": float(e_k), "floor": float(floor)}


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m experiments.probes.eden_rotation` (see --help and the module docstring); returns the exit code."""
  from experiments.probes import recipe_gemms, training  # pylint: disable=g-import-not-at-top  (Flax, data)
  from fp4jax.analysis import model_probes  # pylint: disable=g-import-not-at-top
  parser = cli_values.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", default="runs/recipe_probes_cpu/base")
  parser.add_argument("--draws", type=int, default=256)
  parser.add_argument("--layers", default="blocks.0.attn.q,blocks.2.attn.q")
  parser.add_argument("--sizes", default="32,128")
  args = parser.parse_args(argv)
  if args.draws < 2:
    parser.error(f"--draws must be >= 2 (the floor compares the mean of the draws with one); got {args.draws}.")
  try:
    sizes = [int(s) for s in args.sizes.split(",")]
  except ValueError:
    parser.error(f"--sizes takes comma-separated ints; got {args.sizes!r}.")
  try:
    config, model, _, _, dataset = training.restore_run(args.checkpoint)
  except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
    print(f"error: {e}", file=sys.stderr)
    return 2
  batch = training.probe_batch(dataset, recipe_gemms.get_preset("cpu").base, config)
  _, tensors = model_probes.capture_layer_tensors(model, batch)
  layers = args.layers.split(",")
  unknown = [name for name in layers if name not in tensors]
  if unknown:
    parser.error(f"--layers: no layer {', '.join(map(repr, unknown))}; the model has {', '.join(tensors)}.")
  print("| layer | size | rotation | err (1 draw) | bias (mean of draws) | floor |\n|---|---|---|---|---|---|")
  for layer in layers:
    t = tensors[layer]
    for n in sizes:
      for kind in ROTATIONS:
        r = wgrad_floor(t.x_MxK, t.dy_MxN, kind, n, jax.random.key(1), num_draws=args.draws)
        print(f"| {layer} | {n} | {kind} | {r['err']:.4f} | {r['bias']:.4f} | {r['floor']:.4f} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
