"""Command-line value parsers shared by recipe specs ("nvfp4:rht_size=4"), training options and precision policies.

Each parser takes the text of one value and returns a typed value or raises `BadValue` (a ValueError that argparse
also reports verbatim). No Flax, no JAX: the library and the CLI both import it.
"""

from __future__ import annotations

import argparse
import difflib
import re

_TRUE, _FALSE, _NONE = ("1", "true", "yes", "on"), ("0", "false", "no", "off"), ("none", "null")
_INT = re.compile(r"[+-]?\d+")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class BadValue(argparse.ArgumentTypeError, ValueError):
  """A value that does not parse; the message says what was expected."""


def closest(word: str, choices) -> str | None:
  """The choice closest to a misspelt `word` (difflib, similarity >= 0.6), or None. Dotted names are compared within
  their group ("model.d_modle" with the "model." choices, by the part after the dot), so a shared prefix does not
  make unrelated names look alike ("model.widht" is not "model.dtype")."""
  head, _, tail = str(word).rpartition(".")
  pool = {}
  for c in map(str, choices):
    c_head, _, c_tail = c.rpartition(".")
    if c_head == head:
      pool.setdefault(c_tail, c)
  close = difflib.get_close_matches(tail, list(pool), n=1, cutoff=0.6)
  return pool[close[0]] if close else None


def did_you_mean(word: str, choices) -> str:
  """" (did you mean 'x'?)" naming the choice closest to a misspelt `word`, or "" when none is close: for error
  messages that then list every valid choice (a typo in a 60-key list is hard to spot)."""
  match = closest(word, choices)
  return f" (did you mean {match!r}?)" if match else ""


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<choices>.*)\)$")


def with_option_hint(message: str, parser: argparse.ArgumentParser) -> str:
  """argparse's error `message`, with " (did you mean '--model'?)" when it is an unrecognized option like --modle,
  or " (did you mean 'tiny'?)" when it is an invalid choice like --model tinny."""
  choice = _INVALID_CHOICE.search(message)
  if choice:
    choices = [c.strip().strip("'\"") for c in choice.group("choices").split(",")]
    return message + did_you_mean(choice.group("word"), choices)
  if not message.startswith("unrecognized arguments: "):
    return message
  flags = [a.split("=")[0] for a in message.split(": ", 1)[1].split() if a.startswith("--")]
  if not flags:
    return message
  # Compared without their dashes, which every option shares ("--sed" is not close to "--preset").
  options = {o.lstrip("-"): o for o in parser._option_string_actions if o.startswith("--")}  # pylint: disable=protected-access
  match = closest(flags[0].lstrip("-"), options)
  return message + (f" (did you mean {options[match]!r}?)" if match else "")


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser, naming the option a misspelt one resembles (the entry points' parsers)."""

  def error(self, message):
    super().error(with_option_hint(message, self))


def parse_bool(text) -> bool:
  """ "true"/"yes"/"on"/"1" -> True, "false"/"no"/"off"/"0" -> False."""
  if isinstance(text, bool):
    return text
  low = str(text).strip().lower()
  if low in _TRUE:
    return True
  if low in _FALSE:
    return False
  raise BadValue(f"expected true/false, got {text!r}")


def parse_int(text) -> int:
  """ "12" -> 12; "1.5", "" and bools are refused."""
  if isinstance(text, int) and not isinstance(text, bool):
    return text
  low = str(text).strip()
  if not _INT.fullmatch(low):
    raise BadValue(f"expected an int, got {text!r}")
  return int(low)


def parse_number(text) -> int | float | None:
  """ "820" -> 820 (an int: a step), "0.82" -> 0.82 (a float: a fraction), "none" or "" -> None."""
  if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
    return text
  low = str(text).strip().lower()
  if low in ("", *_NONE):
    return None
  if _INT.fullmatch(low):
    return int(low)
  try:
    return float(low)
  except ValueError:
    raise BadValue(f"expected a number, got {text!r}") from None


MAX_LIST_RANGE = 65536  # indices in one "a-b" range of parse_int_list (block indices: a model's depth)


def parse_int_list(text) -> tuple[int, ...]:
  """ "3,5,7-9" -> (3, 5, 7, 8, 9); "" -> ()."""
  if isinstance(text, (tuple, list)):
    return tuple(parse_int(v) for v in text)
  out = []
  for part in (p.strip() for p in str(text).split(",")):
    if not part:
      continue
    match = _RANGE.fullmatch(part)
    if match is None:
      raise BadValue(f"bad list entry {part!r} in {text!r}; use e.g. '3,5,7-9'")
    lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
    if hi < lo:
      raise BadValue(f"bad range {part!r}: end before start")
    if hi - lo >= MAX_LIST_RANGE:  # expanding 0-30000000 took 3 GB before the list's users could refuse it
      raise BadValue(f"range {part!r} holds {hi - lo + 1} indices; ranges are limited to {MAX_LIST_RANGE}")
    out.extend(range(lo, hi + 1))
  return tuple(out)


def optional(parse):
  """`parse`, except that "none" / "null" give None."""

  def parse_optional(text):
    return None if text is None or str(text).strip().lower() in _NONE else parse(text)

  parse_optional.__name__ = getattr(parse, "__name__", "value")
  return parse_optional


def parse_scalar(text: str):
  """A recipe option value by its look: bool words, none, int, float, 'a+b' tuples, else the stripped string."""
  low = text.strip().lower()
  if low in _TRUE[1:]:  # "1" / "0" stay ints here: rht_size=1 is a size
    return True
  if low in _FALSE[1:]:
    return False
  if low in _NONE:
    return None
  for cast in (int, float):
    try:
      return cast(low)
    except ValueError:
      pass
  if "+" in text:  # tuples: rht_on=wgrad+dgrad
    return tuple(t.strip() for t in text.split("+") if t.strip())
  return text.strip()
