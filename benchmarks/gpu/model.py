"""Sections `linear`, `train` and `repeat`: one quantized linear layer and whole training steps, nvfp4 against bf16.

`linear`: jitted value_and_grad of sum(y * G) for y = x W (x bf16 [T, D_in], W float32 [D_in, D_out]) under the
bf16 recipe and nvfp4 on the xla path in its default bf16-operand GEMM mode, in its float32 HIGHEST mode (the
reference) and on the Pallas backend, then tetrajet_v2 in its float32 mode, its bf16 mode (one bf16 GEMM per
1x128 group: is that faster than FP32 units on this GPU at K = 4096?) and on the Pallas backend (quantizers on
XLA, GEMMs in the Pallas kernel, which scales each K step of 128 by the group factors). Quantized rows compare
(dx, dW) with their recipe's float32-mode run on the same key (same stochastic-rounding draws); the bf16 row with a
float32 HIGHEST layer.
`train`: `fp4jax.pretrain` train steps (AdamW, real batches) of the `small` model and of a 2-layer slice of the
paper's 1.2B model (d_model 2048, 1024-token sequences), in groups timed together: first bf16 and nvfp4 on each
model, then the other nvfp4 rows with bf16 once more. Each recipe of a group is compiled and warmed up, then the
recipes take turns in 6 blocks of 5 timed steps (A B, B A, A B, ...: a drift of the machine's speed during the run
hits every recipe alike; the order run is in each row). A row reports its median block time against bf16's in the
same group, and the median and min over blocks of the paired ratio (its block over bf16's same block); the first
step's loss of each quantized row compared with the first quantized row's (bf16 vs nvfp4 shown as is); and the loss
at its last timed step (`loss@step`, two batches, alternating), so that no speed is read without what the step
learns.
`repeat`: the priority train rows (bf16 and nvfp4, both models) in each of several separate processes, the block
order rotated by the process's number, then one row per train row with the min and median of its ratio over the
processes (issue 12 asks for >= 3 runs); plus each model's nvfp4 step traced with the platform's inexact float32
divide (`native_division`), timed in blocks with bf16 and nvfp4, whose paired ratio against the nvfp4 blocks is
what the exact scale division (fp4jax.division: float64 quotients on GPUs) costs the step.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from unittest import mock

from benchmarks.gpu import report
from benchmarks.interleave import block_orders, paired_ratios


SMALL_BATCH_SEQ = (32, 128)  # the `small` model's train rows: sequences x tokens
REFERENCE = "nvfp4 xla f32"  # the quantized rows' reference: dequantized float32 operands at HIGHEST precision
NVFP4 = "nvfp4 xla bf16"  # the default nvfp4 train row: the xla path, bf16-operand GEMMs
TETRAJET_REFERENCE = "tetrajet_v2 xla f32"  # `linear` only: double-block operands, float32 HIGHEST GEMMs
TETRAJET = "tetrajet_v2 xla bf16"  # `linear` only: one bf16 GEMM per 1x128 group of the contraction
TETRAJET_PALLAS = "tetrajet_v2 pallas"  # `linear` only: the Pallas GEMM, one K step per 1x128 group
# The `repeat` section's extra row: nvfp4 traced with XLA's own float32 divide for the scale quotients.
NATIVE_DIVISION = f"{NVFP4}, native division"
# Train rows: after WARMUP_STEPS (the first compiles or loads), TIMING_BLOCKS blocks of BLOCK_STEPS timed steps per
# recipe, the recipes of a group taking turns block by block (`block_orders`).
WARMUP_STEPS = 2
TIMING_BLOCKS = 6
BLOCK_STEPS = 5
_now = time.perf_counter  # the train steps' clock (a test drives a fake one)


def _recipes():
  """[(label, recipe)] to time, in priority order: bf16, nvfp4 as trained by default (xla, bf16 operands), the
  float32 reference GEMM mode, the Pallas backend."""
  import fp4jax  # pylint: disable=g-import-not-at-top
  nvfp4 = fp4jax.recipes.nvfp4()
  return [("bf16", fp4jax.recipes.bf16()), (NVFP4, nvfp4.replace(gemm_mode="bf16")),
          (REFERENCE, nvfp4.replace(gemm_mode="f32")), ("nvfp4 pallas", nvfp4.replace(backend="pallas"))]


def _linear_recipes():
  """_recipes(), then tetrajet_v2 in its float32 GEMM mode, in bf16 mode, where its double-block operands run one
  bf16 GEMM per 1x128 group of the contraction (fp4jax.gemm.grouped_gemm: 32 per GEMM at D_in = 4096, 64 for Wgrad
  over 8192 tokens), and on the Pallas backend (one kernel per GEMM). Last, so they run only with time to spare in
  the section."""
  import fp4jax  # pylint: disable=g-import-not-at-top
  tetrajet = fp4jax.recipes.tetrajet_v2()
  return _recipes() + [(TETRAJET_REFERENCE, tetrajet.replace(gemm_mode="f32")),
                       (TETRAJET, tetrajet.replace(gemm_mode="bf16")),
                       (TETRAJET_PALLAS, tetrajet.replace(backend="pallas"))]


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

  recipes = _linear_recipes()
  refs = {"bf16": jax.jit(jax.value_and_grad(f32_loss, argnums=(0, 1)))(x, w, key, g),
          REFERENCE: step_fn(dict(recipes)[REFERENCE])(x, w, key, g)}
  ref_of = {"bf16": "bf16", TETRAJET_REFERENCE: TETRAJET_REFERENCE, TETRAJET: TETRAJET_REFERENCE,
            TETRAJET_PALLAS: TETRAJET_REFERENCE}
  times = {}
  for name, recipe in recipes:
    label = f"linear fwd+bwd {name} [{tokens}x{d_in}]@[{d_in}x{d_out}]"
    if not sec.has_time(12):
      sec.skip(label, "time budget")
      continue
    if name in (TETRAJET, TETRAJET_PALLAS) and TETRAJET_REFERENCE not in refs:  # its row failed or was skipped
      sec.skip(label, f"no {TETRAJET_REFERENCE} run to compare with")
      continue
    try:
      fn = step_fn(recipe)
      t = report.median_time(fn, [(x, w, key, g)], target_s=0.1, reps=2 if sec.dry else 5)
      out = fn(x, w, key, g)
      if name == TETRAJET_REFERENCE:
        refs[name] = out
      ref = refs[ref_of.get(name, REFERENCE)]
      errs = [report.rel_errors(o, r) for o, r in zip(out[1], ref[1])]
      fro, mx, fin = max(e[0] for e in errs), max(e[1] for e in errs), all(e[2] for e in errs)
      times[name] = t
      tol = 3e-2 if name == "bf16" else 1e-3  # bf16 rounding of y and the grads / summation order only
      sec.add(label, t * 1e3, "ms", times.get("bf16", 0) * 1e3 or None, "bf16 ms", err=mx, ok=bool(fin and fro < tol),
              note=f"grads rel err {fro:.2g} vs {'f32 layer' if name == 'bf16' else ref_of.get(name, REFERENCE)}")
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
  """(compiled train step, its step-0 state, two batches, the step key). Compiled ahead of time: a Compiled object
  keeps its program when `native_division` clears JAX's caches, so the recipes can be stepped in turn."""
  import jax  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  step, state, config = train_step_and_state(model_config, recipe, batch_size, seq_len)
  batches = [data.get_batch(dataset, "train", i, batch_size=batch_size, seq_len=config.train_seq_len, seed=0)
             for i in range(2)]
  key = trainer.run_keys(0)["step"]
  compiled = jax.jit(step, donate_argnums=0).lower(state, batches[0], key).compile()  # donated, as in the trainer
  return compiled, state, batches, key


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
  """(models {name: (config, batch, seq)}, groups [(model name, [(label, recipe), ...])] in priority order). Each
  group's recipes are timed together, interleaved block by block; its first recipe (bf16) is the baseline. A recipe
  in several groups of a model is compiled once and timed again alongside the later group's."""
  from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top
  recipes = _recipes()
  native = (NATIVE_DIVISION, recipes[1][1])
  if dry:  # interpret-mode kernels in a whole model are slow on CPU; test_backend_pallas covers that path
    # One block: the plumbing is the same, and XLA:CPU compiles each step in about half the time of two blocks.
    models = {"tiny": (model_lib.get_model_config("tiny", n_layers=1), 2, 32)}
    return models, [("tiny", recipes[:2] + ([native] if priority_only else []))]
  models = {"small": (model_lib.get_model_config("small"), *SMALL_BATCH_SEQ),
            "paper_1b x2 layers": (model_lib.get_model_config("paper_1b", n_layers=2, max_seq_len=1024), 8, 1024)}
  # Priority order: nvfp4 vs bf16 on both models first, then the other backends against bf16 once more.
  plan = [(m, recipes[:2]) for m in models]
  if priority_only:  # and what the exact scale division costs each step, timed alongside the nvfp4 step
    return models, plan + [(m, recipes[:2] + [native]) for m in models]
  return models, plan + [(m, recipes[:1] + recipes[2:]) for m in models]


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


LOOP_STEPS = 60  # `loop`: trainer steps per recipe; the first LOOP_SKIP (compile, first calls) are not counted
LOOP_SKIP = 10


def _loop_corpus(sec: report.Section, folder: str) -> str:
  """The default corpus where it loads, else a file of random printable bytes in `folder` (as `_dataset`)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  try:
    data.load_dataset(data.DataConfig())
    return data.BUILTIN_CORPUS
  except Exception as e:  # pylint: disable=broad-except
    path = os.path.join(folder, "random.txt")
    with open(path, "wb") as f:
      f.write(np.random.default_rng(0).integers(32, 127, size=1 << 20).astype(np.uint8).tobytes())
    sec.add("loop data", note=f"default corpus unavailable ({type(e).__name__}: {str(e)[:80]}); random bytes used")
    return path


def run_loop(sec: report.Section) -> None:
  """Section `loop`: `fp4jax.pretrain.trainer.train` itself (what `fp4jax train` runs) on the `tiny` model, then
  `small` (not in dry runs), bf16 and nvfp4, LOOP_STEPS steps each, overlapped (as `fp4jax train` runs: step s + 1
  sent before step s's loss is read) and synchronous (a hook reading the state after every step), twice each,
  alternating: benchmarks/trainer_loop.py. The synchronous loop's period minus its step is the host's work between
  steps: on a GPU with steps of a few ms, time the device would idle, which the overlapped loop should hide (its
  period against the synchronous one, value against baseline). Each row: both periods, the synchronous step and
  host work, and the loss at the last step, which must be the same in both modes (the row fails otherwise)."""
  from benchmarks import trainer_loop  # pylint: disable=g-import-not-at-top
  steps = 16 if sec.dry else LOOP_STEPS
  skip = 4 if sec.dry else LOOP_SKIP
  with tempfile.TemporaryDirectory() as folder:
    _time_loops(sec, trainer_loop, steps, skip, _loop_corpus(sec, folder))


def _time_loops(sec: report.Section, trainer_loop, steps: int, skip: int, corpus: str) -> None:
  for model in ("tiny",) if sec.dry else ("tiny", "small"):
    for recipe in ("bf16", "nvfp4"):
      label = f"trainer loop {model} {recipe} (batch 8)"
      if not sec.has_time(30 if model == "tiny" else 45):
        sec.skip(label, "time budget")
        continue
      try:
        best = trainer_loop.loop_periods(model, recipe, steps=steps, skip=skip, rounds=2, batch_size=8,
                                         corpus=corpus)
        over, sync = best["overlapped"], best["synchronous"]
        sec.add(label, over["period"] * 1e3, "ms period", sync["period"] * 1e3, "ms period synchronous",
                ok=over["loss"] == sync["loss"],
                note=f"synchronous: step {1e3 * sync['step']:.2f} ms, host work between steps "
                     f"{1e3 * (sync['period'] - sync['step']):.2f} ms; loss {over['loss']:.4f} after {steps} steps "
                     f"(synchronous {sync['loss']:.4f}); {over['counted']} periods counted")
      except Exception as e:  # pylint: disable=broad-except
        sec.fail(label, e)


def _train_step(run: dict) -> float:
  """Runs one train step of `run` (its own step count picks the batch and key); returns its seconds."""
  import jax  # pylint: disable=g-import-not-at-top
  i = run["i"]
  # The key outside the clock: `native_division` clears JAX's caches, and fold_in's next call compiles it again.
  key = jax.block_until_ready(jax.random.fold_in(run["key"], i))
  t0 = _now()
  state, metrics = run["step"](run["state"], run["batches"][i % 2], key)
  jax.block_until_ready(metrics)
  seconds = _now() - t0
  run["state"], run["i"] = state, i + 1
  run["loss"] = float(metrics["loss"])  # the loss of step i's batch, before its update
  run.setdefault("first_loss", run["loss"])  # same init, batch and key for every recipe of a model
  return seconds


def _prepare(model_config, name: str, recipe, batch: int, seq: int, dataset) -> dict:
  """A recipe's compiled step and state, after the warm-up steps."""
  with native_division() if name == NATIVE_DIVISION else contextlib.nullcontext():
    step, state, batches, key = _train_setup(model_config, recipe, batch, seq, dataset)
  run = {"step": step, "state": state, "batches": batches, "key": key, "i": 0}
  for _ in range(WARMUP_STEPS):
    _train_step(run)
  return run


def _time_blocks(sec: report.Section, runs: dict[str, dict], n_blocks: int, per_block: int, offset: int):
  """Times `per_block` steps of every run per block, the runs taking turns as `block_orders` says. Returns
  ({name: [median seconds per block]}, the orders run, {name: the exception of a run that failed})."""
  import gc  # pylint: disable=g-import-not-at-top
  import statistics  # pylint: disable=g-import-not-at-top
  block_s, orders, failed = {name: [] for name in runs}, [], {}
  # What the set-up left (`native_division` clears JAX's caches) is collected now, not by a full collection that
  # Python starts inside the first timed step (~150 ms of a CPU dry run's 5 ms step).
  gc.collect()
  for order in block_orders(list(runs), n_blocks, offset):
    if orders and not sec.has_time(5):
      break
    order = [name for name in order if name not in failed]
    for name in order:
      try:
        block_s[name].append(statistics.median([_train_step(runs[name]) for _ in range(per_block)]))
      except Exception as e:  # pylint: disable=broad-except
        failed[name] = e
    orders.append(order)
  return block_s, orders, failed


def _time_train_steps(sec: report.Section, models, plan, prefix: str = "") -> None:
  """Times each group of `plan` as `_time_blocks` does and adds a row per recipe the first time it is timed."""
  import statistics  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  dataset = _dataset(sec)
  n_blocks, per_block = (2, 1) if sec.dry else (TIMING_BLOCKS, BLOCK_STEPS)
  runs, reported, ref_loss = {}, set(), {}
  for g, (model_name, group) in enumerate(plan):
    model_config, batch, seq = models[model_name]
    label = f"{prefix}train step {model_name} {{}} (batch {batch} x {seq})".format
    for name, recipe in group:
      if (model_name, name) in runs or (model_name, name) in reported:
        continue
      if not sec.has_time(25):
        sec.skip(label(name), "time budget")
        reported.add((model_name, name))
        continue
      try:
        runs[(model_name, name)] = _prepare(model_config, name, recipe, batch, seq, dataset)
      except Exception as e:  # pylint: disable=broad-except
        sec.fail(label(name), e)
        reported.add((model_name, name))
    names = [name for name, _ in group if (model_name, name) in runs]
    block_s, orders, failed = _time_blocks(sec, {n: runs[(model_name, n)] for n in names}, n_blocks, per_block,
                                           offset=sec.run)
    base = group[0][0]
    ratios = paired_ratios(block_s, base) if block_s.get(base) else {}
    for name in names:
      if name in failed:  # a row of its own even if an earlier group reported the recipe: its state is lost
        sec.fail(label(name), failed[name])
        reported.add((model_name, name))
        del runs[(model_name, name)]
        continue
      if (model_name, name) in reported:
        continue
      reported.add((model_name, name))
      run, times = runs[(model_name, name)], block_s[name]
      first, t = run["first_loss"], statistics.median(times)
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
      note += f"; loss@step {run['loss']:.5g}@{run['i']} (after {run['i'] - 1} updates)"
      note += f"; block medians {'/'.join(f'{v * 1e3:.3g}' for v in times)} ms"
      extra = {}
      if name in ratios and name != base:
        r = ratios[name]
        extra = {"median_ratio": statistics.median(r), "min_ratio": min(r), "block_ratios": r}
        note += (f"; block ratios {'/'.join(f'{v:.3g}' for v in r)} (median {extra['median_ratio']:.3g}, "
                 f"min {extra['min_ratio']:.3g})")
      if name == NATIVE_DIVISION and block_s.get(NVFP4):
        exact = [a / b for a, b in zip(block_s[NVFP4], times)]  # the same blocks: what the exact division costs
        extra["exact_over_native"] = statistics.median(exact)
        note += f"; {NVFP4} / this {'/'.join(f'{v:.3g}' for v in exact)}"
      note += (f"; order {' '.join(''.join(str(names.index(n)) for n in o) for o in orders)} "
               f"({', '.join(f'{i} = {n}' for i, n in enumerate(names))})")
      ok = bool(np.isfinite(first)) and err < 1e-3
      b_ms = statistics.median(block_s[base]) * 1e3 if block_s.get(base) else None
      sec.add(label(name), t * 1e3, "ms", b_ms, "bf16 ms", err=err, ok=ok, note=note, final_loss=run["loss"],
              loss_step=run["i"], block_order=orders, **extra)
    later = {(m, n) for m, grp in plan[g + 1:] for n, _ in grp}
    for key in [k for k in runs if k not in later]:  # free the device memory of what no later group times
      del runs[key]


def summarize_runs(out: str) -> list[dict]:
  """Appends one row per train row that the `repeat` section's processes measured: the median and the min over the
  runs of its step-time ratio to bf16 (each run's ratio is the median of its paired block ratios; "min block" is the
  smallest block ratio of any run), with each run's loss after the timed steps. Returns them."""
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
    ratios = [runs[k].get("median_ratio", runs[k]["ratio"]) for k in order]
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
    if common:  # the exact division's cost, run by run: paired in the same blocks where the row says so
      cost = [runs[k].get("exact_over_native", exact[k]["value"] / runs[k]["value"]) for k in common]
      note += f"; exact division / native: {'/'.join(f'{v:.3g}' for v in cost)} (median {statistics.median(cost):.3g})"
    row = sec.add(f"over {len(order)} runs: {label}", median, "x (median ratio)", 1.0, "bf16 of each run",
                  ok=all(runs[k].get("ok") for k in order), note=note, median_ratio=median, min_ratio=min(ratios),
                  runs=len(order))
    added.append(row)
  return added
