"""Comparison of a rerun's results with stored results, shared by the experiments tests.

Results are stored per platform (tests/platform_numerics.py): `data/NAME` as first computed, on an AVX-512 host with
jax 0.10.2 on CPU, and `data/PLATFORM/NAME` for each platform recorded since. Where this platform has a record, a
rerun reproduces it up to float32 summation order. Elsewhere the numbers move further, since the BF16 base run and
its GEMMs round differently: on an AVX2 host (AMD Zen 3) the probes' 4039 numbers differ from the AVX-512 host's
by a median of 0.5 % (the recipe probes' 1841 by 1.6 %), small statistics near zero by far more; with jax 0.11.2 on
CPU the base run's loss after 8 steps is 3.24393 instead of 3.24442.
So there the structure is checked and the first differing number is reported, not asserted. A platform's record is
made with `python tests/experiments/stored_results.py`, from a commit that reproduces a recorded platform's.
"""

import json
import math
import pathlib
import sys
import tempfile

import pytest

from platform_numerics import FIRST_PLATFORM
from platform_numerics import platform

DATA = pathlib.Path(__file__).parent / "data"
BLANKED = ("checkpoint", "seconds")  # where the run wrote and how long it took: not results


def platform_folder(name: str) -> str:
  """The data/ subfolder of a platform's records, which names it."""
  return name.replace(" ", "_")


def stored(file: str) -> dict[str, dict]:
  """platform folder name -> the results stored in `file` for it; the first platform first. Checkpoint path and run
  time are left out."""
  paths = {platform_folder(FIRST_PLATFORM): DATA / file}
  paths.update({p.parent.name: p for p in sorted(DATA.glob(f"*/{file}"))})
  out = {}
  for plat, path in paths.items():
    results = json.loads(path.read_text())
    out[plat] = {k: v for k, v in results.items() if k not in BLANKED}
  return out


def assert_close(got, want, path="results"):
  """Same keys and lengths everywhere; finite floats equal up to float32 summation order, everything else exactly."""
  if isinstance(want, dict):
    assert set(got) == set(want), path
    for k in want:
      assert_close(got[k], want[k], f"{path}.{k}")
  elif isinstance(want, list):
    assert len(got) == len(want), path
    for i, (g, w) in enumerate(zip(got, want)):
      assert_close(g, w, f"{path}[{i}]")
  elif isinstance(want, float) and math.isfinite(want):
    assert got == pytest.approx(want, rel=1e-3, abs=1e-6), path
  elif isinstance(want, float) and math.isnan(want):
    assert isinstance(got, float) and math.isnan(got), path
  else:
    assert got == want, path


def assert_same_structure(got, want, path="results"):
  """Same keys, lengths and types everywhere, and finite floats where the stored ones are finite."""
  if isinstance(want, dict):
    assert isinstance(got, dict) and set(got) == set(want), path
    for k in want:
      assert_same_structure(got[k], want[k], f"{path}.{k}")
  elif isinstance(want, list):
    assert isinstance(got, list) and len(got) == len(want), path
    for i, (g, w) in enumerate(zip(got, want)):
      assert_same_structure(g, w, f"{path}[{i}]")
  elif isinstance(want, float):
    assert isinstance(got, (float, int)) and math.isfinite(got) == math.isfinite(want), path
  else:
    assert type(got) is type(want), path


def check_reproduces(got, stored_by_platform: dict[str, dict]) -> str | None:
  """assert_close against the results stored for this platform; where there are none, the structure against the
  first platform's and the first number that differs is returned (None: all agree) for the test to skip with once
  its other checks have passed."""
  got = {k: v for k, v in got.items() if k not in BLANKED}
  mine = stored_by_platform.get(platform_folder(platform()))
  first, want = next(iter(stored_by_platform.items()))
  assert_same_structure(got, mine or want)
  try:
    assert_close(got, mine or want)
  except AssertionError as e:
    if mine is not None:
      raise
    return f"no results stored for {platform()!r}; those of {first!r} differ first at {str(e).splitlines()[0]}"
  return None


def record() -> None:
  """Runs both smoke presets and stores their results for this platform (refused where it has them)."""
  from experiments.probes import run as probes_run  # pylint: disable=g-import-not-at-top
  from experiments.probes import report  # pylint: disable=g-import-not-at-top
  folder = DATA / platform_folder(platform())
  if folder.exists():
    raise SystemExit(f"{folder} exists.")
  recipe_runs = ",".join(json.loads((DATA / "recipe_probes_smoke_results.json").read_text())["runs"])
  commands = {"probes_smoke_results.json": ["--preset", "smoke"],
              "recipe_probes_smoke_results.json": ["recipes", "--preset", "smoke", "--runs", recipe_runs]}
  with tempfile.TemporaryDirectory() as tmp:
    for i, (file, args) in enumerate(commands.items()):
      out = pathlib.Path(tmp) / str(i)
      assert probes_run.main([*args, "--out", str(out)]) == 0
      results = json.loads((out / report.RESULTS_FILE).read_text())
      results.update(checkpoint=json.loads((DATA / file).read_text())["checkpoint"], seconds=0.0)
      folder.mkdir(exist_ok=True)
      (folder / file).write_text(json.dumps(results))
  print(f"Recorded {platform()!r} in {folder}.")


if __name__ == "__main__":
  sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))
  record()
