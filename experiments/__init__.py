"""Ablation experiments after the NVFP4 pretraining paper (arXiv 2509.25149): sweeps of fp4jax training runs.

Each experiment module (formats, rht_size, high_precision_layers, components, precision_switch) has a
`get_config(preset)` returning a `sweep.Sweep` and runs as

    python -m experiments.NAME --preset {smoke,cpu,gpu} --out DIR [--seeds N] [--set KEY=VALUE ...]

`python -m experiments.report DIR` redraws the tables and plots of a (finished or partial) sweep.
`python -m experiments.probes --preset {smoke,cpu,gpu} --out DIR` measures recipes on the fixed tensors of one
trained model (a package: presets, training, run, summary, report, plots). `common` holds the helpers they share.
"""
