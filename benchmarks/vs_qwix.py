"""fp4jax recipes and Google's Qwix (quantized training rules) side by side: step time and loss after N steps.

  pip install -e ".[bench]"          # qwix, installed with --no-deps if pip would move jax
  python benchmarks/vs_qwix.py                                    # the MLP and the `small` model
  python benchmarks/vs_qwix.py --parts mlp --steps 10 --runs 3

Workloads:
  mlp    4 linear layers of width 1024 (ReLU between), batch 2048, MSE against a fixed random teacher, AdamW,
         float32 activations and weights. Baseline: the same MLP unquantized (plain float32 dot_generals).
  small  the `small` Transformer of fp4jax.pretrain (its train step, real batches). Baseline: recipe bf16. Qwix
         rows intercept the linear layers' dot_generals of that bf16 model.
Rows: fp4jax recipes (CLI strings), and Qwix's QtRule with weight, activation and backward qtype nvfp4 (tiles of
16), mxfp4 (32) or float8_e4m3fn (per channel). Qwix's NVFP4 has one scale level (E4M3 block scales without a
per-tensor scale), no stochastic rounding and no RHT, so "nvfp4:stochastic_rounding=false,rht=false" is the fp4jax
row doing comparable work. Each row reports the median and min over --runs blocks of timed steps of its step-time
ratio to the baseline (rows interleaved step by step), and its loss after all the steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import optax  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

import fp4jax  # pylint: disable=wrong-import-position

QWIX_RULES = {  # qtype, tile size along the contraction axes
    "qwix:nvfp4": ("nvfp4", 16),
    "qwix:mxfp4": ("mxfp4", 32),
    "qwix:fp8": ("float8_e4m3fn", None),
}
DEFAULT_FP4JAX = ["nvfp4", "nvfp4:stochastic_rounding=false", "nvfp4:stochastic_rounding=false,rht=false",
                  "mxfp4", "fp8"]


def qwix_provider(name: str):
  import qwix  # pylint: disable=g-import-not-at-top
  qtype, tile = QWIX_RULES[name]
  # Every backward operand quantized too, in tiles along its contraction axis (FP4 formats need the tiles).
  extra = {"dlhs_tile_size": tile, "drhs_tile_size": tile} if tile else None
  # Only dot_general: the linear layers (attention's einsums stay in high precision, as in fp4jax). Not the `small`
  # model's lm_head, which fp4jax's recipes keep in BF16: quantizing it cost Qwix's nvfp4 row ~0.38 nats after 14
  # steps and made up the whole mxfp4 loss gap (paths are "/"-joined, matched with re.fullmatch).
  rule = qwix.QtRule(module_path=r"(?!lm_head(/|$)).*", op_names=("dot_general",), weight_qtype=qtype, act_qtype=qtype,
                     bwd_qtype=qtype, tile_size=tile, bwd_weight_grad_tile_size=tile, additional_qt_config=extra)
  return qwix.QtProvider([rule])


# --- the MLP --------------------------------------------------------------------------------------------------------

class MLP(nnx.Module):
  """Four width x width layers; fp4jax.nn.Linear under `recipe`, or nnx.Linear (recipe None, for Qwix)."""

  def __init__(self, width: int, recipe, rngs: nnx.Rngs):
    if recipe is None:
      make = lambda: nnx.Linear(width, width, use_bias=False, rngs=rngs)
    else:
      make = lambda: fp4jax.nn.Linear(width, width, recipe=recipe, dtype=jnp.float32, rngs=rngs)
    self.layers = nnx.List([make() for _ in range(4)])

  def __call__(self, x, key=None):
    for i, layer in enumerate(self.layers):
      if isinstance(layer, fp4jax.nn.Linear):
        x = layer(x, key=None if key is None else jax.random.fold_in(key, i))
      else:
        x = layer(x)
      if i < len(self.layers) - 1:
        x = jax.nn.relu(x)
    return x


def _mlp_run(name: str, width: int, batch: int):
  """(step fn, state) of one MLP row; step(state, key) -> (state, loss)."""
  x = jax.random.normal(jax.random.key(0), (batch, width), jnp.float32)
  teacher = jax.random.normal(jax.random.key(1), (width, width), jnp.float32) / np.sqrt(width)
  y = jnp.tanh(x @ teacher)
  if name.startswith("qwix:"):
    model = nnx.merge(*nnx.split(MLP(width, None, nnx.Rngs(2))))
    model = __import__("qwix").quantize_model(model, qwix_provider(name), x)
  else:
    model = MLP(width, "bf16" if name == "unquantized" else name, nnx.Rngs(2))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optax.adamw(1e-3)

  def step(state, key, x, y):  # x, y as arguments: Qwix takes a constant (closed-over) operand for a weight
    params, opt_state = state

    def loss_fn(p):
      out = nnx.merge(graphdef, p, rest)(x, key)
      return jnp.mean((out.astype(jnp.float32) - y)**2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  jitted = jax.jit(step, donate_argnums=0)
  return lambda state, key: jitted(state, key, x, y), (params, opt.init(params))


# --- the small Transformer ------------------------------------------------------------------------------------------

def _small_run(name: str, batch: int, model_name: str = "small"):
  """(step(state, key) -> (state, loss), state) of the pretraining Transformer `model_name` under recipe `name`."""
  from fp4jax.pretrain import data  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  recipe = "bf16" if name.startswith("qwix:") or name == "unquantized" else name
  config = TrainConfig.from_options(model=model_name, recipe=recipe, batch_size=batch, steps=1000, progress=False)
  keys = trainer.run_keys(0)
  model = trainer.build_model(config, keys["init"])
  dataset = data.load_dataset(data.DataConfig())
  batches = [data.get_batch(dataset, "train", i, batch_size=batch, seq_len=config.train_seq_len, seed=0)
             for i in range(4)]
  if name.startswith("qwix:"):
    import qwix  # pylint: disable=g-import-not-at-top
    inputs = jnp.asarray(batches[0]["inputs"]) if isinstance(batches[0], dict) else batches[0][0]
    model = qwix.quantize_model(model, qwix_provider(name), inputs)
  graphdef = nnx.graphdef(model)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.steps)
  params = nnx.state(model, nnx.Param)
  state = steps_lib.TrainState(params, jax.jit(optimizer.init)(params), jnp.asarray(0, jnp.int32))
  train_step = jax.jit(steps_lib.make_train_step(graphdef, optimizer))
  counter = {"i": 0}

  def step(state, key):
    batch_i = batches[counter["i"] % len(batches)]
    counter["i"] += 1
    state, metrics = train_step(state, batch_i, key)
    return state, metrics["loss"]

  return step, state


# --- timing ---------------------------------------------------------------------------------------------------------

def run_part(part: str, names: list[str], *, steps: int, warmup: int, runs: int, width: int, batch: int):
  """({name: [median step-time ratio to "unquantized" per run]}, {name: median step s}, {name: final loss}).

  Each row compiles once; then `warmup` steps, then `runs` blocks of `steps` timed steps, rows interleaved step by
  step so that load from other processes hits every row alike. The loss is the last step's (training goes on
  across blocks: warmup + runs * steps steps in all).
  """
  setups = {n: _mlp_run(n, width, batch) if part == "mlp" else _small_run(n, batch) for n in names}
  states = {n: setups[n][1] for n in names}
  times = {n: [] for n in names}
  losses = {}
  for i in range(warmup + runs * steps):
    key = jax.random.fold_in(jax.random.key(7), i)
    for n in names:
      t0 = time.perf_counter()
      states[n], loss = setups[n][0](states[n], key)
      jax.block_until_ready(loss)
      if i >= warmup:
        times[n].append(time.perf_counter() - t0)
      losses[n] = float(loss)
  ratios = {n: [] for n in names}
  for b in range(runs):
    base = statistics.median(times["unquantized"][b * steps:(b + 1) * steps])
    for n in names:
      ratios[n].append(statistics.median(times[n][b * steps:(b + 1) * steps]) / base)
  return ratios, {n: statistics.median(times[n]) for n in names}, losses


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", default="mlp,small", help="comma-separated: mlp, small")
  parser.add_argument("--recipes", nargs="*", default=DEFAULT_FP4JAX, help="fp4jax recipes (CLI strings)")
  parser.add_argument("--qwix", default=",".join(QWIX_RULES), help="Qwix rows (empty: none)")
  parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1: the first step compiles)")
  parser.add_argument("--runs", type=int, default=3, help="blocks of --steps timed steps; min and median reported")
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=2048, help="MLP batch")
  parser.add_argument("--small-batch", type=int, default=8)
  args = parser.parse_args(argv)
  for flag in ("steps", "warmup", "runs"):  # steps compile on their first call: with no warmup the compile is timed
    if getattr(args, flag) < 1:
      parser.error(f"--{flag} must be >= 1; got {getattr(args, flag)}.")
  qwix_rows = [q for q in args.qwix.split(",") if q]
  unknown = [q for q in qwix_rows if q not in QWIX_RULES]
  if unknown:
    parser.error(f"unknown Qwix rows {unknown}; choose from {list(QWIX_RULES)}.")
  if qwix_rows:
    try:
      import qwix  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      parser.error("Qwix rows need qwix: pip install -e '.[bench]' (or --qwix '' for fp4jax rows only).")
  names = ["unquantized"] + args.recipes + qwix_rows
  print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs; {args.runs} runs x "
        f"{args.steps} steps (+{args.warmup} warmup), recipes interleaved")
  for part in args.parts.split(","):
    ratios, step_s, losses = run_part(part, names, steps=args.steps, warmup=args.warmup, runs=args.runs,
                                      width=args.width, batch=args.batch if part == "mlp" else args.small_batch)
    n_steps = args.warmup + args.runs * args.steps
    print(f"\n{part}: step time / unquantized step time (median, min over runs), loss of step {n_steps} "
          f"(after {n_steps - 1} updates)")
    print(f"  {'row':<46} {'median':>7} {'min':>6} {'step ms':>8} {'loss':>10}")
    for n in names:
      print(f"  {n:<46} {statistics.median(ratios[n]):>7.2f} {min(ratios[n]):>6.2f} {1e3 * step_s[n]:>8.1f} "
            f"{losses[n]:>10.5f}")


if __name__ == "__main__":
  main()
