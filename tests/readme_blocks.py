"""The ```python and ```bash blocks of README.md, and how the tests run them (tests/test_readme.py, tests/conftest.py).

Python blocks run as written, each in a fresh interpreter; when a bare ``` block follows one, it is the block's
printed output and must match. Bash blocks run as one script each in a scratch folder, with the few changes that keep
them small, listed in `shrink`: training runs get 3 steps (also those that rely on the 200-step default), the `small`
model becomes `tiny`, `--preset cpu|gpu` sweeps only `--list` their runs, installs and the test command itself are
skipped, and `fp4jax` is `python -m fp4jax` (this checkout, installed or not). `--preset smoke` sweeps run as written.
"""

import os
import pathlib
import re
import shutil
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
_BLOCK = re.compile(r"```(\w*)\n(.*?)```\n", re.S)
# The README's main job (its first bash block, the formats smoke sweep) and the smoke-sweep tests: one xdist unit
# sharing one trained formats sweep and one compile cache (tests/conftest.py).
MAIN_JOB_GROUP = "smoke_sweeps"
MAIN_JOB_OUT = "runs/formats"  # its --out, relative to the folder it ran in


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


def env(devices: int = 1) -> dict:
  out = dict(os.environ)
  out["PYTHONPATH"] = os.pathsep.join([str(REPO), out.get("PYTHONPATH", "")])
  out["JAX_PLATFORMS"] = "cpu"
  out["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return out


def shrink(line: str) -> str | None:
  """One README shell line made small enough for the tests; None to skip it."""
  line = re.sub(r"^pip install [^&]*&&\s*", "", line.strip())
  if not line or line.startswith("#") or line.startswith("pip install") or "-m pytest" in line:
    return None
  line = re.sub(r"(^|\s)(?<!-m )fp4jax (train|eval|sample)\b", r"\1python -m fp4jax \2", line)  # not "python -m fp4jax"
  line = line.replace("--model small", "--model tiny")
  if re.search(r"--preset (cpu|gpu)\b", line):
    line = re.sub(r"\s+#.*$", "", line) + " --list"
  plain_train = " --resume" not in line and "--help" not in line and "--steps" not in line
  if re.search(r"\bfp4jax train\b", line) and plain_train:
    line = re.sub(r"\bfp4jax train\b", "fp4jax train --steps 3", line, count=1)
  if " --resume" in line:
    line = re.sub(r"--steps \d+", "--steps 5", line)
  else:
    line = re.sub(r"--steps \d+", "--steps 3", line)
  return line


def script(block: str) -> str:
  joined = block.replace("\\\n", " ")
  lines = [shrink(line) for line in joined.splitlines()]
  return "set -euo pipefail\n" + "\n".join(line for line in lines if line)


def run_bash(index: int, cwd: pathlib.Path) -> subprocess.CompletedProcess:
  """Runs bash block `index` (shrunk) in `cwd`; returns the finished process (output captured)."""
  text = script(BASH[index])
  if "experiments.report runs/formats_cpu" in text:  # redraws the committed cpu results
    shutil.copytree(REPO / "experiments" / "results" / "formats_cpu", cwd / "runs" / "formats_cpu")
  devices = 8 if "--mesh" in text and "FP4JAX_NUM_PROCESSES" not in text else 2
  # The session's persistent compilation cache (tests/conftest.py): a block's later commands (resume, eval) and
  # other blocks training the same model reuse earlier executables.
  run_env = {**env(devices), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  assert run_env.get("JAX_COMPILATION_CACHE_DIR"), "tests/conftest.py sets the session's compilation cache"
  return subprocess.run(["bash", "-c", text], cwd=cwd, env=run_env, capture_output=True, text=True, timeout=900)


def failure(index: int, res: subprocess.CompletedProcess) -> str:
  return f"README bash block {index} failed:\n{script(BASH[index])}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
