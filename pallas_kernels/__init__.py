"""Pallas (Triton backend) kernels for fp4jax: fused NVFP4 quantization and FP4 GEMMs.

`quantize_nvfp4` and `fp4_matmul` produce what fp4jax's XLA path produces (bit-identical QArrays; GEMM results to
float32 summation order). `available()` says whether they can run compiled here; `interpret=None` runs them in
Pallas interpret mode on CPU. fp4jax never imports this package at top level: it is an optional backend.
"""

from pallas_kernels.platform import available
from pallas_kernels.quantize import quantize_nvfp4
from pallas_kernels.matmul import fp4_matmul
