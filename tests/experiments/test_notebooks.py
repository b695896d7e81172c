"""Executes every notebook in notebooks/ with nbclient (kernel "python3") and checks they are stored without outputs.

Needs nbclient, nbformat and ipykernel with a registered "python3" kernelspec (`python -m ipykernel install --user`
if `jupyter kernelspec list` does not show one). 04_read_sweep reads the committed experiments/results/formats_cpu.
"""

import os
import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL = "python3"
SWEEP_RESULTS = REPO / "experiments" / "results" / "formats_cpu"


def _have_kernel() -> bool:
  try:
    from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
    return KERNEL in KernelSpecManager().find_kernel_specs()
  except Exception:  # pylint: disable=broad-except
    return False


def test_notebooks_exist():
  assert [p.name for p in NOTEBOOKS] == ["01_formats.ipynb", "02_rht.ipynb", "03_stochastic_rounding.ipynb",
                                         "04_read_sweep.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
  book = nbformat.read(path, as_version=4)
  nbformat.validate(book)
  for cell in book.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
  if not _have_kernel():
    pytest.skip(f"No Jupyter kernel named {KERNEL!r}: run `python -m ipykernel install --user` to register one.")
  if path.stem == "04_read_sweep":
    assert (SWEEP_RESULTS / "results.jsonl").is_file(), f"committed sweep results missing in {SWEEP_RESULTS}"
    monkeypatch.setenv("FP4JAX_SWEEP_DIR", str(SWEEP_RESULTS))
  # The kernel inherits this environment: make the repository importable and keep JAX on the CPU.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  book = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(book, kernel_name=KERNEL, timeout=300,
                                   resources={"metadata": {"path": str(path.parent)}})
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError (with the traceback) if any cell fails, asserts included
  elapsed = time.perf_counter() - start
  outputs = [o for c in book.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no figure"
  print(f"{path.name}: executed in {elapsed:.1f}s")
