"""Tests for fp4jax.pretrain.config / options: groups, flat option names, JSON round trip, result-free fields, and
the recipe string parsed once per CLI run."""

import json

import numpy as np
import pytest

import fp4jax.recipes
from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import optimizer as optimizer_lib
from fp4jax.pretrain import policy as policy_lib
from fp4jax.pretrain import sharding
from fp4jax.pretrain.config import TrainConfig


def test_flat_options_land_in_their_groups():
  config = TrainConfig.from_options(lr=1e-3, bf16_last=1, checkpoint_every=7, eval_every=5, log_every=2,
                                    recipe="mxfp4", **{"model.n_layers": 3})
  assert config.optimizer.lr == 1e-3 and config.policy.last == 1 and config.checkpointing.every == 7
  assert config.evaluation.every == 5 and config.logging.every == 2 and config.model.n_layers == 3
  assert config.recipe == fp4jax.recipes.mxfp4() == config.policy.recipe
  assert config.replace(lr=2e-3).optimizer == optimizer_lib.OptimizerConfig(lr=2e-3)
  with pytest.raises(ValueError, match="Unknown TrainConfig option 'learning_rate'"):
    config.replace(learning_rate=1.0)
  with pytest.raises(ValueError, match="OptimizerConfig: lr must be > 0"):
    config.replace(lr=0.0)
  for name in ("lr", "eps", "weight_decay", "grad_clip"):  # eps=inf trained with every Adam update 0
    with pytest.raises(ValueError, match=f"OptimizerConfig: {name} must be finite; got inf"):
      config.replace(**{name: float("inf")})
  for name, value in (("lr", "1e-3"), ("warmup_fraction", None), ("b1", "0.9"), ("grad_clip", True)):
    with pytest.raises(ValueError, match=f"OptimizerConfig: {name} must be a number; got {value!r}"):
      config.replace(**{name: value})
  assert optimizer_lib.OptimizerConfig(lr=np.float32(1e-3), grad_clip=1).lr == np.float32(1e-3)
  with pytest.raises(ValueError, match=r"overwrite and resume \(--overwrite, --resume\) exclude each other"):
    config.replace(overwrite=True, resume=True)
  with pytest.raises(ValueError, match="decay_shape must be a str; got 1"):
    config.replace(decay_shape=1)
  with pytest.raises(ValueError, match="exceeds the model's 3 blocks"):
    config.replace(bf16_last=4)


def test_to_dict_round_trip_stores_the_canonical_recipe_string():
  config = TrainConfig.from_options(recipe="NVFP4: stochastic_rounding=false , rht_size=4", bf16_blocks=(0, 1),
                                    switch_at=0.5)
  stored = json.loads(json.dumps(config.to_dict()))
  assert stored["policy"]["recipe"] == "nvfp4:rht_size=4,stochastic_rounding=false"
  assert set(stored) >= {"policy", "optimizer", "evaluation", "logging", "checkpointing"}
  assert TrainConfig.from_dict(stored) == config
  # A hand-built recipe has no string: it is stored field by field.
  custom = fp4jax.recipes.nvfp4().replace(name="custom", rht_size=8)
  config = TrainConfig.from_options(policy=policy_lib.PrecisionPolicy(recipe=custom))
  assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))).recipe == custom


def test_from_dict_reads_the_flat_form_of_earlier_versions():
  flat = {"out": "runs/x", "model": dict(TrainConfig().to_dict()["model"], n_layers=3), "recipe": "fp8", "lr": 0.01,
          "bf16_blocks": [1], "eval_every": 3, "keep_checkpoints": 2, "steps": 20}
  config = TrainConfig.from_dict(flat)
  assert (config.recipe, config.optimizer.lr, config.policy.blocks) == (fp4jax.recipes.fp8(), 0.01, (1,))
  assert (config.evaluation.every, config.checkpointing.keep, config.model.n_layers) == (3, 2, 3)


def test_result_free_fields_are_marked_once():
  assert config_lib.result_free_keys() == {"out", "progress", "log_every", "profile", "checkpoint_every",
                                           "keep_checkpoints", "resume", "resume_step", "overwrite",
                                           "data_changed"}
  a = TrainConfig.from_options(lr=1e-2)
  b = a.replace(out="elsewhere", progress=False, log_every=5, profile="1:3", checkpoint_every=3, keep_checkpoints=1,
                resume=True)
  assert config_lib.result_differences(a.to_dict(), b.to_dict()) == []
  c = a.replace(lr=1e-3, eval_every=7, mesh="data=8", recipe="bf16")
  assert config_lib.result_differences(a.to_dict(), c.to_dict()) == ["eval_every", "lr", "mesh", "recipe"]
  # Model and data fields by their options: a resume's note said only ['model'] or ['data'].
  d = a.replace(**{"model.rope_theta": 500.0, "data.val_fraction": 0.1})
  assert config_lib.result_differences(a.to_dict(), d.to_dict()) == ["data.val_fraction", "model.rope_theta"]
  stored = a.to_dict()
  stored["model"] = {k: v for k, v in stored["model"].items() if k != "rope_theta"}  # a field added since
  assert config_lib.result_differences(stored, d.to_dict()) == ["data.val_fraction"]


def test_a_resume_says_when_val_fraction_moves_the_validation_windows():
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  a = TrainConfig.from_options(eval_batches=2)
  assert trainer._windows_note(a, a.replace(lr=1e-2), 8) is None  # pylint: disable=protected-access
  for changes in ({"data.val_fraction": 0.1}, {"eval_batches": 3}, {"seq_len": 32}):
    note = trainer._windows_note(a, a.replace(**changes), 8)  # pylint: disable=protected-access
    assert note and "from step 8 on val_loss is measured on other windows" in note, changes
  assert trainer._windows_note(a, a.replace(eval_batches=0, **{"data.val_fraction": 0.1}), 8) is None  # pylint: disable=protected-access


@pytest.mark.slow
def test_one_recipe_parse_per_cli_run(tmp_path, monkeypatch, capsys):
  """`fp4jax train --recipe SPEC` parses SPEC once (3 steps, one checkpoint, a precision switch); `fp4jax eval`
  parses the stored string once. The model is built with the step-0 recipes; they are re-set only at the switch."""
  parses, applies = [], []
  parse, apply = fp4jax.recipes.get_recipe, policy_lib.PrecisionPolicy.apply
  # Only strings are parsed: the library passes Recipe objects through get_recipe unchanged.
  monkeypatch.setattr(fp4jax.recipes, "get_recipe",
                      lambda spec: (parses.append(spec) if isinstance(spec, str) else None, parse(spec))[1])
  monkeypatch.setattr(policy_lib.PrecisionPolicy, "apply",
                      lambda self, *a, **k: (applies.append(a), apply(self, *a, **k))[1])
  out = tmp_path / "run"
  code = cli.main(["train", "--model", "tiny", "--model.n_layers", "2", "--recipe", "nvfp4:rht_size=4",
                   "--bf16-last", "1", "--switch-at", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                   "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "100", "--progress", "false",
                   "--data.cache_dir", str(tmp_path / "cache"), "--out", str(out)])
  assert code == 0, capsys.readouterr().err
  assert parses == ["nvfp4:rht_size=4"]
  assert [a[1] for a in applies] == [2]  # (model, step, total_steps): only the switch, at step 2
  assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
  manager = ckpt.open_manager(out, create=False)  # each checkpoint stores its config (no run-level config.json)
  try:
    assert ckpt.restore_meta(manager)[1]["config"]["policy"]["recipe"] == "nvfp4:rht_size=4"
  finally:
    manager.close()
  parses.clear()
  assert cli.main(["eval", "--out", str(out), "--json"]) == 0
  assert parses == ["nvfp4:rht_size=4"]


def test_a_recipe_whose_rht_does_not_tile_a_layer_fails_at_config_time_naming_the_layer_and_the_size_that_fits():
  # tiny: d_model 64, kv width 32. Quartet II's 128-point RHT on Dgrad's N axis tiles none of them; 32 tiles all.
  with pytest.raises(ValueError, match=r"Linear layer 'blocks\.0\.attn\.q': dgrad lhs: recipe 'quartet2' .*"
                                       r"Every layer of this model fits rht_size=32\."):
    TrainConfig.from_options(model="tiny", recipe="quartet2")
  TrainConfig.from_options(model="tiny", recipe="quartet2:rht_size=32")
  # BF16 layers run no RHT: with every block in BF16 the same recipe is fine.
  TrainConfig.from_options(model="tiny", recipe="quartet2", bf16_first=2)


@pytest.mark.parametrize("spec, match", [
    ("dat=2", "axis in"),
    ("data=two", "must be an int"),
    ("data=0,fsdp=8", "positive int"),
    ("data=8,data=1", "more than once"),
    (8, "must be a string like"),
    (0, "must be a string like"),
])
def test_a_bad_mesh_spec_fails_when_the_config_is_made(spec, match):
  """Before any data loads or step compiles (the device count itself is checked when the run starts)."""
  with pytest.raises(ValueError, match=match):
    TrainConfig(mesh=spec)
  with pytest.raises(ValueError, match=match):
    TrainConfig.from_options(mesh=spec)


def test_a_mesh_config_is_stored_as_its_spec():
  config = TrainConfig(mesh=sharding.MeshConfig(data=2, fsdp=4))
  assert config.mesh == "data=2,fsdp=4,tensor=1"
  assert TrainConfig(mesh="fsdp=8").mesh == "fsdp=8" and TrainConfig().mesh is None
  # A spec for more devices than this machine has is a valid config (it may run elsewhere).
  assert TrainConfig(mesh="data=64").mesh == "data=64"


def test_resume_step_without_resume_is_refused():
  """It was ignored: the run started afresh (and with overwrite=True deleted the checkpoint it named)."""
  with pytest.raises(ValueError, match="only applies with resume=True"):
    TrainConfig.from_options(resume_step=4)
  with pytest.raises(ValueError, match="only applies with resume=True"):
    TrainConfig.from_options(resume_step=4, overwrite=True)
  assert TrainConfig.from_options(resume=True, resume_step=4).checkpointing.resume_step == 4


@pytest.mark.parametrize("option, value, flag", [("log_every", 0, "--log-every"), ("eval_every", -1, "--eval-every"),
                                                 ("checkpoint_every", 0, "--checkpoint-every"),
                                                 ("keep_checkpoints", 0, "--keep-checkpoints"),
                                                 ("stats_every", -1, "--stats-every"), ("steps", 0, "--steps")])
def test_a_bad_count_names_its_option(option, value, flag):
  """`--log-every 0` said "LogConfig: every must be an int >= 1": the field's name, not the option to fix."""
  with pytest.raises(ValueError, match=f"\\({flag}\\) must be an int >= "):
    TrainConfig.from_options(**{option: value})


@pytest.mark.parametrize("policy", [dict(bf16_first=2), dict(bf16_blocks=(0, 1)), dict(bf16_pattern=".*")])
def test_outcontrol_needs_a_quantized_layer(policy):
  """With every linear layer in BF16, OutControl was refused only at the run's start, after the model was built, with
  no flag named."""
  with pytest.raises(ValueError, match="keeps every linear layer in BF16 .*--bf16-first.*nothing to split"):
    TrainConfig.from_options(model="tiny", steps=20, outcontrol_fraction=0.05, **policy)
  TrainConfig.from_options(model="tiny", steps=20, bf16_first=1, outcontrol_fraction=0.05)
  # OsciReset with nothing to reset trained before: a stored config of such a run still loads.
  stored = TrainConfig.from_options(model="tiny", steps=20, osci_reset_start=2, **policy).to_dict()
  assert TrainConfig.from_dict(stored).osci_reset.start == 2


@pytest.mark.parametrize("policy", [dict(bf16_first=2), dict(bf16_pattern=".*")])
def test_a_new_osci_reset_run_needs_a_quantized_layer(tmp_path, policy):
  """OsciReset with every linear layer in BF16 started and trained, tracking and resetting nothing; a new run is now
  refused before its folder is made (a stored config of such a run still loads and resumes, test above)."""
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  config = TrainConfig.from_options(model="tiny", steps=20, osci_reset_start=2, out=str(tmp_path / "run"), **policy)
  with pytest.raises(ValueError, match=r"OsciReset \(osci_reset_start=2\) is on, but .* nothing to reset"):
    trainer.train(config)
  assert not (tmp_path / "run").exists()
  TrainConfig.from_options(model="tiny", steps=20, osci_reset_start=2, bf16_first=1).check_new_run()


def test_a_new_run_whose_recipe_or_outcontrol_would_do_nothing_is_refused(tmp_path):
  """Both trained under names that said otherwise: `--recipe nvfp4 --bf16-pattern '.*'` trained BF16 logged as nvfp4;
  OutControl choosing its channels at step 4 of a run switched to BF16 at step 2 left every loss bit-identical to
  the run without it, while the log said the top 50 % of channels ran in MXFP8."""
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  all_bf16 = TrainConfig.from_options(model="tiny", steps=8, bf16_pattern=".*", out=str(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"would train BF16 under the recipe 'nvfp4'\. Pass --recipe bf16"):
    trainer.train(all_bf16)
  TrainConfig.from_options(model="tiny", steps=8, recipe="bf16", bf16_pattern=".*").check_new_run()
  oc = dict(model="tiny", steps=8, outcontrol_fraction=0.5, outcontrol_start=3, outcontrol_window=2)
  for switch_at in (2, 5, 0.5):  # OutControl's channels would apply from step 5 on
    late = TrainConfig.from_options(switch_at=switch_at, out=str(tmp_path / "b"), **oc)
    with pytest.raises(ValueError, match=r"chooses its channels at step 4 .* BF16 at step \d"):
      trainer.train(late)
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
  TrainConfig.from_options(switch_at=6, **oc).check_new_run()  # step 5 splits its channels
  TrainConfig.from_options(switch_at=2, switch="forward", **oc).check_new_run()  # Dgrad and Wgrad stay quantized
  # A stored config of such a run still loads (and resumes: train() runs these checks only without --resume).
  stored = TrainConfig.from_dict(all_bf16.to_dict())
  assert stored.policy.pattern == ".*"
