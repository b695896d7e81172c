"""Every kernel configuration and the `small` train step compile for sm_90 without a GPU (XLA deviceless AOT,
benchmarks/gpu/aot.py).

The compile needs jax >= 0.11 with a CUDA PJRT plugin installed (jax[cuda13]) and is skipped elsewhere; it runs
Triton's compiler on 33 kernel configurations and XLA's GPU compiler on three train steps (~8 min on a 2-core
machine). The train steps' lowering for cuda runs everywhere.
"""

import os
import sys
import warnings

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
  for name, _, detail in results:  # each compiled kernels we can see
    assert ("kernel launches" if name.startswith("train step") else "shared_memory") in detail, (name, detail)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, scan_layers", [("nvfp4", False), ("nvfp4:backend=pallas", False),
                                                 ("nvfp4:backend=pallas", True),
                                                 ("four_over_six:backend=pallas", False),
                                                 ("quartet2:backend=pallas,rht_size=64", False)])
def test_train_step_cases_lower_for_cuda(recipe, scan_layers):
  """The `small` train step lowers for cuda with its quantizers and GEMMs as Triton kernels. For the Four Over Six
  and MS-EDEN kernels (never yet run on a GPU) at the model's own layer shapes (k and v are 64 wide), nothing falls
  back to the XLA path: the fallback would warn."""
  from fp4jax import backends  # pylint: disable=g-import-not-at-top
  from pallas_kernels import platform  # pylint: disable=g-import-not-at-top
  backends._fallback.cache_clear()  # pylint: disable=protected-access  (it warns once per reason and process)
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message="fp4jax backend='pallas'")
    fn, args = aot._train_step_case(recipe, scan_layers=scan_layers)  # pylint: disable=protected-access
    text = platform.lower_for_cuda(fn, *args).as_text()
  # The Pallas recipe's kernels lower as Triton calls (compiled, not interpret mode's loops); the XLA path has none.
  assert (text.count("__gpu$xla.gpu.triton") > 0) == ("backend=pallas" in recipe), recipe
  # With scan_layers the kernels sit in the layer loops' bodies (the forward's and the backward's); without, the
  # Pallas path has no loop at all.
  assert ("stablehlo.while" in text) == scan_layers or "backend=pallas" not in recipe


def test_xla_gpu_keeps_the_bf16_roundings_in_front_of_the_quantizers():
  ok, why = aot.supported()
  if not ok:
    pytest.skip(f"no deviceless cuda compilation here: {why}")
  kept = aot.bf16_roundings_kept()
  assert all(n >= need for _, n, need in kept), kept
