"""Pretraining on top of the fp4jax library: model, precision policy, data, checkpoints, sharding, trainer, CLI.

The library (`fp4jax`) never imports this package. Entry points: `fp4jax train ...` / `python -m fp4jax train ...`.
Multi-process (multi-host) runs from Python: call `fp4jax.pretrain.distributed.init_distributed()` before any other
JAX use (the CLI and the experiments do it for you), then `trainer.train(config)` with a `mesh` over all devices.
"""
