"""Quantize + dequantize throughput (elements/s) on the CPU, each as a ratio to a same-run copy-like baseline.

  python benchmarks/quantize.py [--size 4096] [--repeats 5] [--warmup 2] [--dtypes float32,bfloat16] [--hlo]

Every computation is jitted with its input donated, warmed up, and timed as the median of `--repeats` runs on a
`size x size` tensor (16M elements by default). The baseline reads the input and writes an output of the same size
and dtype (`x + 1`); "vs baseline" is throughput / baseline throughput, measured in the same run (from the medians;
"(min)" from the fastest runs, steadier when other processes share the cores); "faults/call" counts the process's minor
page faults per call (memory the call maps in afresh, see below). Each call's result is freed after the clock
stops (common.time_jitted): until 2026-12-02 it was freed inside the timed region, and unmapping a 64 MiB result
(~4.5 ms, more than the in-place baseline's 2.5) made every ratio look 1.5-2.3x better than it was (float32 SR
q+dq 0.49 instead of 0.20-0.26; benchmarks/RESULTS.md, "Correction"). Rows ("q+dq" is `fake_quant`, bit-identical to
`dequantize(quantize(x))`, with the codes decoded in the same fused pass):
  x+1 into a new buffer       the baseline without donation: the output is a freshly allocated buffer
  nvfp4 rne / sr q+dq         NVFP4, round-to-nearest-even / stochastic rounding (32 random bits, the default
                              counter-based hash generator of fp4jax.prng, fused into the elementwise pass)
  nvfp4 sr q+dq, threefry     stochastic rounding with sr_bits="threefry" (jax.random.bits, the reference)
  nvfp4 rne / sr +rht q+dq    the same after a 16-point random Hadamard transform along the blocked axis
  nvfp4 rne +rht axis0 q+dq   RHT and blocks along axis 0 (Wgrad's token axis: the RHT runs in place, no transposes)
  nvfp4 rne 2d q+dq           16x16 blocks (the weights' layout)
  mxfp4 q+dq                  MXFP4, OCP floor scale rule
  nvfp4 quantize              quantize() alone: packed codes + E4M3 scales + amax (outputs 9/16 of a float32 size)
  nvfp4 dequantize            dequantize() alone, from a QArray (the input is not donatable: new output buffer)
  nvfp4 dequantize(quantize)  the two public calls composed in one jit (codes packed, unpacked, decoded)

HLO findings (XLA:CPU, jax 0.10.2, AVX-512 host; `--hlo` prints the kernels of the NVFP4 RNE chain):
  Before (fake_quant = dequantize(quantize(x)) on x reshaped to [.., S/16, 16]): 0.02x the baseline. Kernels: a
  global amax reduction, a block-amax reduction over the minor 16-axis (YNNPACK: slow, and it drops NaN), the
  per-block scales, and one loop fusion for the rest. That fusion decoded E2M1 with a gather (a table lookup per
  element, not vectorised), unpacked nibbles with a concatenate (a branch per element) and packed them with stride-2
  slices, so each output recomputed both codes of its byte through frexp-based rounding; the blocked reshape of the
  input also stopped XLA from writing in place into the donated input (a full-size copy plus a fresh,
  page-faulting output buffer).
  After: 2 passes over the data (the baseline makes 1): (1) block amax, one integer-max reduction of the |x| bit
  patterns (NaN-propagating, vectorised by XLA itself, a standard reduction that partitions under sharding);
  (2) one elementwise loop fusion that reads x and writes the result in place: scale, RNE onto E2M1 (exponent-bit
  arithmetic, no frexp), times block and global scale: 47 instructions per 16-element block (AVX-512VL, ymm).
  In between, small kernels on 1/16 of the data (block scales, encode scales; the global amax is one unsigned
  integer max over the block amaxes' bits, which XLA emits itself: the float max it replaced went to YNNPACK, which
  drops NaN, and needed a NaN-check kernel and a reduction of its own). quantize() adds integer-compare codes and a
  uint16 pack (no stride-2 reads); dequantize() decodes arithmetically, and alone it writes a fresh output buffer,
  whose page faults dominate its time here.
  Pitfalls found on the way: XLA duplicates cheap per-block producers into their broadcasting consumer (the E4M3
  rounding of each block scale ran once per element) but not a divide, so per-block scales end in an exact
  division; XLA merges reduce(reduce(x)) with one computation into a full-size reduction and splits reductions over
  more than 32 elements into a tree with |x| materialised, so long and 2D blocks reduce in two stages of different
  kinds; the SPMD partitioner rejects reductions with a custom computation, so every reduction is a plain max.
  Stochastic rounding used to be bound by generating 32 random bits per element (threefry: ~17 ns per element on
  this CPU; an "rbg" key, XLA's RngBitGenerator, was no faster). The default generator hashes (seed, element index)
  inside the elementwise loop (fp4jax.prng: an iota and two multiply/xor-shift rounds, ~20 vector instructions per
  8 elements, no random tensor in memory), and the round-up probability is the fractional part of |y| / step
  (grids.e2m1_floor_fraction: the gap to the upper neighbour always equals the step of |y|'s binade), so the SR
  loop is 78 LLVM IR instructions per 8 elements (85 with the gap lookup), against RNE's ~45.
  Where the time goes (LLVM IR of the kernels, AVX-512 host, XLA vectorises 8-wide): the block amax along the
  minor axis is ~3.4 instructions per element (XLA vectorises across blocks, so each block's 16 elements are
  gathered by scalar loads); the RNE loop ~5.7, the SR loop ~9.8. Both passes are compute-bound, not memory-bound.
  RHT: the 16-point RHT is 16 broadcast multiply-adds per element (fp4jax.rht.mix_fixed_order, in the dot's order: the
  same bits), ~7.8 instructions per element in its own loop, whose result XLA writes out and the quantizer's two
  passes read: RNE+RHT makes 3 passes against q+dq's 2, and ~17 instructions per element in all. A bfloat16 input
  used to be converted into a float32 copy first (a fourth pass: XLA fuses a producer into at most 15 differently
  indexed users, and the convert had 16 slices); it is now widened inside the RHT loop. Recomputing the RHT inside
  both quantizer passes instead of writing it out (tried: two optimization-barrier copies of x, so that CSE keeps
  both) fuses as intended, but is slower on this CPU: along the token axis the two passes run the 16 multiply-adds
  twice (~1.35x the CPU time of writing and reading the result), and along the minor axis the rounding pass's
  output is the flat [M, N] array, so XLA indexes the 16-tiles through a reshape and LLVM no longer vectorises the
  loop (scalar code, ~2.7x slower). The 0.3 target for RNE+RHT is out of reach for XLA:CPU's loop emitter here:
  ~17 instructions per element are ~270M per 16M elements, >= 15 ms on two cores even at 3 per cycle and 3 GHz,
  against ~3 ms for the memory-bound copy: <= 0.2.
  Page faults (Linux, glibc; AMD Zen 4 host): a buffer a call allocates is, above glibc's 32 MiB limit for heap
  reuse, a fresh mapping that the kernel faults in one 4 KiB page at a time on first write, on every call: 16,385
  faults per call for a float32 output of 16M elements. Writing `x+1` into such a buffer took 19-21 ms against
  2.3-7 ms in place. The RHT's output is such a buffer (no XLA kernel writes a transform that mixes 16 elements
  into its input's memory), and that write, not the 16 multiply-adds, was most of RNE+RHT's extra time. With
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc >= 2.35; transparent huge pages in "madvise" mode) malloc asks for
  2 MiB pages: ~550 faults per call, and every row got faster (float32 RNE+RHT 35 -> 16 ms, q+dq 11 -> 7 ms; the
  in-place baseline's 7 -> 3 ms was the cheaper unmapping of its result, which the timer then counted: 2.5 ms in
  both modes with the result freed after the clock). With the fixed timer RNE+RHT is 0.09 (0.14 with 2 MiB pages):
  the RHT is still one more full-size write and read than q+dq makes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fp4jax  # noqa: E402
from benchmarks import common  # noqa: E402

BASELINE = "baseline x+1"
FRESH = "x+1 into a new buffer"
NVFP4 = fp4jax.NVFP4()
MXFP4 = fp4jax.MXFP4()


def _rht(x):
  return fp4jax.random_hadamard(x, size=16, axis=-1)


def computations(x, key):
  """(name, fn, args, donate_argnums) for each row; every fn returns a result of x's size."""
  q = jax.jit(lambda x: fp4jax.quantize(x, NVFP4))(x)
  return [
      (BASELINE, lambda x: x + jnp.asarray(1, x.dtype), (x,), (0,)),
      (FRESH, lambda x: x + jnp.asarray(1, x.dtype), (x,), ()),
      ("nvfp4 rne q+dq", lambda x: fp4jax.fake_quant(x, NVFP4), (x,), (0,)),
      ("nvfp4 sr q+dq", lambda x, k: fp4jax.fake_quant(x, NVFP4, rounding="stochastic", key=k), (x, key), (0,)),
      ("nvfp4 sr q+dq, threefry", lambda x, k: fp4jax.fake_quant(x, NVFP4, rounding="stochastic", key=k,
                                                                   sr_bits="threefry"), (x, key), (0,)),
      ("nvfp4 rne +rht q+dq", lambda x: fp4jax.fake_quant(_rht(x), NVFP4), (x,), (0,)),
      ("nvfp4 rne +rht axis0 q+dq",
       lambda x: fp4jax.fake_quant(fp4jax.random_hadamard(x, size=16, axis=0), NVFP4, axis=0), (x,), (0,)),
      ("nvfp4 sr +rht q+dq", lambda x, k: fp4jax.fake_quant(_rht(x), NVFP4, rounding="stochastic", key=k), (x, key),
       (0,)),
      ("nvfp4 rne 2d q+dq", lambda x: fp4jax.fake_quant(x, NVFP4, block_2d=True), (x,), (0,)),
      ("mxfp4 q+dq", lambda x: fp4jax.fake_quant(x, MXFP4), (x,), (0,)),
      ("nvfp4 quantize", lambda x: fp4jax.quantize(x, NVFP4), (x,), ()),  # outputs are smaller: nothing to reuse
      ("nvfp4 dequantize", lambda q: fp4jax.dequantize(q, q.dtype), (q,), ()),
      ("nvfp4 dequantize(quantize)", lambda x: fp4jax.dequantize(fp4jax.quantize(x, NVFP4), x.dtype), (x,), (0,)),
  ]


def run(size: int, repeats: int, warmup: int, dtypes: list[str]) -> list[common.Timing]:
  """Times every computation for every dtype; returns the timings in table order."""
  timings = []
  for dtype in dtypes:
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    for name, fn, args, donate in computations(x, jax.random.key(1)):
      timings.append(common.time_jitted(fn, args, name=name, group=jnp.dtype(dtype).name, elements=x.size,
                                        donate_argnums=donate, warmup=warmup, repeats=repeats))
  return timings


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", type=int, default=4096, help="the tensor is size x size (default 4096: 16M elements)")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs per computation (median reported)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed runs after the compile")
  parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated input dtypes")
  parser.add_argument("--hlo", action="store_true", help="also print the optimised HLO kernels of nvfp4 rne q+dq")
  args = parser.parse_args(argv)
  if args.size < 32 or args.size % 32:
    parser.error(f"--size must be a positive multiple of 32 (the MXFP4 block); got {args.size}.")
  if args.repeats < 1:
    parser.error("--repeats must be >= 1.")
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0; got {args.warmup}.")
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  for d in dtypes:
    if d not in ("float32", "bfloat16", "float16"):
      parser.error(f"unsupported dtype {d!r}: use float32, bfloat16 or float16.")

  timings = run(args.size, args.repeats, args.warmup, dtypes)
  n = args.size * args.size
  title = (f"quantize+dequantize throughput, {args.size}x{args.size} ({n / 1e6:.3g}M elements), "
           f"median of {args.repeats} (warmup {args.warmup}), {jax.devices()[0].platform} x{os.cpu_count()} cores; "
           f"{common.malloc_note()}")
  common.print_ratio_table(timings, BASELINE, title)
  if args.hlo:
    x = jnp.zeros((args.size, args.size), jnp.float32)
    print("\noptimised HLO kernels of nvfp4 rne q+dq (* = a pass over full-size data):")
    print("\n".join(common.hlo_passes(lambda x: fp4jax.fake_quant(x, NVFP4), (x,), n)))
  return timings


if __name__ == "__main__":
  main()
