"""The stored-results comparison: numbers asserted where they were made, structure everywhere."""

import jax
import pytest

import stored_results

STORED = {"loss": 3.2444, "errs": [0.1, float("nan")], "name": "nvfp4", "n": 3}


def test_numbers_are_asserted_where_the_results_were_made(monkeypatch):
  monkeypatch.setattr(stored_results, "STORED_WITH", (jax.default_backend(), jax.__version__))
  assert stored_results.check_reproduces(dict(STORED, loss=3.2444 * (1 + 5e-4)), STORED) is None
  with pytest.raises(AssertionError, match="results.loss"):
    stored_results.check_reproduces(dict(STORED, loss=3.26), STORED)


def test_elsewhere_a_differing_number_is_reported_and_the_structure_asserted(monkeypatch):
  monkeypatch.setattr(stored_results, "STORED_WITH", ("cpu", "0.0.1"))
  note = stored_results.check_reproduces(dict(STORED, loss=3.26), STORED)
  assert "jax 0.0.1 on cpu" in note and "results.loss" in note
  for broken in (dict(STORED, errs=[0.1]), dict(STORED, errs=[0.1, 0.2]), dict(STORED, name=1),
                 {k: v for k, v in STORED.items() if k != "n"}):
    with pytest.raises(AssertionError):
      stored_results.check_reproduces(broken, STORED)
