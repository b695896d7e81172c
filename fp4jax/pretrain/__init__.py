"""Pretraining on top of the fp4jax library: model, precision policy, data, checkpoints, sharding, trainer, CLI.

The library (`fp4jax`) never imports this package. Entry points: `fp4jax train ...` / `python -m fp4jax train ...`.
"""
