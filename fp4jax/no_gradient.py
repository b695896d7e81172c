"""Quantizers refuse reverse-mode gradients with a clear error instead of giving zeros.

A quantizer's outputs are rounded (integer codes, grid values, scales from integer maxima), so plain autodiff
through it gives an all-zero gradient: a model trained through `dequantize(quantize(w))` would silently never
update `w`. `refusing_gradient` runs a quantizer's body as a `jax.custom_vjp` whose backward raises. JAX calls a
backward only with a nonzero cotangent, so values that do not reach the differentiated output (quantization
statistics returned as `has_aux`, or a stop_gradient'ed input) are unaffected, and the forward is the body itself:
the same program, the same bits.
"""

from __future__ import annotations

import functools

import jax

MESSAGE = (
    "{name} has no gradient: its codes and element values are rounded, so differentiating through it (for "
    "example dequantize(quantize(x))) would give zeros. Use fp4jax.fake_quant for the straight-through gradient, "
    "fp4jax.dot_general (or fp4jax.nn) for quantized GEMMs with the recipe's backward, or quantize "
    "jax.lax.stop_gradient(x) where a zero gradient is meant.")


def refusing_gradient(x, keys, body, name: str, settings: tuple):
  """body(x, keys, **dict(settings)), whose reverse-mode gradient raises a TypeError naming `name`.

  `keys` is any pytree of the body's other array inputs (PRNG keys, sign vectors, None); `settings` holds the
  body's static keyword arguments as hashable (name, value) pairs. Forward mode (jax.jvp) is refused by JAX itself.
  A concrete `x` (an eager call outside any transformation) cannot be differentiated, so the body runs directly,
  without the custom_vjp's per-call cost (~0.25 ms).
  """
  if not isinstance(x, jax.core.Tracer):
    return body(x, keys, **dict(settings))
  return _refusing_gradient(x, keys, body, name, settings)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _refusing_gradient(x, keys, body, name, settings):
  return body(x, keys, **dict(settings))


def _fwd(x, keys, body, name, settings):
  return _refusing_gradient(x, keys, body, name, settings), None


def _bwd(body, name, settings, residuals, cotangents):
  del body, settings, residuals, cotangents
  raise TypeError(MESSAGE.format(name=name))


_refusing_gradient.defvjp(_fwd, _bwd)
