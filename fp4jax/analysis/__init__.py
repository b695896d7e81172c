"""Analysis on top of the fp4jax library: GEMM probes, layer taps and tensor inspection.

The library (`fp4jax`) never imports this package.
"""
