"""Tests for `fp4jax train` options that were ignored or misread: --out "", --resume-step without --resume, and
the start flags a resumed run took from its stored config (no training)."""

import pytest

from fp4jax.pretrain import cli
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import resume as resume_lib


@pytest.mark.parametrize("extra", [[], ["--overwrite"], ["--resume", "false"]])
def test_resume_step_without_resume_is_refused(tmp_path, extra, capsys):
  """--resume-step N alone started a fresh run; with --overwrite it deleted the checkpoints it meant to resume."""
  argv = ["--out", str(tmp_path), "--steps", "4", "--resume-step", "2", *extra]
  with pytest.raises(ValueError, match="--resume-step 2 only applies with --resume"):
    cli.config_from_args(argv)
  assert cli.main(["train", *argv]) == cli.EXIT_USAGE
  assert "only applies with --resume" in capsys.readouterr().err
  assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("out", ["", " "])
def test_empty_out_is_refused(out, tmp_path, monkeypatch):
  """`--out "$DIR"` with an empty DIR trained into the working directory (and --overwrite cleared its run files)."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="fp4jax train needs --out DIR"):
    cli.config_from_args(["--out", out, "--steps", "1"])
  assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("stored", [{"overwrite": True}, {"resume": True, "resume_step": 2}])
def test_resume_does_not_inherit_how_the_stored_run_was_started(stored, tmp_path, monkeypatch):
  """A run started with --overwrite could not be resumed ("overwrite and resume exclude each other"); one resumed
  with --resume-step 2 went back to step 2 on every later --resume."""
  config = config_lib.TrainConfig(out=str(tmp_path), steps=4).replace(**stored)
  monkeypatch.setattr(resume_lib, "resume_meta", lambda out, step=None: (4, {"config": config.to_dict()}))
  got = cli.config_from_args(["--out", str(tmp_path), "--resume", "--steps", "8"])
  assert got.checkpointing.resume and got.checkpointing.resume_step is None and not got.checkpointing.overwrite
  assert got.steps == 8
  assert cli.config_from_args(["--out", str(tmp_path), "--resume", "--resume-step", "3"]).checkpointing.resume_step == 3
