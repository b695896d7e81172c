"""fp4jax: NVFP4 pretraining (arXiv 2509.25149) in JAX.

Numerics: `quantize`, `dequantize`, `fake_quant`, `random_hadamard` over the formats `NVFP4`, `MXFP4`, `FP8`.
"""

from fp4jax.formats import FORMAT_NAMES, FP8, MXFP4, NVFP4, Format, get_format
from fp4jax.qarray import QArray
from fp4jax.quantize import dequantize, fake_quant, num_blocks, pad_to_blocks, quantization_error, quantize
from fp4jax.rht import hadamard_matrix, random_hadamard

__version__ = "0.1.0"
from fp4jax import recipes
from fp4jax.dot_general import dot_general, quantized_dot_general
from fp4jax.recipes import Recipe
from fp4jax import nn
