"""Sections `linear` and `train`: one quantized linear layer and whole training steps, nvfp4 against bf16.

`linear`: jitted value_and_grad of sum(y * G) for y = x W (x bf16 [T, D_in], W float32 [D_in, D_out]) under the
bf16 recipe and nvfp4 on the xla path in its default bf16-operand GEMM mode, in its float32 HIGHEST mode (the
reference) and on the Pallas backend. Quantized rows compare (dx, dW) with the float32-mode reference run on the
same key (same stochastic-rounding draws); the bf16 row with a float32 HIGHEST layer.
`train`: `fp4jax.pretrain` train steps (AdamW, real batches) of the `small` model and of a 2-layer slice of the
paper's 1.2B model (d_model 2048, 1024-token sequences): 30 timed steps in 3 blocks of 10, the median block's step
time per recipe relative to bf16 (and the smallest block against bf16's smallest: min and median), and the
first step's loss of each quantized row compared with the first quantized row's (bf16 vs nvfp4 shown as is), and
the loss after the timed steps (two batches, alternating), so that no speed is read without what the step learns.
"""

from __future__ import annotations

from benchmarks.gpu import report


SMALL_BATCH_SEQ = (32, 128)  # the `small` model's train rows: sequences x tokens
REFERENCE = "nvfp4 xla f32"  # the quantized rows' reference: dequantized float32 operands at HIGHEST precision
TIMING_BLOCKS = 3  # train rows: timed steps in 3 blocks; the row reports the median block and the min ratio


def _recipes():
  """[(label, recipe)] to time, in priority order: bf16, nvfp4 as trained by default (xla, bf16 operands), the
  float32 reference GEMM mode, the Pallas backend."""
  import fp4jax  # pylint: disable=g-import-not-at-top
  nvfp4 = fp4jax.recipes.nvfp4()
  return [("bf16", fp4jax.recipes.bf16()), ("nvfp4 xla bf16", nvfp4.replace(gemm_mode="bf16")),
          (REFERENCE, nvfp4.replace(gemm_mode="f32")), ("nvfp4 pallas", nvfp4.replace(backend="pallas"))]


def run_linear(sec: report.Section) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import fp4jax  # pylint: disable=g-import-not-at-top
  tokens, d_in, d_out = (64, 64, 64) if sec.dry else (8192, 4096, 4096)
  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  x = report.random_input(k1, (tokens, d_in), jnp.bfloat16)
  w = report.random_input(k2, (d_in, d_out), jnp.float32, 0.02)
  g = report.random_input(k3, (tokens, d_out), jnp.float32)
  dims = (((1,), (0,)), ((), ()))
  key = jax.random.key(11)

  # g is an argument, not a closed-over constant: as a constant, XLA folded the quantization of dY = g into the
  # compiled program (seconds of constant folding on the first GPU run, and a backward pass that skipped dY's work).
  def step_fn(recipe):
    def loss(x, w, key, g):
      if recipe.is_quantized:
        y = fp4jax.dot_general(x, w, dims, recipe=recipe, key=key, preferred_element_type=jnp.bfloat16)
      else:
        y = jax.lax.dot_general(x, w.astype(jnp.bfloat16), dims, preferred_element_type=jnp.bfloat16)
      return jnp.sum(y.astype(jnp.float32) * g)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  def f32_loss(x, w, key, g):
    del key
    y = jax.lax.dot_general(x.astype(jnp.float32), w, dims, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(y * g)

  recipes = _recipes()
  refs = {"bf16": jax.jit(jax.value_and_grad(f32_loss, argnums=(0, 1)))(x, w, key, g),
          REFERENCE: step_fn(dict(recipes)[REFERENCE])(x, w, key, g)}
  times = {}
  for name, recipe in recipes:
    label = f"linear fwd+bwd {name} [{tokens}x{d_in}]@[{d_in}x{d_out}]"
    if not sec.has_time(12):
      sec.skip(label, "time budget")
      continue
    try:
      fn = step_fn(recipe)
      t = report.median_time(fn, [(x, w, key, g)], target_s=0.1, reps=2 if sec.dry else 5)
      out = fn(x, w, key, g)
      ref = refs["bf16" if name == "bf16" else REFERENCE]
      errs = [report.rel_errors(o, r) for o, r in zip(out[1], ref[1])]
      fro, mx, fin = max(e[0] for e in errs), max(e[1] for e in errs), all(e[2] for e in errs)
      times[name] = t
      tol = 3e-2 if name == "bf16" else 1e-3  # bf16 rounding of y and the grads / summation order only
      sec.add(label, t * 1e3, "ms", times.get("bf16", 0) * 1e3 or None, "bf16 ms", err=mx, ok=bool(fin and fro < tol),
              note=f"grads rel err {fro:.2g} vs {'f32 layer' if name == 'bf16' else REFERENCE}")
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(label, e)


def train_step_and_state(model_config, recipe, batch_size: int, seq_len: int):
  """(train step to jit, its step-0 state, the run's TrainConfig) for `model_config` under `recipe` (also used by
  benchmarks.gpu.aot, which compiles the same steps for sm_90 without a GPU)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  config = TrainConfig.from_options(model=model_config, recipe=recipe, batch_size=batch_size, seq_len=seq_len,
                                    steps=1000, progress=False)
  model = trainer.build_model(config, trainer.run_keys(0)["init"])
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  params = nnx.state(model, nnx.Param)
  state = steps_lib.TrainState(params, jax.jit(optimizer.init)(params), jnp.asarray(0, jnp.int32))
  return steps_lib.make_train_step(nnx.graphdef(model), optimizer), state, config


def _train_setup(model_config, recipe, batch_size: int, seq_len: int, dataset):
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  step, state, config = train_step_and_state(model_config, recipe, batch_size, seq_len)
  batches = [data.get_batch(dataset, "train", i, batch_size=batch_size, seq_len=config.train_seq_len, seed=0)
             for i in range(2)]
  return jax.jit(step, donate_argnums=0), state, batches, trainer.run_keys(0)["step"]  # donated, as in the trainer


def _dataset(sec: report.Section):
  """The default corpus, or random bytes where it cannot load (the GPU image may lack the corpus package)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  try:
    return data.load_dataset(data.DataConfig())
  except Exception as e:  # pylint: disable=broad-except
    sec.add("train data", note=f"default corpus unavailable ({type(e).__name__}: {str(e)[:80]}); random bytes used")
    tokens = np.random.default_rng(0).integers(0, 256, size=1 << 20).astype(np.uint16)
    return data.TokenDataset(train=tokens[: -(1 << 16)], val=tokens[-(1 << 16):], vocab_size=256,
                             source="random bytes")


def run_train(sec: report.Section) -> None:
  import statistics  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  dataset = _dataset(sec)
  recipes = _recipes()
  if sec.dry:  # interpret-mode kernels in a whole model are slow on CPU; test_backend_pallas covers that path
    models = {"tiny": (model_lib.get_model_config("tiny"), 2, 32, 1)}
    plan = [("tiny", r) for r in recipes[:2]]
  else:
    models = {"small": (model_lib.get_model_config("small"), *SMALL_BATCH_SEQ, 30),
              "paper_1b x2 layers": (model_lib.get_model_config("paper_1b", n_layers=2, max_seq_len=1024), 8, 1024,
                                     30)}
    # Priority order: nvfp4 vs bf16 on both models first, then the other backends.
    plan = [(m, r) for m in models for r in recipes[:2]] + [(m, r) for m in models for r in recipes[2:]]
  n_blocks = 1 if sec.dry else TIMING_BLOCKS
  base, base_min, ref_loss = {}, {}, {}
  for model_name, (name, recipe) in plan:
    model_config, batch, seq, steps = models[model_name]
    label = f"train step {model_name} {name} (batch {batch} x {seq})"
    if not sec.has_time(25):
      sec.skip(label, "time budget")
      continue
    try:
      step, state, batches, key = _train_setup(model_config, recipe, batch, seq, dataset)
      first, times = None, []
      for i in range(2 + steps):  # 2 warm-up steps (compile), then timed ones
        t0 = time.perf_counter()
        state, metrics = step(state, batches[i % 2], jax.random.fold_in(key, i))
        jax.block_until_ready(metrics)
        if i >= 2:
          times.append(time.perf_counter() - t0)
        if first is None:
          first = float(metrics["loss"])  # same init, batch and key for every recipe of a model
      last = float(metrics["loss"])
      per_block = len(times) // n_blocks
      blocks = [statistics.median(times[b * per_block:(b + 1) * per_block]) for b in range(n_blocks)]
      t = statistics.median(blocks)
      if name == "bf16":
        base[model_name], base_min[model_name] = t, min(blocks)
      # Same init, batch and key for every recipe of a model: the quantized rows' first losses differ only by the
      # GEMM's summation order (bf16 vs f32 mode) or backend, so each is checked against the first one measured.
      quantized = [(n, v) for (m, n), v in ref_loss.items() if m == model_name and n != "bf16"]
      ref_loss[(model_name, name)] = first
      ref_name, ref = quantized[0] if name != "bf16" and quantized else (name, first)
      err = abs(first - ref) / abs(ref)
      note = f"first loss {first:.5g}" + (f"; rel diff vs {ref_name} {err:.2g}" if ref_name != name else "")
      if name != "bf16" and (model_name, "bf16") in ref_loss:
        b = ref_loss[(model_name, "bf16")]
        note += f"; vs bf16 {abs(first - b) / abs(b):.2g}"
      note += f"; loss after {2 + steps} steps {last:.5g}"
      if n_blocks > 1:
        note += f"; block medians {'/'.join(f'{b * 1e3:.3g}' for b in blocks)} ms"
        if model_name in base_min and name != "bf16":
          note += f"; min ratio {min(blocks) / base_min[model_name]:.3g}"
      ok = bool(np.isfinite(first)) and err < 1e-3
      b_ms = base[model_name] * 1e3 if model_name in base else None
      sec.add(label, t * 1e3, "ms", b_ms, "bf16 ms", err=err, ok=ok, note=note)
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(label, e)
