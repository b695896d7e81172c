"""Decoder-only transformer (Flax NNX) whose linear layers run through fp4jax's quantized GEMMs.

Pre-norm RMSNorm blocks, RoPE, grouped-query attention, a SwiGLU or squared-ReLU MLP, untied embeddings and LM
head, no biases. The q/k/v/o projections and the MLP up/gate/down projections are `fp4jax.nn.Linear` layers whose
`recipe` attribute picks each GEMM's precision (see fp4jax.pretrain.policy for per-layer choices). Kept in high precision,
as in the paper: embeddings, the LM head, norms, nonlinearities, the attention softmax (float32) and the two
attention batched GEMMs (QK^T, PV: compute dtype in, float32 accumulation). The residual stream is float32.
Attention is causal, but a recipe whose activations share one per-tensor scale (NVFP4's FP32 second level: nvfp4,
four_over_six, quartet2) derives it from the amax of the whole batch, so later tokens and other sequences of the
batch move earlier logits through that one scale (it carries no gradient); row-wise scaled recipes (bf16, mxfp4,
fp8, tetrajet_v2, quartet) are exactly causal (tests/pretrain/test_model_reference.py).

Layer names: "blocks.{i}.attn.{q,k,v,o}" and "blocks.{i}.mlp.{up,gate,down}" ("gate" only for SwiGLU), the same
paths nnx.split / nnx.state use.

`ModelConfig.scan_layers` runs each run of consecutive blocks with one graphdef (the same recipes, shapes and
OutControl channel counts) as a `jax.lax.scan` over their parameters stacked at call time, so XLA compiles one block
body per run instead of one per block. The parameters stay per block (checkpoints, sharding rules and precision
policies address them by path) and each block reads its own row of the per-layer keys; blocks whose layers write
state (OutControl's record phase, analysis taps) run in the loop.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

import fp4jax.nn
import fp4jax.recipes
from fp4jax import cli_values
from fp4jax import formats
from fp4jax import keys as keys_lib
from fp4jax import prng
from fp4jax import recipe_names
from fp4jax.dot_general import LayerKeys, check_layer_shape, derive_layer_keys, rht_size_limit

MLP_KINDS = ("swiglu", "squared_relu")
# NVFP4's block size: every quantized GEMM dimension of a weight must split into whole 16-element blocks.
BLOCK_SIZE = formats.NVFP4().block_size
# Sub-layer order inside a block; fixes each layer's integer id (and so its PRNG stream) forever.
SUBLAYERS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.gate", "mlp.down")
_LAYER_NAME = re.compile(r"blocks\.(\d+)\.(attn\.[qkvo]|mlp\.(?:up|gate|down))")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Transformer shape and dtypes. The attention width is n_heads * head_dim (need not equal d_model)."""

  vocab_size: int = 256
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  mlp: str = "swiglu"
  max_seq_len: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "bfloat16"  # compute dtype of activations fed to GEMMs
  param_dtype: str = "float32"  # master weights
  remat: bool = False  # rematerialise each block's activations in the backward pass
  scan_layers: bool = False  # runs of identical blocks as one lax.scan: compile time independent of depth

  def __post_init__(self):
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ModelConfig.{field} must be a positive int; got {value!r}.")
    if self.mlp not in MLP_KINDS:
      raise ValueError(f"ModelConfig.mlp must be one of {MLP_KINDS}; got {self.mlp!r}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}).")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even (RoPE rotates pairs); got {self.head_dim}.")
    widths = {"d_model": self.d_model, "d_ff": self.d_ff, "n_heads * head_dim": self.n_heads * self.head_dim,
              "n_kv_heads * head_dim": self.n_kv_heads * self.head_dim}
    for field, width in widths.items():
      if width % BLOCK_SIZE:
        raise ValueError(f"ModelConfig.{field} = {width} must be a multiple of {BLOCK_SIZE} (the NVFP4 block size): "
                         "it is an in/out feature count of a quantized linear layer.")
    for field in ("rope_theta", "norm_eps"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"ModelConfig.{field} must be a positive number; got {value!r}.")
    for field in ("dtype", "param_dtype"):
      value = getattr(self, field)
      try:
        ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
      except TypeError:
        ok = False
      if not ok or not isinstance(value, str):
        raise ValueError(f"ModelConfig.{field} must name a float dtype like 'bfloat16'; got {value!r}.")
      if jnp.dtype(value).itemsize == 8 and not jax.config.jax_enable_x64:  # else JAX silently makes it float32
        raise ValueError(f"ModelConfig.{field}={value!r} needs 64-bit JAX (JAX_ENABLE_X64=1); without it the "
                         "arrays would be float32.")
      if jnp.dtype(value).itemsize == 1:
        raise ValueError(f"ModelConfig.{field}={value!r}: an 8-bit float is a storage format, not a dtype to "
                         "compute or keep master weights in (FP8 GEMMs are a recipe: --recipe fp8).")
    for field in ("remat", "scan_layers"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"ModelConfig.{field} must be a bool; got {getattr(self, field)!r}.")

  @property
  def linear_shapes(self) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each quantized linear layer of one block, by sub-layer name."""
    q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    shapes = {"attn.q": (self.d_model, q_width), "attn.k": (self.d_model, kv_width),
              "attn.v": (self.d_model, kv_width), "attn.o": (q_width, self.d_model),
              "mlp.up": (self.d_model, self.d_ff), "mlp.gate": (self.d_model, self.d_ff),
              "mlp.down": (self.d_ff, self.d_model)}
    if self.mlp != "swiglu":
      del shapes["mlp.gate"]
    return shapes


MODEL_PRESETS: dict[str, ModelConfig] = {
    # CPU smoke tests: a training step in well under a second.
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192, max_seq_len=64),
    # CPU experiments: minutes per run.
    "small": ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512, max_seq_len=128),
    # GPU scale, after the paper's 1.2B ablation model (20 layers, d_model 2048, d_ff 6144, 16 query / 8 KV heads
    # of 128). Not verified against the paper: the squared-ReLU MLP (Nemotron's choice), the 4096 context and the
    # byte vocabulary (the paper uses a large BPE vocabulary; set vocab_size to match the tokenizer) are assumptions.
    "paper_1b": ModelConfig(d_model=2048, n_layers=20, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=6144,
                            mlp="squared_relu", max_seq_len=4096),
}


def get_model_config(name: str, **overrides) -> ModelConfig:
  """A preset from MODEL_PRESETS with fields replaced by `overrides` (re-validated)."""
  if name not in MODEL_PRESETS:
    raise ValueError(f"Unknown model preset {name!r}{cli_values.did_you_mean(name, MODEL_PRESETS)}; choose from "
                     f"{sorted(MODEL_PRESETS)}.")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"Unknown ModelConfig field(s) {unknown}; valid fields: {sorted(fields)}.")
  return dataclasses.replace(MODEL_PRESETS[name], **overrides)


def layer_id(name: str) -> int:
  """Stable integer id of a linear layer name ("blocks.3.mlp.down" -> 3 * 7 + 6); seeds its PRNG stream."""
  match = _LAYER_NAME.fullmatch(name)
  if match is None:
    raise ValueError(f"Not a linear layer name: {name!r}; expected 'blocks.<i>.<one of {SUBLAYERS}>'.")
  return int(match.group(1)) * len(SUBLAYERS) + SUBLAYERS.index(match.group(2))


def layer_key(key: jax.Array | None, name: str) -> jax.Array | None:
  """The layer's own key folded from the model-level `key` (None stays None)."""
  return None if key is None else jax.random.fold_in(key, layer_id(name))


def block_layer_keys(key: jax.Array | None, n_layers: int) -> LayerKeys | None:
  """The LayerKeys of every linear layer's key, [n_layers, len(SUBLAYERS)] leading: [i, j] is derived from
  layer_key(key, "blocks.<i>.<SUBLAYERS[j]>"), the same bits, but in a few batched threefry evaluations per step
  instead of a few small kernels per layer (fp4jax.dot_general.LayerKeys)."""
  if key is None:
    return None
  if not keys_lib.is_typed_key(key):
    key = jax.random.wrap_key_data(key)  # raw key data, read as JAX reads it (the default implementation)
  ids = [layer_id(f"blocks.{i}.{sub}") for i in range(n_layers) for sub in SUBLAYERS]
  keys_LxS = prng.fold_in_many(key, ids).reshape(n_layers, len(SUBLAYERS))
  return derive_layer_keys(keys_LxS)


def layer_names(config: "ModelConfig") -> tuple[str, ...]:
  """Names of the quantizable linear layers of a model with `config`, in `Transformer.linear_layers()` order."""
  subs = [s for s in SUBLAYERS if s != "mlp.gate" or config.mlp == "swiglu"]
  return tuple(f"blocks.{i}.{s}" for i in range(config.n_layers) for s in subs)


def check_layer_recipes(config: "ModelConfig", recipe) -> None:
  """Raises a ValueError naming the first quantizable linear layer whose weight shape cannot run its recipe (`recipe`
  as Transformer takes it: a Recipe, its string form, or a {layer name: Recipe} mapping): Fprop/Dgrad blocks or RHT
  tiles that do not divide its in/out features. The message gives the largest RHT size every layer fits."""
  shapes = config.linear_shapes
  names = layer_names(config)
  per_layer = {name: fp4jax.recipes.get_recipe(_layer_recipe(recipe, name)) for name in names}
  shape_of = lambda name: shapes[name.split(".", 2)[2]]
  for name in names:
    r = per_layer[name]
    try:
      check_layer_shape(*shape_of(name), r)
    except ValueError as e:
      same = [m for m in names if per_layer[m] == r]
      limits = [x for x in (rht_size_limit(*shape_of(m), r) for m in same) if x is not None]
      smaller = _with_rht_size(r, min(limits)) if limits and 1 < min(limits) < r.rht_size else None
      fit = (f" Every layer of this model fits rht_size={min(limits)}."
             if smaller is not None and _all_fit(same, shape_of, smaller) else "")
      raise ValueError(f"Linear layer {name!r}: {e}{fit}") from None


def _with_rht_size(recipe, size: int):
  """`recipe` with RHT size `size` (a preset rebuilt from its spec, so that what follows the size follows it: Quartet
  II's EDEN groups), or None where that recipe cannot be built."""
  from fp4jax.pretrain import policy as policy_lib  # pylint: disable=g-import-not-at-top  (policy builds on model)
  spec = policy_lib.recipe_spec(recipe)
  try:
    if spec is None:
      return recipe.replace(rht_size=size)
    name, kwargs = recipe_names.parse_spec(spec, fp4jax.recipes.PRESETS)
    return fp4jax.recipes.PRESETS[name](**{**kwargs, "rht_size": size})
  except (TypeError, ValueError):
    return None


def _all_fit(names, shape_of, recipe) -> bool:
  """Whether every layer in `names` can run `recipe` (its blocks as well as its RHT tiles)."""
  try:
    for name in names:
      check_layer_shape(*shape_of(name), recipe)
  except ValueError:
    return False
  return True


def _layer_recipe(recipe, name: str):
  """`recipe` for every layer, or a {layer name: Recipe} mapping's entry for `name`."""
  if isinstance(recipe, Mapping):
    if name not in recipe:
      raise ValueError(f"The per-layer recipes name no recipe for layer {name!r}.")
    return recipe[name]
  return recipe


def _params_only(rngs: nnx.Rngs) -> nnx.Rngs:
  # Linear layers get no stream to draw quantization randomness from: it must come from the model's explicit
  # `key` (reproducible per step and per layer), never from hidden RNG state that jit or remat could freeze.
  return nnx.Rngs(params=rngs.params())


def rope(x_BxTxNxH: jax.Array, positions_T: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (split-half pairing), computed in float32, returned in x's dtype."""
  half = x_BxTxNxH.shape[-1] // 2
  inv_freq_F = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles_TxF = positions_T.astype(jnp.float32)[:, None] * inv_freq_F[None, :]
  cos_1xTx1xF, sin_1xTx1xF = (f(angles_TxF)[None, :, None, :] for f in (jnp.cos, jnp.sin))
  x = x_BxTxNxH.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos_1xTx1xF - x2 * sin_1xTx1xF, x2 * cos_1xTx1xF + x1 * sin_1xTx1xF], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned scale; statistics in float32, output in the compute dtype."""

  def __init__(self, features: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
    del rngs  # the scale starts at ones
    self.scale = nnx.Param(jnp.ones((features,), param_dtype))
    self.eps, self.dtype = eps, dtype

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Attention(nnx.Module):
  """Causal grouped-query attention; q/k/v/o are quantizable, QK^T / softmax / PV stay high precision."""

  def __init__(self, config: ModelConfig, index: int, *, recipe, rngs: nnx.Rngs):
    self.config = config  # no index: blocks that differ only by position share a graphdef (scan_layers)
    shapes, dtype, param_dtype = config.linear_shapes, jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    for sub in ("q", "k", "v", "o"):
      layer_recipe = _layer_recipe(recipe, f"blocks.{index}.attn.{sub}")
      setattr(self, sub, fp4jax.nn.Linear(*shapes[f"attn.{sub}"], recipe=layer_recipe, rngs=_params_only(rngs),
                                           dtype=dtype, param_dtype=param_dtype))

  def __call__(self, x_BxTxD: jax.Array, positions_T: jax.Array, keys_S: LayerKeys | None) -> jax.Array:
    c = self.config
    b, t, _ = x_BxTxD.shape
    group = c.n_heads // c.n_kv_heads
    k_ = lambda sub: _sublayer_key(keys_S, f"attn.{sub}")
    q_BxTxNxH = self.q(x_BxTxD, key=k_("q")).reshape(b, t, c.n_heads, c.head_dim)
    k_BxSxKxH = self.k(x_BxTxD, key=k_("k")).reshape(b, t, c.n_kv_heads, c.head_dim)
    v_BxSxKxH = self.v(x_BxTxD, key=k_("v")).reshape(b, t, c.n_kv_heads, c.head_dim)
    q_BxTxNxH = rope(q_BxTxNxH, positions_T, c.rope_theta)
    k_BxSxKxH = rope(k_BxSxKxH, positions_T, c.rope_theta)
    # Query heads n = kv_head * group + g share kv_head, matching the usual GQA repeat order.
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, c.n_kv_heads, group, c.head_dim)
    logits_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                                  preferred_element_type=jnp.float32) / math.sqrt(c.head_dim)
    causal_TxS = jnp.tril(jnp.ones((t, t), bool))
    logits_BxKxGxTxS = jnp.where(causal_TxS, logits_BxKxGxTxS, jnp.finfo(jnp.float32).min)
    probs_BxKxGxTxS = jax.nn.softmax(logits_BxKxGxTxS, axis=-1)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS.astype(v_BxSxKxH.dtype), v_BxSxKxH,
                               preferred_element_type=jnp.float32)
    out_BxTxA = out_BxTxKxGxH.reshape(b, t, c.n_heads * c.head_dim).astype(jnp.dtype(c.dtype))
    return self.o(out_BxTxA, key=k_("o"))


class Mlp(nnx.Module):
  """SwiGLU (silu(gate) * up) or squared-ReLU (relu(up)^2) MLP; the nonlinearity runs in float32."""

  def __init__(self, config: ModelConfig, index: int, *, recipe, rngs: nnx.Rngs):
    self.config = config
    shapes, dtype, param_dtype = config.linear_shapes, jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    make = lambda sub: fp4jax.nn.Linear(*shapes[f"mlp.{sub}"], recipe=_layer_recipe(recipe, f"blocks.{index}.mlp.{sub}"),
                                         rngs=_params_only(rngs), dtype=dtype, param_dtype=param_dtype)
    self.up = make("up")
    if config.mlp == "swiglu":
      self.gate = make("gate")
    self.down = make("down")

  def __call__(self, x_BxTxD: jax.Array, keys_S: LayerKeys | None) -> jax.Array:
    k_ = lambda sub: _sublayer_key(keys_S, f"mlp.{sub}")
    up_BxTxF = self.up(x_BxTxD, key=k_("up")).astype(jnp.float32)
    if self.config.mlp == "swiglu":
      gate_BxTxF = self.gate(x_BxTxD, key=k_("gate")).astype(jnp.float32)
      h_BxTxF = jax.nn.silu(gate_BxTxF) * up_BxTxF
    else:
      h_BxTxF = jnp.square(jax.nn.relu(up_BxTxF))
    return self.down(h_BxTxF.astype(jnp.dtype(self.config.dtype)), key=k_("down"))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); the residual stream is float32."""

  def __init__(self, config: ModelConfig, index: int, *, recipe, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(config.d_model, eps=config.norm_eps, dtype=jnp.dtype(config.dtype),
                           param_dtype=jnp.dtype(config.param_dtype), rngs=rngs)
    self.attn_norm = norm()
    self.attn = Attention(config, index, recipe=recipe, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = Mlp(config, index, recipe=recipe, rngs=rngs)

  def __call__(self, x_BxTxD: jax.Array, positions_T: jax.Array, keys_S: LayerKeys | None) -> jax.Array:
    """keys_S: this block's row of block_layer_keys (None when no layer needs randomness)."""
    x_BxTxD = x_BxTxD + self.attn(self.attn_norm(x_BxTxD), positions_T, keys_S).astype(jnp.float32)
    return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD), keys_S).astype(jnp.float32)


def _take(layer_keys: LayerKeys | None, i: int) -> LayerKeys | None:
  """Entry i along the leading axis of batched LayerKeys (None stays None)."""
  return None if layer_keys is None else jax.tree.map(lambda a: a[i], layer_keys)


def _sublayer_key(keys_S: LayerKeys | None, sub: str) -> LayerKeys | None:
  return _take(keys_S, SUBLAYERS.index(sub))


def _block_forward(block: Block, x_BxTxD, positions_T, keys_S):
  return block(x_BxTxD, positions_T, keys_S)


_block_forward_remat = nnx.remat(_block_forward)


def _scannable(block: Block) -> bool:
  """Whether `block` holds only the model's own modules and reads, never writes, its state: no layer records its
  inputs (OutControl), draws from an RNG stream or is wrapped (analysis taps). A scan body's writes would be lost."""
  for _, module in nnx.iter_modules(block):
    if isinstance(module, fp4jax.nn.Linear):
      if module.record_inputs or module.quant_rngs is not None:
        return False
    elif not isinstance(module, (Block, Attention, Mlp, RMSNorm)):
      return False
  return True


def block_runs(blocks) -> list[tuple[int, int]]:
  """[start, stop) ranges of consecutive blocks that one lax.scan can run: scannable, with the same graphdef (so the
  same recipes) and the same state shapes and dtypes (so the same OutControl channel counts). Blocks that differ (a
  BF16 first block) start a new run."""
  runs, previous = [], None
  for i, block in enumerate(blocks):
    signature = None
    if _scannable(block):
      graphdef, state = nnx.split(block)
      signature = (graphdef, tuple((jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(state)))
    if runs and signature is not None and signature == previous:
      runs[-1] = (runs[-1][0], i + 1)
    else:
      runs.append((i, i + 1))
    previous = signature
  return runs


def _scan_blocks(blocks, x_BxTxD, positions_T, keys_LxS, *, remat: bool):
  """The blocks (one graphdef) applied in order as a lax.scan over their stacked state: one traced and compiled
  block body whatever the depth. The same arithmetic as the loop; the parameters stay per block."""
  graphdef = nnx.graphdef(blocks[0])
  state_L = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[nnx.state(block) for block in blocks])

  def body(x_BxTxD, state_and_keys):
    state, keys_S = state_and_keys
    return nnx.merge(graphdef, state)(x_BxTxD, positions_T, keys_S), None

  if remat:
    body = jax.checkpoint(body, prevent_cse=False)  # the loop already keeps XLA from merging the recomputation
  x_BxTxD, _ = jax.lax.scan(body, x_BxTxD, (state_L, keys_LxS))
  return x_BxTxD


class Transformer(nnx.Module):
  """Decoder-only LM. `model(tokens_BxT, key=...)` -> float32 logits [B, T, vocab_size].

  `recipe` (a fp4jax Recipe, its string form, or a {layer name: Recipe} mapping over `layer_names(config)`) is the
  initial recipe of the quantizable linear layers; change
  layers later through `linear_layers()` or `fp4jax.pretrain.policy.PrecisionPolicy.apply`. Quantization randomness comes
  only from `key` (each layer folds in its `layer_id`; fold the step in before calling); key=None is allowed
  only when no layer's recipe needs randomness. `rngs` is used for initialisation only: every linear kernel (the
  LM head's too) is LeCun normal (truncated at two standard deviations, std 1/sqrt(in_features)), the embedding a
  normal of std 1/sqrt(d_model), the norm scales ones.
  """

  def __init__(self, config: ModelConfig, *, recipe=None, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"config must be a ModelConfig; got {type(config).__name__}.")
    recipe = fp4jax.recipes.bf16() if recipe is None else recipe
    if isinstance(recipe, str):
      recipe = fp4jax.recipes.get_recipe(recipe)
    check_layer_recipes(config, recipe)
    self.config = config
    param_dtype = jnp.dtype(config.param_dtype)
    self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=jnp.float32, param_dtype=param_dtype,
                           rngs=rngs)
    self.blocks = nnx.List([Block(config, i, recipe=recipe, rngs=rngs) for i in range(config.n_layers)])
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=jnp.dtype(config.dtype),
                              param_dtype=param_dtype, rngs=rngs)
    # Plain high-precision GEMM: compute-dtype operands, float32 accumulation and output.
    self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, dtype=jnp.dtype(config.dtype),
                              param_dtype=param_dtype, preferred_element_type=jnp.float32, rngs=rngs)

  def __call__(self, tokens_BxT: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
    c = self.config
    if tokens_BxT.ndim != 2 or not jnp.issubdtype(tokens_BxT.dtype, jnp.integer):
      raise ValueError(f"tokens must be an integer array [batch, seq]; got {tokens_BxT.dtype} {tokens_BxT.shape}.")
    t = tokens_BxT.shape[1]
    if t > c.max_seq_len:
      raise ValueError(f"Sequence length {t} exceeds ModelConfig.max_seq_len={c.max_seq_len}.")
    if key is None:
      # get_recipe: a layer's recipe may have been assigned as a name after construction (fp4jax.nn.Linear allows it).
      recipes = {name: fp4jax.recipes.get_recipe(layer.recipe) for name, layer in self.linear_layers().items()}
      needing = [name for name, recipe in recipes.items() if recipe.needs_key]
      if needing:
        raise ValueError(f"key=None, but {len(needing)} linear layers (e.g. {needing[0]!r}, recipe "
                         f"{recipes[needing[0]].name!r}) need randomness; pass key=.")
    positions_T = jnp.arange(t, dtype=jnp.int32)
    x_BxTxD = self.embed(tokens_BxT).astype(jnp.float32)
    forward = _block_forward_remat if c.remat else _block_forward
    keys_LxS = block_layer_keys(key, c.n_layers)
    runs = block_runs(self.blocks) if c.scan_layers else [(i, i + 1) for i in range(c.n_layers)]
    for start, stop in runs:
      if stop - start == 1:
        x_BxTxD = forward(self.blocks[start], x_BxTxD, positions_T, _take(keys_LxS, start))
      else:
        keys = None if keys_LxS is None else jax.tree.map(lambda a: a[start:stop], keys_LxS)
        x_BxTxD = _scan_blocks(self.blocks[start:stop], x_BxTxD, positions_T, keys, remat=c.remat)
    return self.lm_head(self.final_norm(x_BxTxD)).astype(jnp.float32)

  def linear_layers(self) -> dict[str, fp4jax.nn.Linear]:
    """The quantizable linear layers by name ("blocks.3.mlp.down"), in block then SUBLAYERS order."""
    found = {".".join(map(str, path)): module for path, module in nnx.iter_modules(self)
             if isinstance(module, fp4jax.nn.Linear)}
    return dict(sorted(found.items(), key=lambda item: layer_id(item[0])))
