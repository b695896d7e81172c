"""Op-by-op execution for the tests that compare it with jit.

The public quantizers jit their bodies (fp4jax.quantize), so a plain call outside jit is compiled as a whole too;
`jax.disable_jit()` is what still runs every primitive on its own (no fusion, no fused multiply-adds).
"""

import functools

import jax


def op_by_op(f):
  """`f`, run under jax.disable_jit() on every call."""
  @functools.wraps(f)
  def run(*args, **kwargs):
    with jax.disable_jit():
      return f(*args, **kwargs)
  return run
