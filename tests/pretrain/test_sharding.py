"""Mesh sharding: mesh construction, partition rules, block-in-shard checks, mesh-independent quantization."""

import re
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import fp4jax
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import sharding
from fp4jax.pretrain import steps as steps_lib

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 simulated devices (tests/conftest.py)")

MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2)]


def _mesh(shape):
  return sharding.make_mesh(sharding.MeshConfig(*shape))


def test_parse_and_make_mesh():
  cfg = sharding.MeshConfig.parse("data=2,fsdp=2,tensor=2")
  assert cfg.shape == (2, 2, 2) and str(cfg) == "data=2,fsdp=2,tensor=2"
  assert sharding.MeshConfig.parse("fsdp=8").shape == (1, 8, 1)
  mesh = sharding.make_mesh(cfg)
  assert mesh.axis_names == ("data", "fsdp", "tensor") and dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize("spec, match", [
    ("data=2,fsdp=2", r"has 4 devices but 8 .* pass --mesh with sizes whose product is 8, or --mesh None"),
    ("data=3,tensor=3", "has 9 devices"),
    ("pipeline=8", "axis in"),
    ("data=two", "must be an int"),
    ("data=0,fsdp=8", "positive int"),
    ("data=8,data=1", "more than once"),  # once silently the last: "mesh data=1 has 1 devices"
    ("data=4,fsdp=2,Data=1", "axis in"),
])
def test_bad_mesh(spec, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(spec)


def test_mesh_sizes_are_ints_and_specs_strings():
  with pytest.raises(ValueError, match="positive int"):
    sharding.MeshConfig(data=True, fsdp=8)
  for spec in (jax.make_mesh((8, 1, 1), sharding.AXES), {"data": 8}, (8, 1, 1)):  # once AttributeError: 'split'
    with pytest.raises(ValueError, match="must be a string like"):
      sharding.make_mesh(spec)


def test_rule_naming_unknown_axis():
  mesh = _mesh((8, 1, 1))
  rules = ((r"kernel", P("model", None)),) + sharding.PARTITION_RULES
  with pytest.raises(ValueError, match="'model', not in the mesh axes"):
    sharding.tree_shardings({"kernel": jnp.zeros((16, 16))}, mesh, rules)


def _tiny_params():
  cfg = model_lib.get_model_config("tiny")
  model = model_lib.Transformer(cfg, recipe="nvfp4", rngs=nnx.Rngs(0))
  return nnx.state(model, nnx.Param), cfg


def test_partition_rules_megatron_and_fsdp():
  params, _ = _tiny_params()
  mesh = _mesh((2, 2, 2))
  sh = sharding.tree_shardings(params, mesh)
  flat = {sharding.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(sh)[0]}
  assert flat["blocks.0.attn.q.kernel"] == P("fsdp", "tensor")
  assert flat["blocks.1.attn.o.kernel"] == P("tensor", "fsdp")
  assert flat["blocks.0.mlp.up.kernel"] == P("fsdp", "tensor")
  assert flat["blocks.0.mlp.down.kernel"] == P("tensor", "fsdp")
  assert flat["blocks.0.attn_norm.scale"] == P()


def test_indivisible_parameter_names_it():
  mesh = _mesh((1, 1, 8))
  with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q\.kernel.*not divisible by the 8 shards"):
    sharding.tree_shardings({"blocks": {"0": {"attn": {"q": {"kernel": jnp.zeros((64, 36))}}}}}, mesh)


NVFP4_BLOCKS = sharding.recipe_block_sizes(fp4jax.recipes.nvfp4())


def test_recipe_block_sizes_come_from_the_format():
  assert NVFP4_BLOCKS == {"block_size": 16, "weight_2d": True, "rht_size": 16}
  mx = sharding.recipe_block_sizes(fp4jax.recipes.mxfp4())
  assert mx["block_size"] == fp4jax.formats.MXFP4().block_size == 32 and mx["rht_size"] == 32
  assert sharding.recipe_block_sizes(fp4jax.recipes.bf16()) == {"block_size": 1, "weight_2d": False, "rht_size": 1}


def test_blocks_must_not_straddle_shards():
  params, cfg = _tiny_params()
  # tiny: attention width 64 over 8 tensor shards = 8 columns per shard < one 16-block.
  with pytest.raises(ValueError, match=r"attn\.[qkv]\.kernel.*per shard, not a multiple of 16"):
    sharding.check_divisibility(params, _mesh((1, 1, 8)), batch_size=8, seq_len=64, **NVFP4_BLOCKS)
  # Tokens per batch shard: 8 / 8 rows x 10 tokens = 10, not a multiple of 16.
  with pytest.raises(ValueError, match="10 tokens"):
    sharding.check_divisibility(params, _mesh((8, 1, 1)), batch_size=8, seq_len=10, **NVFP4_BLOCKS)
  with pytest.raises(ValueError, match="batch_size 6 is not divisible"):
    sharding.check_divisibility(params, _mesh((8, 1, 1)), batch_size=6, seq_len=64, **NVFP4_BLOCKS)
  sharding.check_divisibility(params, _mesh((2, 2, 2)), batch_size=8, seq_len=64, **NVFP4_BLOCKS)


@pytest.mark.parametrize("policy, seq_len", [({"pattern": r".*attn\.(k|v)"}, 64), ({"first": 2}, 10)])
def test_layers_the_policy_keeps_in_bf16_are_not_checked(policy, seq_len):
  r"""The check took every block's kernels: `--bf16-pattern '.*attn\.(k|v)'` on data=2,tensor=4 was refused for k/v's
  8 columns per shard, which run in BF16; with every block in BF16 (`--bf16-first 2`) even 5 tokens per shard were."""
  from fp4jax.pretrain import config as config_lib, trainer  # pylint: disable=g-import-not-at-top
  params, cfg = _tiny_params()
  state = steps_lib.TrainState(params=params, opt_state=(), step=jnp.asarray(0, jnp.int32))
  mesh = "data=2,tensor=4"
  # tiny's k and v: 2 KV heads x 16 = 32 columns, 8 per shard of 4; q: 64, 16 per shard.
  with pytest.raises(ValueError, match=r"attn\.k\.kernel.*8 per shard, not a multiple of 16"):
    sharding.Placement.for_mesh(mesh, state, recipe=fp4jax.recipes.nvfp4(), batch_size=8, seq_len=seq_len)
  for switch_at in (None, 0.5):  # a fractional switch needs the run's length to resolve: not asked here
    config = config_lib.TrainConfig(model=cfg, mesh=mesh, batch_size=8, seq_len=seq_len, steps=4,
                                    policy=config_lib.PrecisionPolicy(recipe="nvfp4", switch_at=switch_at, **policy))
    assert trainer._placement(config, state).mesh is not None  # pylint: disable=protected-access
  # Layers that do run the recipe are still checked.
  with pytest.raises(ValueError, match=r"attn\.k\.kernel"):
    sharding.Placement.for_mesh(mesh, state, recipe=fp4jax.recipes.nvfp4(), batch_size=8, seq_len=64,
                                quantized_layers=["blocks.0.attn.q", "blocks.1.attn.k"])
  with pytest.raises(ValueError, match="5 tokens"):
    sharding.Placement.for_mesh("data=8", state, recipe=fp4jax.recipes.nvfp4(), batch_size=8, seq_len=5,
                                quantized_layers=["blocks.0.attn.q"])


def _assert_same_qarray(a, b):
  np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
  np.testing.assert_array_equal(np.asarray(a.scales.astype(jnp.float32)), np.asarray(b.scales.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(a.amax), np.asarray(b.amax))


@pytest.mark.parametrize("spec, mesh_shape", [(P("data"), (8, 1, 1)), (P(None, "tensor"), (1, 1, 8)),
                                              (P(("data", "fsdp"), "tensor"), (2, 2, 2))])
@pytest.mark.parametrize("rounding, axis, block_2d", [("nearest", -1, False), ("stochastic", -1, False),
                                                      ("stochastic", 0, False), ("nearest", -1, True)])
def test_quantize_sharded_equals_unsharded(spec, mesh_shape, rounding, axis, block_2d):
  x = jax.random.t(jax.random.key(0), 3.0, (256, 256)).astype(jnp.bfloat16)
  key = jax.random.key(7)
  fn = jax.jit(lambda x, k: fp4jax.quantize(x, "nvfp4", axis=axis, block_2d=block_2d, rounding=rounding,
                                           key=k if rounding == "stochastic" else None))
  xs = jax.device_put(x, NamedSharding(_mesh(mesh_shape), spec))
  assert len(xs.sharding.device_set) == 8
  _assert_same_qarray(fn(xs, key), fn(x, key))


def test_rht_quantize_sharded_along_tokens():
  mesh = _mesh((8, 1, 1))
  x = jax.random.normal(jax.random.key(1), (512, 64))
  fn = jax.jit(lambda x: fp4jax.quantize(fp4jax.random_hadamard(x, axis=0), "nvfp4", axis=0))
  _assert_same_qarray(fn(jax.device_put(x, NamedSharding(mesh, P("data")))), fn(x))


@pytest.mark.parametrize("shape", MESHES)
def test_quantized_layer_fwd_bwd_independent_of_mesh(shape):
  """Fprop, Dgrad and Wgrad with SR and RHT: equal up to float32 summation order on every mesh."""
  mesh = _mesh(shape)
  x = jax.random.normal(jax.random.key(0), (256, 128)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (128, 256)) * 0.1
  g = jax.random.normal(jax.random.key(2), (256, 256)).astype(jnp.bfloat16)

  @jax.jit
  def fwd_bwd(x, w, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4", key=key,
                                                     preferred_element_type=jnp.bfloat16), x, w)
    return (y,) + vjp(g)

  ref = fwd_bwd(x, w, jax.random.key(3))
  out = fwd_bwd(jax.device_put(x, sharding.batch_sharding(mesh)),
                jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor"))), jax.random.key(3))
  for a, b in zip(out, ref):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-5)
    assert float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32))) < 1e-4  # bf16 ulp flips


def _placement(shape):
  mesh = _mesh(shape)
  return sharding.Placement(state=None, params=None, batch=sharding.batch_sharding(mesh),
                            replicated=sharding.replicated(mesh), mesh=mesh)


def test_steps_are_traced_on_the_mesh_only_where_it_has_fsdp():
  step = lambda x: jax.sharding.get_abstract_mesh()
  assert sharding.Placement.single_device().traced_on_mesh(step) is step
  for shape in [(8, 1, 1), (1, 1, 8)]:
    assert _placement(shape).traced_on_mesh(step) is step
  for shape in [(1, 8, 1), (2, 2, 2)]:
    seen = _placement(shape).traced_on_mesh(step)(0)
    assert not seen.empty and dict(seen.shape) == dict(zip(sharding.AXES, shape))


def test_on_an_fsdp_mesh_the_rht_operands_are_resharded_once_not_term_by_term():
  """One NVFP4 layer's Fprop, Dgrad and Wgrad (RHT on both Wgrad operands) with FSDP weights: traced as plain jit,
  XLA reshards each of the RHT loop's 16 terms (an all-to-all each); traced on the mesh (the trainer's steps), the
  RHT is one dot and is resharded once. The results are the same bits."""
  pl = _placement((1, 8, 1))
  x = jax.random.normal(jax.random.key(0), (256, 128)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (128, 256)) * 0.1
  g = jax.random.normal(jax.random.key(2), (256, 256)).astype(jnp.bfloat16)
  w_sharding = NamedSharding(pl.mesh, P("fsdp", "tensor"))

  def fwd_bwd(x, w, key):
    y, vjp = jax.vjp(lambda x, w: fp4jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4", key=key,
                                                     preferred_element_type=jnp.bfloat16), x, w)
    return (y,) + vjp(g)

  args = (jax.device_put(x, pl.batch), jax.device_put(w, w_sharding), jax.random.key(3))
  counts, outs = [], []
  for fn in (fwd_bwd, pl.traced_on_mesh(fwd_bwd)):
    step = jax.jit(fn, out_shardings=(None, None, w_sharding))
    hlo = step.lower(*args).compile().as_text()
    counts.append(len(re.findall(r" all-to-all(?:-start)?\(", hlo[hlo.index("ENTRY"):])))
    outs.append(step(*args))
  plain, on_mesh = counts
  assert plain >= 16 and on_mesh <= 2, counts  # measured: 16 and 2
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_gather_at_use_replicates_the_embedding_over_fsdp_and_leaves_the_rest():
  params, _ = _tiny_params()
  mesh = _mesh((2, 2, 2))
  sh = sharding.tree_shardings(params, mesh)
  out = jax.jit(lambda p: sharding.gather_at_use(p, mesh), in_shardings=(sh,))(params)
  assert sh["embed"]["embedding"].spec == P(None, "fsdp")
  for (path, leaf), given in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree.leaves(sh)):
    if sharding.path_str(path) == "embed.embedding":
      assert leaf.sharding.is_fully_replicated
    else:
      assert leaf.sharding.is_equivalent_to(given, leaf.ndim), sharding.path_str(path)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), out, params))  # values unchanged
  one = sharding.Placement.single_device()
  assert one.gather_params(params) is params


def _step_partitioning(capfd, gather_params) -> tuple[str, str]:
  """(XLA's stderr, the compiled HLO) of a freshly compiled 1-block bf16 train step on the data=2,fsdp=2,tensor=2
  mesh."""
  cfg = model_lib.get_model_config("tiny", n_layers=1)
  graphdef, params = nnx.split(model_lib.Transformer(cfg, recipe="bf16", rngs=nnx.Rngs(0)), nnx.Param)
  optimizer = optimizer_lib.make_optimizer(optimizer_lib.OptimizerConfig(), 10)
  state = steps_lib.TrainState(params=params, opt_state=optimizer.init(params), step=jnp.asarray(0, jnp.int32))
  pl = sharding.Placement.for_mesh("data=2,fsdp=2,tensor=2", state, recipe=fp4jax.recipes.bf16(), batch_size=8,
                                   seq_len=32)
  step = steps_lib.make_train_step(graphdef, optimizer, gather_params=gather_params(pl))

  def sharding_warnings_probe_step(state, batch, key):
    return step(state, batch, key)
  # A name no other test or run compiles (the module's name is part of the persistent-cache key): a cache kept
  # across runs (JAX_COMPILATION_CACHE_DIR set from outside, tests/conftest.py) must not serve it either.
  sharding_warnings_probe_step.__name__ = f"sharding_warnings_probe_step_{uuid.uuid4().hex}"

  batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=pl.batch) for k in ("inputs", "targets")}
  hits = []
  listener = lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None
  jax.monitoring.register_event_listener(listener)
  capfd.readouterr()
  try:
    compiled = jax.jit(sharding_warnings_probe_step, in_shardings=(pl.state, pl.batch, pl.replicated),
                       out_shardings=(pl.state, pl.replicated)).lower(state, batch, jax.random.key(0)).compile()
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert not hits, "the step came from the compilation cache: XLA printed nothing to check"
  return capfd.readouterr().err, compiled.as_text()


def _count(hlo: str, op: str) -> int:
  return len(re.findall(rf" {op}\(", hlo))


def test_train_step_on_a_mixed_mesh_partitions_without_replicating_activations(capfd):
  # Without the gather, the lookup from the D-over-fsdp table makes D-over-fsdp activations that XLA reshards to the
  # batch's sharding: all-to-alls, and more all-gathers (jax 0.10.2's XLA also logs "Involuntary full
  # rematerialization"; 0.11.2's logs nothing). The trainer's Placement gathers the table.
  _, without = _step_partitioning(capfd, lambda pl: None)
  err, with_gather = _step_partitioning(capfd, lambda pl: pl.gather_params)
  assert _count(without, "all-to-all") > 0  # the control: what the gather removes
  assert _count(with_gather, "all-to-all") == 0
  assert _count(with_gather, "all-gather") < _count(without, "all-gather")
  assert "Involuntary full rematerialization" not in err


# End-to-end training on each mesh (losses vs one device, cross-mesh resume): tests/test_train_mesh.py.
