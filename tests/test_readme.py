"""Every ```python and ```bash block of README.md runs, so the README cannot rot.

Python blocks run as written, each in a fresh interpreter; when a bare ``` block follows one, it is the block's
printed output and must match. Bash blocks run as one script each in a scratch folder, with the few changes that keep
them small, listed in `_shrink`: training runs get 3 steps (also those that rely on the 200-step default), the `small`
model becomes `tiny`, `--preset cpu|gpu` sweeps only `--list` their runs, `--preset smoke` sweeps run their bf16 and nvfp4
runs (tests/experiments/test_experiments.py runs every smoke run in full), installs and the test command itself are
skipped, and `fp4jax` is `python -m fp4jax` (this checkout, installed or not).
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
_BLOCK = re.compile(r"```(\w*)\n(.*?)```\n", re.S)


def _blocks():
  """(language, text, the bare block printed right after it or None), in README order."""
  found = [(m.group(1), m.group(2), m.start(), m.end()) for m in _BLOCK.finditer(README)]
  out = []
  for i, (lang, text, _, end) in enumerate(found):
    nxt = found[i + 1] if i + 1 < len(found) else None
    shown = nxt[1] if nxt and nxt[0] == "" and README[end:nxt[2]].strip() == "" else None
    if lang in ("python", "bash"):
      out.append((lang, text, shown))
  return out


PYTHON = [(t, shown) for lang, t, shown in _blocks() if lang == "python"]
BASH = [t for lang, t, _ in _blocks() if lang == "bash"]


def _env(devices: int = 1) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _shrink(line: str) -> str | None:
  """One README shell line made small enough for the tests; None to skip it."""
  line = re.sub(r"^pip install [^&]*&&\s*", "", line.strip())
  if not line or line.startswith("#") or line.startswith("pip install") or "-m pytest" in line:
    return None
  line = re.sub(r"(^|\s)fp4jax (train|eval)\b", r"\1python -m fp4jax \2", line)
  line = line.replace("--model small", "--model tiny")
  if re.search(r"--preset (cpu|gpu)\b", line):
    line = re.sub(r"\s+#.*$", "", line) + " --list"
  if re.search(r"--preset smoke\b", line) and "--runs" not in line:
    line = re.sub(r"\s+#.*$", "", line) + " --runs bf16,nvfp4"
  if re.search(r"\bfp4jax train\b", line) and " --resume" not in line and "--help" not in line and "--steps" not in line:
    line = re.sub(r"\bfp4jax train\b", "fp4jax train --steps 3", line, count=1)
  if " --resume" in line:
    line = re.sub(r"--steps \d+", "--steps 5", line)
  else:
    line = re.sub(r"--steps \d+", "--steps 3", line)
  return line


def _script(block: str) -> str:
  joined = block.replace("\\\n", " ")
  lines = [_shrink(line) for line in joined.splitlines()]
  return "set -euo pipefail\n" + "\n".join(line for line in lines if line)


def test_readme_has_the_blocks_we_expect():
  assert len(PYTHON) >= 4 and len(BASH) >= 3
  first = _script(BASH[0])
  assert "python -m experiments.formats --preset smoke" in first and "pytest" not in first
  # Every training run is shrunk: none falls back to the 200-step default.
  for block in BASH:
    for line in _script(block).splitlines():
      if "fp4jax train" in line and "--help" not in line:
        assert "--steps" in line or " --resume" in line, line


def test_shrink_rules():
  assert _shrink("pip install -e . && python -m experiments.formats --preset smoke --out runs/f") == (
      "python -m experiments.formats --preset smoke --out runs/f --runs bf16,nvfp4")
  assert _shrink('pip install -e ".[test]" && python -m pytest -q -n 2') is None
  assert _shrink("fp4jax train --model tiny --steps 200 --out runs/x   # c") == (
      "python -m fp4jax train --model tiny --steps 3 --out runs/x   # c")
  assert _shrink("fp4jax train --model small --out runs/y") == (
      "python -m fp4jax train --steps 3 --model tiny --out runs/y")
  assert _shrink("fp4jax train --help") == "python -m fp4jax train --help"
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
@pytest.mark.parametrize("index", range(len(BASH)))
def test_bash_block_runs(index, tmp_path):
  script = _script(BASH[index])
  if "experiments.report runs/formats_cpu" in script:  # redraws the committed cpu results
    shutil.copytree(REPO / "experiments" / "results" / "formats_cpu", tmp_path / "runs" / "formats_cpu")
  devices = 8 if "--mesh" in script and "FP4JAX_NUM_PROCESSES" not in script else 2
  # The session's persistent compilation cache (tests/conftest.py): a block's later commands (resume, eval) and
  # other blocks training the same model reuse earlier executables.
  env = {**_env(devices), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  assert env.get("JAX_COMPILATION_CACHE_DIR"), "tests/conftest.py sets the session's compilation cache"
  res = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, f"README bash block {index} failed:\n{script}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
