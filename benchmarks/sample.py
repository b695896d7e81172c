"""`fp4jax sample`'s cost per token, per recipe, against the first recipe of the same run.

  python benchmarks/sample.py [--model tiny] [--recipes bf16 nvfp4 mxfp4] [--tokens 64] [--rounds 3]

Each recipe's model (random parameters, the same for every recipe) draws `--tokens` tokens with
fp4jax.pretrain.sample.generate over a full window (the model's max_seq_len; the prompt fills it, so every token
runs the same compiled forward). The first call of each recipe compiles; its time is reported apart. Then the
recipes take turns, `--rounds` times, and each reports its fastest round's milliseconds per token (one forward over
the window plus the host round trip for the token), the ratio to the first recipe's, and the median and min over
the rounds of its ratio to the first recipe's same round.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  pylint: disable=wrong-import-position
from flax import nnx  # noqa: E402  pylint: disable=wrong-import-position

import fp4jax  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks import common  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax import cli_values  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import model as model_lib  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import run_setup  # noqa: E402  pylint: disable=wrong-import-position
from fp4jax.pretrain import sample as sample_lib  # noqa: E402  pylint: disable=wrong-import-position


def models(model: str, recipes) -> dict[str, tuple]:
  """{recipe: (graphdef, params)}: one set of random parameters shared by every recipe's graph."""
  config = model_lib.get_model_config(model)
  return {name: nnx.split(run_setup.init_model(config, fp4jax.recipes.get_recipe(name), jax.random.key(0)))
          for name in recipes}


def measure(model: str, recipes, *, tokens: int, rounds: int) -> list[dict]:
  """Per recipe: {"recipe", "compile_s" (the first 1-token call), "ms_per_token" (fastest round), "round_ms" (each
  round's ms per token), "tokens"}."""
  if tokens < 1 or rounds < 1:
    raise ValueError(f"need tokens >= 1 and rounds >= 1; got tokens={tokens}, rounds={rounds}.")
  built = models(model, recipes)
  window = model_lib.get_model_config(model).max_seq_len
  prompt = np.arange(window, dtype=np.int32) % 200 + 32
  key = jax.random.key(1)

  def draw(name, n):
    graphdef, params = built[name]
    start = time.perf_counter()
    out = sample_lib.generate(graphdef, params, prompt, sample_lib.SampleConfig(new_tokens=n), window=window,
                              model_key=key)
    return time.perf_counter() - start, out

  rows = {name: {"recipe": name, "compile_s": draw(name, 1)[0], "runs": []} for name in recipes}
  for _ in range(rounds):
    for name in recipes:
      seconds, out = draw(name, tokens)
      rows[name]["runs"].append(seconds / tokens)
      if rows[name].setdefault("tokens", out.tolist()) != out.tolist():  # same seed and inputs: same tokens
        raise RuntimeError(f"{name}: a later round drew other tokens than the first.")
  return [{**r, "round_ms": [1e3 * t for t in r["runs"]], "ms_per_token": 1e3 * min(r.pop("runs"))}
          for r in rows.values()]


def round_ratios(rows: list[dict]) -> list[list[float]]:
  """Per row, each round's ms per token over the first row's in the same round (the rounds take turns)."""
  return [[t / b for t, b in zip(r["round_ms"], rows[0]["round_ms"])] for r in rows]


def main(argv=None) -> int:
  parser = cli_values.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default="tiny", choices=sorted(model_lib.MODEL_PRESETS))
  parser.add_argument("--recipes", nargs="+", default=["bf16", "nvfp4", "mxfp4"])
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args(argv)
  rows = measure(args.model, args.recipes, tokens=args.tokens, rounds=args.rounds)
  base = rows[0]["ms_per_token"]
  print(f"model {args.model}, {args.tokens} tokens per round, fastest of {args.rounds} rounds (ratios per round: "
        f"median, min); jax {jax.__version__} on {jax.devices()[0].device_kind}")
  print(common.format_table(["recipe", "compile s", "ms/token", f"vs {rows[0]['recipe']}", "median", "min"],
                            [[r["recipe"], f"{r['compile_s']:.2f}", f"{r['ms_per_token']:.2f}",
                              f"{r['ms_per_token'] / base:.2f}x", f"{statistics.median(q):.2f}x", f"{min(q):.2f}x"]
                             for r, q in zip(rows, round_ratios(rows))]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
