"""Training step time per mesh layout on 8 simulated CPU devices, as ratios to the pure data-parallel (8,1,1) mesh.

Catches layouts whose collectives explode (a ratio far above the others). Simulated devices share this machine's
cores, so absolute times mean little; the ratios between layouts measured in one run are the figure.

  python benchmarks/mesh.py [--recipe nvfp4] [--steps 5] [--runs 3] [--batch 16] [--seq 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import interleave  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import model as model_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import steps as steps_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top,wrong-import-position

MESHES = ((8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 2, 1), (2, 1, 4))
# Widths whose per-shard slices stay whole 16-blocks on every mesh above.
MODEL = dict(d_model=128, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=256, n_layers=2, max_seq_len=128)


def setup_mesh(shape, recipe: str, batch: int, seq: int):
  """(step, state, batch data) of the model on a (data, fsdp, tensor) mesh, placed as the trainer places a run,
  the step compiled and run once (untimed)."""
  cfg = config_lib.TrainConfig.from_options(model=model_lib.get_model_config("tiny", **MODEL), recipe=recipe,
                                            batch_size=batch, seq_len=seq, steps=100)
  model = trainer.build_model(cfg, jax.random.key(0))
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = optimizer_lib.make_optimizer(cfg.optimizer, cfg.steps)
  state = steps_lib.TrainState(params=params, opt_state=optimizer.init(params), step=jnp.asarray(0, jnp.int32))
  # As the trainer places a run: divisibility checked, state and batch sharded, the step traced as its steps are.
  placement = sharding.Placement.for_mesh(str(sharding.MeshConfig(*shape)), state, recipe=cfg.recipe,
                                          batch_size=batch, seq_len=seq)
  state_sh, batch_sh = placement.state, placement.batch
  step = jax.jit(placement.traced_on_mesh(steps_lib.make_train_step(graphdef, optimizer,
                                                                    gather_params=placement.gather_params)),
                 in_shardings=(state_sh, batch_sh, None),
                 out_shardings=(state_sh, None), donate_argnums=0)
  state = jax.device_put(state, state_sh)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, 256)
  data = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, batch_sh)
  state, m = step(state, data, jax.random.key(2))  # compile + warm up
  jax.block_until_ready(m)
  return step, state, data


def time_meshes(shapes, recipe: str, *, steps: int, runs: int, batch: int, seq: int) -> dict:
  """{shape: {"ratios": per-block step-time medians over the first shape's of the same block, "ms": median step ms,
  "loss": the loss of its last step}}. The meshes take turns block by block, the order rotating, so that a change
  of the machine's load hits all alike; every mesh trains the same model from the same state on the same batches
  and keys, so their losses differ only by summation order (and the FP4 roundings that flips)."""
  runs_by_shape = {shape: list(setup_mesh(shape, recipe, batch, seq)) for shape in shapes}
  block_s = {shape: [] for shape in shapes}
  losses = {}
  for b, order in enumerate(interleave.block_orders(shapes, runs)):
    for shape in order:
      run = runs_by_shape[shape]
      times = []
      for i in range(steps):
        key = jax.random.key(3 + b * steps + i)
        t0 = time.perf_counter()
        run[1], m = run[0](run[1], run[2], key)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
      block_s[shape].append(statistics.median(times))
      losses[shape] = float(m["loss"])
  ratios = interleave.paired_ratios(block_s, shapes[0])
  return {shape: {"ratios": ratios[shape],
                  "ms": 1e3 * statistics.median(block_s[shape]), "loss": losses[shape]} for shape in shapes}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--recipe", default="nvfp4")
  p.add_argument("--steps", type=int, default=5, help="timed steps per mesh and block")
  p.add_argument("--runs", type=int, default=3, help="blocks (the meshes take turns); min and median reported")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--meshes", default=";".join(",".join(map(str, m)) for m in MESHES),
                 help="';'-separated data,fsdp,tensor triples")
  args = p.parse_args(argv)
  for flag in ("steps", "runs"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag} must be >= 1; got {getattr(args, flag)}.")
  if jax.device_count() != 8:
    raise SystemExit(f"needs 8 devices (XLA_FLAGS set before jax import); found {jax.device_count()}")
  meshes = [tuple(int(v) for v in m.split(",")) for m in args.meshes.split(";")]
  results = time_meshes(meshes, args.recipe, steps=args.steps, runs=args.runs, batch=args.batch, seq=args.seq)
  n_steps = 1 + args.runs * args.steps
  print(f"recipe={args.recipe} batch={args.batch} seq={args.seq}, 8 simulated devices; {args.runs} blocks of "
        f"{args.steps} steps, meshes in turns; loss of step {n_steps} (after {n_steps - 1} updates)")
  print(f"{'mesh (data,fsdp,tensor)':<26}{'step ms':>10}{'ratio median':>14}{'min':>7}{'loss':>10}")
  for m, r in results.items():
    print(f"{str(m):<26}{r['ms']:>10.1f}{statistics.median(r['ratios']):>14.2f}{min(r['ratios']):>7.2f}"
          f"{r['loss']:>10.4f}")
  return results


if __name__ == "__main__":
  main()
