"""The project cites only what it ships: no tracked file names the internal spec notes it was first written from
(docs/numerics.md and the paper replace them), and docs/numerics.md has the sections other files point to."""

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Spelled in two pieces so that this file does not match itself.
UNSHIPPED = ("NVFP4" + "_SPEC.md", "RECIPES" + "_SPEC.md")
NUMERICS_SECTIONS = ("Formats", "Quantization", "Stochastic rounding", "Random Hadamard transform", "Recipe",
                     "Recipes beyond NVIDIA's")


def _tracked_files(root):
  """Paths of the files git tracks under `root`; without git, every file outside hidden and cache folders."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=60).stdout
    return [root / p for p in out.decode().split("\0") if p]
  except (OSError, subprocess.CalledProcessError):
    files = []
    for folder, dirs, names in os.walk(root):
      dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
      files.extend(pathlib.Path(folder) / n for n in names)
    return files


def _mentions(root, files, needles):
  """'path:line: needle' for every line of `files` that contains one of `needles` (bytes search, any encoding)."""
  found = []
  for path in files:
    if not path.is_file():  # deleted in the working tree but still tracked
      continue
    data = path.read_bytes()
    for needle in needles:
      for m in re.finditer(re.escape(needle.encode()), data):
        line = data.count(b"\n", 0, m.start()) + 1
        found.append(f"{path.relative_to(root)}:{line}: {needle}")
  return found


def test_no_file_cites_unshipped_spec_notes():
  files = _tracked_files(ROOT)
  assert any(p.name == "pyproject.toml" for p in files)  # the listing really covers the repository
  found = _mentions(ROOT, files, UNSHIPPED)
  assert not found, "cite docs/numerics.md or the paper's section instead:\n" + "\n".join(found)


def test_mention_scan_finds_a_mention(tmp_path):
  (tmp_path / "a.py").write_text('"""From the notes."""\nx = 1  # see ' + UNSHIPPED[1] + "\n")
  (tmp_path / "b.ipynb").write_bytes(b'{"cells": []}')
  assert _mentions(tmp_path, sorted(tmp_path.iterdir()), UNSHIPPED) == [f"a.py:2: {UNSHIPPED[1]}"]


def test_numerics_doc_has_the_linked_sections():
  headings = re.findall(r"^## (.+?)\s*$", (ROOT / "docs" / "numerics.md").read_text(), re.M)
  assert headings == list(NUMERICS_SECTIONS)


def test_readme_lists_every_train_config_group():
  from fp4jax.pretrain import config  # pylint: disable=g-import-not-at-top
  readme = " ".join((ROOT / "README.md").read_text().split())
  listed = re.search(r"TrainConfig with groups ((?:`\w+`, )*`\w+`);", readme).group(1)
  assert tuple(re.findall(r"`(\w+)`", listed)) == config.GROUPS


def test_readme_layout_names_every_library_module():
  layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
  packages = {ROOT / "fp4jax", ROOT / "fp4jax" / "pretrain", ROOT / "fp4jax" / "analysis"}
  missing = [str(p.relative_to(ROOT)) for p in sorted(_tracked_files(ROOT))
             if p.parent in packages and p.suffix == ".py" and not p.name.startswith("__")
             and f"`{p.name}`" not in layout]
  assert not missing, f"README.md's Layout does not name {missing}"


def test_pyproject_license_is_an_spdx_string():
  # setuptools deprecated the `{ text = ... }` table (builds warn now, and are to fail after 2027-02-18); the SPDX
  # string form needs setuptools >= 77 in the isolated build environment.
  import tomllib  # pylint: disable=g-import-not-at-top
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert project["project"]["license"] == "Apache-2.0"
  assert "setuptools>=77" in project["build-system"]["requires"]
