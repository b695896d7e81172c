"""Multi-process (multi-host) runs: JAX's multi-controller runtime, set up from FP4JAX_* environment variables.

Every process runs the same program on its own devices; `jax.devices()` then lists the devices of all processes
and a mesh spans them. Launch one process per host (or several per machine for testing):

  FP4JAX_COORDINATOR=host0:12377 FP4JAX_NUM_PROCESSES=2 FP4JAX_PROCESS_ID=0 fp4jax train --mesh data=2,fsdp=2 ...
  (the same on host1 with FP4JAX_PROCESS_ID=1)

`init_distributed()` must run before anything touches a JAX backend (the first jax.devices(), jnp array or jit):
the `fp4jax` CLI and the experiments call it first; Python API users call it at the top of their script. On CPU it
selects gloo collectives, without which XLA cannot run a computation across processes.

Failure handling (all bounded, none silent):
- initialization waits at most FP4JAX_INIT_TIMEOUT seconds (default 300) for all processes to connect, then JAX
  aborts the process (SIGABRT, "DEADLINE_EXCEEDED");
- a collective whose peer died fails at once when the socket closes (the CLI exits with code 3); a peer that stops
  sending heartbeats for FP4JAX_HEARTBEAT_TIMEOUT seconds (default 100) makes the coordination service abort the
  others ("heartbeat timeout" or "stopped sending heartbeats") instead of leaving them blocked forever;
- at exit, processes wait at most FP4JAX_SHUTDOWN_TIMEOUT seconds (default 300) for each other;
- a process whose command line or run config cannot be built (an invalid flag on one host only) would exit alone
  and leave the others waiting in their first collective until that timeout: `check_all_started` (a small
  collective the CLI joins on every process right after parsing, and again after building the config) makes the
  others raise PeerStartError (the CLI exits with code 2) naming the process and its error, within seconds
  (`fp4jax eval`: after parsing, and again after each process read its checkpoint's config and data). The same
  holds for a process whose FP4JAX_* variables are invalid (the CLI's first check; one with an invalid timeout joins
  with the default first, see joinable_from_env) and, in `trainer.train`, one that cannot read its data (a corpus
  or token cache folder its host lacks);
- processes started with different settings (another --lr, --recipe, --seed, ...) would train apart silently, hang
  in mismatched collectives or fail deep inside JAX: `check_same_run` (the first thing `trainer.train` does) compares
  digests of every process's run config and makes all of them raise ConfigMismatchError (the CLI exits with code 2)
  naming the options that differ, before any data is read or step compiled. The settings each host may keep its own
  are PER_PROCESS_FIELDS. `fp4jax eval` compares its --out, --step, --eval-batches and --corpus the same way;
- processes whose corpus files differ (a stale copy on one host) would train on two corpora silently:
  `check_same_data` (once each process has read its data) compares the data's fingerprint, size and tokenizer and
  makes all of them raise ConfigMismatchError naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

ENV_COORDINATOR = "FP4JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FP4JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FP4JAX_PROCESS_ID"
ENV_INIT_TIMEOUT = "FP4JAX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "FP4JAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "FP4JAX_SHUTDOWN_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Where the coordinator listens, how many processes take part, which one this is, and the timeouts (seconds)."""

  coordinator: str
  num_processes: int
  process_id: int
  init_timeout: int = 300
  heartbeat_timeout: int = 100
  shutdown_timeout: int = 300

  def __post_init__(self):
    for name in ("num_processes", "process_id", "init_timeout", "heartbeat_timeout", "shutdown_timeout"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int; got {value!r}.")
    # Checked here because JAX does not: with a port no peer can reach (0 binds a random one) or a host with a
    # scheme or a space, every process waits init_timeout for the coordinator and then aborts.
    host, colon, port = str(self.coordinator).rpartition(":")
    if (not colon or not host or re.search(r"[\s/,]", host) or not re.fullmatch(r"[0-9]{1,5}", port)
        or not 1 <= int(port) <= 65535):
      raise ValueError(f"{ENV_COORDINATOR} must be host:port with a port in 1..65535; got {self.coordinator!r}.")
    if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"need {ENV_NUM_PROCESSES} >= 1 and 0 <= {ENV_PROCESS_ID} < {ENV_NUM_PROCESSES}; got "
                       f"{self.num_processes} and {self.process_id}.")
    for name in ("init_timeout", "heartbeat_timeout", "shutdown_timeout"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1 second; got {getattr(self, name)}.")

  @classmethod
  def from_env(cls, environ=None) -> "DistributedConfig | None":
    """The config the FP4JAX_* variables describe; None when none of the three main ones is set (one process)."""
    env = os.environ if environ is None else environ
    main = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    given = [name for name in main if env.get(name, "").strip()]
    if not given:
      return None
    if len(given) != len(main):
      missing = [name for name in main if name not in given]
      raise ValueError(f"multi-process run: {', '.join(given)} set but {', '.join(missing)} missing; set all of "
                       f"{', '.join(main)} (or none for a single process).")

    def as_int(name, default=None):
      text = env.get(name, "").strip()
      if not text:
        return default
      if not re.fullmatch(r"[+-]?[0-9]+", text):  # int() also reads "2_0" as 20 and non-ASCII digits
        raise ValueError(f"{name} must be an integer; got {text!r}.")
      return int(text)

    return cls(coordinator=env[ENV_COORDINATOR].strip(), num_processes=as_int(ENV_NUM_PROCESSES),
               process_id=as_int(ENV_PROCESS_ID), init_timeout=as_int(ENV_INIT_TIMEOUT, 300),
               heartbeat_timeout=as_int(ENV_HEARTBEAT_TIMEOUT, 100),
               shutdown_timeout=as_int(ENV_SHUTDOWN_TIMEOUT, 300))


TIMEOUT_VARIABLES = (ENV_INIT_TIMEOUT, ENV_HEARTBEAT_TIMEOUT, ENV_SHUTDOWN_TIMEOUT)


def timeout_error(environ=None) -> str | None:
  """Why the FP4JAX_*_TIMEOUT variables set are not whole numbers of seconds >= 1 (None when they all are)."""
  env = os.environ if environ is None else environ
  bad = [(name, env[name].strip()) for name in TIMEOUT_VARIABLES if env.get(name, "").strip()]
  bad = [(name, text) for name, text in bad if not re.fullmatch(r"[+-]?[0-9]+", text) or int(text) < 1]
  return " ".join(f"{name} must be a whole number of seconds >= 1; got {text!r}." for name, text in bad) or None


def joinable_from_env(environ=None) -> tuple[DistributedConfig | None, str | None]:
  """(the config to join the run with, the error of its timeout variables or None), from the FP4JAX_* variables.

  A process whose timeouts are invalid still joins, with the defaults for those, so that the first start check
  (check_all_started) stops every process at once naming its error: failing before joining left the others waiting
  FP4JAX_INIT_TIMEOUT (300 s) for it, then aborted them. Invalid main variables (coordinator, process count or id)
  raise ValueError as in DistributedConfig.from_env: without them no process can join.
  """
  env = dict(os.environ if environ is None else environ)
  error = timeout_error(env)
  if error is not None:
    env = {k: v for k, v in env.items() if k not in TIMEOUT_VARIABLES or timeout_error({k: v}) is None}
  config = DistributedConfig.from_env(env)
  return config, error if config is not None else None  # one process reads no timeout


def _backends_started() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.backends_are_initialized()


def init_distributed(config: DistributedConfig | None = None) -> bool:
  """Joins the multi-process run described by `config` (default: the FP4JAX_* environment); returns whether it did.

  Without a config and without the variables this is a no-op (a single-process run), as is a second call. Raises
  RuntimeError when a JAX backend already started (call this first), ValueError for malformed variables.
  """
  config = DistributedConfig.from_env() if config is None else config
  if config is None:
    return False
  if jax.distributed.is_initialized():
    return True
  if _backends_started():
    raise RuntimeError("init_distributed() must run before anything uses a JAX backend (jax.devices(), a jnp "
                       "array, a jit call): call it at the top of the program, right after the imports.")
  # Said first because a peer that never connects aborts this process from C++ (DEADLINE_EXCEEDED, SIGABRT)
  # after init_timeout: no Python exception to catch.
  # A duplicated process id, a process never started and an unreachable coordinator all end in that same abort.
  print(f"fp4jax: process {config.process_id} of {config.num_processes} joining the run at {config.coordinator} "
        f"(waiting up to {config.init_timeout}s for all processes; if it aborts with DEADLINE_EXCEEDED, check that "
        f"each {ENV_PROCESS_ID} from 0 to {config.num_processes - 1} was started exactly once and that every "
        f"process can reach the coordinator)", file=sys.stderr, flush=True)
  # Only affects the CPU client; GPU runs use NCCL whatever this says.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                             process_id=config.process_id, initialization_timeout=config.init_timeout,
                             heartbeat_timeout_seconds=config.heartbeat_timeout,
                             shutdown_timeout_seconds=config.shutdown_timeout)
  return True


def is_main_process() -> bool:
  """Whether this process writes the run's files (metrics, config, logs): process 0, or the only one."""
  return jax.process_index() == 0


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is true on any of them (a collective: all processes must call it)."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  flags = multihost_utils.process_allgather(np.asarray(bool(flag), np.int32))
  return bool(np.any(flags))


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


# --- every process started -------------------------------------------------------------------------------------

class PeerStartError(ValueError):
  """Another process of a multi-process run could not parse its command line or build its run config."""


REASON_BYTES = 1024  # how much of each failing process's error goes round (one row of bytes per process)


def start_row(reason: str | None) -> np.ndarray:
  """[failed flag, the first REASON_BYTES bytes of `reason` (UTF-8), zero padded]: one process's row."""
  row = np.zeros(REASON_BYTES + 1, np.uint8)
  if reason is not None:
    encoded = reason.encode("utf-8")[:REASON_BYTES]
    row[0], row[1:1 + len(encoded)] = 1, np.frombuffer(encoded, np.uint8)
  return row


def failed_processes(rows: np.ndarray) -> dict[int, str]:
  """{process: its reason} for each row of `rows` (one start_row per process) whose failed flag is set."""
  return {p: bytes(row[1:]).rstrip(b"\0").decode("utf-8", errors="replace")
          for p, row in enumerate(np.asarray(rows)) if row[0]}


def check_all_started(what: str, reason: str | None) -> None:
  """Tells every process whether each could `what` ("parse its command line"): `reason` is this process's error
  (None: it could). Raises PeerStartError on the processes that could when another could not; the failing ones
  return and raise their own error. A collective that all processes must call; a no-op with one process."""
  if jax.process_count() == 1:
    return
  failed = failed_processes(_allgather(start_row(reason)))
  if not failed or reason is not None:
    return
  parts = "; ".join(f"process {p}: {text.rstrip().rstrip('.')}" for p, text in failed.items())
  raise PeerStartError(
      f"process{'es' if len(failed) > 1 else ''} {_join([str(p) for p in failed])} of this multi-process run could "
      f"not {what}, so this process ({jax.process_index()} of {jax.process_count()}) stops too: {parts}. Fix it and "
      "start every process again with the same flags.")


def failure_text(e: BaseException) -> str:
  """What check_all_started tells the other processes of error `e`: the message of the errors that explain
  themselves (bad values, missing files), else with the error's type."""
  return str(e) if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: {e}"


def all_started(what: str, build: Callable[[], Any], describe: Callable[[BaseException], str] = failure_text) -> Any:
  """build(), after every process of a multi-process run said whether its own build() succeeded (check_all_started,
  `describe` giving the text of its error): a process that failed alone would leave the others waiting in their next
  collective until FP4JAX_SHUTDOWN_TIMEOUT. Just build() outside a multi-process run."""
  if not jax.distributed.is_initialized():
    return build()
  try:
    result, error = build(), None
  except (Exception, SystemExit) as e:  # pylint: disable=broad-exception-caught
    result, error = None, e
  check_all_started(what, None if error is None else describe(error))
  if error is not None:
    raise error
  return result


# --- every process runs the same configuration ------------------------------------------------------------------

class ConfigMismatchError(ValueError):
  """The processes of a multi-process run were started with different run settings."""


# TrainConfig fields (dotted paths of its to_dict form) each process may set on its own; all others must agree. What
# legitimately differs per process (its id, the coordinator, its local devices) is not in the config at all: it
# comes from the FP4JAX_* variables and JAX's own settings.
PER_PROCESS_FIELDS = frozenset({
    # Where this host caches the tokenized corpus (a local disk per host): the tokens are the same wherever kept.
    "data.cache_dir",
    # Where this host keeps the corpus (hosts mount it at other paths): what it holds is compared once read
    # (check_same_data), which also catches one path holding other text on two hosts.
    "data.corpus",
    # Only process 0 shows the progress bar and writes metrics.jsonl; the other processes never read these, and
    # neither runs a collective.
    "logging.progress", "logging.every",
    # Not logging.profile: the loop waits for the step in flight where a trace starts or stops, and a process that
    # waits there reaches the stop check's collective before it sends the next step, while the others send it first
    # (their devices then run the step, whose collectives wait for the first process, before the check): deadlock.
})


def run_fields(config_dict: Mapping[str, Any]) -> dict[str, Any]:
  """The settings every process must share: a TrainConfig.to_dict() form keyed by dotted path ("optimizer.lr",
  "model.d_model", "seed"), without PER_PROCESS_FIELDS."""
  fields = {}
  for key, value in config_dict.items():
    # Only the groups are mappings at the top; a group's values (a hand-built recipe's dict too) are digested whole.
    items = {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, Mapping) else {key: value}
    fields.update({k: v for k, v in items.items() if k not in PER_PROCESS_FIELDS})
  return dict(sorted(fields.items()))


def digest(value: Any) -> int:
  """A 32-bit digest of a JSON-ready value, the same in every process and on every machine (unlike hash())."""
  text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def field_digests(fields: Mapping[str, Any]) -> np.ndarray:
  """One uint32 digest per field, in the order of `fields`."""
  return np.asarray([digest(v) for v in fields.values()], np.uint32)


def summary_digests(fields: Mapping[str, Any], versions: Sequence[str] = ()) -> np.ndarray:
  """[number of fields, digest of their names, digest of `versions`, digest of all values]: what one cheap
  collective compares; the per-field digests (field_digests) only go round when these differ."""
  return np.asarray([len(fields), digest(list(fields)), digest(list(versions)),
                     digest(field_digests(fields).tolist())], np.uint32)


def differing_fields(names: Sequence[str], gathered: np.ndarray) -> dict[int, list[str]]:
  """{process: the names whose digest differs from process 0's} for each process that differs in any;
  `gathered` holds one row of field_digests per process."""
  gathered = np.asarray(gathered)
  return {p: [n for n, differs in zip(names, row != gathered[0]) if differs]
          for p, row in enumerate(gathered) if (row != gathered[0]).any()}


def _join(items: Sequence[str]) -> str:
  return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def mismatch_message(differing: Mapping[int, Sequence[str]], flags: Mapping[str, str], own: Mapping[str, Any],
                     process_index: int, process_count: int) -> str:
  """Names, for each process that differs, the options (and dotted fields) that differ from process 0's, and this
  process's values of them (each process's log shows its own, so the logs together show all)."""
  listed = 8
  parts = []
  for p, names in differing.items():
    shown = [f"{flags.get(n, n)} ({n})" for n in names[:listed]]
    if len(names) > listed:
      shown.append(f"{len(names) - listed} more")
    parts.append(f"process {p}'s {_join(shown)} {'differs' if len(names) == 1 else 'differ'} from process 0's")
  names = list(dict.fromkeys(n for ns in differing.values() for n in ns))[:listed]
  values = ", ".join(f"{n}={json.dumps(own.get(n), default=repr)}" for n in names)
  return (f"the processes of this multi-process run were started with different settings: {'; '.join(parts)}. "
          f"Start every process with the same flags (only the FP4JAX_* variables differ between them). This "
          f"process ({process_index} of {process_count}) has {values}.")


def _versions() -> list[str]:
  import fp4jax  # pylint: disable=g-import-not-at-top
  return [f"fp4jax {fp4jax.__version__}", f"jax {jax.__version__}"]


def _allgather(values: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(values))


# What DataIdentity fields must agree: the tokens every process reads its rows of each batch from. The corpus path
# and token cache entry may differ per host.
DATA_FIELDS = ("fingerprint", "num_files", "num_bytes", "tokenizer", "vocab_size", "tokenizer_digest")


def check_same_data(identity: Mapping[str, Any] | None) -> None:
  """Raises ConfigMismatchError on every process when the processes read different data (`identity`, this process's
  DataIdentity.to_dict()): each process reads its own copy of the corpus and trains on its own rows of every batch,
  so a stale copy on one host would make the run train on two corpora silently. A collective that all processes
  must call; a no-op with one process."""
  if jax.process_count() == 1:
    return
  identity = identity or {}
  fields = {name: identity.get(name) for name in DATA_FIELDS}
  differing = differing_fields(list(fields), _allgather(field_digests(fields)))
  if not differing:
    return
  parts = "; ".join(f"process {p}'s {_join(names)} {'differs' if len(names) == 1 else 'differ'} from process 0's"
                    for p, names in differing.items())
  fingerprint = str(fields["fingerprint"])[:16]
  raise ConfigMismatchError(
      f"the processes of this multi-process run read different data: {parts}. Every process reads its own copy of "
      f"--data.corpus and trains on its own rows of each batch: give every host the same corpus files. This process "
      f"({jax.process_index()} of {jax.process_count()}) read {identity.get('corpus')} (fingerprint {fingerprint}, "
      f"{fields['num_bytes']} bytes in {fields['num_files']} files, {fields['tokenizer']} tokenizer, vocabulary "
      f"{fields['vocab_size']}).")


def check_same_run(config_dict: Mapping[str, Any], flags: Mapping[str, str]) -> None:
  """Raises ConfigMismatchError on every process when the processes' run settings (`config_dict`, a
  TrainConfig.to_dict() form, less PER_PROCESS_FIELDS) differ; `flags` maps dotted fields to their options for the
  message. A collective that all processes must call; a no-op with one process."""
  if jax.process_count() == 1:
    return
  fields = run_fields(config_dict)
  versions = _versions()
  summaries = _allgather(summary_digests(fields, versions))
  if (summaries == summaries[0]).all():
    return
  if (summaries[:, :3] != summaries[0, :3]).any():  # the per-field digests would not line up
    others = [p for p, row in enumerate(summaries) if (row[:3] != summaries[0, :3]).any()]
    raise ConfigMismatchError(
        f"process{'es' if len(others) > 1 else ''} {_join([str(p) for p in others])} of this multi-process run "
        f"run{'' if len(others) > 1 else 's'} a different fp4jax or jax version from process 0 (their run configs "
        f"have other fields, or the versions differ); this process ({jax.process_index()}) runs "
        f"{' and '.join(versions)}. Install the same versions on every host.")
  differing = differing_fields(list(fields), _allgather(field_digests(fields)))
  raise ConfigMismatchError(mismatch_message(differing, flags, fields, jax.process_index(), jax.process_count()))
