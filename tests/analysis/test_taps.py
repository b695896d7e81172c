"""Tests for fp4jax.analysis.taps: a tap records its layer's input and output gradient and changes nothing else;
the model-level helpers tap every linear layer, check keys, and feed fp4jax.pretrain.metrics.quant_stats."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.analysis import taps
from fp4jax.pretrain import metrics
from fp4jax.pretrain import model as model_lib

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_tap_records_input_and_output_gradient_and_keeps_the_output():
  layer = fp4jax.nn.Linear(32, 16, recipe="bf16", rngs=nnx.Rngs(params=0))
  x_BxTxK = jax.random.normal(jax.random.key(1), (2, 3, 32), jnp.float32)
  c_BxTxN = jax.random.normal(jax.random.key(2), (2, 3, 16), jnp.float32)
  want = layer(x_BxTxK)
  tap = taps.Tap(layer, (2, 3), output_grad=True)
  graphdef, dys, rest = nnx.split(tap, taps.TapOutputGrad, ...)

  def loss_fn(dys):
    m = nnx.merge(graphdef, dys, rest, copy=True)
    y = m(x_BxTxK)
    return jnp.sum(c_BxTxN * y.astype(jnp.float32)), (y, nnx.state(m, taps.TapInput))

  (_, (y, inputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(dys)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))  # adding 0 changes nothing
  (x_in,) = taps.by_layer(inputs).values()
  assert x_in.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(x_in), np.asarray(x_BxTxK.astype(jnp.bfloat16)))
  (dy,) = taps.by_layer(grads).values()  # d(sum c * y)/dy = c, in the layer's compute dtype
  np.testing.assert_array_equal(np.asarray(dy), np.asarray(c_BxTxN.astype(jnp.bfloat16)))
  assert taps.Tap(layer, (2, 3)).dy is None  # no output gradient unless asked


@pytest.fixture(scope="module")
def tiny():
  config = model_lib.get_model_config("tiny", n_layers=2, d_ff=64, n_kv_heads=4, max_seq_len=16, remat=True)
  model = model_lib.Transformer(config, rngs=nnx.Rngs(params=0))
  tokens_BxT = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
  return model, tokens_BxT


def _copy(model):
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, state, copy=True)


def test_capture_inputs_are_the_layers_inputs(tiny):
  model, tokens_BxT = tiny
  want_logits = model(tokens_BxT)
  copy = _copy(model)
  names = list(copy.linear_layers())
  inputs = taps.capture_inputs(copy, tokens_BxT, None)
  assert list(inputs) == names and not copy.config.remat and model.config.remat  # the copy alone is tapped
  # The first block's q, k and v all read the normalised embeddings.
  block = model.blocks[0]
  x_BxTxD = block.attn_norm(model.embed(tokens_BxT).astype(jnp.float32))
  for sub in ("q", "k", "v"):
    np.testing.assert_array_equal(np.asarray(inputs[f"blocks.0.attn.{sub}"]), np.asarray(x_BxTxD))
  for name, layer in model.linear_layers().items():
    assert inputs[name].shape == (2, 16, layer.in_features) and inputs[name].dtype == layer.dtype
  # Taps change no output (a key: the model cannot see its BF16 layers through the taps).
  np.testing.assert_array_equal(np.asarray(copy(tokens_BxT, key=jax.random.key(0))), np.asarray(want_logits))
  with pytest.raises(ValueError, match="already tapped"):
    taps.tap_linear_layers(copy, tokens_BxT.shape)


def test_keys_are_checked_before_tapping(tiny):
  model, tokens_BxT = tiny
  sr = _copy(model)
  for layer in sr.linear_layers().values():
    layer.recipe = fp4jax.recipes.nvfp4()
  with pytest.raises(ValueError, match="need randomness"):
    taps.capture_inputs(sr, tokens_BxT, None)
  assert taps.check_key(model, None) is not None  # BF16 layers: a placeholder key
  key = jax.random.key(3)
  assert taps.check_key(sr, key) is key


def test_a_model_without_linear_layers_is_refused_clearly():
  """Any NNX model quantizes (quantize_model), but the taps find layers by `linear_layers()`: say so, rather than
  AttributeError: 'config'."""
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = fp4jax.nn.Linear(32, 64, recipe="bf16", rngs=rngs)

  with pytest.raises(ValueError, match="linear_layers"):
    taps.tap_linear_layers(Block(nnx.Rngs(params=0)), (2,))
  with pytest.raises(ValueError, match="linear_layers"):
    taps.capture_inputs(Block(nnx.Rngs(params=0)), jnp.zeros((2, 4), jnp.int32), None)


class _Repeat(nnx.Module):
  """A toy LM whose one linear layer runs `times` times per forward."""

  def __init__(self, times, rngs):
    self.times = times
    self.lin = fp4jax.nn.Linear(16, 16, recipe="bf16", rngs=rngs)

  def linear_layers(self):
    return {"lin": self.lin}

  def __call__(self, tokens_BxT, *, key=None):
    x = jax.nn.one_hot(tokens_BxT, 16)
    for _ in range(self.times):
      x = self.lin(x, key=key)
    return x


@pytest.mark.parametrize("times", [0, 2])
def test_a_layer_run_other_than_once_is_refused(times):
  """A layer run twice paired its last input with the sum of both output gradients (never run: zeros), silently."""
  from fp4jax.analysis import model_probes  # pylint: disable=g-import-not-at-top
  tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
  with pytest.raises(ValueError, match=f"'lin' ran {times} times in one forward"):
    taps.capture_inputs(_Repeat(times, nnx.Rngs(params=0)), jnp.asarray(tokens), None)
  with pytest.raises(ValueError, match=f"'lin' ran {times} times in one forward"):
    model_probes.capture_layer_tensors(_Repeat(times, nnx.Rngs(params=0)), {"inputs": tokens, "targets": tokens})
  model_probes.capture_layer_tensors(_Repeat(1, nnx.Rngs(params=0)), {"inputs": tokens, "targets": tokens})


def test_quant_stats_measure_the_tapped_inputs(tiny):
  model, tokens_BxT = tiny
  graphdef, params = nnx.split(model, nnx.Param)
  stats = jax.jit(metrics.quant_stats, static_argnums=0)(graphdef, params, tokens_BxT, None)
  inputs = taps.capture_inputs(_copy(model), tokens_BxT, None)
  assert set(stats) == set(inputs)
  name = "blocks.1.mlp.down"
  x = metrics.tensor_stats(inputs[name].reshape(-1, inputs[name].shape[-1]), "nvfp4", axis=-1)
  for k in ("zero", "sat", "err"):
    np.testing.assert_allclose(float(stats[name][f"x_{k}"]), float(x[k]), rtol=1e-6)
  assert 0.0 < float(stats[name]["x_err"]) < 0.3


def test_analysis_imports_no_training_harness():
  code = ("import sys, fp4jax.analysis.probes, fp4jax.analysis.model_probes, fp4jax.analysis.taps, "
          "fp4jax.analysis.inspection; print(sorted(m for m in sys.modules if m.startswith('fp4jax.pretrain')))")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "[]"
