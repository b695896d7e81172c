"""Tests for the data identity checkpoints record (data.DataIdentity) and its checks on resume and evaluation: an
edited corpus changed `fp4jax eval` and `--resume` results with no note, and a relative --data.corpus stored as
typed was read from whatever folder a later command ran in."""

import json

import jax.numpy as jnp
import pytest

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import data
from fp4jax.pretrain import resume as resume_lib
from fp4jax.pretrain import trainer
from train_helpers import tiny_config

TEXT = "To be, or not to be, that is the question. " * 60  # 2640 bytes: train and val splits hold 33-token windows


def identity(tmp_path, text=TEXT, name="corpus.txt", **config):
  path = tmp_path / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return data.load_dataset(data.DataConfig(corpus=str(path), cache_dir=str(tmp_path / "cache"), **config)).identity


def test_identity_resolves_the_corpus_and_fingerprints_its_bytes(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "corpus.txt").write_text(TEXT)
  got = data.load_dataset(data.DataConfig(corpus="corpus.txt", cache_dir="cache")).identity
  assert got.corpus == str((tmp_path / "corpus.txt").resolve())  # absolute, as this folder reads it
  assert (got.tokenizer, got.vocab_size, got.num_files, got.num_bytes) == ("byte", 256, 1, len(TEXT))
  assert (tmp_path / "cache" / got.cache_key).is_dir()  # the token cache's own key, reused
  # The same bytes elsewhere (another name, another cache) are the same data; edited bytes are not.
  moved = identity(tmp_path / "b", name="other.txt")
  assert moved.fingerprint == got.fingerprint and moved.cache_key == got.cache_key
  assert data.identity_changes(got, moved) == []
  edited = identity(tmp_path / "c", TEXT.replace("question", "answer!!"))
  assert edited.num_bytes == got.num_bytes and edited.fingerprint != got.fingerprint
  assert data.resolve_corpus("shakespeare, corpus.txt") == f"shakespeare,{got.corpus}"
  assert data.DataIdentity.from_dict(json.loads(json.dumps(got.to_dict()))) == got


def test_identity_changes_say_what_changed(tmp_path):
  old = identity(tmp_path / "a")
  longer = identity(tmp_path / "a", TEXT + "Whether 'tis nobler.")
  [said] = data.identity_changes(old, longer)
  assert f"the corpus '{old.corpus}' holds other text: 1 files, {len(TEXT) + 20} bytes" in said
  assert f"(it was 1 files, {len(TEXT)} bytes, fingerprint {old.fingerprint})" in said
  elsewhere = identity(tmp_path / "b", TEXT + "x")
  assert f"(it was '{old.corpus}')" in data.identity_changes(old, elsewhere)[0]
  other_tokenizer = data.DataIdentity(**{**old.to_dict(), "tokenizer": "bpe", "vocab_size": 512})
  assert data.identity_changes(old, other_tokenizer) == [
      "the tokenizer is bpe with vocab 512 (it was byte with vocab 256)"]


def test_identity_tells_bpe_vocabularies_learned_from_other_text_apart(tmp_path):
  """BPE's vocabulary is learned from the train text alone, so another val_fraction (or a record from an fp4jax that
  learned it from the whole corpus) gives other tokens for the same corpus and vocab_size: a change."""
  pytest.importorskip("tokenizers")
  text = TEXT + "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune. " * 20
  bpe = identity(tmp_path / "a", text, tokenizer="bpe", vocab_size=300, val_fraction=0.1)
  again = identity(tmp_path / "b", text, tokenizer="bpe", vocab_size=300, val_fraction=0.1)  # another cache
  assert bpe.tokenizer_digest and again.tokenizer_digest == bpe.tokenizer_digest  # learned again: the same
  assert data.identity_changes(bpe, again) == []
  other = identity(tmp_path / "a", text, tokenizer="bpe", vocab_size=300, val_fraction=0.3)
  assert (other.fingerprint, other.vocab_size) == (bpe.fingerprint, bpe.vocab_size) == (bpe.fingerprint, 300)
  assert data.identity_changes(bpe, other) == [
      f"the bpe vocabulary (vocab 300) has other tokens: digest {other.tokenizer_digest} (it was "
      f"{bpe.tokenizer_digest}): it was learned from other text, as another val_fraction holds out"]
  with pytest.raises(resume_lib.DataChangedError, match="the bpe vocabulary .* has other tokens"):
    resume_lib.check_data_kept(bpe.to_dict(), other, 8)
  # Records from before the digest: a byte one is the same data, a BPE one had a vocabulary learned from all text.
  byte = identity(tmp_path / "a", text)
  assert byte.tokenizer_digest == ""
  older = {k: v for k, v in byte.to_dict().items() if k != "tokenizer_digest"}
  assert resume_lib.check_data_kept(older, byte, 8) is None
  older = {k: v for k, v in bpe.to_dict().items() if k != "tokenizer_digest"}
  assert data.identity_changes(data.DataIdentity.from_dict(older), bpe) == [
      "the bpe vocabulary (vocab 300) has other tokens: it is learned from the train text alone, and this record's "
      "was learned by an older fp4jax from the whole corpus, validation text included"]


def test_resume_on_changed_data_is_refused_unless_data_changed(tmp_path):
  old = identity(tmp_path / "a")
  recorded = old.to_dict()
  assert resume_lib.check_data_kept(recorded, old, 8) is None
  edited = identity(tmp_path / "a", TEXT + "!")
  with pytest.raises(ValueError, match=r"The data differs from what checkpoint 8 was trained on: the corpus .* holds "
                     r"other text.* pass --data-changed; .* restore the corpus at '.*corpus.txt'"):
    resume_lib.check_data_kept(recorded, edited, 8)
  note = resume_lib.check_data_kept(recorded, edited, 8, data_changed=True)
  assert note.startswith("Note: --data-changed: resuming checkpoint 8 on other data") and "holds other text" in note
  # A checkpoint from before the identity was recorded is resumed, with a note.
  note = resume_lib.check_data_kept(None, edited, 8)
  assert note.startswith("Note: checkpoint 8 does not record which data it was trained on") and edited.corpus in note


def test_eval_on_changed_data_is_refused_unless_the_corpus_is_named(tmp_path):
  old = identity(tmp_path / "a")
  edited = identity(tmp_path / "a", TEXT + "!")
  assert resume_lib.eval_data_note(old.to_dict(), old, 4, False, "corpus.txt") is None
  with pytest.raises(ValueError, match=r"checkpoint 4 was trained on: .* name the corpus explicitly \(--corpus .*"
                     r"corpus.txt\)"):
    resume_lib.eval_data_note(old.to_dict(), edited, 4, False, "corpus.txt")
  assert "val_loss is not comparable" in resume_lib.eval_data_note(old.to_dict(), edited, 4, True, "corpus.txt")
  note = resume_lib.eval_data_note(None, edited, 4, False, "corpus.txt")
  assert "does not record which data" in note and "its relative path 'corpus.txt' read from the current folder" in note
  assert "relative" not in resume_lib.eval_data_note(None, edited, 4, False, edited.corpus)


def test_recorded_corpus_that_is_gone_says_how_to_name_it(tmp_path):
  meta = {"data": {"corpus": f"shakespeare,{tmp_path / 'gone.txt'}"}}
  with pytest.raises(FileNotFoundError, match=r"gone.txt no longer exists\. If the corpus moved, name it: "
                     r"fp4jax eval --out X --corpus PATH"):
    resume_lib.recorded_corpus(meta, 4, "fp4jax eval --out X")
  assert resume_lib.recorded_corpus({}, 4, "") is None
  (tmp_path / "gone.txt").write_text("back")
  assert resume_lib.recorded_corpus(meta, 4, "") == meta["data"]["corpus"]


def test_sample_names_itself_in_the_moved_corpus_fix(tmp_path):
  """fp4jax sample reads its checkpoint through eval_setup, whose fix for a moved corpus named `fp4jax eval`."""
  stored = config_lib.TrainConfig(out=str(tmp_path), steps=4, data="corpus.txt").to_dict()
  manager = ckpt.open_manager(tmp_path)
  ckpt.save(manager, 4, {"w": jnp.zeros(3)}, {"config": stored, "data": {"corpus": str(tmp_path / "gone.txt")}},
            force=True)
  manager.wait_until_finished()
  manager.close()
  for command in ("fp4jax eval", "fp4jax sample"):
    kwargs = {} if command == "fp4jax eval" else {"command": command}
    with pytest.raises(FileNotFoundError, match=f"name it: {command} --out {tmp_path} --corpus PATH"):
      trainer.eval_setup(tmp_path, **kwargs)


def _stored(tmp_path, monkeypatch, meta):
  monkeypatch.setattr(resume_lib, "resume_meta", lambda out, step=None: (4, meta))


def test_cli_resume_reads_the_recorded_absolute_corpus(tmp_path, monkeypatch):
  (tmp_path / "proj").mkdir()
  (tmp_path / "proj" / "corpus.txt").write_text(TEXT)
  stored = config_lib.TrainConfig(out=str(tmp_path), steps=4, data="corpus.txt")
  recorded = {"corpus": str(tmp_path / "proj" / "corpus.txt")}
  _stored(tmp_path, monkeypatch, {"config": stored.to_dict(), "data": recorded})
  monkeypatch.chdir(tmp_path)  # not the folder the run trained in: ./corpus.txt would be other text (or none)
  got = cli.config_from_args(["--out", str(tmp_path), "--resume"])
  assert got.data.corpus == recorded["corpus"]
  named = cli.config_from_args(["--out", str(tmp_path), "--resume", "--corpus", "other.txt"])
  assert named.data.corpus == "other.txt"  # named on this command line: read from here
  _stored(tmp_path, monkeypatch, {"config": stored.to_dict()})  # an older checkpoint: the config as typed
  assert cli.config_from_args(["--out", str(tmp_path), "--resume"]).data.corpus == "corpus.txt"
  with pytest.raises(ValueError, match="--data-changed only applies with --resume"):
    cli.config_from_args(["--out", str(tmp_path / "new"), "--data-changed"])
  with pytest.raises(ValueError, match="data_changed only applies with resume=True"):
    stored.replace(data_changed=True)
  # A run resumed with --data-changed stores it; a later --resume does not inherit it.
  changed = stored.replace(resume=True, data_changed=True)
  _stored(tmp_path, monkeypatch, {"config": changed.to_dict(), "data": recorded})
  assert not cli.config_from_args(["--out", str(tmp_path), "--resume"]).checkpointing.data_changed
  assert "data_changed" in config_lib.result_free_keys()


def test_a_refused_checkpoint_moves_nothing_aside(tmp_path, monkeypatch):
  """restore_readable's check runs before --resume-step moves the later checkpoints aside; in a multi-process run
  every process learns that one refused (one host's copy of the corpus alone may differ)."""
  manager = ckpt.open_manager(tmp_path)
  for step in (4, 8):
    ckpt.save(manager, step, {"w": jnp.full(3, step, jnp.float32)}, {"config": {}, "data": {"step": step}}, force=True)
  manager.wait_until_finished()
  manager.close()

  def refuse(step, meta):
    raise ValueError(f"refused {step} {meta['data']}")

  target, moved = {"w": jnp.zeros(3, jnp.float32)}, []
  with pytest.raises(ValueError, match=r"refused 4 \{'step': 4\}"):
    resume_lib.restore_readable(tmp_path, target, 4, log=moved.append, process_index=0, process_count=1,
                                check=refuse)
  assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["4", "8"]
  assert not (tmp_path / resume_lib.MOVED_DIR).exists() and not moved
  flags = []
  monkeypatch.setattr(resume_lib.distributed, "any_process", lambda flag: flags.append(flag) or True)
  with pytest.raises(ValueError, match="refused 4"):  # this process refused: it says why, after the agreement
    resume_lib.restore_readable(tmp_path, target, 4, log=moved.append, process_index=1, process_count=2,
                                check=refuse)
  with pytest.raises(ckpt.CheckpointError, match="process 1: another process refused checkpoint 4"):
    resume_lib.restore_readable(tmp_path, target, 4, log=moved.append, process_index=1, process_count=2)

  assert flags == [True, False]
  monkeypatch.undo()
  start, _, _ = resume_lib.restore_readable(tmp_path, target, 4, log=moved.append, process_index=0, process_count=1,
                                            check=lambda step, meta: None)
  assert start == 4 and len(moved) == 1 and "Moved checkpoint 8 aside" in moved[0]


def test_eval_reads_the_recorded_absolute_corpus(tmp_path, monkeypatch):
  (tmp_path / "proj").mkdir()
  (tmp_path / "proj" / "corpus.txt").write_text(TEXT)
  stored = config_lib.TrainConfig(out=str(tmp_path), steps=4, data="corpus.txt").to_dict()
  manager = ckpt.open_manager(tmp_path)
  ckpt.save(manager, 4, {"w": jnp.zeros(3)}, {"config": stored, "data": {"corpus": str(tmp_path / "proj" /
                                                                                         "corpus.txt")}}, force=True)
  ckpt.save(manager, 8, {"w": jnp.zeros(3)}, {"config": stored}, force=True)  # an older checkpoint
  manager.wait_until_finished()
  manager.close()
  read = []

  def load_data(config):  # what evaluate reads; stops it before it builds a model
    read.append(config.data.corpus)
    raise InterruptedError

  monkeypatch.setattr(trainer, "load_data", load_data)
  monkeypatch.chdir(tmp_path)
  for step, corpus, expected in ((4, None, str(tmp_path / "proj" / "corpus.txt")), (4, "x.txt", "x.txt"),
                                 (8, None, "corpus.txt")):
    with pytest.raises(InterruptedError):
      trainer.evaluate(tmp_path, step, corpus=corpus)
    assert read.pop() == expected


@pytest.mark.slow
def test_an_edited_corpus_is_refused_on_resume_and_eval(env, tmp_path, monkeypatch, capsys):
  proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
  proj.mkdir()
  elsewhere.mkdir()
  (proj / "corpus.txt").write_text(TEXT)
  (elsewhere / "corpus.txt").write_text(TEXT.upper())  # what the relative path reads from the other folder
  out = tmp_path / "run"
  corpus = data.DataConfig(corpus="corpus.txt", cache_dir=env["data"].cache_dir)
  monkeypatch.chdir(proj)
  # One --steps throughout (each resume goes back with --resume-step), so the step compiles once.
  trainer.train(tiny_config(env, out, data=corpus, steps=3, batch_size=2, checkpoint_every=1), log=None,
                compile_cache=env["cache"])
  monkeypatch.chdir(elsewhere)
  resume = ["--resume", "--out", str(out), "--resume-step"]

  # Resumed from another folder: the recorded corpus, unchanged, so no note about it.
  log = []
  config = cli.config_from_args([*resume, "2"])
  assert config.data.corpus == str((proj / "corpus.txt").resolve())
  assert trainer.train(config, log=log.append, compile_cache=env["cache"])["start_step"] == 2
  assert not any("data" in line for line in log if line.startswith("Note")), log  # nor 'data' as a changed setting

  # Edited: refused on resume, nothing moved aside or written.
  (proj / "corpus.txt").write_text(TEXT.replace("question", "problem!"))
  before = sorted(p.name for p in ckpt.checkpoint_dir(out).iterdir())
  moved_before = sorted(p.name for p in (out / resume_lib.MOVED_DIR).iterdir())
  with pytest.raises(ValueError, match=r"The data differs from what checkpoint 1 was trained on: the corpus "
                     r"'.*proj/corpus.txt' holds other text.*pass --data-changed"):
    trainer.train(cli.config_from_args([*resume, "1"]), log=None, compile_cache=env["cache"])
  assert sorted(p.name for p in ckpt.checkpoint_dir(out).iterdir()) == before == ["1", "2", "3"]
  assert sorted(p.name for p in (out / resume_lib.MOVED_DIR).iterdir()) == moved_before
  assert cli.main(["train", "--resume", "--out", str(out)]) == cli.EXIT_USAGE
  assert "pass --data-changed" in capsys.readouterr().err
  # `fp4jax eval` refuses too (before building anything), and says how to evaluate on the new text.
  assert cli.main(["eval", "--out", str(out)]) == cli.EXIT_USAGE
  assert "name the corpus explicitly (--corpus" in capsys.readouterr().err

  # --data-changed continues on the new text, said; the new checkpoint records it.
  log = []
  config = cli.config_from_args([*resume, "2", "--data-changed"])
  assert trainer.train(config, log=log.append, compile_cache=env["cache"])["start_step"] == 2
  assert any(line.startswith("Note: --data-changed: resuming checkpoint 2 on other data") for line in log)
  _, meta = resume_lib.resume_meta(out)
  assert meta["data"]["fingerprint"] == data.load_dataset(config.data).identity.fingerprint

  # A checkpoint from before the identity was recorded resumes, unchecked, with a note (its corpus as typed).
  meta_file = ckpt.checkpoint_dir(out) / "1" / "meta" / "metadata"
  older = json.loads(meta_file.read_text())
  del older["data"]
  meta_file.write_text(json.dumps(older))
  log = []
  config = cli.config_from_args([*resume, "1"])
  assert config.data.corpus == "corpus.txt"
  assert trainer.train(config, log=log.append, compile_cache=env["cache"])["start_step"] == 1
  assert any(line.startswith("Note: checkpoint 1 does not record which data it was trained on") for line in log)


def test_a_checkpoint_that_cannot_be_moved_aside_is_a_checkpoint_error(tmp_path, monkeypatch):
  # A PermissionError went up as a bare OSError: the CLI, which reports ValueErrors, printed a traceback.
  manager = ckpt.open_manager(tmp_path)
  for step in (4, 8):
    ckpt.save(manager, step, {"w": jnp.full(3, step, jnp.float32)}, {"config": {}}, force=True)
  manager.wait_until_finished()
  manager.close()

  def denied(out_dir, step, reason):
    raise PermissionError(13, "Permission denied", str(tmp_path / resume_lib.MOVED_DIR))

  monkeypatch.setattr(resume_lib, "move_aside", denied)
  with pytest.raises(ckpt.CheckpointError, match=r"Could not move checkpoint 8 aside \(it comes after --resume-step "
                                                 r"4\) to .*checkpoints_moved: \[Errno 13\] Permission denied"):
    resume_lib.restore_readable(tmp_path, {"w": jnp.zeros(3, jnp.float32)}, 4, log=print, process_index=0,
                                process_count=1)
  assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == ["4", "8"]
