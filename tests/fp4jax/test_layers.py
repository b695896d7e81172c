"""NNX (fp4jax.nn.Linear) and Linen (fp4jax.linen.Dense) layers: a 2-layer MLP trains under every preset, and
parameters, optimizer state and gradients stay float32; flax's own nnx.Linear takes fp4jax.quantized_dot_general."""

import flax.linen as linen
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp4jax
import fp4jax.linen
from fp4jax import recipes

D_IN, D_HID, D_OUT, TOKENS, STEPS = 32, 64, 32, 64, 60
PRESETS = ("bf16", "nvfp4", "mxfp4", "fp8")


def _toy_regression():
  """y = tanh(x A) B: a smooth target a 2-layer MLP fits quickly."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((TOKENS, D_IN)).astype(np.float32)
  a = rng.standard_normal((D_IN, D_HID)) / np.sqrt(D_IN)
  b = rng.standard_normal((D_HID, D_OUT)) / np.sqrt(D_HID)
  y = (np.tanh(x @ a) @ b).astype(np.float32)
  return jnp.asarray(x), jnp.asarray(y)


def _mse(pred, y):
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def _assert_float32(tree, what):
  dtypes = {jnp.dtype(a.dtype).name for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)}
  assert dtypes == {"float32"}, f"{what}: {dtypes}"


class NnxMLP(nnx.Module):

  def __init__(self, recipe, rngs):
    self.up = fp4jax.nn.Linear(D_IN, D_HID, recipe=recipe, use_bias=True, rngs=rngs)
    self.down = fp4jax.nn.Linear(D_HID, D_OUT, recipe=recipe, use_bias=True, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.gelu(self.up(x)))


@pytest.mark.parametrize("preset", PRESETS)
def test_nnx_mlp_trains(preset):
  x, y = _toy_regression()
  model = NnxMLP(recipes.get_recipe(preset), nnx.Rngs(params=0, quant=1))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), y))(model)
    optimizer.update(model, grads)
    return loss, grads

  losses = []
  for _ in range(STEPS):
    loss, grads = step(model, optimizer, x, y)
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert min(losses[-5:]) < 0.1 * losses[0], losses[::10]  # measured: 0.005-0.03x
  _assert_float32(grads, "grads")
  _assert_float32(nnx.state(model, nnx.Param), "params")
  _assert_float32(nnx.state(optimizer, nnx.optimizer.OptState), "optimizer state")


class LinenMLP(linen.Module):
  recipe: str

  @linen.compact
  def __call__(self, x):
    h = fp4jax.linen.Dense(D_HID, recipe=self.recipe, use_bias=True)(x)
    return fp4jax.linen.Dense(D_OUT, recipe=self.recipe, use_bias=True)(linen.gelu(h))


def _linen_params(x):
  """Parameters do not depend on the recipe: initialise through bf16 (an eager quantized init is slow on CPU)."""
  return LinenMLP("bf16").init(jax.random.key(0), x)["params"]


@pytest.mark.parametrize("preset", PRESETS)
def test_linen_mlp_trains(preset):
  x, y = _toy_regression()
  model = LinenMLP(preset)
  params = _linen_params(x)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, key):
    loss_fn = lambda p: _mse(model.apply({"params": p}, x, rngs={"quant": key}), y)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  losses = []
  for i in range(STEPS):
    params, opt_state, loss, grads = step(params, opt_state, jax.random.key(100 + i))
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert min(losses[-5:]) < 0.1 * losses[0], losses[::10]  # measured: 0.005-0.03x
  _assert_float32(grads, "grads")
  _assert_float32(params, "params")
  _assert_float32(opt_state, "optimizer state")


def test_linen_sr_recipe_needs_quant_rng():
  x, _ = _toy_regression()
  with pytest.raises(ValueError, match=r"needs randomness .* rngs=\{'quant': key\}"):
    LinenMLP("nvfp4").apply({"params": _linen_params(x)}, x)


def test_layer_errors_name_the_layer():
  """A shape or dtype error inside a model named no layer; the NNX layer now refuses its shape when built."""
  with pytest.raises(ValueError, match=r"fp4jax.nn.Linear\(32, 24, recipe='nvfp4'\): fprop rhs: nvfp4 blocks of 16 "
                                       "need N divisible by 16"):
    fp4jax.nn.Linear(32, 24, recipe="nvfp4", rngs=nnx.Rngs(0))
  layer = fp4jax.nn.Linear(32, 32, recipe="nvfp4:stochastic_rounding=false", dtype=jnp.int8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"fp4jax.nn.Linear\(32, 32, recipe='nvfp4-sr'\): quantize supports float32"):
    layer(jnp.ones((4, 32)))

  class Two(linen.Module):
    @linen.compact
    def __call__(self, x):
      return fp4jax.linen.Dense(24, recipe="nvfp4", name="proj")(fp4jax.linen.Dense(32, recipe="nvfp4")(x))

  with pytest.raises(ValueError, match=r"fp4jax.linen.Dense 'proj' \(32 -> 24, recipe 'nvfp4'\): fprop rhs"):
    Two().init({"params": jax.random.key(0), "quant": jax.random.key(1)}, jnp.ones((4, 32)))


class _ScannedDense(linen.Module):
  """One fp4jax.linen.Dense per scan step, each on the same input (equal layers see equal GEMMs but for SR)."""

  @linen.compact
  def __call__(self, c, x):
    return c, fp4jax.linen.Dense(D_IN, recipe="nvfp4", dtype=jnp.float32)(x)


@pytest.mark.parametrize("split, noise", [(True, "per layer"), (False, "shared"), (None, "missing")])
def test_linen_scan_draws_sr_noise_per_layer_only_with_quant_split(split, noise):
  # README, "Quantizing a Flax model": list "quant": True in split_rngs.
  rngs = {"params": True} | ({} if split is None else {"quant": split})
  scan = linen.scan(_ScannedDense, variable_axes={"params": 0}, split_rngs=rngs, in_axes=linen.broadcast, length=2)
  x = jax.random.normal(jax.random.key(0), (TOKENS, D_IN))
  params = scan().init(jax.random.key(1), None, x)
  params = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], a.shape), params)  # two equal layers
  loss = lambda p: jnp.sum(scan().apply(p, None, x, rngs={"quant": jax.random.key(2)})[1] ** 2)
  if noise == "missing":
    with pytest.raises(ValueError, match="needs randomness.*list 'quant' in split_rngs"):
      jax.grad(loss)(params)
    return
  g_LxKxN = np.asarray(jax.tree.leaves(jax.grad(loss)(params))[0])
  assert np.array_equal(g_LxKxN[0], g_LxKxN[1]) == (noise == "shared")


def test_nnx_layer_keys():
  """SR keys come from the layer's "quant" stream (fresh per call) or from key=; without either: ValueError."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((TOKENS, D_IN)), jnp.float32)
  layer = fp4jax.nn.Linear(D_IN, D_HID, recipe="nvfp4", rngs=nnx.Rngs(params=0, quant=1))
  grad = nnx.jit(lambda m, x, key=None: nnx.grad(lambda m: jnp.sum(m(x, key=key) ** 2))(m).kernel[...])
  k = jax.random.key(5)
  np.testing.assert_array_equal(grad(layer, x, k), grad(layer, x, k))
  assert not np.array_equal(grad(layer, x), grad(layer, x))  # the stream advances between calls
  no_stream = fp4jax.nn.Linear(D_IN, D_HID, recipe="nvfp4", rngs=nnx.Rngs(params=0))  # (a default stream would do)
  with pytest.raises(ValueError, match="quant"):
    no_stream(x)
  with pytest.raises(ValueError, match=f"inputs \\[..., {D_IN}\\]"):
    layer(x[:, :16])
  with pytest.raises(ValueError, match="key must be one JAX PRNG key"):
    layer(x, key=1)


def test_nnx_layers_initialise_as_nnx_linear_from_the_same_rngs():
  """With use_bias=True the layer drew no key for its zero bias, so a second layer built from the same nnx.Rngs got
  another kernel than nnx.Linear's."""
  def two(make):
    rngs = nnx.Rngs(0)
    return make(32, 32, use_bias=True, rngs=rngs), make(32, 16, use_bias=True, rngs=rngs)

  for ours, theirs in zip(two(fp4jax.nn.Linear), two(nnx.Linear)):
    np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])
    np.testing.assert_array_equal(ours.bias[...], theirs.bias[...])


def _dot_operand_dtypes(jaxpr):
  """The operand dtypes of every dot_general in `jaxpr` and the jaxprs nested in its equations."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _dot_operand_dtypes(sub.jaxpr)
  return found


@pytest.mark.parametrize("backend, mode, backward", [("cpu", "auto", "float32"), ("gpu", "auto", "bfloat16"),
                                                     ("cpu", "bf16", "bfloat16"), ("gpu", "f32", "float32")])
def test_bf16_recipe_backward_multiplies_bf16_operands_on_accelerators(backend, mode, backward, monkeypatch):
  """The bf16 recipe's layer asked its GEMM for a float32 output, so its cotangent, and Dgrad's and Wgrad's
  operands, were float32: the train-step benchmarks' BF16 baseline ran its backward on TF32/float32 units on a GPU
  while the quantized rows multiplied bf16. Now an output of the compute dtype where the GEMM mode is bf16 (as
  nnx.Linear); CPUs keep the float32 backward under "auto" (faster there, and the recorded bits)."""
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  graph, params = nnx.split(fp4jax.nn.Linear(32, 16, recipe=f"bf16:gemm_mode={mode}", rngs=nnx.Rngs(0)))
  loss = lambda params, x: jnp.sum(nnx.merge(graph, params)(x).astype(jnp.float32) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, jnp.ones((8, 32), jnp.bfloat16)).jaxpr
  assert _dot_operand_dtypes(jaxpr) == [("bfloat16", "bfloat16")] + [(backward, "bfloat16")] * 2
  dense = fp4jax.linen.Dense(16, recipe=f"bf16:gemm_mode={mode}")
  variables = dense.init(jax.random.key(0), jnp.ones((8, 32), jnp.bfloat16))
  loss = lambda v, x: jnp.sum(dense.apply(v, x).astype(jnp.float32) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(variables, jnp.ones((8, 32), jnp.bfloat16)).jaxpr
  assert _dot_operand_dtypes(jaxpr) == [("bfloat16", "bfloat16")] + [(backward, "bfloat16")] * 2


def test_flax_nnx_linear_with_quantized_dot_general():
  """flax.nnx.Linear(dot_general=fp4jax.quantized_dot_general(recipe, fixed_key_every_call=key)) runs the recipe's
  GEMMs (with one key for every call: a test-only opt-in; without it an SR recipe is refused)."""
  recipe, key = recipes.nvfp4(), jax.random.key(3)
  layer = nnx.Linear(D_IN, D_HID, dot_general=fp4jax.quantized_dot_general(recipe, fixed_key_every_call=key),
                     rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(2).standard_normal((TOKENS, D_IN)), jnp.float32)
  dn = (((1,), (0,)), ((), ()))

  def direct(kernel, bias):
    return fp4jax.dot_general(x, kernel, dn, recipe=recipe, key=key) + bias

  @nnx.jit
  def both(layer):
    loss = lambda m: jnp.sum(jnp.sin(m(x)))
    loss_ref = lambda kb: jnp.sum(jnp.sin(direct(*kb)))
    g = nnx.grad(loss)(layer)
    g_ref = jax.grad(loss_ref)((layer.kernel[...], layer.bias[...]))
    return layer(x), direct(layer.kernel[...], layer.bias[...]), g.kernel[...], g_ref[0]

  y, y_ref, dk, dk_ref = both(layer)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_allclose(dk, dk_ref, rtol=1e-5, atol=1e-5 * np.abs(dk_ref).max())
  # ... and it is really quantized: the plain layer differs.
  plain = nnx.Linear(D_IN, D_HID, rngs=nnx.Rngs(0))
  assert np.abs(np.asarray(plain(x)) - np.asarray(y)).max() > 1e-3
  unkeyed = nnx.Linear(D_IN, D_HID, dot_general=fp4jax.quantized_dot_general(recipe), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="fresh key on every call"):
    unkeyed(x)


def test_switching_recipe_compiles_once_per_recipe():
  """Assigning layer.recipe switches precision; nnx.jit traces once per distinct recipe."""
  x = jnp.ones((TOKENS, D_IN), jnp.float32)
  layer = fp4jax.nn.Linear(D_IN, D_IN, rngs=nnx.Rngs(0))
  traces = []

  @nnx.jit
  def forward(layer, x):
    traces.append(layer.recipe.name)
    return layer(x)

  outputs = {}
  for _ in range(4):
    for spec in ("bf16", "nvfp4:stochastic_rounding=false"):
      layer.recipe = recipes.get_recipe(spec)  # a fresh, equal object each time
      outputs.setdefault(spec, []).append(np.asarray(forward(layer, x)))
  assert sorted(traces) == ["bf16", "nvfp4-sr"]
  assert not np.array_equal(outputs["bf16"][0], outputs["nvfp4:stochastic_rounding=false"][0])


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4:stochastic_rounding=false"])
def test_biased_layer_output_has_the_compute_dtype(recipe):
  """y = x W + b comes back in the layer's compute dtype (bfloat16 by default), NNX and Linen, quantized or not:
  the float32 bias is cast before the add, else it would promote every biased layer's output (and so the next
  layer's input and activation memory) to float32. The MLP tests cast the loss to float32 and cannot see it."""
  x = jnp.ones((16, D_IN), jnp.float32)
  layer = fp4jax.nn.Linear(D_IN, D_HID, recipe=recipe, use_bias=True, rngs=nnx.Rngs(0))
  assert layer(x).dtype == jnp.bfloat16
  dense = fp4jax.linen.Dense(D_HID, recipe=recipe, use_bias=True)
  variables = dense.init(jax.random.key(0), x)
  assert dense.apply(variables, x).dtype == jnp.bfloat16


def test_nnx_layers_draw_sr_keys_from_streams_of_their_own():
  """Each Linear forks its own "quant" stream when built: a layer's SR keys do not depend on how often other layers
  built from the same nnx.Rngs were called (calling, or freezing, one layer must not change another's noise)."""
  x = jnp.asarray(np.random.default_rng(1).standard_normal((TOKENS, D_IN)), jnp.float32)

  def build():
    rngs = nnx.Rngs(params=0, quant=1)
    return (fp4jax.nn.Linear(D_IN, D_HID, recipe="nvfp4", rngs=rngs),
            fp4jax.nn.Linear(D_IN, D_HID, recipe="nvfp4", rngs=rngs))

  grad = nnx.jit(lambda m: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m).kernel[...])
  (a1, b1), (_, b2) = build(), build()
  grad(a1)  # only the first model's first layer is called
  np.testing.assert_array_equal(grad(b1), grad(b2))


def test_quantized_layers_quantize_the_float32_master_weight():
  """Under a quantized recipe both layers hand dot_general the float32 master weight (only x is cast to the compute
  dtype): NVFP4's scales and codes are computed from the float32 values, as the paper's recipe quantizes master
  weights. Quantizing the bfloat16-rounded weight instead changes codes and so outputs, which training alone hides."""
  x = jnp.asarray(np.random.default_rng(2).standard_normal((TOKENS, D_IN)), jnp.float32)
  recipe = recipes.nvfp4(stochastic_rounding=False)
  dims = (((1,), (0,)), ((), ()))

  def expected(kernel):
    y = fp4jax.dot_general(x.astype(jnp.bfloat16), kernel, dims, recipe=recipe, preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)

  layer = fp4jax.nn.Linear(D_IN, D_HID, recipe=recipe, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(layer(x), expected(layer.kernel[...]))
  assert not np.array_equal(expected(layer.kernel[...]), expected(layer.kernel[...].astype(jnp.bfloat16)))
  dense = fp4jax.linen.Dense(D_HID, recipe=recipe)
  variables = dense.init(jax.random.key(0), x)
  np.testing.assert_array_equal(dense.apply(variables, x), expected(variables["params"]["kernel"]))
