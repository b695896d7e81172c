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
  others ("heartbeat timeout") instead of leaving them blocked forever;
- at exit, processes wait at most FP4JAX_SHUTDOWN_TIMEOUT seconds (default 300) for each other.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

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
  print(f"fp4jax: process {config.process_id} of {config.num_processes} joining the run at {config.coordinator} "
        f"(waiting up to {config.init_timeout}s for all processes)", file=sys.stderr, flush=True)
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
