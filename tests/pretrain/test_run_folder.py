"""Tests for fp4jax.pretrain.runfolder and the run-folder checks of trainer / cli: one run per folder (a second is
refused naming the holder), stale locks from dead processes reported and taken over, --out required, a corpus too
small for one window named as such, and each checkpoint carrying the config it was saved under."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import data
from fp4jax.pretrain import metrics
from fp4jax.pretrain import runfolder
from fp4jax.pretrain import run_setup
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_config(env, out, **changes) -> TrainConfig:
  run = dict(batch_size=4, steps=4, recipe="bf16", checkpoint_every=2)
  return tiny_config(env, out, **{**run, **changes})


def hold_lock_in_subprocess(folder):
  """A child process that locks `folder` and sleeps; returns it once the lock is held."""
  code = textwrap.dedent(f"""
      import sys, time
      from fp4jax.pretrain import runfolder
      lock = runfolder.acquire({str(folder)!r})
      print("locked", flush=True)
      time.sleep(600)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.readline().strip() == "locked"
  return proc


@pytest.mark.slow
def test_a_second_run_on_a_running_folder_is_refused(env, tmp_path):
  """While a run trains (it is inside its step hook), a second train() on the same --out is refused."""
  config = make_config(env, tmp_path)
  refusals = []

  def second_run(step, record):
    if step == 1:
      with pytest.raises(runfolder.RunLockedError) as info:
        trainer.train(config.replace(overwrite=True), log=None, compile_cache=env["cache"])
      refusals.append(str(info.value))

  summary = trainer.train(config, [second_run], log=None, compile_cache=env["cache"])
  assert len(refusals) == 1
  assert f"pid {os.getpid()} on host {socket.gethostname()}" in refusals[0] and "in use by another" in refusals[0]
  # The refused --overwrite run deleted nothing: the first run finished with all its checkpoints and metrics.
  manager = ckpt.open_manager(tmp_path, create=False)
  assert ckpt.available_steps(manager) == [2, 4]
  manager.close()
  assert [r["step"] for r in metrics.read_metrics(tmp_path) if "loss" in r] == [0, 1, 2, 3]
  assert summary["steps"] == 4
  # Released on return, and a clean exit leaves nothing stale behind.
  lock = runfolder.acquire(tmp_path)
  assert lock.stale == {}
  lock.release()


def test_lock_held_by_another_process_then_stale_after_it_dies(tmp_path, capsys):
  proc = hold_lock_in_subprocess(tmp_path)
  try:
    code = cli.main(["train", "--out", str(tmp_path), "--steps", "2", "--progress", "false"])
    assert code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"in use by another fp4jax run: pid {proc.pid} on host {socket.gethostname()}" in err
    assert "choose another --out" in err
    assert not ckpt.checkpoint_dir(tmp_path).exists() and not (tmp_path / metrics.METRICS_FILE).exists()
  finally:
    proc.send_signal(signal.SIGKILL)  # dies without releasing: its record stays in the lock file
    proc.wait(timeout=60)
  notes = []
  lock = runfolder.acquire(tmp_path, log=notes.append)
  try:
    assert lock.stale["pid"] == proc.pid
    assert len(notes) == 1 and f"pid {proc.pid}" in notes[0] and "did not exit cleanly" in notes[0]
    assert "that process is gone" in notes[0]
    fd = os.open(lock.path, os.O_RDONLY)
    assert runfolder._read_holder(fd)["pid"] == os.getpid()
    os.close(fd)
  finally:
    lock.release()
  assert lock.path.read_bytes() == b""


def test_stale_and_unreadable_lock_files(tmp_path):
  path = runfolder.lock_path(tmp_path)
  path.write_text("garbage{")
  notes = []
  with runfolder.acquire(tmp_path, log=notes.append) as lock:
    assert "unparsable lock file" in notes[0] and lock.stale
    with pytest.raises(runfolder.RunLockedError, match=f"pid {os.getpid()}"):
      runfolder.acquire(tmp_path)  # another open of the file is another lock, even in this process
  assert runfolder.lock_path(tmp_path, 3, 4).name == "run.3.lock" and path.name == "run.lock"


def test_single_and_multi_process_runs_exclude_each_other(tmp_path):
  """Process 0 of a multi-process run locks the file a single-process run does (they once locked different files
  and could write one folder together)."""
  assert runfolder.lock_path(tmp_path, 0, 2) == runfolder.lock_path(tmp_path)
  with runfolder.acquire(tmp_path):
    with pytest.raises(runfolder.RunLockedError, match="in use by another fp4jax run"):
      runfolder.acquire(tmp_path, process_index=0, process_count=2)
    with runfolder.acquire(tmp_path, process_index=1, process_count=2):  # its own file: free
      pass
  with runfolder.acquire(tmp_path, process_index=0, process_count=4):
    with pytest.raises(runfolder.RunLockedError, match="in use by another fp4jax run"):
      runfolder.acquire(tmp_path)


def test_an_out_that_cannot_be_a_folder_is_a_usage_error(tmp_path, capsys):
  """A file at --out once ended `fp4jax train` in a FileExistsError traceback."""
  (tmp_path / "x").write_text("not a folder")
  with pytest.raises(ValueError, match=f"Cannot create the run folder .*: {tmp_path / 'x'} is a file"):
    runfolder.open_run_folder(tmp_path / "x", resume=False, overwrite=False, process_index=0, process_count=1)
  assert cli.main(["train", "--out", str(tmp_path / "x" / "run"), "--steps", "2"]) == cli.EXIT_USAGE
  assert f"{tmp_path / 'x'} is a file. Choose another --out." in capsys.readouterr().err
  assert (tmp_path / "x").read_text() == "not a folder"


def test_train_requires_out(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert cli.main(["train", "--steps", "2"]) == cli.EXIT_USAGE
  assert "fp4jax train needs --out DIR" in capsys.readouterr().err
  assert not (tmp_path / "runs").exists()
  with pytest.raises(ValueError, match="needs --out"):
    cli.config_from_args(["--resume"])
  with pytest.raises(ValueError, match="--keep-schedule only applies with --resume"):
    cli.config_from_args(["--out", "x", "--keep-schedule"])
  help_text = cli._train_parser().format_help()
  assert "--keep-schedule" in help_text and "A different --steps is a new schedule" in help_text


def test_corpus_too_small_says_so(env, tmp_path, capsys):
  corpus = tmp_path / "tiny.txt"
  corpus.write_text("Hello world!")  # 12 bytes
  assert cli.main(["train", "--corpus", str(corpus), "--data.cache_dir", env["data"].cache_dir,
                   "--out", str(tmp_path / "run")]) == cli.EXIT_USAGE
  err = capsys.readouterr().err
  assert "The corpus is too small: it has 12 tokens" in err
  assert "seq_len+1=65" in err and "--eval-batches 0" in err
  # seq_len 64 + 32 held-out tokens for eval_batches 4 x batch_size 8 windows at val_fraction 0.05 (it said 1300,
  # whose 65-token split holds one window): a corpus of the size it names loads, one token fewer does not.
  assert "validation takes 32 windows (eval_batches x batch_size), so it needs at least 1901 tokens" in err
  for n, loads in ((1901, True), (1900, False)):
    corpus.write_text("abcdefghij" * 190 + "a" * (n - 1900))
    config = TrainConfig.from_options(out=str(tmp_path / "run"), data=data.DataConfig(
        corpus=str(corpus), cache_dir=env["data"].cache_dir))
    if loads:
      assert len(run_setup.load_data(config)[1]) == 4
    else:
      with pytest.raises(ValueError, match="has only 31 distinct windows"):
        run_setup.load_data(config)
  corpus.write_text("Hello world!")
  small = data.DataConfig(corpus=str(corpus), cache_dir=env["data"].cache_dir, val_fraction=0.5)
  # The longest --seq-len that leaves 4 validation windows (eval_batches 1 x batch_size 4) in the 6-token split:
  # it said 5 (one window), and following it failed in the next check.
  with pytest.raises(ValueError, match="has 12 tokens .*--seq-len of at most 2, or"):
    trainer.train(make_config(env, tmp_path / "run2", data=small, eval_batches=1), log=None)
  assert len(run_setup.load_data(make_config(env, tmp_path / "run2", data=small, eval_batches=1, seq_len=2))[1]) == 1
  with pytest.raises(ValueError, match="has 12 tokens .*Use a larger --corpus, or --eval-batches 0"):  # none fits
    trainer.train(make_config(env, tmp_path / "run2", data=small, eval_batches=2), log=None)
  with pytest.raises(ValueError, match="no validation split"):
    trainer.train(make_config(env, tmp_path / "run3", data=data.DataConfig(
        corpus=str(corpus), cache_dir=env["data"].cache_dir, val_fraction=0.0), eval_batches=1), log=None)


def test_corpus_too_small_for_a_tiny_val_fraction_names_the_one_that_fits(env, tmp_path):
  """A 1-token validation split (val_fraction 0.001 of 1000 tokens) was blamed on the corpus ("needs at least 96001
  tokens"), with no word of --data.val_fraction; the fraction named now loads."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("abcdefghij" * 100)
  config = lambda frac: TrainConfig.from_options(out=str(tmp_path / "run"), data=data.DataConfig(
      corpus=str(corpus), cache_dir=env["data"].cache_dir, val_fraction=frac))
  # seq_len 64 + eval_batches 4 x batch_size 8 windows = 96 held-out tokens: 0.096 of 1000.
  with pytest.raises(ValueError, match=r"a --data.val_fraction of 0.096 when training, or --eval-batches 0"):
    run_setup.load_data(config(0.001))
  assert len(run_setup.load_data(config(0.096))[1]) == 4
  with pytest.raises(ValueError, match="has only 31 distinct windows"):  # one token fewer
    run_setup.load_data(config(0.095))
  # BPE cuts the text, not the tokens, and learns another vocabulary from another cut: no such promise there.
  split = types.SimpleNamespace(train=np.zeros(999), val=np.zeros(1))
  for tokenizer, vocab, hinted in (("byte", 256, True), ("bpe", 300, False)):
    bpe = TrainConfig.from_options(data=data.DataConfig(tokenizer=tokenizer, vocab_size=vocab, val_fraction=0.001))
    with pytest.raises(ValueError, match="too small") as error:
      run_setup._check_corpus_size(split, bpe)  # pylint: disable=protected-access
    assert ("--data.val_fraction of 0.096" in str(error.value)) == hinted


def test_a_file_named_like_a_step_is_no_checkpoint(tmp_path):
  """Only a <step> folder in checkpoints/ is a finished checkpoint: a stray file named "3" gives --resume nothing
  to resume from and does not make the folder an existing run."""
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  (tmp_path / "run" / "checkpoints" / "3").write_text("")
  with pytest.raises(ckpt.CheckpointError, match="holds no finished checkpoint"):
    runfolder.check_resumable(tmp_path / "run")
  out, lock = runfolder.open_run_folder(tmp_path / "run", resume=False, overwrite=False)
  lock.release()


def test_an_empty_metrics_file_is_no_run_to_protect(tmp_path):
  """A run killed before its first record leaves an empty metrics.jsonl: a fresh run in that folder is not refused."""
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text("")
  out, lock = runfolder.open_run_folder(tmp_path / "run", resume=False, overwrite=False)
  lock.release()
  (out / "metrics.jsonl").write_text('{"step": 0}\n')
  with pytest.raises(ValueError, match="already holds a run"):
    runfolder.open_run_folder(out, resume=False, overwrite=False)


def test_corpus_too_small_hint_leaves_a_training_window(env, tmp_path):
  """The --seq-len hint fits the train split too (seq_len + 1 tokens), not only the validation windows: with a
  3-token train split and room for more in the held-out one, it says 2, and --seq-len 2 then loads."""
  corpus = tmp_path / "tiny.txt"
  corpus.write_text("Hello world!")  # 12 bytes: 3 train tokens, 9 held out at val_fraction 0.75
  small = data.DataConfig(corpus=str(corpus), cache_dir=env["data"].cache_dir, val_fraction=0.75)
  with pytest.raises(ValueError, match="train split 3, .*--seq-len of at most 2, or"):
    run_setup.load_data(make_config(env, tmp_path / "run", data=small, eval_batches=1))
  assert len(run_setup.load_data(make_config(env, tmp_path / "run", data=small, eval_batches=1, seq_len=2))[1]) == 1


@pytest.mark.slow
def test_each_checkpoint_holds_its_own_config(env, tmp_path):
  """No run-level config file that a resume with other settings could make disagree with older checkpoints."""
  config = make_config(env, tmp_path)
  trainer.train(config, log=None, compile_cache=env["cache"])
  trainer.train(config.replace(resume=True, steps=6, log_every=2), log=None, compile_cache=env["cache"])
  assert not (tmp_path / "config.json").exists()
  manager = ckpt.open_manager(tmp_path, create=False)
  try:
    stored = {s: TrainConfig.from_dict(ckpt.restore_meta(manager, s)[1]["config"]) for s in (2, 4, 6)}
  finally:
    manager.close()
  assert stored[2] == stored[4] == config
  assert stored[6] == config.replace(resume=True, steps=6, log_every=2)


def test_overwrite_deletes_only_what_fp4jax_wrote(tmp_path):
  """--overwrite removed the whole <out>/checkpoints folder, files fp4jax never wrote included."""
  out = tmp_path / "run"
  ck_dir = ckpt.checkpoint_dir(out)
  for name in ("4", "8", "12.orbax-checkpoint-tmp-1700000000", "metadata"):  # steps, a killed save, orbax's own
    (ck_dir / name).mkdir(parents=True)
    (ck_dir / name / "f").write_text("x")
  (ck_dir / "notes.txt").write_text("mine")
  (ck_dir / "export").mkdir()
  (ck_dir / "export" / "model.bin").write_text("mine too")
  (ck_dir / "7").write_text("a file, not a step folder")
  (out / metrics.METRICS_FILE).write_text('{"step": 0, "loss": 5.0}\n')
  log = []
  _, lock = runfolder.open_run_folder(out, resume=False, overwrite=True, log=log.append, process_index=0,
                                      process_count=1)
  lock.release()
  assert sorted(p.name for p in ck_dir.iterdir()) == ["7", "export", "notes.txt"]
  assert (ck_dir / "export" / "model.bin").read_text() == "mine too"
  assert not (out / metrics.METRICS_FILE).exists()
  assert log == [f"--overwrite: kept 3 entries of {ck_dir} that fp4jax did not write: 7, export, notes.txt."]
  # Nothing foreign: the folder goes, as before.
  for p in (ck_dir / "7", ck_dir / "notes.txt", ck_dir / "export" / "model.bin", ck_dir / "export"):
    p.unlink() if p.is_file() else p.rmdir()
  (ck_dir / "4").mkdir()
  _, lock = runfolder.open_run_folder(out, resume=False, overwrite=True, process_index=0, process_count=1)
  lock.release()
  assert not ck_dir.exists()


def test_out_home_is_refused(tmp_path, monkeypatch, capsys):
  """`--out '~'` (quoted) expanded to the home folder: a run there wrote ~/checkpoints and ~/metrics.jsonl, and
  --overwrite deleted ~/checkpoints/<step> folders and ~/metrics.jsonl."""
  home = tmp_path / "home"
  (home / "checkpoints" / "4").mkdir(parents=True)
  (home / metrics.METRICS_FILE).write_text('{"step": 0}\n')
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(tmp_path)
  before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
  for out in ("~", "~/", str(home), str(home / "sub" / "..")):
    said = re.escape(f"--out '{out}' is your home folder ({home.resolve()}): a run writes checkpoints/")
    with pytest.raises(ValueError, match=said + ".* --overwrite deletes them"):
      runfolder.open_run_folder(out, resume=False, overwrite=True, process_index=0, process_count=1)
  with pytest.raises(ValueError, match="is a folder above your home folder"):
    runfolder.open_run_folder(tmp_path, resume=False, overwrite=False, process_index=0, process_count=1)
  with pytest.raises(ValueError, match=r"'~no_such_user_fp4jax/run': no home folder to expand '~no_such_user_fp4jax' "
                     r"to \(Could not determine home directory"):
    runfolder.open_run_folder("~no_such_user_fp4jax/run", resume=False, overwrite=False, process_index=0,
                              process_count=1)
  assert cli.main(["train", "--out", "~", "--overwrite", "--steps", "2"]) == cli.EXIT_USAGE
  assert "is your home folder" in capsys.readouterr().err
  assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing made, nothing deleted
  # A folder in the home folder is fine, '~' expanded.
  folder, lock = runfolder.open_run_folder("~/runs/x", resume=False, overwrite=False, process_index=0,
                                           process_count=1)
  lock.release()
  assert folder == home / "runs" / "x" and folder.is_dir()


def test_out_without_a_home_folder(tmp_path, monkeypatch):
  """Without a home folder (no $HOME, no passwd entry) only a '~' path is refused; a full path is a run folder."""
  def no_home(*args, **kwargs):
    raise RuntimeError("Could not determine home directory.")

  monkeypatch.setattr(runfolder.pathlib.Path, "home", classmethod(no_home))
  monkeypatch.setattr(runfolder.pathlib.Path, "expanduser",
                      lambda self: no_home() if str(self).startswith("~") else self)
  with pytest.raises(ValueError, match=r"'~/run': no home folder to expand '~' to \(Could not determine"):
    runfolder.run_path("~/run")
  assert runfolder.run_path(tmp_path / "run") == tmp_path / "run"


def test_resume_of_a_run_still_before_its_first_checkpoint_names_the_holder(tmp_path):
  """--resume on a folder whose run holds the lock but has saved nothing said "no checkpoints ... run without
  --resume to start afresh", which would then have failed on the lock; it names the running holder now, and the
  look takes nothing: the lock file and a free folder's message are as they were."""
  with runfolder.acquire(tmp_path) as held:
    record = runfolder.lock_path(tmp_path).read_text()
    with pytest.raises(runfolder.RunLockedError, match=f"pid {os.getpid()} .* has saved no checkpoint yet"):
      runfolder.check_resumable(tmp_path)
    assert runfolder.lock_path(tmp_path).read_text() == record and held.fd >= 0
  with pytest.raises(ckpt.CheckpointError, match="no checkpoints"):
    runfolder.check_resumable(tmp_path)
