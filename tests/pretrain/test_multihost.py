"""Multi-process training for real: `python -m fp4jax train` launched as 2 processes on localhost with 2 simulated CPU
devices each (gloo collectives), against one process with 4 devices on the same (data=2, fsdp=2) mesh.

The slow tests share one module-scoped pair of reference runs and a persistent compilation cache (which spares
single-process launches a recompile; multi-process CPU runs go without it: fp4jax.pretrain.compile_cache).
Every subprocess is bounded by a timeout: a hang fails the test instead of CI.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from fp4jax.pretrain import checkpoint as ckpt
from fp4jax.pretrain import cli
from fp4jax.pretrain import config as config_lib
from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import distributed
from fp4jax.pretrain import resume
from fp4jax.pretrain import runfolder
from fp4jax.pretrain import sharding
from fp4jax.pretrain import trainer

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 16  # enough steps left for a SIGINT sent after step 0 to land mid-run
# The README's two-process command, plus what keeps it short: 1 block, 32-token rows, no validation, a checkpoint every 8 steps.
TRAIN_ARGS = ["train", "--model", "tiny", "--recipe", "nvfp4", "--mesh", "data=2,fsdp=2", "--steps", str(STEPS),
              "--model.n_layers", "1", "--seq-len", "32", "--eval-batches", "0", "--checkpoint-every", "8",
              "--progress", "false"]
# The slow tests share the module's `runs` fixture: one unit of work under `pytest -n` (tests/conftest.py).
RUNS_GROUP = "multihost_runs"
TIMEOUT = 240  # per launch; generous for a loaded 2-core machine, still fails a hang
PROMPT_S = 200  # start-check tests: below the 300 s FP4JAX_SHUTDOWN_TIMEOUT the old behaviour waited for


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(tmp: pathlib.Path, devices: int, **extra) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("FP4JAX_")}
  env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
             PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", FP4JAX_HEARTBEAT_TIMEOUT="60",
             FP4JAX_SHUTDOWN_TIMEOUT="10", FP4JAX_INIT_TIMEOUT="60")
  # Heartbeats: 60 s, as 10 s aborted healthy processes when two of these tests (8 JAX processes) shared the 2 cores
  # of a CI run; the test of a dead process sets 10 s.
  env.update(extra)
  return env


def _launch(tmp, args, nprocs: int, log_name: str, process_args=None, process_env=None,
            **extra) -> list[subprocess.Popen]:
  """`python -m fp4jax ARGS` as `nprocs` processes (2 devices each) or one process with 4 devices; process i also
  gets `process_args[i]` and the environment variables `process_env[i]` where given."""
  port = _free_port()
  procs = []
  for pid in range(nprocs):
    env = _env(tmp, 2, FP4JAX_COORDINATOR=f"localhost:{port}", FP4JAX_NUM_PROCESSES=str(nprocs),
               FP4JAX_PROCESS_ID=str(pid), **extra) if nprocs > 1 else _env(tmp, 4, **extra)
    env.update(process_env[pid] if process_env else {})
    own = list(process_args[pid]) if process_args else []
    with open(tmp / f"{log_name}.{pid}.log", "w", encoding="utf-8") as log:  # the child keeps its own handle
      procs.append(subprocess.Popen([sys.executable, "-m", "fp4jax", *args, *own], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, text=True))
  return procs


def _wait(procs, timeout=TIMEOUT) -> list[int]:
  deadline = time.monotonic() + timeout
  codes = []
  try:
    for p in procs:
      codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"a process did not finish within {timeout}s (hang)")
  return codes


def _logs(tmp, log_name, nprocs) -> str:
  return "\n".join(f"--- {log_name}.{i}\n" + (tmp / f"{log_name}.{i}.log").read_text()[-3000:]
                   for i in range(nprocs))


def _run(tmp, args, nprocs, log_name, **extra) -> None:
  codes = _wait(_launch(tmp, args, nprocs, log_name, **extra))
  assert codes == [0] * nprocs, _logs(tmp, log_name, nprocs)


def _losses(out) -> dict[int, float]:
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if "loss" in r]
  assert len(steps) == len(set(steps)), f"duplicate step records (one writer only): {steps}"
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def _copy_checkpoint(src, dst, step):
  (dst / "checkpoints").mkdir(parents=True)
  shutil.copytree(src / "checkpoints" / str(step), dst / "checkpoints" / str(step))


def _assert_losses_match(got: dict[int, float], want: dict[int, float], first: int):
  # As in test_train_mesh.py: the first step from identical params agrees to float tolerance; later steps drift
  # like a change of SR seed once a float32 summation-order difference flips an FP4 code.
  assert sorted(got) == list(range(first, STEPS)), got
  np.testing.assert_allclose(got[first], want[first], rtol=1e-5)
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=2e-2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The same run as 2 processes x 2 devices and as 1 process x 4 devices (launched together)."""
  tmp = tmp_path_factory.mktemp("multihost")
  two = _launch(tmp, TRAIN_ARGS + ["--out", str(tmp / "two")], 2, "two")
  one = _launch(tmp, TRAIN_ARGS + ["--out", str(tmp / "one")], 1, "one")
  codes = _wait(two + one)
  assert codes == [0, 0, 0], _logs(tmp, "two", 2) + _logs(tmp, "one", 1)
  return tmp


# --- fast checks -------------------------------------------------------------------------------------------------

def test_env_config_parsing():
  assert distributed.DistributedConfig.from_env({}) is None
  cfg = distributed.DistributedConfig.from_env({"FP4JAX_COORDINATOR": "h:1", "FP4JAX_NUM_PROCESSES": "4",
                                                "FP4JAX_PROCESS_ID": "3", "FP4JAX_INIT_TIMEOUT": "7"})
  assert (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.init_timeout) == ("h:1", 4, 3, 7)
  with pytest.raises(ValueError, match="FP4JAX_PROCESS_ID missing"):
    distributed.DistributedConfig.from_env({"FP4JAX_COORDINATOR": "h:1", "FP4JAX_NUM_PROCESSES": "2"})
  with pytest.raises(ValueError, match="must be an integer"):
    distributed.DistributedConfig.from_env({"FP4JAX_COORDINATOR": "h:1", "FP4JAX_NUM_PROCESSES": "two",
                                            "FP4JAX_PROCESS_ID": "0"})
  with pytest.raises(ValueError, match="0 <= FP4JAX_PROCESS_ID"):
    distributed.DistributedConfig("h:1", num_processes=2, process_id=2)
  with pytest.raises(ValueError, match="host:port"):
    distributed.DistributedConfig("h", num_processes=2, process_id=0)


@pytest.mark.parametrize("coordinator", ["h:0", "h:65536", "h:99999", "my host:1", "http://h:1", "a:1,b:2"])
def test_malformed_coordinator_is_refused(coordinator):
  # Once accepted: the processes then waited FP4JAX_INIT_TIMEOUT (300 s) for a coordinator none could reach.
  with pytest.raises(ValueError, match="host:port"):
    distributed.DistributedConfig.from_env({"FP4JAX_COORDINATOR": coordinator, "FP4JAX_NUM_PROCESSES": "2",
                                            "FP4JAX_PROCESS_ID": "0"})


def test_env_integers_are_plain_decimals():
  env = {"FP4JAX_COORDINATOR": "[::1]:12377", "FP4JAX_NUM_PROCESSES": " 2 ", "FP4JAX_PROCESS_ID": "1"}
  assert distributed.DistributedConfig.from_env(env).num_processes == 2
  for bad in ("2_0", "2.0", "0x2", "²"):  # int() reads "2_0" as 20
    with pytest.raises(ValueError, match="FP4JAX_NUM_PROCESSES must be an integer"):
      distributed.DistributedConfig.from_env({**env, "FP4JAX_NUM_PROCESSES": bad})
  for bad in ({"num_processes": "2"}, {"num_processes": 2.5}, {"process_id": True}, {"init_timeout": 1.5}):
    with pytest.raises(ValueError, match="must be an int"):
      distributed.DistributedConfig(**{"coordinator": "h:1", "num_processes": 2, "process_id": 0, **bad})


def test_invalid_timeouts_still_join_and_are_reported():
  # A process with an invalid timeout joins with the default, so that the first start check can stop all processes.
  main = {"FP4JAX_COORDINATOR": "h:1", "FP4JAX_NUM_PROCESSES": "2", "FP4JAX_PROCESS_ID": "1"}
  env = {**main, "FP4JAX_INIT_TIMEOUT": "7", "FP4JAX_HEARTBEAT_TIMEOUT": "abc", "FP4JAX_SHUTDOWN_TIMEOUT": "0"}
  config, error = distributed.joinable_from_env(env)
  assert config == distributed.DistributedConfig("h:1", num_processes=2, process_id=1, init_timeout=7)
  assert error == ("FP4JAX_HEARTBEAT_TIMEOUT must be a whole number of seconds >= 1; got 'abc'. "
                   "FP4JAX_SHUTDOWN_TIMEOUT must be a whole number of seconds >= 1; got '0'.")
  assert distributed.joinable_from_env({**main, "FP4JAX_INIT_TIMEOUT": " 7 "}) == (config, None)
  assert distributed.joinable_from_env({"FP4JAX_INIT_TIMEOUT": "abc"}) == (None, None)  # one process: unused
  with pytest.raises(ValueError, match="FP4JAX_PROCESS_ID must be an integer"):  # no id: cannot join at all
    distributed.joinable_from_env({**env, "FP4JAX_PROCESS_ID": "one"})


def test_train_joins_a_start_check_with_its_data_error(monkeypatch, tmp_path):
  # A process that could not read its data (a cache folder or corpus its host lacks) failed alone: the others went
  # on to their next collective and waited there until FP4JAX_SHUTDOWN_TIMEOUT, then all aborted (SIGABRT).
  rows = []
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed, "check_all_started", lambda what, reason: rows.append((what, reason)))
  monkeypatch.setenv("FP4JAX_CACHE", "~fp4jax-no-such-user/data")
  config = config_lib.TrainConfig.from_options(out=str(tmp_path / "x"), model="tiny", seq_len=32, eval_batches=0,
                                               progress=False)
  want = ("FP4JAX_CACHE=~fp4jax-no-such-user/data: no home folder for fp4jax-no-such-user on this machine; give an "
          "existing folder (or unset it for ~/.cache/fp4jax/data).")
  with pytest.raises(ValueError) as info:
    trainer.train(config, log=None)
  assert str(info.value) == want and rows == [("read its data", want)]


def test_init_after_backend_started_is_a_clear_error():
  jax.devices()  # this pytest process already uses its backend
  with pytest.raises(RuntimeError, match="must run before anything uses a JAX backend"):
    distributed.init_distributed(distributed.DistributedConfig("localhost:1", num_processes=2, process_id=0))


def test_init_without_variables_is_a_no_op(monkeypatch):
  for name in ("FP4JAX_COORDINATOR", "FP4JAX_NUM_PROCESSES", "FP4JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.init_distributed() is False
  assert distributed.is_main_process() and distributed.any_process(True) and not distributed.any_process(False)


def _fake_mesh(process_of_device, shape):
  devices = np.empty(len(process_of_device), object)
  devices[:] = [types.SimpleNamespace(process_index=p) for p in process_of_device]
  return types.SimpleNamespace(devices=devices.reshape(shape), axis_names=sharding.AXES,
                               shape=dict(zip(sharding.AXES, shape)))


@pytest.mark.parametrize("procs, shape, want", [
    ([0, 0, 1, 1], (2, 2, 1), [(0, 2), (1, 2)]),  # the tests' mesh: each process holds half the rows
    ([0, 0, 0, 0, 1, 1, 1, 1], (2, 2, 2), [(0, 2), (1, 2)]),  # tensor inside a process
    ([0, 1, 0, 1], (1, 2, 2), [(0, 1), (0, 1)]),  # tensor across processes: both hold all rows
    ([0, 1, 2, 3], (4, 1, 1), [(i, 4) for i in range(4)]),
])
def test_batch_block(procs, shape, want):
  mesh = _fake_mesh(procs, shape)
  assert [sharding.batch_block(mesh, p) for p in range(max(procs) + 1)] == want


def test_batch_block_interleaved_processes_is_a_clear_error():
  with pytest.raises(ValueError, match="not one contiguous block"):
    sharding.batch_block(_fake_mesh([0, 1, 0, 1], (4, 1, 1)), 0)


def test_imports_start_no_backend():
  # init_distributed must come before any backend use: importing the CLI, trainer and experiments must not start
  # one (a module-level jnp constant once did, making every multi-process launch fail).
  code = ("import fp4jax, fp4jax.pretrain.cli, fp4jax.pretrain.trainer, experiments.sweep, experiments.probes\n"
          "import experiments.probes.run, fp4jax.prng, fp4jax.formats, fp4jax.model_quantize, fp4jax.keys\n"
          "import fp4jax.pretrain.runfolder, fp4jax.pretrain.resume, fp4jax.pretrain.distributed\n"
          "fp4jax.quantize_model  # lazy attribute: imports model_quantize's dependencies\n"
          "from fp4jax.pretrain import cli\n"
          "cli.config_from_args(['--mesh', 'data=2,fsdp=2', '--steps', '3', '--out', 'x'])\n"
          "from jax._src import xla_bridge\n"
          "assert not xla_bridge.backends_are_initialized(), 'a backend started'\n")
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-2000:]


def test_run_folder_other_processes_wait_and_leave_the_folder_to_process_0(tmp_path, monkeypatch):
  # Process 1 of 2 (simulated: JAX itself has one process here): it creates and deletes nothing, locks its own
  # run.1.lock, and waits (a collective) before locking and after process 0's deletion.
  waits = []
  monkeypatch.setattr(distributed, "any_process", lambda flag: waits.append(flag) or bool(flag))
  out = tmp_path / "run"
  with pytest.raises(FileNotFoundError):  # process 0 never created it: process 1 did not either
    runfolder.open_run_folder(out, resume=False, overwrite=False, process_index=1, process_count=2)
  assert not out.exists() and waits == [False, True]  # its lock failed: all processes learn it
  (out / "checkpoints" / "8").mkdir(parents=True)
  (out / "metrics.jsonl").write_text("{}\n")
  waits.clear()
  path, lock = runfolder.open_run_folder(out, resume=False, overwrite=True, process_index=1, process_count=2)
  with lock:
    assert lock.path.name == "run.1.lock" and waits == [False, False, False]
    assert (out / "checkpoints" / "8").is_dir() and (out / "metrics.jsonl").exists()  # process 0's job
  waits.clear()
  path, lock = runfolder.open_run_folder(out, resume=False, overwrite=True, process_index=0, process_count=2)
  with lock:
    assert lock.path.name == "run.lock" and waits == [False, False, False]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_run_folder_refusal_on_one_process_makes_all_raise(tmp_path, monkeypatch):
  monkeypatch.setattr(distributed, "any_process", lambda flag: True)  # another process refused
  with pytest.raises(runfolder.PeerFailedError, match="another process failed to open the run folder"):
    runfolder.open_run_folder(tmp_path / "run", resume=False, overwrite=False, process_index=1, process_count=2)


def _run_digests(**options):
  fields = distributed.run_fields(config_lib.TrainConfig.from_options(**{"out": "x", **options}).to_dict())
  return list(fields), distributed.field_digests(fields), fields


def test_the_help_names_the_options_each_process_may_set_on_its_own():
  """`fp4jax train --help` still listed --profile as per-process after it had to agree (a mismatch deadlocked), and
  left out --data.corpus, which may differ."""
  flags = config_lib.field_flags()
  listed = re.search(r"Processes started with different settings \(any but ([^)]*)\)", " ".join(cli.__doc__.split()))
  named = set(re.findall(r"--[\w.-]+", listed.group(1)))
  assert named == {flags[field] for field in distributed.PER_PROCESS_FIELDS}, named


def test_run_config_digests_name_the_options_that_differ():
  names, base, fields = _run_digests()
  again = _run_digests()
  assert again[0] == names and (again[1] == base).all()
  assert (distributed.summary_digests(fields) == distributed.summary_digests(again[2])).all()
  flags = config_lib.field_flags()
  assert set(names) <= set(flags)  # every field a message can name has its option
  cases = [({"lr": 1e-3}, "--lr (optimizer.lr)"), ({"seed": 1}, "--seed (seed)"),
           ({"recipe": "bf16"}, "--recipe (policy.recipe)"), ({"mesh": "data=2"}, "--mesh (mesh)"),
           ({"model.d_model": 128}, "--model.d_model (model.d_model)"), ({"out": "y"}, "--out (out)"),
           ({"checkpoint_every": 7}, "--checkpoint-every (checkpointing.every)"),
           ({"profile": "0:1"}, "--profile (logging.profile)")]  # where the loop waits: see PER_PROCESS_FIELDS
  for changes, want in cases:
    _, other, own = _run_digests(**changes)
    differing = distributed.differing_fields(names, np.stack([base, other]))
    assert len(differing) == 1 and len(differing[1]) == 1, (changes, differing)
    message = distributed.mismatch_message(differing, flags, own, 1, 2)
    assert f"process 1's {want} differs from process 0's" in message, message
    assert "Start every process with the same flags" in message
  _, other, own = _run_digests(lr=1e-3, seed=5)
  message = distributed.mismatch_message(distributed.differing_fields(names, np.stack([base, base, other])), flags,
                                         own, 2, 3)
  assert "process 2's --lr (optimizer.lr) and --seed (seed) differ from process 0's" in message, message
  assert "This process (2 of 3) has optimizer.lr=0.001, seed=5." in message, message
  # What each host may set on its own: its data cache, and what only process 0 uses.
  _, same, _ = _run_digests(**{"data.cache_dir": "/local", "progress": False, "log_every": 5})
  assert (same == base).all()


def _as_process_1_of_2(monkeypatch, theirs):
  """This process is process 1 of 2; the n-th collective returns theirs(n) (process 0's row) and ours. Returns the
  list of the gathered rows' lengths."""
  gathers = []

  def allgather(values):
    gathers.append(len(values))
    return np.stack([theirs(len(gathers)), values])

  monkeypatch.setattr(distributed, "_allgather", allgather)
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed.jax, "process_index", lambda: 1)
  return gathers


def _fake_peer(monkeypatch, peer_config, peer_versions=None):
  """Process 0 ran `peer_config` (and `peer_versions`): the summary first, then the per-field digests."""
  peer = distributed.run_fields(peer_config.to_dict())
  versions = distributed._versions() if peer_versions is None else peer_versions  # pylint: disable=protected-access
  return _as_process_1_of_2(monkeypatch, lambda n: (distributed.summary_digests(peer, versions) if n == 1
                                                    else distributed.field_digests(peer)))


def test_check_same_run_raises_naming_the_options(monkeypatch):
  config = config_lib.TrainConfig.from_options(out="x", lr=1e-3)
  gathers = _fake_peer(monkeypatch, config.replace(progress=False))
  distributed.check_same_run(config.replace(progress=True).to_dict(), config_lib.field_flags())
  assert gathers == [4]  # agreeing processes pay one small collective
  gathers = _fake_peer(monkeypatch, config.replace(lr=3e-3))
  with pytest.raises(distributed.ConfigMismatchError, match=r"process 1's --lr \(optimizer.lr\) differs from "
                     r"process 0's\. Start every process with the same flags .* This process \(1 of 2\) has "
                     r"optimizer.lr=0.001\."):
    distributed.check_same_run(config.to_dict(), config_lib.field_flags())
  assert gathers == [4, len(distributed.run_fields(config.to_dict()))]
  # Another --profile: a process that waits for its step in flight where its trace starts meets the stop check's
  # collective before the others' next step does: both hung for good (found with two CPU processes).
  _fake_peer(monkeypatch, config.replace(profile="1:2"))
  with pytest.raises(distributed.ConfigMismatchError, match=r"--profile \(logging.profile\) differs"):
    distributed.check_same_run(config.to_dict(), config_lib.field_flags())
  _fake_peer(monkeypatch, config, peer_versions=["fp4jax 0.0.1", "jax 0.4"])
  with pytest.raises(distributed.ConfigMismatchError,
                     match="process 1 of this multi-process run runs a different fp4jax or jax version"):
    distributed.check_same_run(config.to_dict(), config_lib.field_flags())


def _identity(**changes):
  return {"corpus": "/data/corpus.txt", "fingerprint": "f3ffcae8" * 8, "tokenizer": "byte", "vocab_size": 256,
          "num_files": 1, "num_bytes": 20000, "cache_key": "k", "tokenizer_digest": "", **changes}


def _fake_data_peer(monkeypatch, peer_identity):
  """Process 0 read `peer_identity`."""
  theirs = distributed.field_digests({n: peer_identity.get(n) for n in distributed.DATA_FIELDS})
  return _as_process_1_of_2(monkeypatch, lambda n: theirs)


def test_check_same_data_refuses_processes_that_read_other_data(monkeypatch):
  # Before it, two hosts whose corpus.txt differed trained on two corpora (each its own rows of every batch) and
  # both exited 0; only a later --resume noticed.
  gathers = _fake_data_peer(monkeypatch, _identity(corpus="/mnt/other/corpus.txt", cache_key="elsewhere"))
  distributed.check_same_data(_identity())  # the same bytes at another path, cached elsewhere: the same data
  assert gathers == [len(distributed.DATA_FIELDS)]
  _fake_data_peer(monkeypatch, _identity(fingerprint="9512266e" * 8, num_bytes=20001))
  with pytest.raises(distributed.ConfigMismatchError) as info:
    distributed.check_same_data(_identity())
  assert str(info.value) == (
      "the processes of this multi-process run read different data: process 1's fingerprint and num_bytes differ "
      "from process 0's. Every process reads its own copy of --data.corpus and trains on its own rows of each batch: "
      "give every host the same corpus files. This process (1 of 2) read /data/corpus.txt (fingerprint "
      "f3ffcae8f3ffcae8, 20000 bytes in 1 files, byte tokenizer, vocabulary 256).")
  for field, value in [("tokenizer", "bpe"), ("vocab_size", 512), ("tokenizer_digest", "d"), ("num_files", 2)]:
    _fake_data_peer(monkeypatch, _identity(**{field: value}))
    with pytest.raises(distributed.ConfigMismatchError, match=f"process 1's {field} differs from process 0's"):
      distributed.check_same_data(_identity())
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 1)
  monkeypatch.setattr(distributed, "_allgather", lambda values: pytest.fail("a collective in a single-process run"))
  distributed.check_same_data(_identity())


def test_each_host_may_keep_the_corpus_at_its_own_path():
  # Compared by content once read (check_same_data), not by the path typed.
  _, base, _ = _run_digests()
  _, other, _ = _run_digests(**{"data.corpus": "/mnt/host1/corpus.txt"})
  assert (other == base).all()


class _Compared(Exception):
  pass


def test_train_and_eval_compare_the_data_each_process_read(monkeypatch, tmp_path):
  compared = []

  def check(identity):
    compared.append(identity)
    raise _Compared

  monkeypatch.setattr(distributed, "check_same_data", check)
  config = config_lib.TrainConfig.from_options(out=str(tmp_path / "x"), model="tiny", seq_len=32, eval_batches=0,
                                               progress=False, **{"model.n_layers": 1})
  with pytest.raises(_Compared):
    trainer.train(config, log=None)
  assert len(compared) == 1 and compared[0]["fingerprint"] and compared[0]["num_bytes"] > 10**6, compared
  monkeypatch.setattr(trainer, "eval_setup", lambda *args, **kwargs: types.SimpleNamespace(
      dataset=types.SimpleNamespace(identity=data_lib.DataIdentity(**_identity()))))
  with pytest.raises(_Compared):
    cli._run_eval(["--out", "nowhere"])  # pylint: disable=protected-access
  assert compared[1] == _identity()


def test_check_same_run_costs_a_single_process_nothing(monkeypatch):
  monkeypatch.setattr(distributed, "_allgather", lambda values: pytest.fail("a collective in a single-process run"))
  distributed.check_same_run({"seed": 0}, {})


def test_start_rows_carry_each_failing_process_and_its_error():
  rows = np.stack([distributed.start_row(None), distributed.start_row("bad --lr 'é'"),
                   distributed.start_row("x" * 5000)])
  assert distributed.failed_processes(rows) == {1: "bad --lr 'é'", 2: "x" * distributed.REASON_BYTES}
  assert distributed.failed_processes(np.stack([distributed.start_row(None)] * 2)) == {}
  assert distributed.failed_processes(np.stack([distributed.start_row("")] * 2)) == {0: "", 1: ""}  # flag, not text


def _fake_start_peers(monkeypatch, peer_reason):
  """This process is process 0 of 2; process 1's row says `peer_reason`."""
  monkeypatch.setattr(distributed, "_allgather",
                      lambda row: np.stack([row, distributed.start_row(peer_reason)]))
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)


def test_check_all_started_names_the_process_that_failed_and_why(monkeypatch):
  _fake_start_peers(monkeypatch, "fp4jax train: error: argument --lr: invalid float value: 'abc'")
  with pytest.raises(distributed.PeerStartError, match=r"^process 1 of this multi-process run could not parse its "
                     r"command line, so this process \(0 of 2\) stops too: process 1: fp4jax train: error: argument "
                     r"--lr: invalid float value: 'abc'\. Fix it"):
    distributed.check_all_started("parse its command line", None)
  distributed.check_all_started("parse its command line", "its own error")  # returns: it raises its own
  _fake_start_peers(monkeypatch, None)
  distributed.check_all_started("parse its command line", None)


def test_check_all_started_costs_a_single_process_nothing(monkeypatch):
  monkeypatch.setattr(distributed, "_allgather", lambda values: pytest.fail("a collective in a single-process run"))
  distributed.check_all_started("parse its command line", "bad")


def test_cli_joins_the_start_check_with_its_own_error(monkeypatch):
  # What each process of a multi-process `fp4jax train` does: the failing one joins the check, then exits with
  # argparse's code and message; the one that parsed learns of it.
  rows = []
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed, "check_all_started", lambda what, reason: rows.append((what, reason)))
  with pytest.raises(SystemExit) as info:
    cli._run_train(["--out", "x", "--lr", "abc"])  # pylint: disable=protected-access
  assert info.value.code == 2
  assert rows == [("parse its command line", "fp4jax train: error: argument --lr: invalid float value: 'abc'")]
  rows.clear()
  with pytest.raises(ValueError, match="--keep-schedule only applies with --resume"):
    cli._run_train(["--out", "x", "--keep-schedule"])  # pylint: disable=protected-access
  assert rows == [("parse its command line", "--keep-schedule only applies with --resume (it keeps the stored "
                   "run's schedule shape).")]


def _assert_stopped_by_process_1(tmp, log_name, what, reason, logs):
  """Process 1 of launch `log_name` failed at stage `what` with `reason`: process 0 names it, neither shows a
  traceback, and process 1 only shows its own error."""
  first, second = [(tmp / f"{log_name}.{pid}.log").read_text() for pid in (0, 1)]
  want = (f"fp4jax: error: process 1 of this multi-process run could not {what}, so this process (0 of 2) "
          f"stops too: process 1: {reason}. Fix it and start every process again with the same flags.")
  assert want in first and reason in second, logs
  assert "Traceback" not in first + second and "stops too" not in second, logs


@pytest.mark.slow
def test_a_process_that_cannot_start_stops_all_promptly(tmp_path):
  """An invalid flag on one process only: it exited 2 alone (after argparse's message), and the other waited in its
  first collective until FP4JAX_SHUTDOWN_TIMEOUT (300 s by default), then JAX aborted both (SIGABRT). Now both exit
  2 within seconds, naming the process and its error; also when a --resume-step names a checkpoint one host lacks
  (the other reads its stored config through orbax, whose reads waited for every process)."""
  stored = tmp_path / "stored"
  manager = ckpt.open_manager(stored)
  ckpt.save(manager, 4, {"w": np.zeros(3, np.float32)},
            {"config": config_lib.TrainConfig(out=str(stored), steps=4).to_dict()}, force=True)
  manager.wait_until_finished()
  manager.close()
  slow_exit = {"FP4JAX_SHUTDOWN_TIMEOUT": "300"}  # the default: what a process left waiting waits for
  t0 = time.monotonic()
  parse = _launch(tmp_path, TRAIN_ARGS + ["--out", str(tmp_path / "x")], 2, "parse",
                  process_args=[[], ["--lr", "abc"]], **slow_exit)
  build = _launch(tmp_path, ["train", "--out", str(stored), "--resume", "--progress", "false"], 2, "build",
                  process_args=[[], ["--resume-step", "8"]], **slow_exit)
  # Well under the 300 s a process left waiting would wait; generous for cold starts of 4-6 processes on 2 cores.
  codes = _wait(parse + build, timeout=PROMPT_S)
  elapsed = time.monotonic() - t0
  logs = _logs(tmp_path, "parse", 2) + _logs(tmp_path, "build", 2)
  assert codes == [2, 2, 2, 2], logs
  assert elapsed < PROMPT_S, logs
  reason = {"parse": "fp4jax train: error: argument --lr: invalid float value: 'abc'",
            "build": f"No checkpoint for step 8 in {stored / 'checkpoints'}; available: [4]"}
  what = {"parse": "parse its command line", "build": "build its run config"}
  for name in ("parse", "build"):
    _assert_stopped_by_process_1(tmp_path, name, what[name], reason[name], logs)
  assert not (tmp_path / "x").exists() and sorted(p.name for p in (stored / "checkpoints").iterdir()) == ["4"]


@pytest.mark.slow
def test_a_process_with_an_invalid_variable_stops_all_promptly(tmp_path):
  """An invalid FP4JAX_* timeout on one process only: it exited 2 before joining, and the other waited
  FP4JAX_INIT_TIMEOUT (300 s by default) for it, then JAX aborted it (SIGABRT). Now the bad one joins with the
  default and every process exits 2 within seconds, naming the process and its error."""
  slow = {"FP4JAX_INIT_TIMEOUT": "300", "FP4JAX_SHUTDOWN_TIMEOUT": "300"}  # the defaults: what the other waited
  procs = _launch(tmp_path, TRAIN_ARGS + ["--out", str(tmp_path / "x")], 2, "timeout",
                  process_env=[{}, {"FP4JAX_SHUTDOWN_TIMEOUT": "abc"}], **slow)
  codes = _wait(procs, timeout=PROMPT_S)
  logs = _logs(tmp_path, "timeout", 2)
  assert codes == [2, 2], logs
  _assert_stopped_by_process_1(tmp_path, "timeout", "read its FP4JAX_* environment variables",
                               "FP4JAX_SHUTDOWN_TIMEOUT must be a whole number of seconds >= 1; got 'abc'", logs)
  assert not (tmp_path / "x").exists()


def test_cli_joins_a_start_check_with_its_environment_error(monkeypatch):
  # A compile cache folder of no user made one process die with a RuntimeError traceback after joining; the others
  # waited in their first start check until FP4JAX_SHUTDOWN_TIMEOUT, then all aborted (SIGABRT).
  rows = []
  for name in ("FP4JAX_COORDINATOR", "FP4JAX_NUM_PROCESSES", "FP4JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed, "check_all_started", lambda what, reason: rows.append((what, reason)))
  monkeypatch.setenv("FP4JAX_COMPILE_CACHE", "~fp4jax-no-such-user/xla")
  before = jax.config.jax_compilation_cache_dir  # JAX's own setting would win over FP4JAX_COMPILE_CACHE
  jax.config.update("jax_compilation_cache_dir", None)
  try:
    assert cli.main(["train", "--out", "x"]) == 2
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  assert rows == [("read its FP4JAX_* environment variables", "FP4JAX_COMPILE_CACHE=~fp4jax-no-such-user/xla: no "
                   "home folder for fp4jax-no-such-user on this machine; give an existing folder (or "
                   "FP4JAX_COMPILE_CACHE=off).")]


def test_cli_eval_joins_the_start_checks_with_its_own_error(monkeypatch, tmp_path):
  # `fp4jax eval` once joined no start check: a bad flag on one process left the others in orbax's restore barrier.
  rows = []
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed, "check_all_started", lambda what, reason: rows.append((what, reason)))
  with pytest.raises(SystemExit) as info:
    cli._run_eval(["--out", "x", "--eval-batches", "abc"])  # pylint: disable=protected-access
  assert info.value.code == 2
  assert rows == [("parse its command line",
                   "fp4jax eval: error: argument --eval-batches/--eval_batches: invalid int value: 'abc'")]
  rows.clear()
  with pytest.raises(ckpt.CheckpointError, match="No checkpoints found"):
    cli._run_eval(["--out", str(tmp_path / "none")])  # pylint: disable=protected-access
  assert rows == [("parse its command line", None),
                  ("read its checkpoint and data", f"No checkpoints found: {tmp_path / 'none' / 'checkpoints'} does "
                   "not exist.")]


def test_cli_eval_compares_its_settings_across_processes(monkeypatch):
  compared = []
  monkeypatch.setattr(distributed, "check_same_run", lambda settings, flags: compared.append((settings, flags)))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  with pytest.raises(ckpt.CheckpointError):
    args = ["--out", "nowhere", "--step", "4", "--corpus", "c.txt", "--recipe", "bf16"]
    cli._run_eval(args)  # pylint: disable=protected-access
  assert compared == [({"out": "nowhere", "step": 4, "eval_batches": None, "corpus": "c.txt", "recipe": "bf16"},
                       {"out": "--out", "step": "--step", "eval_batches": "--eval-batches", "corpus": "--corpus",
                        "recipe": "--recipe"})]


@pytest.mark.slow
def test_eval_a_process_that_cannot_start_stops_all_promptly(tmp_path):
  """`fp4jax eval` on 2 processes: a bad flag on process 1 only left process 0 in orbax's restore barrier until
  FP4JAX_SHUTDOWN_TIMEOUT (300 s by default). Now every process exits 2 within seconds, naming the process and its
  error: also when the processes were given different settings, or one host lacks the corpus."""
  stored = tmp_path / "stored"
  manager = ckpt.open_manager(stored)
  config = config_lib.TrainConfig.from_options(out=str(stored), steps=4, seq_len=32)
  ckpt.save(manager, 4, {"w": np.zeros(3, np.float32)}, {"config": config.to_dict()}, force=True)
  manager.wait_until_finished()
  manager.close()
  homes = [tmp_path / "home0", tmp_path / "home1"]  # one host has the corpus at ~/corpus.txt, the other does not
  for home in homes:
    home.mkdir()
  (homes[0] / "corpus.txt").write_text("To be, or not to be, that is the question. " * 100)
  slow_exit = {"FP4JAX_SHUTDOWN_TIMEOUT": "300"}
  args = ["eval", "--out", str(stored)]
  t0 = time.monotonic()
  procs = (_launch(tmp_path, args, 2, "parse", process_args=[[], ["--eval-batches", "abc"]], **slow_exit)
           + _launch(tmp_path, args, 2, "differ", process_args=[[], ["--step", "8"]], **slow_exit)
           + _launch(tmp_path, args + ["--corpus", "~/corpus.txt"], 2, "data",
                     process_env=[{"HOME": str(home)} for home in homes], **slow_exit))
  codes = _wait(procs, timeout=PROMPT_S)
  logs = "".join(_logs(tmp_path, name, 2) for name in ("parse", "differ", "data"))
  assert codes == [2] * 6, logs
  assert time.monotonic() - t0 < PROMPT_S, logs
  reason = {"parse": "fp4jax eval: error: argument --eval-batches/--eval_batches: invalid int value: 'abc'",
            "data": f"Corpus path does not exist: {homes[1] / 'corpus.txt'}"}
  what = {"parse": "parse its command line", "data": "read its checkpoint and data"}
  for name in ("parse", "data"):
    _assert_stopped_by_process_1(tmp_path, name, what[name], reason[name], logs)
  for pid, value in enumerate(["null", "8"]):
    log = (tmp_path / f"differ.{pid}.log").read_text()
    want = ("fp4jax: error: the processes of this multi-process run were started with different settings: process "
            "1's --step (step) differs from process 0's. Start every process with the same flags (only the FP4JAX_* "
            f"variables differ between them). This process ({pid} of 2) has step={value}.")
    assert want in log and "Traceback" not in log, logs


@pytest.mark.slow
def test_processes_started_with_different_flags_all_exit_naming_them(tmp_path):
  # Before the check, another --lr trained apart silently (exit 0), another --recipe hung in mismatched collectives
  # (only kill -9 stopped it) and another --seed failed in jax.device_put with a bare AssertionError. Now every
  # process stops before the run folder exists, and names both options.
  out = tmp_path / "x"
  procs = _launch(tmp_path, TRAIN_ARGS + ["--out", str(out)], 2, "differ",
                  process_args=[[], ["--lr", "1e-3", "--seed", "1"]])
  codes = _wait(procs, timeout=120)
  logs = _logs(tmp_path, "differ", 2)
  assert codes == [2, 2], logs
  for pid, values in enumerate(["optimizer.lr=0.003, seed=0", "optimizer.lr=0.001, seed=1"]):
    log = (tmp_path / f"differ.{pid}.log").read_text()
    want = ("fp4jax: error: the processes of this multi-process run were started with different settings: process "
            "1's --lr (optimizer.lr) and --seed (seed) differ from process 0's. Start every process with the same "
            f"flags (only the FP4JAX_* variables differ between them). This process ({pid} of 2) has {values}.")
    assert want in log and "Traceback" not in log, logs
  assert not out.exists()


@pytest.mark.slow
def test_missing_peer_fails_initialization_in_bounded_time(tmp_path):
  # Process 1 never starts: after FP4JAX_INIT_TIMEOUT, JAX aborts process 0 from C++ (SIGABRT, DEADLINE_EXCEEDED);
  # there is no Python exception to turn into a nicer exit, so the line printed before waiting says what it was.
  port = _free_port()
  env = _env(tmp_path, 2, FP4JAX_COORDINATOR=f"localhost:{port}", FP4JAX_NUM_PROCESSES="2", FP4JAX_PROCESS_ID="0",
             FP4JAX_INIT_TIMEOUT="3")
  t0 = time.monotonic()
  result = subprocess.run([sys.executable, "-m", "fp4jax", *TRAIN_ARGS, "--out", str(tmp_path / "x")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode != 0
  assert f"process 0 of 2 joining the run at localhost:{port} (waiting up to 3s" in result.stderr
  assert "check that each FP4JAX_PROCESS_ID from 0 to 1 was started exactly once" in result.stderr
  assert "DEADLINE_EXCEEDED" in result.stderr, result.stderr[-3000:]
  assert time.monotonic() - t0 < 100
  assert not (tmp_path / "x").exists()


# --- real processes ----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.xdist_group(RUNS_GROUP)
def test_two_processes_match_one_process(runs):
  two, one = _losses(runs / "two"), _losses(runs / "one")
  _assert_losses_match(two, one, 0)
  lines = (runs / "two" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == list(range(STEPS))  # one writer, one line per step
  assert not (runs / "two" / "config.json").exists()  # each checkpoint holds the config
  assert resume.resume_meta(runs / "two")[1]["config"]["mesh"] == "data=2,fsdp=2"
  assert sorted(p.name for p in (runs / "two").glob("run*.lock")) == ["run.1.lock", "run.lock"]
  assert sorted(int(p.name) for p in (runs / "two" / "checkpoints").iterdir()) == [8, 16]
  assert "Done: step 16" in (runs / "two.0.log").read_text()
  assert "Done: step" not in (runs / "two.1.log").read_text()  # only process 0 logs


@pytest.mark.slow
@pytest.mark.xdist_group(RUNS_GROUP)
def test_resume_one_process_checkpoint_on_two_processes(runs):
  out = runs / "one_to_two"
  _copy_checkpoint(runs / "one", out, 8)
  _run(runs, TRAIN_ARGS + ["--out", str(out), "--resume"], 2, "one_to_two")
  _assert_losses_match(_losses(out), _losses(runs / "one"), 8)


@pytest.mark.slow
@pytest.mark.xdist_group(RUNS_GROUP)
def test_eval_on_two_processes_matches_one_process(runs):
  # Every process evaluates (each on its own devices); process 0 alone prints the result.
  args = ["eval", "--out", str(runs / "two"), "--eval-batches", "2", "--json"]
  codes = _wait(_launch(runs, args, 2, "eval_two") + _launch(runs, args, 1, "eval_one"))
  assert codes == [0, 0, 0], _logs(runs, "eval_two", 2) + _logs(runs, "eval_one", 1)

  def result(name):
    lines = [line for line in (runs / name).read_text().splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]

  (two,), (one,) = result("eval_two.0.log"), result("eval_one.0.log")
  assert result("eval_two.1.log") == []
  assert two["step"] == one["step"] == STEPS and two["eval_batches"] == 2
  np.testing.assert_allclose(two["val_loss"], one["val_loss"], rtol=1e-5)


def _launch_and_wait_for_first_step(tmp, out, log_name, **extra):
  procs = _launch(tmp, TRAIN_ARGS + ["--out", str(out)], 2, log_name, **extra)
  deadline = time.monotonic() + TIMEOUT
  metrics = out / "metrics.jsonl"
  while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      pytest.fail("the run did not start: " + _logs(tmp, log_name, 2))
    time.sleep(0.1)
  return procs


@pytest.mark.slow
@pytest.mark.xdist_group(RUNS_GROUP)
def test_sigint_to_one_process_stops_all_with_a_checkpoint_then_resume_on_one_process(runs):
  out = runs / "sigint"
  procs = _launch_and_wait_for_first_step(runs, out, "sigint")
  procs[1].send_signal(signal.SIGINT)  # not the process that writes metrics
  assert _wait(procs) == [130, 130], _logs(runs, "sigint", 2)
  saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir())
  assert len(saved) == 1 and 1 <= saved[0] < STEPS, saved
  stopped = saved[0]
  # The processes agree every 4 steps (a collective waits for the step in flight): after step s = 0, 4, 8, ..., or
  # after s + 1 when that step was already sent.
  assert (stopped - 1) % trainer._STOP_CHECK_EVERY in (0, 1), stopped  # pylint: disable=protected-access
  assert sorted(_losses(out)) == list(range(stopped))  # every finished step logged, once
  assert f"Interrupted after step {stopped}: checkpoint saved" in (runs / "sigint.0.log").read_text()
  # The checkpoint the two processes wrote together restores onto one process with 4 devices.
  resumed = runs / "sigint_resumed"
  _copy_checkpoint(out, resumed, stopped)
  _run(runs, TRAIN_ARGS + ["--out", str(resumed), "--resume"], 1, "sigint_resumed")
  _assert_losses_match(_losses(resumed), _losses(runs / "two"), stopped)


@pytest.mark.slow
@pytest.mark.xdist_group(RUNS_GROUP)
def test_a_dead_process_makes_the_other_exit_with_an_error(runs):
  procs = _launch_and_wait_for_first_step(runs, runs / "dead", "dead", FP4JAX_HEARTBEAT_TIMEOUT="10")
  procs[1].kill()
  t0 = time.monotonic()
  code = _wait(procs[:1], timeout=90)[0]
  procs[1].wait(timeout=10)
  log = (runs / "dead.0.log").read_text()
  # Exit 3 with our message when a collective fails (gloo sees the closed socket); otherwise the coordination
  # service's heartbeat timeout (10 s here) aborts the process (SIGABRT: -6) naming the dead task, as "heartbeat
  # timeout" or as "unhealthy (stopped sending heartbeats)": which check notices first varies (jax 0.10.2 and 0.11.2).
  assert code in (3, -6), log[-3000:]
  said = ("another process probably died", "heartbeat timeout", "stopped sending heartbeats")
  assert any(text in log for text in said), log[-3000:]
  assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_two_processes_record_the_statistics_of_the_whole_validation_batch(tmp_path):
  """Each process holds its own rows of the validation batch; the statistics took them unsharded, as if they were
  the whole batch, so process 0 logged the statistics of its half (x_err off by 1e-4 from the 1-process run)."""
  args = [*TRAIN_ARGS[:TRAIN_ARGS.index("--steps")], "--steps", "1", "--model.n_layers", "1", "--seq-len", "32",
          "--eval-batches", "1", "--stats-every", "1", "--checkpoint-every", "8", "--progress", "false"]
  two = _launch(tmp_path, args + ["--out", str(tmp_path / "two")], 2, "stats_two")
  one = _launch(tmp_path, args + ["--out", str(tmp_path / "one")], 1, "stats_one")
  assert _wait(two + one) == [0, 0, 0], _logs(tmp_path, "stats_two", 2) + _logs(tmp_path, "stats_one", 1)

  def quant(name):
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["quant"] for r in records if "quant" in r]

  got, want = quant("two"), quant("one")
  assert len(got) == len(want) == 2 and got[0].keys() == want[0].keys()
  for g, w in zip(got, want):
    for layer in w:
      for stat in w[layer]:
        np.testing.assert_allclose(g[layer][stat], w[layer][stat], rtol=1e-6, atol=1e-7, err_msg=f"{layer} {stat}")


def test_train_compares_the_hooks_that_read_the_state_across_processes(monkeypatch):
  """A Hook with reads_state=True on one process only makes its loop wait for the step in flight where the others
  send the next step first: their collectives then meet out of order and every process hangs (as with --profile)."""
  compared = []

  def check(settings, flags):
    compared.append((settings, flags))
    raise distributed.ConfigMismatchError("stop here")

  monkeypatch.setattr(distributed, "check_same_run", check)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  hooks = iter([trainer.Hook(lambda info: None, every=5), trainer.Hook(lambda info: None, every=2, reads_state=False),
                lambda step, record: None, trainer.Hook(lambda info: None),
                trainer.Hook(lambda info: None, every=0)])  # the final call only: after the loop, no wait in it
  with pytest.raises(distributed.ConfigMismatchError, match="stop here"):
    trainer.train(config_lib.TrainConfig.from_options(out="x"), hooks)
  [(settings, flags)] = compared
  assert settings["hooks"] == {"reading_state": [1, 5]} and "reads_state=True" in flags[trainer.HOOKS_READING_STATE]
  assert distributed.run_fields(settings)[trainer.HOOKS_READING_STATE] == [1, 5]
