"""The machine a test's float bits come from, for the tests that compare with numbers stored from a run.

XLA:CPU's dots (YNNPACK, Eigen) choose their kernels by the CPU's instruction set, and so their float32 summation
order: the 16-long float32 dot of the RHT adds in four partial sums on the AVX-512 machine the project started on
and sequentially on an AVX2 one (AMD Zen 3), and 4-step losses then differ from the fifth significant digit on.
Stored numbers are therefore recorded per `platform()`: reproduced exactly (or to float32 summation order) where
one was recorded for this platform, checked more loosely elsewhere.
"""

import platform as platform_lib

import jax

from fp4jax import gemm

# What the numbers stored before platforms were recorded are filed under (the golden losses, the probe results).
FIRST_PLATFORM = "cpu jax 0.10.2 x86_64 AVX-512 host (flags not recorded)"

# Instruction-set extensions that change which CPU kernels XLA:CPU's libraries pick.
_ISA_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "avx_vnni", "avx2", "fma")


def cpu_features() -> tuple[str, ...]:
  """The CPU's flags among _ISA_FLAGS (fp4jax.gemm.cpu_flags: /proc/cpuinfo; empty where there is none)."""
  flags = gemm.cpu_flags()
  return tuple(f for f in _ISA_FLAGS if f in flags)


def platform() -> str:
  """Backend, jax version, machine and ISA flags, e.g. "cpu jax 0.10.2 x86_64 avx2+fma"."""
  return (f"{jax.default_backend()} jax {jax.__version__} {platform_lib.machine()} "
          f"{'+'.join(cpu_features()) or 'no-isa-flags'}")
