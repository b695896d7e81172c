"""The pretraining model and its loss against a plain NumPy float64 reference written from the ModelConfig.

The architecture the reference spells out (fp4jax.pretrain.model's choices):
- untied token embedding [vocab, d_model] and LM head [d_model, vocab], no biases anywhere;
- pre-norm blocks x + attn(norm1(x)), then x + mlp(norm2(x)); a final norm before the LM head;
- RMSNorm: x / sqrt(mean(x^2) + eps) * scale (eps inside the root, learned scale, no bias);
- attention: q = h Wq, k = h Wk, v = h Wv split into heads of head_dim; RoPE on q and k with split-half pairing
  (element i rotates with element i + head_dim/2 by angle pos * theta^(-2i/head_dim)), positions 0..T-1;
  grouped-query heads: query head n reads kv head n // (n_heads / n_kv_heads); scores q.k / sqrt(head_dim),
  causal (key position <= query position), softmax over keys, heads concatenated, then Wo;
- MLP: SwiGLU silu(h Wgate) * (h Wup) Wdown, or squared ReLU relu(h Wup)^2 Wdown;
- the loss: mean over every (row, position) of -log softmax(logits)[next token of the corpus stream].
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax.recipes
from fp4jax.pretrain import data
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import run_setup
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain.config import TrainConfig

# Small enough to run eagerly in well under a second; two KV heads serve four query heads. rope_theta and norm_eps
# are far from their defaults so that a model that ignored either would not match.
CONFIG = model_lib.get_model_config("tiny", n_layers=2, max_seq_len=16, rope_theta=50.0, norm_eps=1e-3,
                                    dtype="float32")
# Narrow enough that a quantized forward runs eagerly in a few seconds on CPU; 32-wide for MXFP4's blocks.
NARROW = model_lib.ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=32,
                               mlp="squared_relu", max_seq_len=16)
# The recipes whose forward activations have one FP32 scale for the whole tensor (NVFP4's second level): every row
# and position of the batch shares it, so their logits cannot be exactly causal.
TENSOR_SCALED = ("nvfp4", "four_over_six", "quartet2")


def _rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x_TxNxH, theta):
  t, _, h = x_TxNxH.shape
  angle_Tx1xF = np.arange(t)[:, None, None] * theta ** (-2.0 * np.arange(h // 2) / h)[None, None, :]
  a, b = x_TxNxH[..., :h // 2], x_TxNxH[..., h // 2:]
  return np.concatenate([a * np.cos(angle_Tx1xF) - b * np.sin(angle_Tx1xF),
                         b * np.cos(angle_Tx1xF) + a * np.sin(angle_Tx1xF)], axis=-1)


def _attention(h, p, c, rnd):
  t = h.shape[0]
  q = rnd(_rope(rnd(h @ rnd(p["q"])).reshape(t, c.n_heads, c.head_dim), c.rope_theta))
  k = rnd(_rope(rnd(h @ rnd(p["k"])).reshape(t, c.n_kv_heads, c.head_dim), c.rope_theta))
  v = rnd(h @ rnd(p["v"])).reshape(t, c.n_kv_heads, c.head_dim)
  heads = []
  for n in range(c.n_heads):
    j = n // (c.n_heads // c.n_kv_heads)
    scores = q[:, n] @ k[:, j].T / np.sqrt(c.head_dim)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    heads.append(rnd(probs / probs.sum(axis=-1, keepdims=True)) @ v[:, j])
  return rnd(rnd(np.concatenate(heads, axis=-1)) @ rnd(p["o"]))


def _mlp(h, p, c, rnd):
  up = rnd(h @ rnd(p["up"]))
  if c.mlp == "swiglu":
    gate = rnd(h @ rnd(p["gate"]))
    return rnd(rnd(gate / (1.0 + np.exp(-gate)) * up) @ rnd(p["down"]))
  return rnd(rnd(np.maximum(up, 0.0) ** 2) @ rnd(p["down"]))


def reference_logits(p, c, tokens_BxT):
  """float64 logits [B, T, vocab] of the architecture above with parameters `p` (see `_params`), each value the
  model keeps in the compute dtype `c.dtype` rounded to it: GEMM operands and outputs, norm outputs, RoPE's output
  and the attention probabilities (the residual stream, norm statistics, softmax and nonlinearities stay float64)."""
  rnd = lambda x: np.asarray(x).astype(jnp.dtype(c.dtype)).astype(np.float64)
  out = []
  for row in np.asarray(tokens_BxT):
    x = p["embed"][row]
    for blk in p["blocks"]:
      x = x + _attention(rnd(_rms_norm(x, blk["attn_norm"], c.norm_eps)), blk, c, rnd)
      x = x + _mlp(rnd(_rms_norm(x, blk["mlp_norm"], c.norm_eps)), blk, c, rnd)
    out.append(rnd(_rms_norm(x, p["final_norm"], c.norm_eps)) @ rnd(p["lm_head"]))
  return np.stack(out)


def reference_loss(p, c, stream, starts, seq_len):
  """Mean next-token cross-entropy of the windows stream[s : s + seq_len] predicting stream[s + 1 : s + seq_len + 1],
  in float64, from the token stream itself (not from a batch's targets)."""
  tokens = np.stack([stream[s: s + seq_len] for s in starts])
  nexts = np.stack([stream[s + 1: s + seq_len + 1] for s in starts])
  logits = reference_logits(p, c, tokens)
  top = logits.max(axis=-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
  return -np.mean(np.take_along_axis(logp, nexts[..., None].astype(np.int64), axis=-1))


def _params(model):
  """The model's parameters as float64 NumPy arrays, by role."""
  f64 = lambda v: np.asarray(v[...], np.float64)
  blocks = []
  for blk in model.blocks:
    layers = {"attn_norm": f64(blk.attn_norm.scale), "mlp_norm": f64(blk.mlp_norm.scale)}
    layers.update({s: f64(getattr(blk.attn, s).kernel) for s in "qkvo"})
    layers.update({s: f64(getattr(blk.mlp, s).kernel) for s in ("up", "gate", "down") if hasattr(blk.mlp, s)})
    blocks.append(layers)
  return {"embed": f64(model.embed.embedding), "blocks": blocks, "final_norm": f64(model.final_norm.scale),
          "lm_head": f64(model.lm_head.kernel)}


def _model(config, recipe=None, seed=0):
  """A model whose norm scales are moved off their initial ones (a norm that skipped its scale would pass)."""
  model = model_lib.Transformer(config, recipe=recipe, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for norm in [model.final_norm] + [n for blk in model.blocks for n in (blk.attn_norm, blk.mlp_norm)]:
    norm.scale[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(config.d_model), jnp.float32)
  return model


def _tokens(shape, seed=0, vocab=256):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


@pytest.mark.parametrize("mlp, dtype, scan_layers", [("swiglu", "float32", False), ("squared_relu", "float32", True),
                                                    ("swiglu", "bfloat16", True), ("squared_relu", "bfloat16", False)])
def test_forward_matches_the_numpy_reference(mlp, dtype, scan_layers):
  """BF16 recipe (no quantization), float32 or bfloat16 compute, blocks in a loop or a lax.scan: logits to float32
  rounding (measured: 2.4e-6 at float32, 2.9e-7 at bfloat16, of logits up to 3.9; without the reference's bfloat16
  roundings the bfloat16 model is 0.045 away)."""
  config = dataclasses.replace(CONFIG, mlp=mlp, dtype=dtype, scan_layers=scan_layers)
  model = _model(config)
  if scan_layers:
    assert model_lib.block_runs(model.blocks) == [(0, 2)]  # both blocks in one lax.scan
  tokens = _tokens((2, 16))
  want = reference_logits(_params(model), config, tokens)
  np.testing.assert_allclose(np.asarray(model(tokens), np.float64), want, rtol=1e-5, atol=2e-5)


def test_scan_layers_gives_the_loops_logits_bit_for_bit():
  """Under jit (as training runs it) the scanned blocks give the loop's logits exactly, BF16 and NVFP4 alike."""
  config = dataclasses.replace(NARROW, n_layers=2)
  forward = nnx.jit(lambda m, t, k: m(t, key=k))
  tokens = _tokens((2, 16))
  for recipe in ("bf16", "nvfp4"):
    loop = model_lib.Transformer(config, recipe=recipe, rngs=nnx.Rngs(0))
    scan = model_lib.Transformer(dataclasses.replace(config, scan_layers=True), recipe=recipe, rngs=nnx.Rngs(0))
    assert model_lib.block_runs(scan.blocks) == [(0, 2)]
    np.testing.assert_array_equal(np.asarray(forward(scan, tokens, jax.random.key(1))),
                                  np.asarray(forward(loop, tokens, jax.random.key(1))), err_msg=recipe)


def _per_row_tensor_scale(recipe):
  """`recipe` with its Fprop activations' FP32 second-level scale taken per 1x128 group along the features
  (TetraJet-v2's double-block scaling), so per row: the one change that removes the tensor-wide amax."""
  lhs = recipe.fprop.lhs
  lhs = dataclasses.replace(lhs, fmt=dataclasses.replace(lhs.fmt, double_block=True))
  return dataclasses.replace(recipe, fprop=dataclasses.replace(recipe.fprop, lhs=lhs))


@pytest.mark.parametrize("name", fp4jax.recipes.RECIPE_NAMES)
def test_future_tokens_reach_past_logits_only_through_a_tensor_wide_scale(name):
  """Changing tokens t+1.. leaves the logits at positions <= t bit for bit unchanged for every recipe whose scales
  follow rows (BF16, MXFP4, FP8 1x128 blocks, TetraJet-v2's 1x128 double blocks, Quartet). The recipes with NVFP4's
  per-tensor FP32 scale (nvfp4, four_over_six, quartet2) are not causal through that one scale: it is the amax of
  the whole [batch * seq, features] activation, so future tokens and other rows of the batch move every block
  scale and with it the past logits (measured on the tiny preset at init, loss 6.05, batch 8 x 64, 5 draws: new
  tokens at positions 32.. moved the mean loss of positions < 32 by up to 0.033 nats with nvfp4, 0.030 with
  four_over_six; new rows 1..7 moved row 0's loss by up to 0.009 and 0.091 nats). The scale carries no gradient
  (the GEMMs' custom_vjp), and with it taken per row the same recipe is exactly causal."""
  spec = "quartet2:rht_size=16" if name == "quartet2" else name  # its 128-point RHT needs layers 128 wide
  recipe = fp4jax.recipes.get_recipe(spec)
  key = jax.random.key(2)
  tokens = _tokens((2, 16))
  t = 6
  changed = tokens.at[:, t + 1:].set(_tokens((2, 16 - t - 1), seed=1))
  logits = lambda m, x: np.asarray(m(x, key=key))

  model = model_lib.Transformer(NARROW, recipe=recipe, rngs=nnx.Rngs(0))
  base, after = logits(model, tokens), logits(model, changed)
  assert not np.array_equal(after[:, t + 1:], base[:, t + 1:])  # the change reaches the future
  if name not in TENSOR_SCALED:
    np.testing.assert_array_equal(after[:, :t + 1], base[:, :t + 1])
    return
  assert not np.array_equal(after[:, :t + 1], base[:, :t + 1])
  other_row = tokens.at[1].set(_tokens((16,), seed=3))
  assert not np.array_equal(logits(model, other_row)[0], base[0])  # no attention path between rows: the scale
  per_row = model_lib.Transformer(NARROW, recipe=_per_row_tensor_scale(recipe), rngs=nnx.Rngs(0))
  base = logits(per_row, tokens)
  np.testing.assert_array_equal(logits(per_row, changed)[:, :t + 1], base[:, :t + 1])
  np.testing.assert_array_equal(logits(per_row, other_row)[0], base[0])


def _starts(stream, inputs_BxT):
  """The stream offset of each row's window (the stream's tokens are random, so each window occurs once)."""
  t = inputs_BxT.shape[1]
  windows = np.lib.stride_tricks.sliding_window_view(stream, t)
  starts = []
  for row in inputs_BxT:
    hits = np.flatnonzero((windows == row).all(axis=1))
    assert hits.size == 1, hits
    starts.append(int(hits[0]))
  return np.array(starts)


def test_trainer_loss_is_the_next_token_cross_entropy_of_the_stream():
  """The train step's loss on a training batch and the eval step's loss on a validation batch equal the reference
  cross-entropy of the windows' next tokens read from the corpus stream; training windows lie in the train split,
  validation windows in the val split, evenly spaced from its first token to its last, covering all of it
  when they hold as many tokens as it does."""
  seq_len, n_train, n_val = 16, 400, 120
  stream = np.random.default_rng(7).integers(0, 256, n_train + n_val).astype(np.uint16)
  dataset = data.TokenDataset(train=stream[:n_train], val=stream[n_train:], vocab_size=256, source="random")
  model = _model(CONFIG)
  graphdef, params = nnx.split(model)
  p = _params(model)

  batch = data.get_batch(dataset, "train", 3, batch_size=4, seq_len=seq_len, seed=0)
  starts = _starts(stream, batch["inputs"])
  assert starts.max() + seq_len < n_train  # the last target is a train token
  loss = float(steps_lib.make_loss_fn(graphdef)(params, batch, None))
  np.testing.assert_allclose(loss, reference_loss(p, CONFIG, stream, starts, seq_len), rtol=2e-6)

  val = data.val_batches(dataset, batch_size=4, seq_len=seq_len, num_batches=2)
  starts = np.concatenate([_starts(stream, b["inputs"]) for b in val])
  assert starts.min() == n_train and starts.max() + seq_len == n_train + n_val - 1
  assert np.ptp(np.diff(starts)) <= 1  # evenly spaced, rounded to whole tokens
  covered = np.unique(starts[:, None] + np.arange(seq_len + 1))  # 8 windows of 17 tokens >= 120: all of it
  np.testing.assert_array_equal(covered, np.arange(n_train, n_train + n_val))
  eval_step = steps_lib.make_eval_step(graphdef)
  val_loss = np.mean([float(eval_step(params, b, None)) for b in val])  # as Phases.val_loss averages
  np.testing.assert_allclose(val_loss, reference_loss(p, CONFIG, stream, starts, seq_len), rtol=2e-6)


def test_initialisation_scales():
  """As the trainer builds it: every linear kernel (q/k/v/o, MLP, LM head) is LeCun normal, a normal truncated at
  two of its standard deviations and rescaled to std 1/sqrt(fan_in), fan_in = its input features; the embedding
  is a plain normal of std 1/sqrt(d_model); norm scales are ones."""
  config = TrainConfig(model="small")
  model = run_setup.build_model(config, jax.random.key(0))
  d = config.model.d_model
  by_kind = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = np.asarray(var[...], np.float64)
    kind = "norm" if path[-1] == "scale" else "embed" if path[0] == "embed" else f"kernel/{value.shape[0]}"
    by_kind.setdefault(kind, []).append(value.ravel())
  assert sorted(by_kind) == sorted(["embed", f"kernel/{config.model.d_ff}", f"kernel/{d}", "norm"])
  for kind, values in by_kind.items():
    x = np.concatenate(values)
    if kind == "norm":
      np.testing.assert_array_equal(x, 1.0)
      continue
    fan_in = d if kind == "embed" else int(kind.split("/")[1])
    assert abs(x.std() * np.sqrt(fan_in) - 1) < 0.02, kind
    assert abs(x.mean()) * np.sqrt(fan_in) < 0.02, kind
    tail = np.abs(x).max() * np.sqrt(fan_in)
    if kind == "embed":
      assert tail > 3.5  # untruncated: ~33k draws reach beyond 3.5 std
    else:
      assert tail <= 2 / 0.87962566103423978 + 1e-6 and tail > 2.2, kind  # lecun_normal's truncation, rescaled
