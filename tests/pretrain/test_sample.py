"""fp4jax.pretrain.sample: drawing tokens (greedy, temperature, top-k), generation against a plain loop over the
model, its checks, and `fp4jax sample` on a trained run (slow)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.pretrain import cli
from fp4jax.pretrain import data as data_lib
from fp4jax.pretrain import model as model_lib
from fp4jax.pretrain import run_setup
from fp4jax.pretrain import sample as sample_lib

CONFIG = model_lib.get_model_config("tiny", n_layers=1, max_seq_len=32)


def _model(recipe="bf16"):
  return run_setup.init_model(CONFIG, fp4jax.recipes.get_recipe(recipe), jax.random.key(0))


def test_pick_token_greedy_top_k_and_vocabulary():
  logits = jnp.asarray([0.5, 3.0, -1.0, 2.9, 1.0], jnp.float32)
  key = jax.random.key(0)
  assert int(sample_lib.pick_token(logits, key, 0.0)) == 1
  assert int(sample_lib.pick_token(logits, key, 0.0, vocab_size=1)) == 0  # ids >= vocab_size are never drawn
  keys = jax.random.split(key, 200)

  def draws(temperature, **kwargs):
    return set(np.asarray(jax.vmap(lambda k: sample_lib.pick_token(logits, k, temperature, **kwargs))(keys)).tolist())

  assert draws(5.0, top_k=1) == {1}  # top_k=1 is greedy at any temperature
  assert draws(5.0, top_k=2) == {1, 3}
  assert draws(5.0) == {0, 1, 2, 3, 4}
  assert draws(1.0, vocab_size=3) == {0, 1, 2}


def test_pick_token_draws_from_the_tempered_softmax():
  """20000 draws at temperature 2 against softmax(logits / 2): each frequency within 5 standard errors."""
  logits = jnp.asarray([1.0, 0.0, -1.0, 2.0], jnp.float32)
  n = 20000
  keys = jax.random.split(jax.random.key(3), n)
  draws = np.asarray(jax.vmap(lambda k: sample_lib.pick_token(logits, k, 2.0))(keys))
  p = np.exp(np.asarray(logits) / 2) / np.exp(np.asarray(logits) / 2).sum()
  freq = np.bincount(draws, minlength=4) / n
  assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n)), (freq, p)


def _greedy_reference(model, prompt, n, window, key):
  """Greedy tokens by calling the model on each exact context (its last `window` tokens), unpadded."""
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens, key=key))  # one compile per length
  context = list(prompt)
  for _ in range(n):
    logits = forward(params, jnp.asarray([context[-window:]], jnp.int32))
    context.append(int(jnp.argmax(logits[0, -1])))
  return context[len(prompt):]


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4"])
def test_greedy_generation_matches_the_model_on_each_exact_context(recipe):
  """Padding after the context changes nothing where the layers are exactly causal (no per-tensor scales), also
  once the context outgrows the window and slides."""
  model = _model(recipe)
  graphdef, params = nnx.split(model)
  prompt = np.asarray([5, 100, 7, 42, 200, 9, 64], np.int32)
  window, key = 8, jax.random.key(2)  # contexts of 7 (padded), 8 and 9 (slid) tokens
  got = sample_lib.generate(graphdef, params, prompt, sample_lib.SampleConfig(new_tokens=3, temperature=0.0),
                            window=window, model_key=key)
  assert got.dtype == np.int32 and got.shape == (3,)
  assert got.tolist() == _greedy_reference(model, prompt, 3, window, key)


def test_generation_is_deterministic_per_seed_and_runs_quantized_forward():
  graphdef, params = nnx.split(_model("nvfp4"))
  prompt = np.arange(1, 9, dtype=np.int32)
  key = jax.random.key(1)  # nvfp4's layers ask for a key (their backward draws random bits)

  def draw(**settings):
    return sample_lib.generate(graphdef, params, prompt, sample_lib.SampleConfig(new_tokens=12, **settings),
                               window=16, model_key=key)

  first = draw(temperature=1.0, seed=0)
  assert np.array_equal(first, draw(temperature=1.0, seed=0))
  assert not np.array_equal(first, draw(temperature=1.0, seed=1))
  assert first.min() >= 0 and first.max() < CONFIG.vocab_size
  with pytest.raises(ValueError, match="need randomness; pass key="):
    sample_lib.generate(graphdef, params, prompt, sample_lib.SampleConfig(new_tokens=1), window=16)


@pytest.mark.parametrize("settings, message", [
    (dict(new_tokens=0), r"new_tokens \(fp4jax sample --tokens\) must be an int >= 1"),
    (dict(temperature=-1.0), r"temperature \(--temperature\) must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature .* must be a finite number >= 0"),
    (dict(top_k=0), r"top_k \(--top-k\) must be None or an int >= 1"),
    (dict(seed=1.5), r"seed \(--seed\) must be an int in \[0, 2\*\*32\)"),
    # jax.random.key keeps the low 32 bits: 2**32 drew seed 0's text, and 2**64 crashed with an OverflowError.
    (dict(seed=2**32), r"must be an int in \[0, 2\*\*32\); got 4294967296"),
    (dict(seed=2**64), "must be an int in"),
    (dict(seed=-1), "must be an int in"),
])
def test_sample_config_refuses_bad_settings(settings, message):
  with pytest.raises(ValueError, match=message):
    sample_lib.SampleConfig(**settings)


def test_generate_refuses_bad_prompts_and_windows():
  graphdef, params = nnx.split(_model())
  one = sample_lib.SampleConfig(new_tokens=1)
  for prompt, message in ((np.zeros(0, np.int32), "non-empty 1D array"), (np.ones((2, 3), np.int32), "1D"),
                          (np.asarray([1.5]), "token ids"), (np.asarray([3, 256]), r"lie in \[0, 256\)")):
    with pytest.raises(ValueError, match=message):
      sample_lib.generate(graphdef, params, prompt, one, window=8)
  for window in (0, 33, 8.0):
    with pytest.raises(ValueError, match=r"window must be an int in \[1, max_seq_len=32\]"):
      sample_lib.generate(graphdef, params, np.asarray([1]), one, window=window)


def test_non_finite_logits_are_an_error():
  graphdef, params = nnx.split(_model())
  params = jax.tree.map(lambda p: p * jnp.nan if p.ndim == 2 else p, params)
  with pytest.raises(ValueError, match="logits are not finite at new token 0"):
    sample_lib.generate(graphdef, params, np.asarray([1, 2]), sample_lib.SampleConfig(new_tokens=2), window=8)


def test_encode_inverts_decode_for_bytes():
  dataset = data_lib.TokenDataset(train=np.zeros(0, np.uint16), val=np.zeros(0, np.uint16), vocab_size=256,
                                  source="test")
  text = "ROMEO: Wherefore art thou — ä\n"
  ids = data_lib.encode(dataset, text)
  assert ids.dtype == np.int32 and ids.size == len(text.encode("utf-8"))
  assert data_lib.decode(dataset, ids) == text
  with pytest.raises(ValueError, match="encode takes a str"):
    data_lib.encode(dataset, b"bytes")


@pytest.mark.slow
def test_cli_samples_a_trained_run_in_its_last_phase(tmp_path, capsys):
  """nvfp4 then BF16 from step 2 (--switch-at 0.5): the step-4 checkpoint samples with every layer in BF16, the same
  tokens for the same seed, and what generate gives on the restored params."""
  out = tmp_path / "run"
  assert cli.main(["train", "--model", "tiny", "--model.n_layers", "1", "--recipe", "nvfp4", "--steps", "4",
                   "--seq-len", "32", "--switch-at", "0.5", "--eval-batches", "0", "--progress", "false",
                   "--out", str(out)]) == 0
  capsys.readouterr()
  argv = ["sample", "--out", str(out), "--tokens", "12", "--temperature", "0.9", "--top-k", "20", "--json"]
  assert cli.main(argv) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["step"] == 4 and result["layers"] == {"bf16": 7} and result["window"] == 32
  assert len(result["tokens"]) == 12 and result["new_tokens"] == 12 and result["top_k"] == 20
  assert cli.main(argv) == 0
  assert json.loads(capsys.readouterr().out)["tokens"] == result["tokens"]
  # The default prompt: the held-out text's first 32 tokens; the text: the tokens decoded.
  from fp4jax.pretrain import trainer  # pylint: disable=g-import-not-at-top
  setup = trainer.eval_setup(out, eval_batches=1, log=None)
  assert result["prompt"] == data_lib.decode(setup.dataset, setup.dataset.val[:32])
  assert result["text"] == data_lib.decode(setup.dataset, result["tokens"])
  run = trainer.restore_run(out, setup)
  again = sample_lib.generate(run.phases.graphdef(run.at), run.params, setup.dataset.val[:32].astype(np.int32),
                              sample_lib.SampleConfig(new_tokens=12, temperature=0.9, top_k=20), window=32,
                              model_key=run.keys["eval"], vocab_size=256)
  assert again.tolist() == result["tokens"]
  # Plain text, and the errors a user can make.
  assert cli.main(["sample", "--out", str(out), "--prompt", "ROMEO:", "--tokens", "5"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith("ROMEO:") and "linear layers: 7 bf16" in captured.err
  assert cli.main(["sample", "--out", str(out), "--prompt", ""]) == cli.EXIT_USAGE
  assert "The prompt is empty" in capsys.readouterr().err
  assert cli.main(["sample", "--out", str(out), "--temperature", "-1"]) == cli.EXIT_USAGE
  assert "temperature (--temperature) must be a finite number >= 0" in capsys.readouterr().err
  assert cli.main(["sample", "--out", str(tmp_path / "none")]) == cli.EXIT_USAGE
  assert "No checkpoints" in capsys.readouterr().err


def test_outcontrol_channels_reach_the_sampled_forward():
  """With an OutControlState, the drawn token is the argmax of the model whose tracked layers run those channels in
  MXFP8 (here channels 0..k-1 of each: the split changes the logits)."""
  from fp4jax.pretrain import outcontrol  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain import steps  # pylint: disable=g-import-not-at-top
  from fp4jax.pretrain.config import TrainConfig  # pylint: disable=g-import-not-at-top
  config = TrainConfig.from_options(recipe="nvfp4", outcontrol_fraction=0.05, outcontrol_start=0)
  config = config.replace(**{"model.n_layers": 1, "model.max_seq_len": 32})
  oc_state = outcontrol.initial_state(config)
  oc_state = oc_state._replace(idx=jax.tree.map(lambda i: jnp.arange(i.size, dtype=jnp.int32), oc_state.idx))
  model = _model("nvfp4")
  graphdef, params = nnx.split(model)
  prompt, key = np.asarray([3, 1, 4, 1, 5, 9, 2, 6], np.int32), jax.random.key(4)
  got = sample_lib.generate(graphdef, params, prompt, sample_lib.SampleConfig(new_tokens=1, temperature=0.0),
                            window=8, model_key=key, outcontrol=oc_state)
  forward = lambda oc: jax.jit(lambda p, t: (steps.with_outliers(nnx.merge(graphdef, p), oc) if oc else  # noqa: E731
                                             nnx.merge(graphdef, p))(t, key=key))(params, jnp.asarray([prompt]))
  with_oc, without = forward(oc_state), forward(None)
  assert not np.array_equal(np.asarray(with_oc), np.asarray(without))  # the channels do change the forward
  assert got.tolist() == [int(jnp.argmax(with_oc[0, -1]))]
