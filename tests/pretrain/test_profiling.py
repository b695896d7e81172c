"""`--profile START:STOP`: the window's checks, and a trace of exactly those steps in the run folder."""

import gzip
import json

import jax
import pytest

from fp4jax.pretrain import cli
from fp4jax.pretrain import profiling
from fp4jax.pretrain import trainer
from fp4jax.pretrain.config import TrainConfig
from train_helpers import tiny_config, run


@pytest.mark.parametrize("spec", ["5", "3:3", "4:2", "a:b", "-1:2", "1:2:3", ""])
def test_malformed_windows_are_rejected(spec):
  with pytest.raises(ValueError, match="START:STOP"):
    TrainConfig.from_options(profile=spec)


def test_window_parses_and_must_end_within_the_run():
  assert profiling.parse_window(" 5 : 8 ") == (5, 8)
  assert TrainConfig.from_options(profile="5:8", steps=8).logging.profile_window == (5, 8)
  assert TrainConfig().logging.profile_window is None
  with pytest.raises(ValueError, match="ends after this 7-step run"):
    TrainConfig.from_options(profile="5:8", steps=7)
  assert cli.config_from_args(["--out", "x", "--profile", "2:4"]).logging.profile == "2:4"


def _traced_step_runs(folder) -> int:
  """How many times the compiled train step ran inside the trace(s) under `folder`."""
  [trace] = folder.glob("plugins/profile/*/*.trace.json.gz")
  assert list(folder.glob("plugins/profile/*/*.xplane.pb"))  # what TensorBoard reads
  events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
  calls = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "PjitFunction(step)")
  outer_end, count = -1.0, 0
  for start, end in calls:  # the profiler nests two events per call
    if start >= outer_end:
      count, outer_end = count + 1, end
  return count


TRACE_GROUP = "profiling_runs"  # the two traced runs share the module's compile cache: one xdist unit


@pytest.mark.slow
@pytest.mark.xdist_group(TRACE_GROUP)
def test_trace_holds_the_window_steps_only(env, tmp_path):
  logged = []
  config = tiny_config(env, tmp_path / "run", recipe="bf16", batch_size=4, steps=4, profile="1:3")
  trainer.train(config, log=logged.append, compile_cache=env["cache"])
  folder = tmp_path / "run" / profiling.PROFILE_DIR
  assert _traced_step_runs(folder) == 2
  assert any("Profile of steps 1..2" in line for line in logged)
  # A resume past the window traced nothing without a word.
  logged = []
  trainer.train(config.replace(steps=5, resume=True), log=logged.append, compile_cache=env["cache"])
  assert any("--profile 1:3 lies before this run's first step 4: nothing is traced" in line for line in logged)
  assert len(list(folder.glob("plugins/profile/*/*.trace.json.gz"))) == 1


def test_a_run_starting_inside_or_after_the_window_says_what_it_traces(tmp_path):
  profiler = profiling.StepProfiler((2, 5), tmp_path)
  assert profiler.start_note(0) is None and profiler.start_note(2) is None
  assert profiler.start_note(3) == ("Note: --profile 2:5 starts before this run's first step 3: steps 3..4 are "
                                    "traced.")
  assert "nothing is traced" in profiler.start_note(5)
  assert profiling.StepProfiler(None, tmp_path).start_note(7) is None


@pytest.mark.slow
@pytest.mark.xdist_group(TRACE_GROUP)
def test_an_exception_inside_the_window_stops_the_trace(env, tmp_path):
  def fail(info):
    if info.step == 1:
      raise RuntimeError("hook failed")

  config = tiny_config(env, tmp_path / "run", recipe="bf16", batch_size=4, steps=4, profile="1:4")
  with pytest.raises(RuntimeError, match="hook failed"):
    run(env, config, [trainer.Hook(fail)])
  jax.profiler.start_trace(str(tmp_path / "again"))  # fails if the run left its trace running
  jax.profiler.stop_trace()


def test_each_process_of_a_multi_process_run_traces_into_its_own_folder(monkeypatch, tmp_path):
  assert profiling.trace_dir(tmp_path) == tmp_path / "profile"
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert profiling.trace_dir(tmp_path) == tmp_path / "profile" / "process_1"


def test_the_loop_waits_for_the_step_before_where_the_trace_starts_or_stops(tmp_path):
  profiler = profiling.StepProfiler((2, 4), tmp_path)
  assert [profiler.starts_or_stops_before(s) for s in range(6)] == [False, False, True, True, False, False]
  profiler.active = True  # as after before(2): within the window the steps overlap, at its end they do not
  assert [profiler.starts_or_stops_before(s) for s in range(2, 6)] == [False, False, True, True]
  assert not profiling.StepProfiler(None, tmp_path).starts_or_stops_before(0)


def test_the_trace_starts_before_the_windows_first_step_and_stops_after_its_last(monkeypatch, tmp_path):
  """Window 2:4 around steps 0..5: start_trace just before step 2, stop_trace just after step 3, steps 2 and 3
  traced (the profiler itself is replaced by a recorder)."""
  calls = []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda folder: calls.append("start"))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))
  logged = []
  with profiling.StepProfiler((2, 4), tmp_path, log=logged.append) as profiler:
    for step in range(6):
      profiler.before(step)
      calls.append(step)
      profiler.after(step)
  assert calls == [0, 1, "start", 2, 3, "stop", 4, 5]
  assert profiler.traced == [2, 3] and not profiler.active
  assert logged and logged[0].startswith("Profile of steps 2..3 in ")
