"""Sections `linear`, `train` and `repeat`: one quantized linear layer and whole training steps, nvfp4 against bf16.

`linear`: jitted value_and_grad of sum(y * G) for y = x W (x bf16 [T, D_in], W float32 [D_in, D_out]) under the
bf16 recipe and nvfp4 on the xla path in its default bf16-operand GEMM mode, in its float32 HIGHEST mode (the
reference) and on the Pallas backend. Quantized rows compare (dx, dW) with the float32-mode reference run on the
same key (same stochastic-rounding draws); the bf16 row with a float32 HIGHEST layer.
`train`: `fp4jax.pretrain` train steps (AdamW, real batches) of the `small` model and of a 2-layer slice of the
paper's 1.2B model (d_model 2048, 1024-token sequences): 30 timed steps in 3 blocks of 10, the median block's step
time per recipe relative to bf16 (and the smallest block against bf16's smallest: min and median), and the
first step's loss of each quantized row compared with the first quantized row's (bf16 vs nvfp4 shown as is), and
the loss after the timed steps (two batches, alternating), so that no speed is read without what the step learns.
`repeat`: the priority train rows (bf16 and nvfp4, both models) in each of several separate processes, then one
row per train row with the min and median of its ratio over the processes (issue 12 asks for >= 3 runs); plus each
model's nvfp4 step traced with the platform's inexact float32 divide (`native_division`), whose ratio against the
nvfp4 row is what the exact scale division (fp4jax.division: float64 quotients on GPUs) costs the step.
"""

from __future__ import annotations

import contextlib
from unittest import mock

from benchmarks.gpu import report


SMALL_BATCH_SEQ = (32, 128)  # the `small` model's train rows: sequences x tokens
REFERENCE = "nvfp4 xla f32"  # the quantized rows' reference: dequantized float32 operands at HIGHEST precision
NVFP4 = "nvfp4 xla bf16"  # the default nvfp4 train row: the xla path, bf16-operand GEMMs
# The `repeat` section's extra row: nvfp4 traced with XLA's own float32 divide for the scale quotients.
NATIVE_DIVISION = f"{NVFP4}, native division"
TIMING_BLOCKS = 3  # train rows: timed steps in 3 blocks; the row reports the median block and the min ratio


def _recipes():
  """[(label, recipe)] to time, in priority order: bf16, nvfp4 as trained by default (xla, bf16 operands), the
  float32 reference GEMM mode, the Pallas backend."""
  import fp4jax  # pylint: disable=g-import-not-at-top
  nvfp4 = fp4jax.recipes.nvfp4()
  return [("bf16", fp4jax.recipes.bf16()), (NVFP4, nvfp4.replace(gemm_mode="bf16")),
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


def _train_plan(dry: bool, priority_only: bool = False):
  """(models {name: (config, batch, seq, timed steps)}, [(model name, (label, recipe))] in priority order)."""
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  recipes = _recipes()
  if dry:  # interpret-mode kernels in a whole model are slow on CPU; test_backend_pallas covers that path
    models = {"tiny": (model_lib.get_model_config("tiny"), 2, 32, 1)}
    extra = [("tiny", (NATIVE_DIVISION, recipes[1][1]))] if priority_only else []
    return models, [("tiny", r) for r in recipes[:2]] + extra
  models = {"small": (model_lib.get_model_config("small"), *SMALL_BATCH_SEQ, 30),
            "paper_1b x2 layers": (model_lib.get_model_config("paper_1b", n_layers=2, max_seq_len=1024), 8, 1024,
                                   30)}
  # Priority order: nvfp4 vs bf16 on both models first, then the other backends.
  plan = [(m, r) for m in models for r in recipes[:2]]
  if priority_only:  # and what the exact scale division costs each step (last: they clear JAX's trace caches)
    return models, plan + [(m, (NATIVE_DIVISION, recipes[1][1])) for m in models]
  return models, plan + [(m, r) for m in models for r in recipes[2:]]


@contextlib.contextmanager
def native_division():
  """Traces fp4jax's scale quotients with the platform's own float32 divide (XLA:GPU: `div.full.f32`, up to 2 ulp
  off) instead of the correctly rounded ones of `fp4jax.division` (float64 on GPUs, `divide_by_bits` elsewhere):
  the row timed under it shows what the exact division costs a step. JAX's trace caches are cleared on entry and
  on exit, so no jaxpr traced inside (nested jits cache theirs) leaks into another row."""
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax import division  # pylint: disable=g-import-not-at-top
  native = lambda a, b, approx=None: jax.numpy.divide(a, b)
  jax.clear_caches()
  try:
    with mock.patch.object(division, "divide_in_float64", native), mock.patch.object(division, "divide_by_bits",
                                                                                         native):
      yield
  finally:
    jax.clear_caches()


def run_train(sec: report.Section) -> None:
  models, plan = _train_plan(sec.dry)
  _time_train_steps(sec, models, plan)


def run_repeat(sec: report.Section) -> None:
  """Section `repeat`: the `train` section's priority rows (bf16 and nvfp4 on both models) once more, as run
  `sec.run` of several separate processes (benchmarks/gpu.sh starts them, sharing one compilation cache, so only
  the first compiles); `summarize_runs` then reports each ratio's min and median over the processes."""
  models, plan = _train_plan(sec.dry, priority_only=True)
  _time_train_steps(sec, models, plan, prefix=f"run {sec.run}: ")


def _time_train_steps(sec: report.Section, models, plan, prefix: str = "") -> None:
  import statistics  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  dataset = _dataset(sec)
  n_blocks = 1 if sec.dry else TIMING_BLOCKS
  base, base_min, ref_loss = {}, {}, {}
  for model_name, (name, recipe) in plan:
    model_config, batch, seq, steps = models[model_name]
    label = f"{prefix}train step {model_name} {name} (batch {batch} x {seq})"
    if not sec.has_time(25):
      sec.skip(label, "time budget")
      continue
    try:
      step, state, batches, key = _train_setup(model_config, recipe, batch, seq, dataset)
      first, times = None, []
      with native_division() if name == NATIVE_DIVISION else contextlib.nullcontext():
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
      note += f"; loss at step {2 + steps} {last:.5g} (after {1 + steps} updates)"
      min_ratio = min(blocks) / base_min[model_name] if model_name in base_min else None
      if n_blocks > 1:
        note += f"; block medians {'/'.join(f'{b * 1e3:.3g}' for b in blocks)} ms"
        if min_ratio is not None and name != "bf16":
          note += f"; min ratio {min_ratio:.3g}"
      ok = bool(np.isfinite(first)) and err < 1e-3
      b_ms = base[model_name] * 1e3 if model_name in base else None
      sec.add(label, t * 1e3, "ms", b_ms, "bf16 ms", err=err, ok=ok, note=note, min_ratio=min_ratio,
              final_loss=last)
    except Exception as e:  # pylint: disable=broad-except
      sec.fail(label, e)


def summarize_runs(out: str) -> list[dict]:
  """Appends one row per train row that the `repeat` section's processes measured: the median and the min of its
  step-time ratio to bf16 over the runs (each run's ratio is its median block's; "min block" is the smallest over
  every run of its fastest block against bf16's fastest), with each run's loss after the timed steps. Returns them."""
  import re  # pylint: disable=g-import-not-at-top
  import statistics  # pylint: disable=g-import-not-at-top
  by_label = {}
  for r in report.read_rows(out):
    m = re.match(r"run (\d+): (.*)", r["name"]) if r["section"] == "repeat" else None
    if m and r.get("ratio") is not None:
      by_label.setdefault(m.group(2), {})[int(m.group(1))] = r  # a rerun of the same process number replaces it
  sec = report.Section("repeat", out, deadline=float("inf"), dry=False)
  added = []
  for label, runs in by_label.items():
    order = sorted(runs)
    ratios = [runs[k]["ratio"] for k in order]
    mins = [runs[k]["min_ratio"] for k in order if runs[k].get("min_ratio") is not None]
    losses = [runs[k].get("final_loss") for k in order]
    median = statistics.median(ratios)
    note = (f"runs {'/'.join(str(k) for k in order)}: ratios {'/'.join(f'{v:.3g}' for v in ratios)}; "
            f"median {median:.3g}, min {min(ratios):.3g}")
    if mins:
      note += f"; min block ratio {min(mins):.3g}"
    if all(v is not None for v in losses):
      note += f"; loss after the timed steps {'/'.join(f'{v:.5g}' for v in losses)}"
    step_ms = [runs[k]["value"] for k in order]
    note += f"; step ms {'/'.join(f'{v:.4g}' for v in step_ms)}"
    exact = by_label.get(label.replace(NATIVE_DIVISION, NVFP4)) if NATIVE_DIVISION in label else None
    common = [k for k in order if exact and k in exact]
    if common:  # the exact division's cost: the nvfp4 step over this one, run by run (same process, same machine)
      cost = [exact[k]["value"] / runs[k]["value"] for k in common]
      note += f"; exact division / native: {'/'.join(f'{v:.3g}' for v in cost)} (median {statistics.median(cost):.3g})"
    row = sec.add(f"over {len(order)} runs: {label}", median, "x (median ratio)", 1.0, "bf16 of each run",
                  ok=all(runs[k].get("ok") for k in order), note=note, median_ratio=median, min_ratio=min(ratios),
                  runs=len(order))
    added.append(row)
  return added
