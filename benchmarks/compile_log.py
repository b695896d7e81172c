"""Where a run's XLA compile time goes: one record per compile, then totals by test module, function and test.

    FP4JAX_COMPILE_LOG=/tmp/clog python -m pytest -q -n 2     # tests/conftest.py records in every test process
    python benchmarks/compile_log.py /tmp/clog [--top 25]

Most of the test suite's time is XLA compiling graphs that no other test compiles (benchmarks/RESULTS.md, "The
test suite's time, compile by compile"); this is the measurement behind that. `start(folder)` registers
jax.monitoring listeners that append one JSON line per compile request to `<folder>/<pid>.jsonl`:
- `seconds`: the duration JAX reports for the backend compile, or for the cache read on a hit.
- `function`: the jitted function's name.
- `cache_hit`: whether the persistent compilation cache served it.
- `saved_seconds`: on a hit, the compile time the cache spared at least (JAX's compile_time_saved_sec: the
  writer's compile time, which JAX stores in whole seconds, less this read's; never below 0); 0 on a miss.
- `test`: the pytest test running then, or "" outside pytest.

Subprocesses that tests launch (`python -m fp4jax`, README blocks) do not load tests/conftest.py and are not
recorded. Public jax.monitoring API only, so it works on jax 0.10 and 0.11.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"
ENV = "FP4JAX_COMPILE_LOG"

_state = threading.local()  # the cache-hit and time-saved events come before their compile's, on the same thread
_listeners: dict[str, object] = {}


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event == CACHE_HIT_EVENT:
    _state.hit = True


def start(folder) -> pathlib.Path:
  """Records every compile of this process into `<folder>/<pid>.jsonl` until stop(); returns that file."""
  if _listeners:
    raise RuntimeError("compile_log.start was already called in this process; call stop() first.")
  path = pathlib.Path(folder)
  path.mkdir(parents=True, exist_ok=True)
  out = path / f"{os.getpid()}.jsonl"

  def on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == SAVED_EVENT:
      _state.saved = max(0.0, float(seconds))
    if event != COMPILE_EVENT:
      return
    hit, _state.hit = getattr(_state, "hit", False), False
    saved, _state.saved = getattr(_state, "saved", 0.0), 0.0
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    record = {"seconds": float(seconds), "function": str(kwargs.get("fun_name", "?")), "cache_hit": hit,
              "saved_seconds": saved if hit else 0.0, "test": test}
    with open(out, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")

  jax.monitoring.register_event_listener(_on_event)
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  _listeners.update(event=_on_event, duration=on_duration)
  return out


def stop() -> None:
  """Unregisters the listeners start() registered (nothing if it was not called)."""
  if "event" in _listeners:
    jax.monitoring.unregister_event_listener(_listeners.pop("event"))
  if "duration" in _listeners:
    jax.monitoring.unregister_event_duration_listener(_listeners.pop("duration"))


def read(folder) -> list[dict]:
  """Every record of every process in `folder`."""
  records = []
  for path in sorted(pathlib.Path(folder).glob("*.jsonl")):
    records.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
  return records


def summarize(records: list[dict], top: int = 25) -> dict:
  """Compiles (cache misses) and their seconds in all, by test module, by function and by test; cache hits apart,
  with the compile seconds they spared (records written before `saved_seconds` existed count 0)."""
  misses = [r for r in records if not r["cache_hit"]]
  hits = [r for r in records if r["cache_hit"]]

  def by(key):
    seconds, counts = collections.Counter(), collections.Counter()
    for r in misses:
      seconds[key(r)] += r["seconds"]
      counts[key(r)] += 1
    return [(name, s, counts[name]) for name, s in seconds.most_common(top)]

  return {"compiles": len(misses), "seconds": sum(r["seconds"] for r in misses),
          "cache_hits": len(hits), "hit_seconds": sum(r["seconds"] for r in hits),
          "saved_seconds": sum(r.get("saved_seconds", 0.0) for r in hits),
          "by_module": by(lambda r: r["test"].split("::")[0] or "(outside a test)"),
          "by_function": by(lambda r: r["function"]),
          "by_test": by(lambda r: r["test"] or "(outside a test)")}


def format_summary(summary: dict) -> str:
  """The summary as Markdown tables."""
  lines = [f"{summary['compiles']} compiles, {summary['seconds']:.1f} s; {summary['cache_hits']} served by the "
           f"persistent cache in {summary['hit_seconds']:.1f} s, sparing {summary['saved_seconds']:.1f} s of compiling"]
  for title, key in (("test module", "by_module"), ("function", "by_function"), ("test", "by_test")):
    lines += ["", f"| {title} | compile s | compiles |", "|---|---|---|"]
    lines += [f"| {name} | {seconds:.1f} | {count} |" for name, seconds, count in summary[key]]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("folder", help=f"the folder {ENV} named")
  parser.add_argument("--top", type=int, default=25, help="rows per table")
  args = parser.parse_args(argv)
  records = read(args.folder)
  if not records:
    parser.error(f"no compile records in {args.folder}: run with {ENV}={args.folder} set.")
  print(format_summary(summarize(records, args.top)))


if __name__ == "__main__":
  main()
