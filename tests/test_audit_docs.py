"""What README.md and docs/numerics.md tell a user to type or to expect, checked against the code.

Each test fails when a statement there stops being true: a preset, format or call written in the text that no longer
constructs, a command-line flag no parser knows, a path or API name that moved, a stored result table that was rerun
without the README, a constant the numerics page spells out. All fast: one subprocess for the CLIs' help texts,
the rest is parsing and tiny arrays.
"""

import ast
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import fp4jax
from fp4jax import formats
from fp4jax import grids
from fp4jax import mxfp4
from fp4jax import nvfp4
from fp4jax import recipes
from fp4jax import rht
from fp4jax import rounding

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NUMERICS = (ROOT / "docs" / "numerics.md").read_text()
DOCS = {"README.md": README, "docs/numerics.md": NUMERICS}
RESULTS = ROOT / "experiments" / "results"
FORMATS = {"NVFP4": fp4jax.NVFP4, "MXFP4": fp4jax.MXFP4, "MXFP8": fp4jax.MXFP8, "FP8": fp4jax.FP8}


def _spans(text):
  """Inline code spans and the lines of fenced code blocks (continuation lines joined)."""
  blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
  prose = re.sub(r"```\w*\n.*?```", "", text, flags=re.S)
  lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
  return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)] + lines


# ------------------------------------------------------------------------------------------------------ calls

def _literal_calls(text):
  """(source, name, kwargs) of every `Name(k=literal, ...)` call in a code span whose name is a recipe preset or a
  format, with an optional fp4jax. / fp4jax.recipes. / formats. prefix. Placeholders (`MXFP4(scale_rule)`,
  `scale_rule=...`) are not literal keyword calls and are left out."""
  names = "|".join(sorted(set(recipes.PRESETS) | set(FORMATS), key=len, reverse=True))
  pattern = re.compile(rf"(?<![\w.])(?:fp4jax\.(?:recipes\.)?|formats\.|recipes\.)?({names})\(")
  out = []
  for span in _spans(text):
    for m in pattern.finditer(span):
      depth, end = 0, None
      for i in range(m.end() - 1, len(span)):
        depth += {"(": 1, ")": -1}.get(span[i], 0)
        if depth == 0:
          end = i + 1
          break
      if end is None:
        continue
      try:
        call = ast.parse(span[m.start(1):end], mode="eval").body
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
      except (SyntaxError, ValueError):
        continue
      if call.args or None in kwargs or Ellipsis in kwargs.values():
        continue
      out.append((span[m.start():end], m.group(1), kwargs))
  return out


def test_call_scan_finds_calls_and_skips_placeholders():
  text = ('`nvfp4(rht_on=("wgrad", "dgrad"))` and `fp4jax.recipes.quartet()` and `MXFP4(scale_rule)` and '
          '`fp4jax.NVFP4(scale_rule=..., headroom=...)`\n```python\nq = formats.FP8(scaling="tensor")\n```\n')
  found = [(name, kwargs) for _, name, kwargs in _literal_calls(text)]
  assert found == [("nvfp4", {"rht_on": ("wgrad", "dgrad")}), ("quartet", {}), ("FP8", {"scaling": "tensor"})]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_preset_and_format_call_in_the_docs_constructs(doc):
  calls = _literal_calls(DOCS[doc])
  assert len(calls) >= (15 if doc == "README.md" else 5)  # the scan really reads the text
  failed = []
  for source, name, kwargs in calls:
    make = FORMATS.get(name) or recipes.PRESETS[name]
    try:
      make(**kwargs)
    except (TypeError, ValueError) as e:
      failed.append(f"{source}: {e}")
  assert not failed, f"{doc} shows calls that raise:\n" + "\n".join(failed)


def test_readme_recipe_tables_name_registered_presets():
  rows = re.findall(r"^\| `(\w+)\(", README, re.M)
  assert {"four_over_six", "tetrajet_v2", "quartet2", "quartet", "nvfp4"} <= set(rows)
  assert set(rows) <= set(recipes.PRESETS), set(rows) - set(recipes.PRESETS)


def test_every_recipe_string_in_the_docs_parses():
  names = "|".join(recipes.PRESETS)
  specs = set()
  for text in DOCS.values():
    specs |= set(re.findall(rf'(?<![\w.-])"?((?:{names}):[\w=+,.]+)"?', text))
    specs |= set(re.findall(r'--recipe "?([\w:=+,.]+)"?', text))
  assert {"nvfp4:rht_size=4,stochastic_rounding=false", "quartet2:rht_size=32", "tetrajet_v2"} <= specs
  failed = []
  for spec in sorted(specs):
    try:
      recipes.get_recipe(spec)
    except ValueError as e:
      failed.append(f"{spec}: {e}")
  assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------------------------------ CLI flags

_HELP_SCRIPT = r"""
import contextlib, io, json, sys
from experiments import cli, eval_precision
from experiments.probes import recipe_gemms, run
from fp4jax.pretrain import cli as train_cli

def help_of(main, argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    try:
      main(argv)
    except SystemExit:
      pass
  return out.getvalue()

print(json.dumps({
    "train": help_of(train_cli.main, ["train", "--help"]),
    "eval": help_of(train_cli.main, ["eval", "--help"]),
    "sample": help_of(train_cli.main, ["sample", "--help"]),
    "experiments": cli.make_parser("python -m experiments.NAME", "").format_help(),
    "probes": help_of(run.main, ["--help"]),
    "probes recipes": help_of(recipe_gemms.main, ["--help"]),
    "eval_precision": help_of(eval_precision.main, ["--help"]),
}))
"""


@pytest.fixture(scope="module")
def cli_flags():
  """The option strings each command-line entry point accepts, from its --help."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  res = subprocess.run([sys.executable, "-c", _HELP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
  assert res.returncode == 0, res.stderr[-3000:]
  helps = json.loads(res.stdout.strip().splitlines()[-1])
  flags = {k: set(re.findall(r"(?<![\w-])--[\w][\w.-]*", v)) for k, v in helps.items()}
  gpu_sh = (ROOT / "benchmarks" / "gpu.sh").read_text()
  flags["gpu.sh"] = set(re.findall(r"^\s+(--[\w-]+)\)", gpu_sh, re.M)) | {"--help"}
  for name, found in flags.items():
    assert "--help" in found or name == "gpu.sh", name
  assert "--keep-schedule" in flags["train"] and "--merge-into" in flags["experiments"] and "--dry" in flags["gpu.sh"]
  return flags


def _command_of(span):
  if re.search(r"\bfp4jax train\b", span):
    return "train"
  if re.search(r"\bfp4jax eval\b", span):
    return "eval"
  if re.search(r"\bfp4jax sample\b", span):
    return "sample"
  if "experiments.probes recipes" in span:
    return "probes recipes"
  if "experiments.probes" in span:
    return "probes"
  if "experiments.eval_precision" in span:
    return "eval_precision"
  if re.search(r"python -m experiments\.(?!report)\w+", span):
    return "experiments"
  if "benchmarks/gpu.sh" in span:
    return "gpu.sh"
  return None


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_cli_flag_in_the_docs_exists(doc, cli_flags):
  """A flag in a command is checked against that command's parser; a flag named alone in the text, against all."""
  everything = set().union(*cli_flags.values())
  unknown = []
  for span in _spans(DOCS[doc]):
    command = _command_of(span)
    for flag in re.findall(r"(?<![\w=-])--[a-z][\w.-]*", span):
      if flag not in (cli_flags[command] if command else everything):
        unknown.append(f"{flag} ({command or 'any command'}): {span.strip()[:100]}")
  assert not unknown, f"{doc} names flags no parser has:\n" + "\n".join(unknown)


def test_experiment_modules_named_in_the_readme_exist():
  names = set(re.findall(r"python -m experiments\.([a-z_]+)\b", README))
  assert {"formats", "recipes", "probes", "report"} <= names
  missing = [n for n in names if not (ROOT / "experiments" / f"{n}.py").is_file()
             and not (ROOT / "experiments" / n / "__main__.py").is_file()]
  assert not missing, missing


# ------------------------------------------------------------------------------------------------------ names, paths

def test_paths_named_in_the_docs_exist():
  missing = []
  for doc, text in DOCS.items():
    for path in set(re.findall(r"(?<![/~.])\b((?:fp4jax|tests|benchmarks|experiments|pallas_kernels|notebooks|docs)/"
                               r"[\w/.-]*\w)", text)):
      if not (ROOT / path).exists():
        missing.append(f"{doc}: {path}")
  assert not missing, "\n".join(sorted(missing))


def test_dotted_api_names_in_the_docs_resolve():
  names = set()
  for text in DOCS.values():
    names |= set(re.findall(r"`((?:fp4jax|pallas_kernels)(?:\.\w+)+)", text))
  assert "fp4jax.gemm.unit_values" in names and "fp4jax.backends.GEMM_ROUTES" in names

  def resolves(name):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
      try:
        obj = importlib.import_module(".".join(parts[:i]))
      except ImportError:
        continue
      for attr in parts[i:]:
        if not hasattr(obj, attr):
          return False
        obj = getattr(obj, attr)
      return True
    return False

  bad = sorted(n for n in names if not resolves(n))
  assert not bad, f"README.md / docs/numerics.md name attributes that do not exist: {bad}"


# ------------------------------------------------------------------------------------------------------ stored results

def _stored_rows(sweep):
  """(run, final val loss 'm ± s', gap '±' string or 'reference') per row of a stored sweep's results.md."""
  rows = []
  for line in (RESULTS / sweep / "results.md").read_text().splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 7 and re.fullmatch(r"\d\.\d{4} ± \d\.\d{4}", cells[4]):
      rows.append((cells[0], cells[4], cells[5]))
  return rows


@pytest.mark.parametrize("sweep,with_loss", [("formats_cpu", True), ("components_cpu", False),
                                             ("recipes_cpu", True)])
def test_readme_tables_match_the_stored_results(sweep, with_loss):
  rows = _stored_rows(sweep)
  assert len(rows) >= 4
  missing = []
  for run, loss, gap in rows:
    if gap != "reference" and f"| {gap}" not in README:
      missing.append(f"{run}: gap {gap}")
    if with_loss and f"| {loss}" not in README:
      missing.append(f"{run}: val loss {loss}")
  assert not missing, f"experiments/results/{sweep}/results.md has rows the README does not show: {missing}"


def test_readme_counts_of_the_recipes_sweep():
  from experiments import recipes as recipes_sweep  # pylint: disable=g-import-not-at-top
  words = {"seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11}
  runs = len(recipes_sweep.get_config("cpu").runs)
  assert words[re.search(r"runs all (\w+) on one model", README).group(1)] == runs
  stored = [json.loads(line) for line in (RESULTS / "recipes_cpu" / "results.jsonl").read_text().splitlines()]
  assert f"the {len(stored)} stored runs" in README and len(stored) == runs * recipes_sweep.SEEDS["cpu"]


# ------------------------------------------------------------------------------------------------------ numerics page

def test_numerics_e2m1_grid_and_rounding_examples():
  assert "The magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4 and 6;" in " ".join(NUMERICS.split())
  np.testing.assert_array_equal(grids.E2M1_VALUES, [0, 0.5, 1, 1.5, 2, 3, 4, 6])
  sends = re.search(r"sends (.*?)\. fp4jax packs", " ".join(NUMERICS.split())).group(1)
  pairs = [(float(a), float(b)) for a, b in re.findall(r"([\d.]+) to ([\d.]+)", sends)]
  assert len(pairs) == 8
  got = np.asarray(rounding.round_e2m1_nearest(np.array([a for a, _ in pairs], np.float32)))
  np.testing.assert_array_equal(got, [b for _, b in pairs])
  decoded = np.asarray(grids.e2m1_decode(np.arange(16, dtype=np.uint8)))
  assert np.signbit(decoded[8]) and decoded[8] == 0  # "code 8 is -0"


def test_numerics_format_constants():
  text = " ".join(NUMERICS.split())
  assert "largest value 448, smallest normal 2^-6, subnormal step 2^-9" in text
  assert (grids.E4M3_MAX, grids.E4M3_MIN_EXPONENT) == (448.0, -6)
  assert "`S_enc = 6 * 448 / amax = 2688 / amax`" in text
  assert nvfp4.GLOBAL_RANGE == 2688.0
  assert "`6 * 256 / amax` (an E4M3 bound of 256" in text and formats.FOUR_OVER_SIX_E4M3_BOUND == 256.0
  assert "`6 / (17/16 * 0.93)`, the E4M3 bound is 255.99" in text
  assert formats.EDEN_ELEM_MAX == 6.0 / ((17.0 / 16.0) * 0.93) and formats.EDEN_E4M3_BOUND == 255.99
  assert "sigma * 2.92247856 / 6 + 1e-8" in text
  assert (mxfp4.QUEST_SCALE, mxfp4.QUEST_EPS) == (2.92247856 / 6.0, 1e-8)
  assert "Storage is 4.5 bits per element" in text and "Storage is 4.25 bits per element" in text
  x = np.zeros((128, 1024), np.float32)  # the float32 amax adds 32 bits per tensor
  assert round(fp4jax.quantize(x, "nvfp4").bits_per_element, 2) == 4.5
  assert round(fp4jax.quantize(x, "mxfp4").bits_per_element, 2) == 4.25


def test_numerics_rht_sign_vector_and_matrix():
  shown = re.search(r"implementation,\s+((?:-?1\s+){15}-?1)\)", NUMERICS).group(1)
  assert tuple(int(s) for s in shown.split()) == rht.REFERENCE_SIGNS_16 == rht.default_signs(16)
  h = np.asarray(fp4jax.hadamard_matrix(16))  # diag(s) H_d / sqrt(d), H_d in scipy.linalg.hadamard's ordering
  h_d = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
  np.testing.assert_array_equal(h, np.diag(rht.REFERENCE_SIGNS_16) @ h_d / 4.0)


def test_numerics_lists_the_jitted_public_calls():
  listed = re.search(r"\*\*Plain calls are compiled\.\*\* (.*?) run their bodies", " ".join(NUMERICS.split()))
  names = re.findall(r"`(\w+)`", listed.group(1))
  assert names == ["quantize", "quantize_with_clip_mask", "dequantize", "fake_quant", "quantize_elements",
                   "decoded_values", "random_hadamard"]
  quantize_module = importlib.import_module("fp4jax.quantize")  # `fp4jax.quantize` is the function
  for name in names:
    assert callable(getattr(fp4jax, name, None) or getattr(quantize_module, name)), name


def _gaps(sweep):
  """{run: {seed: gap to the reference in %}} of a stored sweep."""
  out = {}
  for line in (RESULTS / sweep / "results.jsonl").read_text().splitlines():
    row = json.loads(line)
    out.setdefault(row["run"], {})[row["seed"]] = row["gap_pct"]
  return out


def test_readme_seed_counts_match_the_stored_results():
  text = " ".join(README.split())
  for sweep, phrase in (("formats_cpu", "| format | val loss (mean ± std, {} seeds) |"),
                        ("components_cpu", "| NVFP4 recipe minus | gap to BF16 ({} seeds) |"),
                        ("recipes_cpu", "| recipe | val loss, {} seeds |")):
    seeds = {len(s) for s in _gaps(sweep).values()}
    assert len(seeds) == 1 and phrase.format(seeds.pop()) in text, sweep


def test_readme_per_seed_statements_match_the_stored_results():
  text = " ".join(README.split())
  words = {"1": 1, "2": 2, "3": 3, "4": 4, "5": 5, "all": None}

  def lower_in(sweep, run, than):
    g = _gaps(sweep)
    return sum(g[run][s] < g[than][s] for s in g[run]), len(g[run])

  # Components: the column "smaller than the full recipe's in".
  for label, run in (("RHT", "no_rht"), ("stochastic rounding", "no_sr"), ("2D weight blocks", "no_2d"),
                     ("BF16 blocks (all NVFP4)", "no_hp_layers")):
    k, n = lower_in("components_cpu", run, "full")
    assert re.search(rf"\| {re.escape(label)} \| [^|]+ \| {k} of {n}( seeds)? \|", text), (label, k, n)
  # Recipes: 4/6 on NVIDIA's and on Quartet II's recipe, OutControl on TetraJet-v2.
  said = re.search(r"NVIDIA −0\.31 points, lower on (\w+) of (\d) seeds; Quartet II −0\.99, lower on (\w+) (?:of \d)?",
                   text)
  assert said, "the README's 4/6 sentence changed: update this test with it"
  k, n = lower_in("recipes_cpu", "nvidia-4over6", "nvidia")
  assert (words[said.group(1)], int(said.group(2))) == (k, n)
  k, n = lower_in("recipes_cpu", "quartet2-4over6", "quartet2")
  assert said.group(3) == "all" and k == n
  k, n = lower_in("recipes_cpu", "tetrajet-v2-outcontrol", "tetrajet-v2")
  assert f"gap by 0.1 point ({k} of {n} seeds)" in text
  # Formats: "NVFP4 lands closer to BF16 than MXFP4 in every seed".
  k, n = lower_in("formats_cpu", "nvfp4", "mxfp4")
  assert "NVFP4 lands closer to BF16 than MXFP4 in every seed" in text and k == n


def test_numerics_quantize_gradient_statement():
  """docs/numerics.md: differentiating dequantize(quantize(x)) raises a TypeError; fake_quant is the STE."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  text = " ".join(NUMERICS.split())
  assert "reverse-mode autodiff that reaches `quantize`," in text and "raises a TypeError" in text
  x = jnp.linspace(-3.0, 3.0, 32, dtype=jnp.float32).reshape(2, 16)
  with pytest.raises(TypeError, match="fp4jax.quantize has no gradient"):
    jax.grad(lambda v: jnp.sum(fp4jax.dequantize(fp4jax.quantize(v, "nvfp4"))))(x)
  straight_through = jax.grad(lambda v: jnp.sum(fp4jax.fake_quant(v, "nvfp4")))(x)
  np.testing.assert_array_equal(np.asarray(straight_through), 1.0)


def _public_callables_without_docstring(package: str) -> list[str]:
  """Public functions, classes, methods and properties defined in `package`'s public modules whose docstring
  (inherited ones count) is empty; dataclass fields (a function as a default value) are not methods."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  import pkgutil  # pylint: disable=g-import-not-at-top
  root = importlib.import_module(package)
  modules = [root] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(root.__path__, f"{package}.")
                      if not m.name.rsplit(".", 1)[-1].startswith("_")]
  missing = []
  for module in modules:
    for name, obj in vars(module).items():
      if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
        continue
      if inspect.isfunction(obj) and not inspect.getdoc(obj):
        missing.append(f"{module.__name__}.{name}")
      if not inspect.isclass(obj):
        continue
      if not inspect.getdoc(obj):
        missing.append(f"{module.__name__}.{name}")
      fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
      for attr, member in vars(obj).items():
        if attr.startswith("_") or attr in fields:
          continue
        if isinstance(member, property) and not inspect.getdoc(member):
          missing.append(f"{module.__name__}.{name}.{attr}")
        elif inspect.isfunction(getattr(member, "__func__", member)) and not inspect.getdoc(getattr(obj, attr)):
          missing.append(f"{module.__name__}.{name}.{attr}")
  return missing


@pytest.mark.parametrize("package", ["fp4jax", "pallas_kernels", "experiments"])
def test_public_functions_classes_and_methods_have_docstrings(package):
  assert _public_callables_without_docstring(package) == []
