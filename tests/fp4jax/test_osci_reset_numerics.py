"""OsciReset numerics (fp4jax.osci_reset, fp4jax.pretrain.osci.update) against NumPy float64 references.

The hand-made trajectories keep one fixed "anchor" element of magnitude A = 2688 * 2^-12 in every 1x16 (and so
every 16x16) block, so every block scale is 448 and every group / tensor scale 2^-12: the quantized weights are
E2M1 values times 448 * 2^-12, all distances and their sums are exact in float32, and the float64 reference must
match bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp4jax.recipes
from fp4jax import osci_reset
from fp4jax.pretrain import osci
from fp4jax.pretrain.sharding import make_mesh, path_str
import reference as ref
import reference_recipes as refr

K, N = 32, 48
ULP = 2.0 ** -12  # the trajectories' grid: every step and every weight is a multiple of it
ANCHOR = 2688 * ULP
EDGE = 560 * ULP  # midpoint of the quantized values 448 and 672 (E2M1 1.0 and 1.5) times ULP
RECIPES = {"blocks.0.mlp.up": fp4jax.recipes.tetrajet_v2(gemm_mode="f32"),  # 1x16 blocks, 1x128 groups along K
           "blocks.0.mlp.down": fp4jax.recipes.nvfp4(gemm_mode="f32"),  # 16x16 blocks, one tensor scale
           "blocks.0.attn.q": fp4jax.recipes.bf16()}


def reference_q(w, recipe):
  """The Fprop weight's values from the NumPy references (float64 holding float32 values)."""
  if not recipe.fprop.rhs.quantized:
    return np.asarray(w, np.float64)
  if recipe.fprop.rhs.fmt.double_block:
    return refr.nvfp4_variant(w, axis=0, double_block=True)["dequant"]
  q = ref.nvfp4_quantize(w, axis=0, block_2d=recipe.fprop.rhs.block_2d)
  return ref.nvfp4_dequantize(q["codes"], q["scales"], q["amax"], axis=0, block_2d=recipe.fprop.rhs.block_2d)


def trajectory(seed, steps):
  """[steps + 1, K, N] float32 weights on the ULP grid (steps >= 3): a random walk, a column of elements flipping
  across EDGE every step (ratio 224 / (2 * 3) or more), a column that never moves (ratio 0), columns with ratio 8,
  7.7 and < 2, and in each 16-row block of every column one anchor fixed at +-A (rows `anchor_rows`)."""
  rng = np.random.default_rng(seed)
  w = rng.integers(-2000, 2000, size=(K, N)) * ULP
  walks = rng.integers(-3, 4, size=(steps, K, N)) * ULP
  ws = np.clip(np.concatenate([w[None], w[None] + np.cumsum(walks, axis=0)]), -2600 * ULP, 2600 * ULP)
  sign = np.where(np.arange(steps + 1) % 2 == 0, 1.0, -1.0)[:, None]
  ws[:, :, 5] = EDGE + sign * ULP * (1 + np.arange(K) % 3)
  ws[:, :, 6] = ws[0, :, 6]
  # One edge crossing each (dQ = 224 ULP) after moving 28 ULP (ratio exactly 8: reset) or 29 ULP (7.7: kept).
  for col, moves in ((7, (6, 14, 8)), (8, (6, 14, 9))):
    ws[:, :, col] = (553 + np.cumsum((0,) + moves + (0,) * (steps - 3))[:steps + 1, None]) * ULP
  ws[:, :, 9] = (501 + 60 * np.arange(steps + 1))[:, None] * ULP  # steady drift across edges: ratio below 2
  rows, cols = anchor_rows()
  ws[:, rows, cols] = ANCHOR * np.where(cols % 2, -1.0, 1.0)
  return ws.astype(np.float32)


def anchor_rows():
  """(rows, cols) of the anchors: row b + n % 16 of column n in each 16-row block b."""
  cols = np.tile(np.arange(N), K // 16)
  rows = np.repeat(np.arange(0, K, 16), N) + cols % 16
  return rows, cols


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_quantized_weight_matches_reference(name):
  w = (np.random.default_rng(1).standard_normal((64, 48)) * 0.02).astype(np.float32)
  got = np.asarray(osci_reset.quantized_weight(jnp.asarray(w), RECIPES[name]))
  np.testing.assert_array_equal(got, reference_q(w, RECIPES[name]).astype(np.float32))


def test_trajectory_quantizes_onto_the_grid():
  ws = trajectory(0, 4)
  for name in ("blocks.0.mlp.up", "blocks.0.mlp.down"):
    q = reference_q(ws[-1], RECIPES[name]) / ULP
    np.testing.assert_array_equal(q, np.round(q))
    assert set(np.unique(np.abs(q))) <= {0, 224, 448, 672, 896, 1344, 1792, 2688}


def test_reset_is_exactly_ratio_at_or_above_threshold():
  dist_q = jnp.asarray([8.0, np.nextafter(np.float32(8), np.float32(0)), 16.0, 0.0, 5.0, 0.5], jnp.float32)
  dist_w = jnp.asarray([1.0, 1.0, 2.0, 0.0, 0.0, 1.0], jnp.float32)
  w = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], jnp.float32)
  q = -w
  np.testing.assert_array_equal(osci_reset.oscillation_ratio(dist_q, dist_w),
                                np.float32([8, np.nextafter(np.float32(8), np.float32(0)), 8, 0, 0, 0.5]))
  new_w, mask = osci_reset.reset(w, q, dist_q, dist_w, 8.0)
  np.testing.assert_array_equal(mask, [True, False, True, False, False, False])
  np.testing.assert_array_equal(new_w, [-1.0, 2.0, -3.0, 4.0, 5.0, 6.0])
  with pytest.raises(ValueError, match="one shape"):
    osci_reset.reset(w, q[:3], dist_q, dist_w, 8.0)


def test_forward_rht_or_sr_weight_is_a_clear_error():
  with pytest.raises(ValueError, match="Hadamard"):
    osci_reset.check_recipe(fp4jax.recipes.nvfp4(rht_on=("fprop", "wgrad")))
  r = fp4jax.recipes.tetrajet_v2()
  # A stochastically rounded Fprop weight has no quantized value to reset to: no Recipe has one (it could not run:
  # the rule draws keys for the backward's operands only).
  with pytest.raises(ValueError, match="fprop.rhs: stochastic rounding applies to the backward's operands"):
    r.replace(fprop=dataclasses.replace(r.fprop, rhs=dataclasses.replace(r.fprop.rhs, rounding="stochastic")))
  with pytest.raises(ValueError, match="\\[K, N\\]"):
    osci_reset.quantized_weight(jnp.zeros((2, 16, 16)), fp4jax.recipes.tetrajet_v2())


@pytest.mark.parametrize("start, every", [(0, 8), (3, 5)])
def test_traced_schedule_matches_host_schedule(start, every):
  config = osci.OsciResetConfig(start=start, every=every, window=every - 2)
  steps = np.arange(4 * every)
  traced = jax.jit(jax.vmap(lambda s: osci._branch(s, config)))(jnp.asarray(steps, jnp.int32))  # pylint: disable=protected-access
  assert [osci.KINDS[int(b)] for b in traced] == [osci.kind(int(s), config) for s in steps]
  first = -(-start // every) * every  # the first cycle starts at the first multiple of `every` >= start
  assert osci.kind(first, config) == "snapshot" and osci.kind(first + every - 1, config) == "reset"
  assert all(osci.kind(int(s), config) == "none" for s in steps[:first])
  assert osci.kind(5, osci.OsciResetConfig()) == "none"  # off by default


def _params(ws_by_layer):
  tree = {}
  for name, w in ws_by_layer.items():
    node = tree
    for part in name.split("."):
      node = node.setdefault(int(part) if part.isdigit() else part, {})
    node["kernel"] = jnp.asarray(w)
  return tree


def _leaf(tree, name):
  return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}[f"{name}.kernel"]


def _run_cycle(window, threshold, trajectories, put=lambda x: x, outlier_idx=None, selected_from=0):
  """Runs update() jitted over steps 0..window+1 (snapshot, track, reset); returns (params, state, count) after the
  reset, from the params trajectories[name][step] the optimizer would have produced. `outlier_idx`: OutControl's
  channels, selected from step `selected_from` on."""
  config = osci.OsciResetConfig(start=0, every=window + 3, window=window, threshold=threshold)
  layers = sorted(trajectories)
  state = osci.init_state(_params({n: trajectories[n][0] for n in layers}), layers)
  fn = jax.jit(lambda p, s, i: osci.update(p, s, i, RECIPES, config, outlier_idx, i >= selected_from))
  for step in range(window + 2):
    params = put(_params({n: trajectories[n][step] for n in layers}))
    out, state, count = fn(params, put(state), jnp.asarray(step, jnp.int32))
    if step <= window:
      assert int(count) == 0
      assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params)))
  return out, state, count


def test_ratio_and_reset_match_numpy_on_a_hand_made_trajectory():
  window, threshold = 6, 8.0
  trajs = {name: trajectory(seed, window + 1) for seed, name in enumerate(sorted(RECIPES))}
  out, state, count = _run_cycle(window, threshold, trajs)
  total = 0
  for name, ws in trajs.items():
    recipe = RECIPES[name]
    qs = [reference_q(w, recipe) for w in ws]
    # The window: steps 1..window, each against the step before; step window+1 only resets.
    dist_q = sum(np.abs(qs[t] - qs[t - 1]) for t in range(1, window + 1))
    dist_w = sum(np.abs(ws[t].astype(np.float64) - ws[t - 1]) for t in range(1, window + 1))
    ratio = np.where(dist_w > 0, dist_q / np.where(dist_w > 0, dist_w, 1), 0.0)
    mask = ratio >= threshold
    expect = np.where(mask, qs[-1], ws[-1])
    get = lambda tree: _leaf(tree, name)
    got_ratio = osci_reset.oscillation_ratio(get(state.dist_q), get(state.dist_w))
    np.testing.assert_array_equal(get(state.dist_q), dist_q.astype(np.float32))
    np.testing.assert_array_equal(get(state.dist_w), dist_w.astype(np.float32))
    np.testing.assert_array_equal(got_ratio, ratio.astype(np.float32))  # exact sums, one correctly rounded divide
    np.testing.assert_array_equal(get(out), expect.astype(np.float32))
    if recipe.fprop.rhs.quantized:
      rows, cols = anchor_rows()
      free = lambda col: np.setdiff1d(np.arange(K), rows[cols == col])
      assert mask[free(5), 5].all() and not mask[:, 6].any()  # the flipping column is reset, the still one is not
      assert mask[free(7), 7].all() and not mask[:, 8].any() and not mask[:, 9].any()  # >= threshold, not >
      np.testing.assert_array_equal(ratio[free(7), 7], 8.0)
      assert not mask[rows, cols].any()
      assert 0 < mask.sum() < mask.size
    else:
      assert not mask.any()  # BF16 weights: Q(w) = w, ratio 1 where they move
    total += int(mask.sum())
  assert int(count) == total


OUTLIER_ROWS = np.array([3, 17, 30])


@pytest.mark.parametrize("name", ["tetrajet_v2", "nvfp4"])
def test_quantized_weight_with_outcontrol_rows_is_the_forwards_rest_operand(name):
  # Before, OsciReset quantized the whole weight while the forward quantizes it with OutControl's rows zeroed: 3-7%
  # of the FP4 elements had another Q (the block, group and tensor scales differ), and the MXFP8 rows were reset
  # onto an FP4 grid the forward never uses.
  from fp4jax import outcontrol  # pylint: disable=g-import-not-at-top
  from fp4jax.gemm import f32_values  # pylint: disable=g-import-not-at-top
  recipe = RECIPES["blocks.0.mlp.up" if name == "tetrajet_v2" else "blocks.0.mlp.down"]
  rng = np.random.default_rng(3)
  w = rng.standard_normal((64, 48)).astype(np.float32) * 0.02
  w[OUTLIER_ROWS] *= 40.0  # the outlier rows hold their blocks' maxima
  rows = np.zeros(64, bool)
  rows[OUTLIER_ROWS] = True
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  ops = outcontrol.split_operands(x, jnp.asarray(w), jnp.asarray(OUTLIER_ROWS, jnp.int32), recipe, jax.random.key(0),
                                  backward=False)
  got = np.asarray(osci_reset.quantized_weight(jnp.asarray(w), recipe, jnp.asarray(rows)))
  np.testing.assert_array_equal(got, np.asarray(f32_values(ops.rest.w_fprop)))
  np.testing.assert_array_equal(got, reference_q(np.where(rows[:, None], 0.0, w), recipe).astype(np.float32))
  assert (got[OUTLIER_ROWS] == 0).all()
  whole = np.asarray(osci_reset.quantized_weight(jnp.asarray(w), recipe))
  assert (whole[~rows] != got[~rows]).mean() > 0.5  # the rows' maxima set the other rows' scales: a real test
  with pytest.raises(ValueError, match="bool \\[K=64\\] row mask"):
    osci_reset.quantized_weight(jnp.asarray(w), recipe, jnp.asarray(OUTLIER_ROWS))


@pytest.mark.parametrize("selected_from", [0, 4, 5])
def test_update_with_outcontrol_quantizes_and_resets_only_the_fp4_rows(selected_from):
  """Channels selected before the cycle (0), just before its reset (4: window 3, reset at step 4) or after it (5).
  Q is the rest operand once they are selected; their rows are never reset, whatever sums they gathered before."""
  window, threshold = 3, 8.0
  trajs = {name: trajectory(20 + seed, window + 1) for seed, name in enumerate(sorted(RECIPES))}
  idx = {name: jnp.asarray(OUTLIER_ROWS, jnp.int32) for name in trajs}
  rows = np.zeros(K, bool)
  rows[OUTLIER_ROWS] = True
  plain = _run_cycle(window, threshold, trajs)
  out, state, count = _run_cycle(window, threshold, trajs, outlier_idx=idx, selected_from=selected_from)
  total = 0
  for name, ws in trajs.items():
    recipe = RECIPES[name]
    get = lambda tree, name=name: np.asarray(_leaf(tree, name))
    q = lambda w, step, recipe=recipe: np.asarray(osci_reset.quantized_weight(
        jnp.asarray(w), recipe, jnp.asarray(rows) if step >= selected_from else None))
    dist_q = sum(np.abs(q(ws[t], t) - q(ws[t - 1], t)) for t in range(1, window + 1))
    np.testing.assert_array_equal(get(state.dist_q), dist_q)
    ratio = np.asarray(osci_reset.oscillation_ratio(jnp.asarray(dist_q), get(state.dist_w)))
    mask = ratio >= threshold
    if selected_from <= window + 1:
      mask &= ~rows[:, None]
    np.testing.assert_array_equal(get(out), np.where(mask, q(ws[-1], window + 1), ws[-1]))
    if selected_from <= window + 1:
      np.testing.assert_array_equal(get(out)[OUTLIER_ROWS], ws[-1][OUTLIER_ROWS])
    total += int(mask.sum())
  assert int(count) == total
  if selected_from > window + 1:  # not selected yet: as without OutControl
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves((out, state, count)),
                                                    jax.tree.leaves(plain)))
  else:  # the outlier rows of the flipping column would have been reset
    assert 0 < int(count) < int(plain[2])


def test_update_is_bit_identical_on_a_mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 simulated devices (tests/conftest.py)")
  mesh = make_mesh("data=2,fsdp=2,tensor=2")
  window = 3
  trajs = {name: trajectory(10 + seed, window + 1) for seed, name in enumerate(sorted(RECIPES))}
  put = lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", "tensor"))), tree)
  single = _run_cycle(window, 8.0, trajs)
  sharded = _run_cycle(window, 8.0, trajs, put)
  assert int(sharded[2]) == int(single[2]) > 0
  for a, b in zip(jax.tree.leaves(sharded[:2]), jax.tree.leaves(single[:2])):
    np.testing.assert_array_equal(a, b)
  assert len(jax.tree.leaves(sharded[1])[0].sharding.device_set) == 8
