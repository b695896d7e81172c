"""fp4jax.quantize_model on models the user did not write: a small NNX transformer written the way Flax's examples
write one (nnx.Embed, nnx.MultiHeadAttention, an nnx.Linear MLP), a Linen MLP with Dense / DenseGeneral, Einsum."""

import subprocess
import sys

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax import recipes

VOCAB, D, HEADS, FF, LAYERS, B, T = 64, 32, 2, 64, 2, 2, 16
RULES = [
    ("head", None),  # first match wins: the head stays in high precision whatever follows
    (r"blocks\.\d+\.attn\.(query|key|value|out)", "nvfp4"),
    (r"blocks\.\d+\.mlp_.*", "nvfp4"),
    ("embed", "nvfp4"),  # an Embed is not a linear layer: this rule matches nothing
    ("blocks.*typo", "mxfp4"),
]


class Block(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.mlp_in = nnx.Linear(D, FF, rngs=rngs)
    self.mlp_out = nnx.Linear(FF, D, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))


class Transformer(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([Block(rngs=rngs) for _ in range(LAYERS)])
    self.ln_f = nnx.LayerNorm(D, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    mask = nnx.make_causal_mask(tokens)
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln_f(x))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, T)), jnp.int32)
TARGETS = jnp.roll(TOKENS, -1, axis=1)


def _loss(model):
  logits = model(TOKENS).astype(jnp.float32)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TARGETS[..., None], -1))


_forward = nnx.jit(lambda model: model(TOKENS))
_grad = nnx.jit(lambda model: nnx.grad(_loss)(model))


def _kernel_grads(grads):
  return {".".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(grads) if p[-1] == "kernel"}


def _reference_dot_general(recipe):
  """fp4jax.dot_general on the layer's inputs flattened to [M, K] and its kernel to [K, N] (the test's own reshape:
  the contracted axes are the input's trailing and the kernel's leading ones for Linear and LinearGeneral)."""

  def fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **unused):
    (lc, rc), (lb, _) = dimension_numbers
    n_in = len(rc)
    assert not lb and tuple(rc) == tuple(range(n_in)) and tuple(lc) == tuple(range(lhs.ndim - n_in, lhs.ndim))
    k = int(np.prod(rhs.shape[:n_in]))
    y = fp4jax.dot_general(lhs.reshape(-1, k), rhs.reshape(k, -1), (((1,), (0,)), ((), ())), recipe=recipe,
                           key=jax.random.key(0), preferred_element_type=preferred_element_type)
    return y.reshape(*lhs.shape[:lhs.ndim - n_in], *rhs.shape[n_in:])

  return fn


def test_report_lists_layers_rules_and_unused_rules():
  model = Transformer(rngs=nnx.Rngs(0))
  report = fp4jax.quantize_model(model, RULES, rngs=nnx.Rngs(quant=1))
  per_block = ["attn.key", "attn.out", "attn.query", "attn.value", "mlp_in", "mlp_out"]
  expected = {f"blocks.{i}.{name}": "nvfp4" for i in range(LAYERS) for name in per_block}
  assert report.quantized == expected
  assert report.unused_rules == ("embed", "blocks.*typo")
  assert report.unmatched_layers == ()
  assert report.recipe_of("head") is None and report.recipe_of("blocks.1.attn.out").name == "nvfp4"
  text = str(report)
  assert "12 of 13 linear layers quantized" in text and "rules that matched no layer: 'embed', 'blocks.*typo'" in text
  assert "head" in text and "left alone" in text


def test_a_rule_quantizing_an_fp4jax_linear_is_refused():
  """fp4jax.nn.Linear layers were skipped without a word ("0 of 0 linear layers quantized"): the model stayed BF16."""
  class Mixed(nnx.Module):
    def __init__(self):
      self.a = fp4jax.nn.Linear(32, 32, rngs=nnx.Rngs(0))
      self.b = nnx.Linear(32, 32, rngs=nnx.Rngs(1))

  model = Mixed()
  with pytest.raises(ValueError, match=r"quantizes \['a'\], which are fp4jax.nn.Linear layers: .*layer.recipe ="):
    fp4jax.quantize_model(model, [(".*", "nvfp4:stochastic_rounding=false")])
  assert model.a.recipe.name == "bf16" and not isinstance(model.b.dot_general, fp4jax.nn.QuantizedDotGeneral)
  report = fp4jax.quantize_model(model, [("b", "nvfp4:stochastic_rounding=false"), (".*", None)])
  assert list(report.quantized) == ["b"] and model.a.recipe.name == "bf16"


def test_the_report_lists_fp4jax_layers_with_their_own_recipe():
  """A None rule on an fp4jax.nn.Linear running nvfp4 changed nothing, yet the report said "1 of 1 linear layers
  quantized" (the other, still quantized, layer missing), listed the rule as matching no layer (as a typo), and
  recipe_of raised KeyError for it. The same for fp4jax.linen.Dense."""
  class Mixed(nnx.Module):
    def __init__(self):
      self.a = fp4jax.nn.Linear(32, 32, recipe="nvfp4", rngs=nnx.Rngs(0))
      self.b = nnx.Linear(32, 32, rngs=nnx.Rngs(1))

  report = fp4jax.quantize_model(Mixed(), [("a", None), (".*", "mxfp4")], rngs=0)
  assert report.quantized == {"a": "nvfp4", "b": "mxfp4"} and report.recipe_of("a").name == "nvfp4"
  assert report.unused_rules == () and report.unmatched_layers == ()
  text = str(report)
  assert "2 of 2 linear layers quantized" in text and "its own recipe: nvfp4 (rule 0 'a' does not change it)" in text

  class MixedLinen(linen.Module):
    @linen.compact
    def __call__(self, x):
      return linen.Dense(D, name="plain")(fp4jax.linen.Dense(D, recipe="nvfp4", name="ours")(x))

  mixed = fp4jax.quantize_model(MixedLinen(), [("ours", None), (".*", "mxfp4")])
  mixed.init({"params": jax.random.key(0), "quant": jax.random.key(1)}, X_LINEN)
  assert mixed.report.quantized == {"ours": "nvfp4", "plain": "mxfp4"} and mixed.report.unused_rules == ()


def test_quantized_forward_equals_fp4jax_dot_general_on_the_layer_inputs():
  """The injected model's logits equal a twin whose layers call fp4jax.dot_general themselves, bit for bit.
  (NVFP4's forward GEMM uses no randomness, so the twin's fixed key changes nothing.)"""
  recipe = recipes.nvfp4()
  model = Transformer(rngs=nnx.Rngs(0))
  report = fp4jax.quantize_model(model, RULES, rngs=nnx.Rngs(quant=1))
  twin = Transformer(rngs=nnx.Rngs(0))
  for path, module in nnx.iter_modules(twin):
    if ".".join(map(str, path)) in report.quantized:
      module.dot_general = _reference_dot_general(recipe)
  plain = Transformer(rngs=nnx.Rngs(0))
  y, y_twin, y_plain = _forward(model), _forward(twin), _forward(plain)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_twin))
  assert np.abs(np.asarray(y) - np.asarray(y_plain)).max() > 1e-3  # really quantized


def test_sr_gradients_differ_per_call_and_the_seed_reproduces_them():
  def two_gradients(quant_seed):
    model = Transformer(rngs=nnx.Rngs(0))
    fp4jax.quantize_model(model, RULES, rngs=nnx.Rngs(quant=quant_seed))
    return _kernel_grads(_grad(model)), _kernel_grads(_grad(model))

  g1, g2 = two_gradients(1)
  quantized = [p for p in g1 if p.startswith("blocks")]
  assert len(quantized) == 12
  for p in quantized:  # fresh stochastic-rounding noise on every call
    assert not np.array_equal(g1[p], g2[p]), p
  # The head is left alone and sees the same (deterministic) forward: its gradient does not move.
  np.testing.assert_array_equal(g1["head.kernel"], g2["head.kernel"])
  r1, r2 = two_gradients(1)
  for p in g1:
    np.testing.assert_array_equal(g1[p], r1[p])
    np.testing.assert_array_equal(g2[p], r2[p])
  other, _ = two_gradients(2)
  assert not np.array_equal(g1["blocks.0.mlp_in.kernel"], other["blocks.0.mlp_in.kernel"])


@pytest.mark.parametrize("rule", [None, "bf16"])
def test_unquantized_rules_give_the_unquantized_model_exactly(rule):
  plain = Transformer(rngs=nnx.Rngs(0))
  model = Transformer(rngs=nnx.Rngs(0))
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=3)  # quantize, then switch everything back off
  report = fp4jax.quantize_model(model, [(".*", rule)])
  assert report.quantized == {}
  np.testing.assert_array_equal(np.asarray(_forward(model)), np.asarray(_forward(plain)))
  g, g_plain = _kernel_grads(_grad(model)), _kernel_grads(_grad(plain))
  for p in g_plain:
    np.testing.assert_array_equal(g[p], g_plain[p])


class EinsumModel(nnx.Module):

  def __init__(self, equation, kernel_shape, bias_shape=None, *, rngs):
    self.proj = nnx.Einsum(equation, kernel_shape, bias_shape=bias_shape, rngs=rngs)

  def __call__(self, x):
    return self.proj(x)


@pytest.mark.parametrize("equation,kernel_shape,bias_shape,k_axes", [
    ("btd,dnh->btnh", (D, HEADS, 16), (HEADS, 16), 1),  # [K, heads, head_dim]
    ("btd,hd->bth", (48, D), (48,), None),  # a transposed [N, K] kernel
    ("...nh,nhd->...d", (HEADS, 16, D), (D,), 2),  # attention output: contract two axes, ellipsis batch
])
def test_einsum_linear_layers(equation, kernel_shape, bias_shape, k_axes):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((B, T, D) if k_axes != 2 else (B, T, HEADS, 16)), jnp.float32)
  model = EinsumModel(equation, kernel_shape, bias_shape, rngs=nnx.Rngs(0))
  report = fp4jax.quantize_model(model, [("proj", "nvfp4")], rngs=4)
  assert report.quantized == {"proj": "nvfp4"}
  y = nnx.jit(lambda m, x: m(x))(model, x)
  w = model.proj.kernel[...]
  w_KxN = w.T if k_axes is None else w.reshape(int(np.prod(w.shape[:k_axes])), -1)
  k = w_KxN.shape[0]
  gemm = jax.jit(lambda x_MxK, w_KxN: fp4jax.dot_general(x_MxK, w_KxN, (((1,), (0,)), ((), ())), recipe="nvfp4",
                                                          key=jax.random.key(0)))
  y_ref = gemm(x.reshape(-1, k), w_KxN).reshape(y.shape) + model.proj.bias[...]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
  g = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(m).proj.kernel[...])
  assert not np.array_equal(g(model, x), g(model, x))


def test_refusals_name_the_layer():
  batched = EinsumModel("btnd,nhd->btnh", (HEADS, 8, 16), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"proj \(nnx.Einsum\).*not a linear layer.*shared by input, kernel"):
    fp4jax.quantize_model(batched, [("proj", "nvfp4")], rngs=0)
  assert fp4jax.quantize_model(batched, [("proj", None)]).quantized == {}  # left alone: fine
  general = nnx.LinearGeneral(D, (HEADS, 16), axis=-1, batch_axis={0: B}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="batch_axis"):
    fp4jax.quantize_model(general, [("", "nvfp4")], rngs=0)
  custom = nnx.Linear(D, D, dot_general=lambda *a, **k: jax.lax.dot_general(*a[:3]), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="custom dot_general"):
    fp4jax.quantize_model(custom, [(".*", "nvfp4")], rngs=0)


def test_bad_arguments():
  model = Transformer(rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="stochastic rounding: pass rngs"):
    fp4jax.quantize_model(model, RULES)
  with pytest.raises(ValueError, match="stochastic rounding: pass rngs"):
    fp4jax.quantize_model(model, RULES, rngs=nnx.Rngs(params=0))  # no "quant" stream
  with pytest.raises(ValueError, match="not a valid regex"):
    fp4jax.quantize_model(model, [("blocks.(", "nvfp4")], rngs=0)
  with pytest.raises(ValueError, match=r"rule 0 \('head'\)"):
    fp4jax.quantize_model(model, [("head", "nvfp5")], rngs=0)
  with pytest.raises(ValueError, match="pair"):
    fp4jax.quantize_model(model, ["head"], rngs=0)
  with pytest.raises(ValueError, match="flax.nnx.Module or flax.linen.Module"):
    fp4jax.quantize_model(lambda x: x, RULES)
  # Round-to-nearest recipes need no stream.
  report = fp4jax.quantize_model(model, [(".*", "nvfp4:stochastic_rounding=false")])
  assert len(report.quantized) == 13


def test_import_fp4jax_does_not_import_flax():
  code = "import sys, fp4jax; fp4jax.quantize_model; assert not [m for m in sys.modules if m.startswith('flax')]"
  subprocess.run([sys.executable, "-c", code], check=True)


# --- Linen ----------------------------------------------------------------------------------------------------------

class LinenMLP(linen.Module):
  """Dense in, DenseGeneral to [heads, head_dim], DenseGeneral contracting both back: a Flax-style model."""

  @linen.compact
  def __call__(self, x):
    h = linen.gelu(linen.Dense(FF)(x))
    h = linen.DenseGeneral((HEADS, 32))(h)
    return linen.DenseGeneral(D, axis=(-2, -1), name="out")(h)


X_LINEN = jnp.asarray(np.random.default_rng(5).standard_normal((B * T, D)), jnp.float32)
KEY = jax.random.key(0)  # NVFP4 forward GEMMs use no randomness: any key gives the same output


def test_linen_quantize_model():
  model = LinenMLP()
  qmodel = fp4jax.quantize_model(model, [("out", None), (".*", "nvfp4"), ("typo", "nvfp4")])
  params = qmodel.init(jax.random.key(0), X_LINEN)
  same = jax.tree.map(np.array_equal, params, model.init(jax.random.key(0), X_LINEN))
  assert all(jax.tree.leaves(same))  # the model's own variables
  apply = jax.jit(qmodel.apply)
  y = apply(params, X_LINEN, rngs={"quant": jax.random.key(1)})
  assert qmodel.report.quantized == {"Dense_0": "nvfp4", "DenseGeneral_0": "nvfp4"}
  assert qmodel.report.unused_rules == ("typo",)

  # Forward: Dense_0's GEMM equals fp4jax.dot_general on its input; the others follow through the same model.
  @jax.jit
  def reference(p):
    dn = (((1,), (0,)), ((), ()))
    h = fp4jax.dot_general(X_LINEN, p["Dense_0"]["kernel"], dn, recipe="nvfp4", key=KEY)
    h = fp4jax.dot_general(linen.gelu(h + p["Dense_0"]["bias"]), p["DenseGeneral_0"]["kernel"].reshape(FF, -1), dn,
                           recipe="nvfp4", key=KEY)
    h = h.reshape(-1, HEADS, 32) + p["DenseGeneral_0"]["bias"]
    return jnp.einsum("mhd,hdn->mn", h, p["out"]["kernel"], precision="highest") + p["out"]["bias"]

  y_ref = reference(params["params"])
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(y) - np.asarray(model.apply(params, X_LINEN))).max() > 1e-3

  grad = jax.jit(jax.grad(lambda p, k: jnp.sum(jnp.sin(qmodel.apply(p, X_LINEN, rngs={"quant": k})))))
  g1, g1_again, g2 = grad(params, jax.random.key(1)), grad(params, jax.random.key(1)), grad(params, jax.random.key(2))
  k1, k2 = g1["params"]["Dense_0"]["kernel"], g2["params"]["Dense_0"]["kernel"]
  assert not np.array_equal(k1, k2)
  np.testing.assert_array_equal(k1, g1_again["params"]["Dense_0"]["kernel"])
  with pytest.raises(Exception, match="quant"):
    qmodel.apply(params, X_LINEN)

  bf16 = fp4jax.quantize_model(model, [(".*", "bf16")])
  np.testing.assert_array_equal(np.asarray(jax.jit(bf16.apply)(params, X_LINEN)),
                                np.asarray(jax.jit(model.apply)(params, X_LINEN)))


# --- the contraction helpers behind both ---------------------------------------------------------------------------

@pytest.mark.parametrize("equation,why", [
    ("btd,bd->bt", "shared by input, kernel and output"),
    ("btd,dh->bh", "summed away on one side"),
    ("btd,dh->btdh", "shared by input, kernel and output"),
    ("btd,dh->bthz", "come from neither operand"),
    ("btd,...h->bth", "ellipsis in the kernel"),
    ("btd,dh", "expected 'input,kernel->output'"),
])
def test_einsum_that_is_not_a_linear_layer_is_refused(equation, why):
  from fp4jax import contraction  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=why):
    contraction.einsum_as_dot_general(equation, 3, 2)


def test_quantized_dot_general_takes_linear_general_kernels():
  """nnx.LinearGeneral([K, heads, head_dim]) with quantized_dot_general: one [M, K] x [K, heads * head_dim] GEMM."""
  recipe = recipes.nvfp4(stochastic_rounding=False)
  layer = nnx.LinearGeneral(D, (HEADS, 16), dot_general=fp4jax.quantized_dot_general(recipe), rngs=nnx.Rngs(0))
  x = X_LINEN.reshape(B, T, D)
  y_ref = fp4jax.dot_general(x.reshape(-1, D), layer.kernel[...].reshape(D, -1), (((1,), (0,)), ((), ())),
                             recipe=recipe).reshape(B, T, HEADS, 16) + layer.bias[...]
  np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y_ref))


def test_linen_refusals_name_the_layer():
  class Batched(linen.Module):
    @linen.compact
    def __call__(self, x):
      return linen.DenseGeneral(16, axis=-1, batch_dims=(0,), name="per_head")(x)

  x = jnp.ones((HEADS, T, D), jnp.float32)
  qmodel = fp4jax.quantize_model(Batched(), [(".*", "nvfp4:stochastic_rounding=false")])
  params = qmodel.init(jax.random.key(0), x)  # init runs unquantized
  with pytest.raises(ValueError, match="per_head: a batched contraction"):
    qmodel.apply(params, x)
  custom = linen.Dense(D, dot_general=jax.lax.dot_general)
  qcustom = fp4jax.quantize_model(custom, [(".*", "nvfp4:stochastic_rounding=false")])
  with pytest.raises(ValueError, match="custom dot_general"):
    qcustom.apply(qcustom.init(jax.random.key(0), X_LINEN), X_LINEN)


  class Mixed(linen.Module):  # fp4jax.linen.Dense was skipped without a word: the model stayed BF16
    @linen.compact
    def __call__(self, x):
      return linen.Dense(D, name="plain")(fp4jax.linen.Dense(D, name="ours")(x))

  rules = [("ours", "nvfp4:stochastic_rounding=false")]
  with pytest.raises(ValueError, match="quantizes 'ours', an fp4jax.linen.Dense: it runs its own `recipe` field"):
    fp4jax.quantize_model(Mixed(), rules).init(jax.random.key(0), X_LINEN)
  mixed = fp4jax.quantize_model(Mixed(), [("plain", "nvfp4:stochastic_rounding=false"), (".*", None)])
  assert mixed.apply(mixed.init(jax.random.key(0), X_LINEN), X_LINEN).shape[-1] == D
  assert list(mixed.report.quantized) == ["plain"]

  class WithEinsum(linen.Module):  # Linen's Einsum calls jnp.einsum: it ran unquantized under a "1 of 1" report
    @linen.compact
    def __call__(self, x):
      return linen.Einsum((D, D), "bk,kn->bn", name="mix")(linen.Dense(D, name="plain")(x))

  with pytest.raises(ValueError, match="quantizes 'mix', a Linen nn.Einsum, which has no dot_general"):
    fp4jax.quantize_model(WithEinsum(), [(".*", "nvfp4:stochastic_rounding=false")]).init(jax.random.key(0), X_LINEN)
  kept = fp4jax.quantize_model(WithEinsum(), [("mix", None), (".*", "nvfp4:stochastic_rounding=false")])
  assert kept.apply(kept.init(jax.random.key(0), X_LINEN), X_LINEN).shape[-1] == D


@pytest.mark.parametrize("rules, match", [
    ("nvfp4", r"got the string 'nvfp4'\. For every layer: \[\('\.\*', 'nvfp4'\)\]"),
    (fp4jax.recipes.nvfp4(), r"\(for every layer: \[\('\.\*', recipe\)\]\); got Recipe"),
    ({"up": "nvfp4"}, r"got a dict: pass list\(rules\.items\(\)\)"),
])
def test_a_bare_recipe_instead_of_rules_says_how_to_quantize_every_layer(rules, match):
  with pytest.raises(ValueError, match=match):
    fp4jax.quantize_model(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), rules, rngs=nnx.Rngs(quant=1))


class _Stack(nnx.Module):
  """Flax's scan-over-layers idiom: layers stacked by nnx.vmap, run by nnx.scan."""

  def __init__(self, n, rngs, einsum=False):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Einsum("bd,dh->bh", (D, D), rngs=rngs) if einsum else nnx.Linear(D, D, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, layer):
      return jnp.tanh(layer(h))

    return body(x, self.layers)


def _stacked_model():
  model = _Stack(3, nnx.Rngs(0))
  layers = model.layers
  layers.kernel[...] = jnp.broadcast_to(layers.kernel[...][0], layers.kernel[...].shape)  # three equal layers
  return model


def test_layers_stacked_by_vmap_and_run_by_scan_get_one_stream_each():
  x = jax.random.normal(jax.random.key(1), (B * T, D))
  model = _stacked_model()
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=nnx.Rngs(quant=0))
  keys = jax.random.key_data(model.layers.dot_general.quant_rngs.key[...])
  assert keys.shape[0] == 3 and len({tuple(np.asarray(k).ravel()) for k in keys}) == 3
  grad = lambda m: np.asarray(nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)["layers"]["kernel"][...])
  g1, g2 = grad(model), grad(model)
  assert g1.shape == (3, D, D) and np.all(np.isfinite(g1))
  assert not np.array_equal(g1, g2)  # SR in the backward: a fresh key per call
  again = _stacked_model()
  fp4jax.quantize_model(again, [(".*", "nvfp4")], rngs=nnx.Rngs(quant=0))
  np.testing.assert_array_equal(grad(again), g1)  # the seed reproduces the run
  plain = _stacked_model()
  fp4jax.quantize_model(plain, [(".*", "nvfp4:stochastic_rounding=false,rht=false")])
  np.testing.assert_array_equal(grad(plain), grad(plain))  # no stream: deterministic


def test_a_layer_whose_shape_the_recipe_cannot_run_is_refused_by_name_before_any_edit():
  class Two(nnx.Module):
    def __init__(self):
      self.good = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
      self.odd = nnx.Linear(3, 32, rngs=nnx.Rngs(1))

  model = Two()
  with pytest.raises(ValueError, match=r"odd \(Linear\): .*blocks of 16 need K divisible by 16"):
    fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)
  assert model.good.dot_general is jax.lax.dot_general or model.good.dot_general is None  # untouched


def test_linen_and_einsum_layers_the_recipe_cannot_run_are_named_at_call_time():
  x = jnp.ones((4, 32))
  qmodel = fp4jax.quantize_model(linen.Sequential([linen.Dense(24), linen.Dense(16)]), [(".*", "nvfp4")])
  params = qmodel.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"^layers_0: fprop rhs: nvfp4 blocks of 16 need N divisible by 16; got N=24"):
    qmodel.apply(params, x, rngs={"quant": jax.random.key(1)})
  model = nnx.Sequential(nnx.Einsum("bd,dn->bn", (32, 24), rngs=nnx.Rngs(0)))
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)  # the equation gives K and N only at call time
  with pytest.raises(ValueError, match=r"^layers\.0: fprop rhs: .*N=24"):
    model(x)


def test_linen_quantize_model_refuses_rngs_and_says_where_keys_go():
  with pytest.raises(ValueError, match=r"takes no rngs.*rngs=\{'quant': key\}"):
    fp4jax.quantize_model(linen.Dense(D), [(".*", "nvfp4")], rngs=0)
  qmodel = fp4jax.quantize_model(linen.Dense(D), [(".*", "nvfp4")])
  x = jnp.ones((B * T, D))
  variables = qmodel.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"the model itself.*'nvfp4' needs randomness.*rngs=\{'quant': key\}"):
    qmodel.apply(variables, x)  # Flax's own error named no fix


def test_a_second_call_sets_every_layer_including_those_no_rule_matches():
  model = nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(0)), nnx.Linear(D, D, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(2), (B * T, D))
  y_plain = model(x)
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)
  report = fp4jax.quantize_model(model, [(r"layers\.0", "mxfp4:stochastic_rounding=false")])
  assert report.quantized == {"layers.0": "mxfp4-sr"} and report.unmatched_layers == ("layers.1",)
  assert model.layers[1].dot_general in (None, jax.lax.dot_general)  # what the report says: its own GEMM
  fp4jax.quantize_model(model, [])
  np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(y_plain))


def test_stacked_einsum_layers_get_one_stream_each():
  """A stacked nnx.Einsum was refused ("does not match operands of rank 2 and 3": the check took the stacked
  kernel's rank) and would have shared one stream: its kernel_shape is one layer's, not the stack's."""
  model = _Stack(3, nnx.Rngs(0), einsum=True)
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)
  keys = jax.random.key_data(model.layers.einsum_op.quant_rngs.key[...])
  assert keys.shape[0] == 3 and len({tuple(np.asarray(k).ravel()) for k in keys}) == 3
  x = jax.random.normal(jax.random.key(1), (B * T, D))
  grad = lambda m: np.asarray(nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)["layers"]["kernel"][...])
  g1, g2 = grad(model), grad(model)
  assert g1.shape == (3, D, D) and np.all(np.isfinite(g1)) and not np.array_equal(g1, g2)
  np.testing.assert_array_equal(np.asarray(model.layers.einsum_op.quant_rngs.count[...]), [2, 2, 2])


def test_quantizing_again_continues_each_layers_stream():
  """A late switch by a second quantize_model call with the same seed restarted every layer's keys at the seed, so
  the steps after it replayed the noise of the first steps in order."""
  model = nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(0)), nnx.Linear(D, D, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(2), (B * T, D))
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)
  stream = lambda: model.layers[0].dot_general.quant_rngs
  first_key = jax.random.key_data(stream()())  # draws key 0 by hand
  model(x)  # draws key 1
  fp4jax.quantize_model(model, [(r"layers\.1", None), (".*", "nvfp4")], rngs=0)  # layer 1 to its own GEMM
  assert int(stream().count[...]) == 2
  assert not np.array_equal(jax.random.key_data(stream()()), first_key)
  fp4jax.quantize_model(model, [(r"layers\.1", None), (".*", "nvfp4")])  # every SR layer has a stream: no rngs
  assert int(stream().count[...]) == 3
  fp4jax.quantize_model(model, [])  # restored: the next quantization reseeds
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)
  np.testing.assert_array_equal(jax.random.key_data(stream()()), first_key)


def test_a_phase_without_stochastic_rounding_keeps_the_stream():
  """nvfp4 -> fp8 -> nvfp4 dropped the stream in the fp8 phase (fp8 draws no key), so the second nvfp4 phase
  restarted at the seed and replayed the first phase's noise; and a layer newly quantized with the same seed while
  the other sat in fp8 could fork that layer's stream."""
  model = nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(0)), nnx.Linear(D, D, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(2), (B * T, D))
  counts = lambda: [int(c) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))]
  fp4jax.quantize_model(model, [(r"layers\.0", "nvfp4")], rngs=0)
  model(x), model(x)
  fp4jax.quantize_model(model, [(r"layers\.0", "fp8"), (r"layers\.1", "nvfp4")], rngs=0)
  model(x)
  data = lambda i: np.asarray(jax.random.key_data(model.layers[i].dot_general.quant_rngs.key[...]))
  assert counts() == [2, 1] and not np.array_equal(data(0), data(1))
  fp4jax.quantize_model(model, [(".*", "nvfp4")])  # both keep their streams: no rngs needed
  model(x)
  assert counts() == [3, 2]


def test_a_layer_quantized_later_with_the_same_seed_gets_a_stream_of_its_own():
  """The second call forked the first call's streams again: a newly quantized layer got the stream an earlier one
  kept, and replayed its stochastic rounding key for key. It now gets what one call quantizing both gives it."""
  x = jax.random.normal(jax.random.key(2), (B * T, D))
  make = lambda: nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(0)), nnx.Linear(D, D, rngs=nnx.Rngs(1)))
  stream_data = lambda m, i: np.asarray(jax.random.key_data(m.layers[i].dot_general.quant_rngs.key[...]))
  late = make()
  fp4jax.quantize_model(late, [(r"layers\.0", "nvfp4")], rngs=0)
  late(x)
  fp4jax.quantize_model(late, [(".*", "nvfp4")], rngs=0)
  assert not np.array_equal(stream_data(late, 0), stream_data(late, 1))
  at_once = make()
  fp4jax.quantize_model(at_once, [(".*", "nvfp4")], rngs=0)
  for i in range(2):
    np.testing.assert_array_equal(stream_data(late, i), stream_data(at_once, i))


def test_a_layer_quantized_on_its_own_is_named_in_messages():
  with pytest.raises(ValueError, match=r"^\(the model itself\) \(Linear\): .*K divisible by 16"):
    fp4jax.quantize_model(nnx.Linear(3, 32, rngs=nnx.Rngs(0)), [(".*", "nvfp4")], rngs=0)
  with pytest.raises(ValueError, match=r"the recipes of \['\(the model itself\)'\] use stochastic rounding"):
    fp4jax.quantize_model(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), [(".*", "nvfp4")])
  report = fp4jax.quantize_model(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), [(".*", "nvfp4")], rngs=0)
  assert "(the model itself)  Linear" in str(report)


def test_linen_dense_subclass_calling_super_is_quantized_once():
  """A Dense subclass whose __call__ calls super().__call__ was refused ("already has a custom dot_general": the
  second interception saw the first's) and would have drawn two keys per call."""
  class ScaledDense(linen.Dense):
    def __call__(self, x):
      return super().__call__(x) * 2.0

  x = jax.random.normal(jax.random.key(0), (8, 32))
  scaled = fp4jax.quantize_model(ScaledDense(32), [(".*", "nvfp4")])
  plain = fp4jax.quantize_model(linen.Dense(32), [(".*", "nvfp4")])
  params = plain.init(jax.random.key(1), x)
  rngs = {"quant": jax.random.key(2)}
  y_scaled = scaled.apply(params, x, rngs=rngs)
  np.testing.assert_array_equal(np.asarray(y_scaled), 2.0 * np.asarray(plain.apply(params, x, rngs=rngs)))
  grad = lambda m: jax.grad(lambda p: jnp.sum(m.apply(p, x, rngs=rngs) ** 2))(params)["params"]["kernel"]
  np.testing.assert_array_equal(np.asarray(grad(scaled)),
                                np.asarray(jax.grad(lambda p: jnp.sum((2 * plain.apply(p, x, rngs=rngs)) ** 2))(
                                    params)["params"]["kernel"]))


def test_rules_match_the_whole_layer_path():
  """re.fullmatch, as documented: "layers" names no layer of a Sequential ("layers.0", "layers.1"), "layers\\.1" one."""
  model = nnx.Sequential(nnx.Linear(D, D, rngs=nnx.Rngs(0)), nnx.Linear(D, D, rngs=nnx.Rngs(1)))
  report = fp4jax.quantize_model(model, [("layers", "nvfp4"), (r"layers\.1", "mxfp4:stochastic_rounding=false"),
                                         ("ayers.0", "nvfp4")])
  assert report.quantized == {"layers.1": "mxfp4-sr"}
  assert report.unmatched_layers == ("layers.0",)
  assert report.unused_rules == ("layers", "ayers.0")


def test_an_evaluation_of_a_clone_leaves_the_training_keys_alone():
  """README: every call draws from the layer's stream, an evaluation too; evaluating nnx.clone(model) does not."""
  model = nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0)))
  fp4jax.quantize_model(model, [(".*", "nvfp4")], rngs=0)
  counts = lambda m: [int(c) for c in jax.tree.leaves(nnx.state(m, nnx.RngCount))]
  x = jnp.ones((16, 32))
  evaluated = nnx.clone(model)
  evaluated(x), evaluated(x)
  assert counts(model) == [0] and counts(evaluated) == [2]
  model(x)
  assert counts(model) == [1]


def test_quantizing_a_linen_quantized_model_names_its_module():
  """A QuantizedModel passed again got "expects a flax.nnx.Module or flax.linen.Module; got QuantizedModel"."""
  qmodel = fp4jax.quantize_model(linen.Dense(D), [(".*", "nvfp4")])
  with pytest.raises(ValueError, match=r"got a QuantizedModel, .* quantize_model\(qmodel.module, rules\)"):
    fp4jax.quantize_model(qmodel, [(".*", "mxfp4")])
  assert fp4jax.quantize_model(qmodel.module, [(".*", "mxfp4")]).module is qmodel.module
