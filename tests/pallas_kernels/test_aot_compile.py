"""Every kernel configuration compiles for sm_90 without a GPU (XLA deviceless AOT, benchmarks/gpu/aot.py).

Needs jax >= 0.11 with a CUDA PJRT plugin installed (jax[cuda13]); skipped elsewhere. Slow: it runs Triton's
compiler on ~26 kernels (the RHT quantizer alone takes ~1 min on a 2-core machine).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu import aot  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path):
  ok, why = aot.supported()
  if not ok:
    pytest.skip(f"no deviceless cuda compilation here: {why}")
  results = aot.compile_all(str(tmp_path))
  failed = [(name, detail) for name, good, detail in results if not good]
  assert not failed, failed
  assert all("shared_memory" in detail for _, _, detail in results)  # each compiled a kernel we can see
