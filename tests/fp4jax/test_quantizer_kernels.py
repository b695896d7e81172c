"""XLA:CPU kernel structure of the quantizer chains: what must not be written out as an extra pass over the data.

Speed itself is measured in benchmarks/quantize.py; these tests pin the compiled structure that the speed relies on.
"""

import jax
import jax.numpy as jnp
import pytest

import fp4jax
import compiled_hlo

FMT = fp4jax.NVFP4()
N = 256


def _entry(fn, x):
  return compiled_hlo.entry(compiled_hlo.compiled_text(fn, x))


def _full_size_float32_buffers(entry):
  """Top-level ops of the entry computation that write a float32 array of N * N elements (any shape)."""
  return [i.name for i in compiled_hlo.instructions(entry)
          if i.type.startswith("f32[") and compiled_hlo.sizes(i.type) == [N * N]]


@pytest.fixture(autouse=True)
def _cpu_only():
  if jax.default_backend() != "cpu":
    pytest.skip("checks XLA:CPU's kernels")


def test_tensor_amax_needs_no_nan_check_kernels():
  """The tensor amax is an integer reduction, not a YNNPACK float max plus a separate NaN check."""
  entry = _entry(lambda v: fp4jax.fake_quant(v, FMT), jnp.zeros((N, N), jnp.float32))
  assert "ynn" not in entry.text
  assert "compare_fusion" not in entry.text


@pytest.mark.parametrize("axis", [-1, 0])
def test_bfloat16_rht_writes_no_float32_copy(axis):
  """A bfloat16 operand's 16-point RHT widens inside its loop: no full-size float32 array is written."""
  fn = lambda v: fp4jax.fake_quant(fp4jax.random_hadamard(v, size=16, axis=axis), FMT, axis=axis)
  entry = _entry(fn, jnp.zeros((N, N), jnp.bfloat16))
  assert _full_size_float32_buffers(entry) == []
  # The float32 input's RHT output is written once (the quantizer reads it twice): the check above can fail.
  entry32 = _entry(fn, jnp.zeros((N, N), jnp.float32))
  assert len(_full_size_float32_buffers(entry32)) >= 1
