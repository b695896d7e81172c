"""fp4jax: NVFP4 pretraining (arXiv 2509.25149) in JAX.

Numerics (no Flax needed): `quantize`, `dequantize`, `fake_quant`, `random_hadamard` over the formats `NVFP4`,
`MXFP4`, `MXFP8`, `FP8`; the recipe table `recipes` / `Recipe`; the quantized GEMM `dot_general` (a `jax.custom_vjp`;
`fp4jax.outcontrol.dot_general` runs chosen input channels in MXFP8, TetraJet-v2's OutControl).
Flax layers load on first use: `fp4jax.nn` (NNX) and `fp4jax.linen`; `quantize_model` quantizes a Flax model's
linear layers by path rules.
Built on top, never imported by the library: `fp4jax.pretrain` (training) and `fp4jax.analysis` (probes).
"""

import importlib

from fp4jax import recipes
from fp4jax.dot_general import dot_general, quantized_dot_general
from fp4jax.model_quantize import quantize_model  # Flax-free: Flax loads when a model is passed
from fp4jax.formats import FORMAT_NAMES, FP8, MXFP4, MXFP8, NVFP4, Format, get_format
from fp4jax.qarray import QArray
from fp4jax.quantize import (dequantize, fake_quant, num_blocks, pad_to_blocks, quantization_error, quantize,
                             quantize_with_clip_mask)
from fp4jax.recipes import Recipe
from fp4jax.rht import hadamard_matrix, random_hadamard

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("nn", "linen")  # Flax layers: imported on first attribute access, so numerics stay Flax-free.

__all__ = [
    "FORMAT_NAMES", "FP8", "MXFP4", "MXFP8", "NVFP4", "Format", "QArray", "Recipe", "dequantize", "dot_general",
    "fake_quant", "get_format", "hadamard_matrix", "linen", "nn", "num_blocks", "pad_to_blocks",
    "quantization_error", "quantize", "quantize_model", "quantize_with_clip_mask", "quantized_dot_general", "random_hadamard", "recipes",
]


def __getattr__(name: str):
  if name in _LAZY_SUBMODULES:
    return importlib.import_module(f"fp4jax.{name}")
  raise AttributeError(f"module 'fp4jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
