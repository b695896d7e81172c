"""Import hygiene: the numerics import without Flax, the Flax layers load lazily, the library never imports what is
built on top of it (fp4jax.pretrain, fp4jax.analysis, experiments), and the source tree has no import cycle.

The Flax check runs in a fresh interpreter (this one has Flax loaded by other tests); the layering and cycle checks
read the source with `ast`, so they see every module whether or not a test imports it.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUMERICS = ("formats", "grids", "nvfp4", "mxfp4", "fp8", "qarray", "quantize", "rounding", "rht", "recipes",
            "dot_general", "backends")
FLAX_FREE = ("fp4jax",) + tuple(f"fp4jax.{m}" for m in NUMERICS) + ("pallas_kernels",)
BUILT_ON_TOP = ("fp4jax.pretrain", "fp4jax.analysis", "experiments")
PACKAGES = ("fp4jax", "pallas_kernels", "experiments")

# Imports every module of argv in turn, recording after each whether Flax is loaded (so the first module that pulls
# Flax in is named), then uses the lazy layers of a plain `import fp4jax`.
_CHILD = textwrap.dedent("""
    import json, sys
    report = {"flax_after": [], "eager_layers": []}
    for name in sys.argv[1:]:
      __import__(name)
      report["flax_after"].append([name, "flax" in sys.modules])
    report["eager_layers"] = [m for m in ("fp4jax.nn", "fp4jax.linen") if m in sys.modules]

    import fp4jax
    import jax
    import jax.numpy as jnp
    from flax import nnx
    recipe = "nvfp4:stochastic_rounding=false"  # deterministic: no PRNG stream needed
    x_BxK = jnp.linspace(-1.0, 1.0, 2 * 32, dtype=jnp.float32).reshape(2, 32)
    y_nn = fp4jax.nn.Linear(32, 16, recipe=recipe, rngs=nnx.Rngs(0))(x_BxK)
    dense = fp4jax.linen.Dense(16, recipe=recipe)
    y_linen = dense.apply(dense.init(jax.random.key(0), x_BxK), x_BxK)
    report["nn"] = [list(y_nn.shape), bool(jnp.all(jnp.isfinite(y_nn))), bool(jnp.any(y_nn != 0))]
    report["linen"] = [list(y_linen.shape), bool(jnp.all(jnp.isfinite(y_linen))), bool(jnp.any(y_linen != 0))]
    report["nn_is_module"] = fp4jax.nn is sys.modules["fp4jax.nn"]
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def child_report():
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  out = subprocess.run([sys.executable, "-c", _CHILD, *FLAX_FREE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_numerics_and_pallas_kernels_import_without_flax(child_report):
  loaded = [name for name, flax in child_report["flax_after"] if flax]
  assert [name for name, _ in child_report["flax_after"]] == list(FLAX_FREE)
  assert not loaded, f"importing {loaded[0]} imports flax (the numerics and pallas_kernels must not)"
  assert child_report["eager_layers"] == [], "the Flax layers must load on first attribute access only"


def test_layers_load_lazily_from_plain_import(child_report):
  assert child_report["nn"] == [[2, 16], True, True]
  assert child_report["linen"] == [[2, 16], True, True]
  assert child_report["nn_is_module"]


def test_public_names():
  import fp4jax  # pylint: disable=g-import-not-at-top
  for name in fp4jax.__all__:
    assert getattr(fp4jax, name) is not None, name
  assert {"nn", "linen"} <= set(dir(fp4jax))
  with pytest.raises(AttributeError, match="no attribute 'pretrain_typo'"):
    fp4jax.pretrain_typo  # pylint: disable=pointless-statement


# --- static import graph -------------------------------------------------------------------------------------------

def _module_files(root, packages):
  """{module name: path} of every .py file under the given top-level packages."""
  modules = {}
  for package in packages:
    for path in sorted((root / package).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def _is_type_checking(test):
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
      isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree, top_level):
  """Import statements; with top_level, only those that run at import time (not in functions, not TYPE_CHECKING)."""
  stack = list(tree.body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
      continue
    if top_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    if top_level and isinstance(node, ast.If) and _is_type_checking(node.test):
      stack.extend(node.orelse)
      continue
    stack.extend(ast.iter_child_nodes(node))


def _imported_modules(name, path, modules, top_level):
  """(imported module names, line) of one module; `from p import x` names p.x when that is a module."""
  is_package = path.name == "__init__.py"
  for node in _import_nodes(ast.parse(path.read_text(), str(path)), top_level):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, node.lineno
      continue
    base = node.module or ""
    if node.level:
      anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
      base = ".".join(anchor + ([base] if base else []))
    for alias in node.names:
      full = f"{base}.{alias.name}"
      yield (full if full in modules else base), node.lineno


def _import_graph(root, packages):
  """Edges between modules of `packages` from top-level imports. Importing a.b.c also runs the __init__ of a and
  a.b, so those are edges too, except for packages the importer itself lives in (already initialising)."""
  modules = _module_files(root, packages)
  graph = {name: set() for name in modules}
  for name, path in modules.items():
    for target, _ in _imported_modules(name, path, modules, top_level=True):
      parts = target.split(".")
      for i in range(1, len(parts) + 1):
        dep = ".".join(parts[:i])
        inside = name == dep or name.startswith(dep + ".")
        if dep in modules and dep != name and (i == len(parts) or not inside):
          graph[name].add(dep)
  return graph


def _find_cycle(graph):
  """One import cycle as [m0, m1, ..., m0], or None."""
  state = {}  # 1: on the current path, 2: done
  for start in sorted(graph):
    if state.get(start):
      continue
    path, iters = [start], [iter(sorted(graph[start]))]
    state[start] = 1
    while path:
      nxt = next(iters[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        iters.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif not state.get(nxt):
        state[nxt] = 1
        path.append(nxt)
        iters.append(iter(sorted(graph.get(nxt, ()))))
  return None


def test_no_import_cycle():
  graph = _import_graph(ROOT, PACKAGES)
  assert "fp4jax.quantize" in graph["fp4jax.dot_general"]  # the graph is really built
  cycle = _find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_never_imports_what_is_built_on_top():
  """fp4jax's numerics and layers, and pallas_kernels, import neither the training harness, the analysis tools nor
  the experiments, not even lazily. fp4jax/__main__.py is exempt: it is the `python -m fp4jax` entry to the CLI."""
  modules = _module_files(ROOT, PACKAGES)
  library = [n for n in modules if n.split(".")[0] in ("fp4jax", "pallas_kernels") and n != "fp4jax.__main__"
             and not any(n == p or n.startswith(p + ".") for p in BUILT_ON_TOP)]
  assert "fp4jax.quantize" in library and "pallas_kernels.matmul" in library
  bad = [f"{n}:{line} imports {t}" for n in library
         for t, line in _imported_modules(n, modules[n], modules, top_level=False)
         if any(t == p or t.startswith(p + ".") for p in BUILT_ON_TOP)]
  assert not bad, "\n".join(bad)


def test_static_checks_catch_cycles_and_lazy_imports(tmp_path):
  """The checks above can fail: a two-module cycle is found, a function-level import is not part of the graph but
  is seen by the layering scan, and relative imports resolve."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("from . import c\nimport pkg.a\n")
  (pkg / "c.py").write_text("def f():\n  from pkg import a\n")
  graph = _import_graph(tmp_path, ("pkg",))
  assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a", "pkg.c"}, "pkg.c": set()}
  assert _find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])
  modules = _module_files(tmp_path, ("pkg",))
  assert [t for t, _ in _imported_modules("pkg.c", modules["pkg.c"], modules, top_level=False)] == ["pkg.a"]
  assert _find_cycle({"x": {"y"}, "y": {"z"}, "z": set()}) is None
