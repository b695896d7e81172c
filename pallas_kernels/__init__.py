"""Pallas (Triton backend) kernels for fp4jax: fused NVFP4 quantization and FP4 GEMMs.

  quantize_nvfp4(x, *, axis=-1, block_2d=False, rounding="nearest", key=None, rht_size=None, interpret=None,
                 random_bits=32, pad=False, rht_signs=None, tile=None, sr_bits="hash", fmt=None)
                 -> fp4jax.QArray
      bit-identical to fp4jax.quantize(x, fmt, ...) (after fp4jax.random_hadamard when rht_size is set), for
      fmt = fp4jax.NVFP4() (the default) and its scale_rule="up", "4over6", "eden", headroom and double_block
      variants. Exceptions (pallas_kernels/quantize.py says more): a tensor whose largest magnitude is a float32
      subnormal keeps it as amax where XLA:CPU's gives 0 (codes, scales and values agree), and with an RHT of a
      size other than 4 and 16, or compiled, the transform's float32 sums may differ from fp4jax's in the last bit.
  fp4_matmul(a, b, *, contract=(1, 0), interpret=None, tiles=None, split_k=None, use_blackwell=None,
             num_warps=None, num_stages=None) -> float32 [M, N]
      the FP4 GEMM of NVFP4/MXFP4 QArrays (NVFP4 double-block too: one K step per 1x128 group): exact
      code x block scale products in bf16, float32 accumulation, the tensor scales in the epilogue. It equals
      fp4jax's gemm_mode="bf16" up to float32 summation order, and dequantize(a) . dequantize(b) (which rounds each
      decoded element and product) within float32 rounding.
  available(reason=False) -> bool (or (bool, why)): whether the kernels can run compiled on this machine.
  platform.lower_for_cuda(fn, *args): jax.jit(fn) lowered for cuda on any machine (jax 0.10 and 0.11).

interpret=None runs Pallas interpret mode on CPU and compiled kernels on a CUDA GPU (RuntimeError with the reason
when the GPU cannot run them). Why Triton and not Mosaic GPU: see pallas_kernels/platform.py. The wrappers are not
differentiable (integer outputs); fp4jax.dot_general calls them inside its custom_vjp rule (fp4jax/backends.py).
fp4jax never imports this package at top level: it is an optional backend.
"""

from pallas_kernels import platform
from pallas_kernels.matmul import fp4_matmul
from pallas_kernels.platform import available
from pallas_kernels.quantize import quantize_nvfp4

__all__ = ["available", "fp4_matmul", "platform", "quantize_nvfp4"]
