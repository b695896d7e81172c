"""Analysis on top of the fp4jax library; the library never imports this package, and it never imports the trainer.

  probes         one linear layer's three GEMMs under a recipe on fixed tensors (errors, bias vs SR draws, codes),
                 run by fp4jax.dot_general's own public pieces (layer_operands, fprop, dgrad, wgrad)
  model_probes   capture each layer's x, W, dY from a BF16 model; loss and gradient under per-layer recipes
  taps           swap linear layers for wrappers that record their inputs and output gradients
  inspection     `python -m fp4jax.analysis.inspection`: what each format loses on a tensor with outliers
"""
