"""XLA's optimized HLO text, read by the tests that pin which work XLA fuses into which compiled kernel.

The text lists the module's computations, each from a header at column 0 (`%name (params) -> result {`, with
`ENTRY` before the entry's) to a `}` at column 0; their instructions are the indented lines between
(`%name = type opcode(operands), attributes`). A fused kernel's body is a computation its `fusion` instruction
`calls=` (XLA names them `%fused_computation[.N]`). Source metadata is dropped (an op name such as
`transpose(jvp(...))` in it is no instruction).
"""

import math
import re
from typing import NamedTuple

import jax

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(([^\n]*)\) -> ([^\n]*) \{$", re.M)
# A result type is an array type (f32[64,128]{1,0}) or a tuple of them; the opcode and its operands follow.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(?:,|$)")
_METADATA = re.compile(r", metadata=\{[^}]*\}")
# Ops that only relabel or copy an array: writer() looks through them to the kernel that computed it.
_LAYOUT_OPS = ("bitcast", "copy", "transpose", "reshape")


class Computation(NamedTuple):
  name: str
  result: str  # the header's result type: an array type or a tuple of them
  text: str  # header through closing brace, without metadata
  entry: bool


class Instruction(NamedTuple):
  name: str
  type: str  # the result type, layout included: f32[64,128]{1,0}
  opcode: str
  operands: tuple  # the names of the instructions it reads
  line: str  # without metadata

  @property
  def calls(self):
    """The computation a fusion, call or custom-call runs; None for other instructions."""
    m = re.search(r"\b(?:calls|to_apply)=%?([\w.\-]+)", self.line)
    return m.group(1) if m else None


def compiled_text(fn, *args) -> str:
  """The optimized HLO of jax.jit(fn) compiled for args (on the default backend), as text."""
  return jax.jit(fn).lower(*args).compile().as_text()


def computations(text: str) -> list:
  """The module's computations in text order, the entry included."""
  found = []
  for m in _HEADER.finditer(text):
    end = text.index("\n}", m.end()) + 2
    found.append(Computation(m.group(2), m.group(4), _METADATA.sub("", text[m.start():end]), bool(m.group(1))))
  return found


def fused_computations(text: str) -> list:
  """The bodies of the module's fused kernels (`%fused_computation...`)."""
  return [c for c in computations(text) if c.name.startswith("fused_computation")]


def entry(text: str) -> Computation:
  """The module's entry computation: its instructions are the program's kernels and the arrays they write."""
  return next(c for c in computations(text) if c.entry)


def instructions(computation: Computation) -> list:
  """The computation's instructions in order (not the header's parameter list)."""
  found = []
  for line in computation.text.splitlines()[1:-1]:
    m = _INSTRUCTION.match(line)
    if m:
      found.append(Instruction(m.group(1), m.group(2), m.group(3), tuple(re.findall(r"%([\w.\-]+)", m.group(4))),
                               line))
  return found


def sizes(type_text: str) -> list:
  """The element counts of the array types in `type_text`, in order (a scalar counts 1)."""
  return [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", type_text)]


def result_sizes(computation: Computation) -> list:
  """The element counts of what the computation yields (each array of a tuple)."""
  return sizes(computation.result)


def body(text: str, instruction: Instruction) -> str:
  """The code an entry instruction runs: the computation a fusion or call runs (a kernel's body), else its line."""
  if instruction.opcode not in ("fusion", "call", "custom-call") or instruction.calls is None:
    return instruction.line
  return next((c.text for c in computations(text) if c.name == instruction.calls), instruction.line)


def writer(text: str, name: str) -> Instruction:
  """The entry instruction that computes the array `name`: `name` itself, or for a bitcast, copy, transpose or
  reshape, the one that computes what it reads."""
  found = {i.name: i for i in instructions(entry(text))}
  i = found[name]
  while i.opcode in _LAYOUT_OPS and i.operands and i.operands[0] in found:
    i = found[i.operands[0]]
  return i


def gemms(text: str) -> list:
  """The entry's matrix products: its dot instructions and the kernels that run one (a fusion whose body holds a
  dot, a library matmul custom-call)."""
  bodies = {c.name: c.text for c in computations(text)}
  return [i for i in instructions(entry(text))
          if i.opcode == "dot" or (i.opcode == "fusion" and re.search(r" dot\(", bodies.get(i.calls, "")))
          or (i.opcode == "custom-call" and "matmul" in i.line)]
