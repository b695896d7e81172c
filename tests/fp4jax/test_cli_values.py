"""Tests for fp4jax.cli_values: the one parser of command-line values (recipe options, training flags, policies)."""

import argparse
import subprocess
import sys

import pytest

from fp4jax import cli_values


def test_parsers():
  words = ("true", "YES", "on", "1", "false", "no", "off", "0")
  assert [cli_values.parse_bool(t) for t in words] == [True] * 4 + [False] * 4
  assert cli_values.parse_int(" -3 ") == -3
  assert cli_values.parse_number("820") == 820 and isinstance(cli_values.parse_number("820"), int)
  assert cli_values.parse_number("0.82") == 0.82 and cli_values.parse_number("none") is None
  assert cli_values.parse_int_list("3,5,7-9") == (3, 5, 7, 8, 9) and cli_values.parse_int_list("") == ()
  assert cli_values.optional(cli_values.parse_int)("null") is None
  assert [cli_values.parse_scalar(t) for t in ("true", "off", "none", "4", "0.5", "wgrad+dgrad", " ceil ")] == [
      True, False, None, 4, 0.5, ("wgrad", "dgrad"), "ceil"]
  assert cli_values.parse_scalar("1") == 1 and cli_values.parse_scalar("1") is not True  # sizes, not booleans


@pytest.mark.parametrize("parse, text, message", [
    (cli_values.parse_bool, "maybe", "expected true/false"), (cli_values.parse_int, "2.5", "expected an int"),
    (cli_values.parse_number, "abc", "expected a number"), (cli_values.parse_int_list, "3,x", "bad list entry"),
    (cli_values.parse_int_list, "5-3", "end before start")])
def test_errors_are_value_errors_argparse_reports(parse, text, message):
  with pytest.raises(ValueError, match=message) as info:
    parse(text)
  assert isinstance(info.value, argparse.ArgumentTypeError)


def test_imports_without_flax():
  code = "import sys, fp4jax.cli_values; print('flax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.split() == ["False"]



def test_misspelt_names_get_the_closest_valid_one(capsys):
  assert cli_values.did_you_mean("nvfpp4", ["bf16", "nvfp4", "mxfp4"]) == " (did you mean 'nvfp4'?)"
  assert cli_values.did_you_mean("qqq", ["bf16", "nvfp4", "mxfp4"]) == ""  # nothing close: no guess
  parser = cli_values.ArgumentParser(prog="p")
  parser.add_argument("--preset")
  parser.add_argument("--seeds", type=int)
  only_preset = cli_values.ArgumentParser(prog="p")
  only_preset.add_argument("--preset")
  for parser_, argv, hint in ((parser, ["--seedz", "2"], "--seedz 2 (did you mean '--seeds'?)"),
                              (parser, ["--seedz=2"], "--seedz=2 (did you mean '--seeds'?)"),
                              (parser, ["--xyz", "3"], "--xyz 3"),
                              (parser, ["stray"], "stray"),
                              # Compared without the dashes every option has: with them, --sed was "close".
                              (only_preset, ["--sed", "3"], "--sed 3")):
    with pytest.raises(SystemExit) as exit_info:
      parser_.parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith("p: error: unrecognized arguments: " + hint + "\n")


def test_a_misspelt_choice_gets_the_closest_valid_one(capsys):
  parser = cli_values.ArgumentParser(prog="p")
  parser.add_argument("--model", choices=["paper_1b", "small", "tiny"])
  for argv, hint in ((["--model", "tinny"], " (did you mean 'tiny'?)"), (["--model", "qqq"], "")):
    with pytest.raises(SystemExit) as exit_info:
      parser.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"invalid choice: '{argv[1]}'" in err and err.endswith(")" + hint + "\n"), err


def test_int_list_range_limit_is_exact():
  """parse_int_list refuses a range of more than MAX_LIST_RANGE indices and takes one of exactly that many: the
  boundary is pinned (an off-by-one would let 0-65536, one index too many, through)."""
  n = cli_values.MAX_LIST_RANGE
  assert len(cli_values.parse_int_list(f"0-{n - 1}")) == n
  with pytest.raises(ValueError, match=f"holds {n + 1} indices"):
    cli_values.parse_int_list(f"0-{n}")


def test_tuple_values_are_stripped_item_by_item():
  """'a + b' (spaces around the '+', as typed in a shell-quoted spec) gives the stripped items, so the recipe spec
  "nvfp4:rht_on=wgrad + dgrad" names the GEMMs "wgrad" and "dgrad", not " dgrad"."""
  assert cli_values.parse_scalar(" wgrad + dgrad ") == ("wgrad", "dgrad")
  assert cli_values.parse_scalar("wgrad+dgrad+") == ("wgrad", "dgrad")  # an empty item is dropped
