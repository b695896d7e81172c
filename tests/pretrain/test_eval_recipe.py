"""`fp4jax eval --recipe R` / `fp4jax sample --recipe R`: a checkpoint's weights with another recipe in the layers
its precision policy quantizes (trainer.with_forward_recipe)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.pretrain import cli
from fp4jax.pretrain import run_setup
from fp4jax.pretrain import sample as sample_lib
from fp4jax.pretrain import steps as steps_lib
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import run, tiny_config


def test_forward_recipe_replaces_the_policy_recipe_and_turns_off_the_trained_recipes_extras():
  trained = TrainConfig.from_options(recipe="tetrajet_v2", outcontrol_fraction=0.05, osci_reset_start=10,
                                     bf16_last=1, model="tiny")
  forward = trainer.with_forward_recipe(trained, "bf16")
  assert forward.policy.recipe == fp4jax.recipes.get_recipe("bf16") and forward.policy.last == 1
  assert not forward.outcontrol.enabled and not forward.osci_reset.enabled
  assert trainer.with_forward_recipe(trained, "nvfp4").policy.recipe == fp4jax.recipes.get_recipe("nvfp4")
  with pytest.raises(ValueError, match="did you mean 'rht_size'"):
    trainer.with_forward_recipe(trained, "nvfp4:rht_sise=4")


@pytest.mark.parametrize("switch", ["all", "forward"])
def test_forward_recipe_runs_after_a_bf16_switch_too(switch):
  """A checkpoint past a late BF16 switch runs the named recipe, not BF16 (the switch would override it silently)."""
  trained = TrainConfig.from_options(recipe="nvfp4", switch_at=0.5, switch=switch, bf16_last=1, model="tiny",
                                     steps=10)
  names, n_layers = ["blocks.0.attn.q", "blocks.1.attn.q"], 2
  assert trained.policy.layer_recipes(names, n_layers, 9, 10)["blocks.0.attn.q"].name != "nvfp4"  # switched
  forward = trainer.with_forward_recipe(trained, "mxfp4")
  assert forward.policy.switch_at is None
  layers = forward.policy.layer_recipes(names, n_layers, 9, 10)
  assert layers["blocks.0.attn.q"] == fp4jax.recipes.get_recipe("mxfp4")
  assert layers["blocks.1.attn.q"] == fp4jax.recipes.bf16()  # the policy's BF16 layers stay BF16


def test_eval_and_sample_take_recipe_and_multi_process_eval_shares_it(capsys):
  assert cli.EVAL_FLAGS["recipe"] == "--recipe"
  for command in ("eval", "sample"):
    with pytest.raises(SystemExit):
      cli.main([command, "--help"])
    assert "--recipe RECIPE" in capsys.readouterr().out


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):
  """A 3-step nvfp4 run whose MLP down projection the policy keeps in BF16."""
  out = tmp_path_factory.mktemp("nvfp4_run")
  config = tiny_config(env, out, recipe="nvfp4", bf16_pattern=r".*mlp\.down", steps=3, eval_batches=2)
  run(env, config)
  return config


@pytest.mark.slow
def test_own_recipe_reproduces_the_run_and_bf16_is_the_weights_unquantized(trained, capsys):
  out = trained.out
  own = trainer.evaluate(out, log=None)
  assert own["recipe"] == "nvfp4"
  assert trainer.evaluate(out, recipe="nvfp4", log=None)["val_loss"] == own["val_loss"]  # the same graph, bits

  bf16 = trainer.evaluate(out, recipe="bf16", log=None)
  assert bf16["recipe"] == "bf16" and bf16["val_loss"] != own["val_loss"]
  # Independently: the restored params in a BF16 model, through the plain eval step.
  setup = trainer.eval_setup(out, log=None)
  restored = trainer.restore_run(out, setup)
  graphdef = nnx.graphdef(run_setup.init_model(trained.model, fp4jax.recipes.get_recipe("bf16"), jax.random.key(0)))
  eval_step = jax.jit(steps_lib.make_eval_step(graphdef))
  expected = np.mean([float(eval_step(restored.params, batch, restored.keys["eval"])) for batch in setup.val])
  assert bf16["val_loss"] == pytest.approx(expected, rel=1e-6)

  mx = trainer.restore_run(out, trainer.eval_setup(out, recipe="mxfp4", log=None))
  recipes = mx.phases.layer_recipes(mx.at)
  assert recipes.pop("blocks.0.mlp.down") == "bf16" and set(recipes.values()) == {"mxfp4"}  # the policy holds

  assert cli.main(["eval", "--out", out, "--recipe", "bf16"]) == 0
  assert capsys.readouterr().out.strip().endswith(f"val_loss {bf16['val_loss']:.6f} (2 batches, recipe bf16)")
  assert cli.main(["eval", "--out", out, "--recipe", "bf16", "--json"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"] == bf16["val_loss"]
  assert cli.main(["eval", "--out", out, "--recipe", "nvpf4"]) == cli.EXIT_USAGE
  assert "did you mean 'nvfp4'" in capsys.readouterr().err
  assert cli.main(["eval", "--out", out, "--eval-batches", "0"]) == cli.EXIT_USAGE
  assert "eval_batches (--eval-batches) must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_sample_runs_the_named_recipe(trained):
  result = sample_lib.sample_run(trained.out, sample_lib.SampleConfig(new_tokens=3, temperature=0.0),
                                 recipe="bf16", log=None)
  assert result["layers"] == {"bf16": 7} and len(result["tokens"]) == 3
