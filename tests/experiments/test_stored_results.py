"""The stored-results comparison: numbers asserted for the platform they were stored for, structure elsewhere."""

import pytest

import stored_results
from platform_numerics import platform

STORED = {"loss": 3.2444, "errs": [0.1, float("nan")], "name": "nvfp4", "n": 3}
ELSEWHERE = {"loss": 3.25, "errs": [0.2, float("nan")], "name": "nvfp4", "n": 3}


def test_numbers_are_asserted_for_the_platform_they_were_stored_for():
  stored = {"first": ELSEWHERE, stored_results.platform_folder(platform()): STORED}
  assert stored_results.check_reproduces(dict(STORED, loss=3.2444 * (1 + 5e-4), seconds=9.0), stored) is None
  with pytest.raises(AssertionError, match="results.loss"):
    stored_results.check_reproduces(dict(STORED, loss=3.26), stored)


def test_elsewhere_a_differing_number_is_reported_and_the_structure_asserted():
  stored = {"first_platform": STORED, "another_platform": ELSEWHERE}
  assert stored_results.check_reproduces(dict(STORED), stored) is None
  note = stored_results.check_reproduces(dict(STORED, loss=3.26), stored)
  assert platform() in note and "first_platform" in note and "results.loss" in note
  for broken in (dict(STORED, errs=[0.1]), dict(STORED, errs=[0.1, 0.2]), dict(STORED, name=1),
                 {k: v for k, v in STORED.items() if k != "n"}):
    with pytest.raises(AssertionError):
      stored_results.check_reproduces(broken, stored)


def test_the_first_platform_is_read_from_data_and_others_from_their_folders():
  got = stored_results.stored("probes_smoke_results.json")
  assert next(iter(got)) == stored_results.platform_folder(stored_results.FIRST_PLATFORM)
  assert all("checkpoint" not in r and "seconds" not in r and r["preset"] == "smoke" for r in got.values())
