"""Low-noise ablations: recipe components measured on the fixed tensors of one trained model, and short paired
continuations from one shared checkpoint.

End-to-end loss at CPU scale cannot tell recipe components apart (stochastic-rounding noise between seeds moves the
validation loss about as much as a component does). Here every recipe sees the SAME layer inputs, weights and output
gradients (captured from a BF16 forward/backward on fixed validation batches), so what differs is the recipe alone:

  1. per layer and GEMM: error and cosine vs BF16; gradient bias vs the number K of averaged SR draws; chain-rule
     consistency (Dgrad weight vs Fprop weight); zero / saturated code fractions and block-scale ranges;
  2. whole model: loss change and gradient error per recipe, per BF16-layer policy, and with one block quantized at
     a time (layer sensitivity: which blocks to keep in BF16);
  3. continuations: each recipe continued for N steps from the shared checkpoint with S seeds; the validation-loss
     change against BF16 continued with the same seed (same data, paired), mean +- standard error.

    python -m experiments.probes --preset smoke --out runs/probes_smoke     # under a minute
    python -m experiments.probes --preset cpu --out runs/probes_cpu         # ~6 min on 2 CPU cores
    python -m experiments.probes --preset gpu --out runs/probes_gpu         # the paper's 1.2B model (GPU)
    python -m experiments.probes --report-only --out runs/probes_cpu        # redraw tables and plots
    python -m experiments.probes recipes --preset cpu --out runs/recipe_probes_cpu  # experiments.recipes' recipes

The checkpoint is a BF16 run of the preset's model (constant learning rate after warmup, so it stops in the stable
phase, as the paper's ablations resumed mid-run), trained with fp4jax's trainer into OUT/base and reused when
present; --checkpoint RUN_DIR probes another run instead. Outputs: OUT/results.json, OUT/report.md, OUT/*.png.

Modules: presets (what each preset measures), training (base run, checkpoint, continuations: the only user of the
trainer), run (orchestration and the command line), summary (paired effects), report (report.md), plots (PNGs);
recipe_gemms and recipe_gemms_report: `probes recipes`, every recipe of experiments.recipes on the same captured
GEMM tensors (error and bias vs the exact product, bias vs the quantized forward's gradient, chain-rule gap).
"""
