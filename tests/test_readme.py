"""Every ```python and ```bash block of README.md runs, so the README cannot rot (how: tests/readme_blocks.py).

The first bash block, the main job (the formats smoke sweep), runs on a copy of that sweep's output trained once per
session (tests/conftest.py's `formats_smoke_sweep`, checked in tests/experiments/test_experiments.py): the command
must find every run finished with the same settings, leave them untouched and write the report.
"""

import shutil
import subprocess
import sys

import pytest

from readme_blocks import BASH
from readme_blocks import MAIN_JOB_GROUP
from readme_blocks import MAIN_JOB_OUT
from readme_blocks import PYTHON
from readme_blocks import env as _env
from readme_blocks import failure
from readme_blocks import run_bash
from readme_blocks import script as _script
from readme_blocks import shrink as _shrink


def test_readme_has_the_blocks_we_expect():
  assert len(PYTHON) >= 4 and len(BASH) >= 3
  first = _script(BASH[0])
  assert f"python -m experiments.formats --preset smoke --out {MAIN_JOB_OUT}" in first and "pytest" not in first
  # Every training run is shrunk: none falls back to the 200-step default.
  for block in BASH:
    for line in _script(block).splitlines():
      if "fp4jax train" in line and "--help" not in line:
        assert "--steps" in line or " --resume" in line, line


def test_shrink_rules():
  assert _shrink("pip install -e . && python -m experiments.formats --preset smoke --out runs/f") == (
      "python -m experiments.formats --preset smoke --out runs/f")
  assert _shrink('pip install -e ".[test]" && python -m pytest -q -n 2') is None
  assert _shrink("fp4jax train --model tiny --steps 200 --out runs/x   # c") == (
      "python -m fp4jax train --model tiny --steps 3 --out runs/x   # c")
  assert _shrink("fp4jax train --model small --out runs/y") == (
      "python -m fp4jax train --steps 3 --model tiny --out runs/y")
  assert _shrink("fp4jax train --help") == "python -m fp4jax train --help"
  assert _shrink("fp4jax sample --out runs/x --tokens 200") == "python -m fp4jax sample --out runs/x --tokens 200"
  assert _shrink("fp4jax train --out runs/x --resume --steps 400") == "python -m fp4jax train --out runs/x --resume --steps 5"
  assert _shrink("python -m experiments.rht_size --preset cpu --out runs/r   # sizes") == (
      "python -m experiments.rht_size --preset cpu --out runs/r --list")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs(index, tmp_path):
  code, shown = PYTHON[index]
  res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, f"README python block {index} failed:\n{code}\n{res.stderr[-3000:]}"
  if shown is not None:
    printed = "\n".join(line.rstrip() for line in res.stdout.strip().splitlines())
    assert printed == shown.strip(), f"README shows:\n{shown}\nthe code prints:\n{res.stdout}"


@pytest.mark.slow
@pytest.mark.parametrize("index", [pytest.param(0, marks=pytest.mark.xdist_group(MAIN_JOB_GROUP)),
                                   *range(1, len(BASH))])
def test_bash_block_runs(index, tmp_path, request):
  if index == 0:
    folder, _ = request.getfixturevalue("formats_smoke_sweep")
    shutil.copytree(folder, tmp_path / MAIN_JOB_OUT)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / MAIN_JOB_OUT).glob("*/seed*/summary.json")}
  res = run_bash(index, tmp_path)
  assert res.returncode == 0, failure(index, res)
  if index == 0:  # same settings: every run is reused as finished, not retrained
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / MAIN_JOB_OUT).glob("*/seed*/summary.json")}
    assert len(before) == 3 and after == before
    assert (tmp_path / MAIN_JOB_OUT / "results.md").is_file()
