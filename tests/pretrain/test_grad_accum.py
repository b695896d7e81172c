"""Gradient accumulation (`--grad-accum N`): the step's gradient is the mean over N micro-batches, each with its
own key, one micro-batch at a time (fp4jax.pretrain.steps.accumulated)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp4jax
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import run_setup
from fp4jax.pretrain import sharding
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain.config import TrainConfig


def test_micro_batch_i_holds_every_nth_row_starting_at_i():
  batch = {"inputs": np.arange(12 * 3).reshape(12, 3), "targets": np.arange(12)}
  micro = steps_lib.micro_batches(batch, 4)
  assert micro["inputs"].shape == (4, 3, 3) and micro["targets"].shape == (4, 3)
  for i in range(4):
    np.testing.assert_array_equal(micro["targets"][i], [i, i + 4, i + 8])
    np.testing.assert_array_equal(micro["inputs"][i], batch["inputs"][i::4])
  with pytest.raises(ValueError, match="grad_accum=5 does not divide the batch of 12 rows"):
    steps_lib.micro_batches(batch, 5)


def _toy_grad_fn(params, batch, key, oc_state):
  """((loss, sums), grads) of a loss that depends on the key: a wrong or shared key changes the result."""
  del oc_state
  noise = jax.random.uniform(key, (), jnp.float32)

  def loss_fn(p):
    return jnp.mean((batch["x"] @ p["w"].astype(jnp.float32) - batch["y"]) ** 2) * (1 + noise)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return (loss, {"sq": jnp.sum(batch["x"] ** 2, axis=0)}), grads


def _toy_inputs(w_dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
  batch = {"x": jax.random.normal(k1, (8, 5)), "y": jax.random.normal(k2, (8, 2))}
  return {"w": jax.random.normal(k3, (5, 2)).astype(w_dtype)}, batch, jax.random.key(7)


def test_accumulated_is_the_mean_over_micro_batches_with_keys_folded_in():
  params, batch, key = _toy_inputs()
  (loss, sums), grads = jax.jit(steps_lib.accumulated(_toy_grad_fn, 4))(params, batch, key, None)
  micro = steps_lib.micro_batches(batch, 4)
  parts = [_toy_grad_fn(params, jax.tree.map(lambda x, i=i: x[i], micro), jax.random.fold_in(key, i), None)
           for i in range(4)]
  np.testing.assert_allclose(loss, np.mean([p[0][0] for p in parts]), rtol=1e-6)
  np.testing.assert_allclose(grads["w"], np.mean([p[1]["w"] for p in parts], axis=0), rtol=1e-5, atol=1e-7)
  # OutControl's input statistics add up over the micro-batches, as over the whole batch.
  np.testing.assert_allclose(sums["sq"], jnp.sum(batch["x"] ** 2, axis=0), rtol=1e-6)
  # The same key for every micro-batch would be another result.
  same = [_toy_grad_fn(params, jax.tree.map(lambda x, i=i: x[i], micro), key, None) for i in range(4)]
  assert not np.allclose(loss, np.mean([p[0][0] for p in same]), rtol=1e-4)


def test_bfloat16_gradients_add_up_in_float32_and_come_back_in_bfloat16():
  params, batch, key = _toy_inputs(jnp.bfloat16)
  _, grads = jax.jit(steps_lib.accumulated(_toy_grad_fn, 8))(params, batch, key, None)
  assert grads["w"].dtype == jnp.bfloat16
  micro = steps_lib.micro_batches(batch, 8)
  parts = [_toy_grad_fn(params, jax.tree.map(lambda x, i=i: x[i], micro), jax.random.fold_in(key, i), None)[1]["w"]
           for i in range(8)]
  exact = np.mean([np.asarray(p, np.float64) for p in parts], axis=0)
  np.testing.assert_array_equal(np.asarray(grads["w"]), np.asarray(jnp.asarray(exact, jnp.float32).astype(
      jnp.bfloat16)))


def test_one_micro_batch_is_the_plain_gradient_function():
  assert steps_lib.accumulated(_toy_grad_fn, 1) is _toy_grad_fn
  for bad in (0, -2, 2.0, True, "2"):
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
      steps_lib.accumulated(_toy_grad_fn, bad)


def test_config_takes_grad_accum_dividing_the_batch():
  assert TrainConfig().grad_accum == 1
  config = TrainConfig.from_options(batch_size=8, grad_accum=4)
  assert config.grad_accum == 4 and TrainConfig.from_dict(config.to_dict()) == config
  stored = config.to_dict()
  del stored["grad_accum"]  # a run stored before the option existed
  assert TrainConfig.from_dict(stored).grad_accum == 1
  with pytest.raises(ValueError, match="grad_accum=3 must divide batch_size=8"):
    TrainConfig.from_options(batch_size=8, grad_accum=3)
  with pytest.raises(ValueError, match=r"grad_accum \(--grad-accum\) must be an int >= 1"):
    TrainConfig.from_options(grad_accum=0)


def test_cli_flag_sets_grad_accum():
  import argparse  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser()
  config_lib.add_config_arguments(parser)
  overrides = config_lib.config_overrides(parser.parse_args(["--grad-accum", "2", "--batch-size", "4"]))
  assert config_lib.config_from_overrides(overrides).grad_accum == 2


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices (tests/conftest.py)")
def test_mesh_shards_must_divide_each_micro_batch():
  model = model_lib.get_model_config("tiny", n_layers=1)
  params = nnx.state(nnx.eval_shape(lambda: model_lib.Transformer(model, rngs=nnx.Rngs(0))))
  mesh = sharding.make_mesh("data=4,tensor=2")
  sizes = dict(block_size=16, weight_2d=True, rht_size=16, seq_len=32)
  sharding.check_divisibility(params, mesh, batch_size=16, grad_accum=4, **sizes)  # 4 rows: one per shard
  with pytest.raises(ValueError, match=r"micro-batch size 2 \(batch_size 16 / grad_accum 8\) is not divisible by "
                                       r"the 4 batch shards"):
    sharding.check_divisibility(params, mesh, batch_size=16, grad_accum=8, **sizes)
  with pytest.raises(ValueError, match=r"each batch shard of a micro-batch holds 8 tokens \(1 x 8\)"):
    sharding.check_divisibility(params, mesh, batch_size=16, grad_accum=4, **{**sizes, "seq_len": 8})


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["nvfp4", "bf16"])
def test_train_step_updates_with_the_micro_batches_mean_gradient(recipe):
  """The step with grad_accum=2 (plain SGD, lr 1) against the mean of the model's per-micro-batch gradients, each
  with its fold_in key: nvfp4's stochastic rounding draws its own bits per micro-batch. For BF16 that mean is also
  the whole batch's gradient, up to summation order."""
  cfg = model_lib.get_model_config("tiny", n_layers=1)
  model = run_setup.init_model(cfg, fp4jax.recipes.get_recipe(recipe), jax.random.key(0))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  key = jax.random.key(2)
  state = steps_lib.TrainState(params=params, opt_state=optax.sgd(1.0).init(params), step=jnp.int32(0))
  new_state, metrics = jax.jit(steps_lib.make_train_step(graphdef, optax.sgd(1.0), grad_accum=2))(state, batch, key)

  grad_fn = jax.jit(jax.value_and_grad(steps_lib.make_loss_fn(graphdef)))
  micro = steps_lib.micro_batches(batch, 2)
  parts = [grad_fn(params, jax.tree.map(lambda x, i=i: x[i], micro), jax.random.fold_in(key, i)) for i in range(2)]
  mean_grads = jax.tree.map(lambda a, b: (a + b) / 2, parts[0][1], parts[1][1])
  np.testing.assert_allclose(metrics["loss"], (parts[0][0] + parts[1][0]) / 2, rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], steps_lib.global_norm(mean_grads), rtol=1e-5)
  for new, old, grad in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(params), jax.tree.leaves(mean_grads)):
    np.testing.assert_allclose(new, old - grad, rtol=1e-5, atol=1e-7)
  if recipe == "nvfp4":  # one key for both micro-batches draws other SR bits: the check above would fail
    same = [grad_fn(params, jax.tree.map(lambda x, i=i: x[i], micro), jax.random.fold_in(key, 0)) for i in range(2)]
    same_grads = jax.tree.map(lambda a, b: (a + b) / 2, same[0][1], same[1][1])
    assert not all(np.allclose(a, b, rtol=1e-5, atol=1e-7)
                   for a, b in zip(jax.tree.leaves(same_grads), jax.tree.leaves(mean_grads)))
  else:  # without quantization, the mean over micro-batches is the whole batch's gradient up to summation order
    loss, whole = grad_fn(params, batch, key)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(mean_grads)):
      np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3 * float(np.max(np.abs(b))))


@pytest.mark.slow
def test_finite_metric_reads_the_updated_params():
  """An update that leaves loss and gradients finite but the new weights not (an overflowing optimizer, a broken
  reset) must read as not finite, or the trainer would carry NaN weights forward and checkpoint them."""
  cfg = model_lib.get_model_config("tiny", n_layers=1)
  graphdef, params = nnx.split(run_setup.init_model(cfg, fp4jax.recipes.bf16(), jax.random.key(0)))
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  broken = optax.sgd(float("nan"))
  state = steps_lib.TrainState(params=params, opt_state=broken.init(params), step=jnp.int32(0))
  _, metrics = jax.jit(steps_lib.make_train_step(graphdef, broken))(state, batch, jax.random.key(2))
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
  assert not bool(metrics["finite"])
