"""Where the Pallas kernels can run: backend detection, interpret-mode default, Triton compiler parameters.

Backend choice (the Pallas *Triton* backend, selected explicitly with `jax.experimental.pallas.triton.CompilerParams`):
  * jax 0.10 made Mosaic GPU the default lowering of `pl.pallas_call` on GPU (`jax_pallas_use_mosaic_gpu=True`) and
    deprecates `pl.pallas_call` for Mosaic GPU in favour of `plgpu.kernel`. Passing Triton compiler params keeps a
    `pl.pallas_call` on the Triton lowering, which jax 0.10 still ships and does not deprecate.
  * These kernels are elementwise bit manipulation (rounding, nibble packing, E4M3/E8M0 encode/decode) plus a bf16
    dot. Triton expresses that on plain register tiles and picks layouts, wgmma/mma and software pipelining itself;
    Mosaic GPU wants warpgroup layouts, explicit SMEM/TMA pipelines and has narrower elementwise/integer coverage.
  * The Triton lowering runs in Python at trace time, so every kernel lowers for `cuda` on a CPU-only machine
    (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`): the kernels are checked here without a GPU.
  * Hopper has no FP4 tensor cores: dequantizing tiles to bf16 in registers and using bf16 MMA is the emulation the
    spec prescribes; Triton's bf16 dot does that on sm_80+ and uses wgmma on sm_90.
  * Blackwell (compute capability >= 10) has native block-scaled FP4 MMA; jax exposes it as `jax.nn.scaled_matmul`
    (cuDNN). `fp4_matmul` routes there on such GPUs (see `matmul.py`); Triton is the path everywhere else.
  * jax 0.11 still ships the Triton lowering but deprecates it (a DeprecationWarning at lowering points to Mosaic
    GPU or to jax-triton with Triton's own bindings). If a future jax drops it, `available()` reports it and the
    wrappers raise with that reason; the kernels would then move to Mosaic GPU or jax-triton.
  * Lowering for cuda without a GPU: jax 0.10 assumes sm_90; jax 0.11 needs an abstract GPU device, which
    `cuda_lowering()` / `lower_for_cuda()` supply (feature-detected, no version checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax

MIN_COMPUTE_CAPABILITY = 8.0  # bf16 tensor-core dot in Triton
BLACKWELL_COMPUTE_CAPABILITY = 10.0


def triton_module():
  """`jax.experimental.pallas.triton`, or None when this jax has no Pallas Triton backend."""
  try:
    from jax.experimental.pallas import triton as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return plt if hasattr(plt, "CompilerParams") else None


def compiler_params(num_warps: int = 4, num_stages: int = 2):
  """Triton compiler parameters; their presence is what selects the Triton lowering of a `pl.pallas_call`."""
  plt = triton_module()
  if plt is None:
    return None
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def compute_capability(device=None) -> float | None:
  """The CUDA compute capability of `device` (default: the first device) as a float, or None off NVIDIA GPUs."""
  device = device or jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or cc is None:
    return None
  try:
    return float(cc)
  except (TypeError, ValueError):
    return None


H100_SM_COUNT = 132  # H100 / H200 SXM: the fallback when the device does not say


def core_count(device=None) -> int:
  """Streaming multiprocessors of a GPU device (jax's `core_count`), else the H100/H200 count."""
  try:
    device = device or jax.devices()[0]
  except RuntimeError:
    return H100_SM_COUNT
  n = getattr(device, "core_count", None)
  return int(n) if device.platform == "gpu" and isinstance(n, int) and n > 0 else H100_SM_COUNT


@functools.lru_cache(maxsize=None)
def _availability() -> tuple[bool, str]:
  if triton_module() is None:
    return False, f"jax {jax.__version__} has no Pallas Triton backend (jax.experimental.pallas.triton)."
  backend = jax.default_backend()
  if backend != "gpu":
    return False, (f"compiled Pallas kernels need an NVIDIA GPU; the default backend is {backend!r} "
                   "(interpret=True runs them, slowly, on any backend).")
  device = jax.devices()[0]
  cc = compute_capability(device)
  if cc is None:
    return False, f"device {device.device_kind!r} is not an NVIDIA CUDA GPU (Pallas Triton kernels are CUDA-only here)."
  if cc < MIN_COMPUTE_CAPABILITY:
    return False, f"{device.device_kind} has compute capability {cc}; the kernels need >= {MIN_COMPUTE_CAPABILITY}."
  return True, f"{device.device_kind} (compute capability {cc}), Pallas Triton backend, jax {jax.__version__}."


def available(reason: bool = False):
  """Whether the kernels can run compiled on the default backend here; with reason=True also returns why (str)."""
  ok, why = _availability()
  return (ok, why) if reason else ok


def resolve_interpret(interpret: bool | None) -> bool:
  """interpret=None: interpret mode on CPU, else compiled after checking `available()` (RuntimeError if not).

  An explicit interpret=False skips the check, so kernels can be traced and lowered for `cuda` on any machine.
  """
  if interpret is not None:
    return bool(interpret)
  if jax.default_backend() == "cpu":
    return True
  ok, why = _availability()
  if not ok:
    raise RuntimeError(f"Pallas FP4 kernels cannot run compiled: {why} Pass interpret=True, or use the XLA path "
                       "(fp4jax.quantize, recipe backend='xla').")
  return False


def has_scaled_matmul() -> bool:
  """Whether this jax has `jax.nn.scaled_matmul` (block-scaled MMA via cuDNN on Blackwell)."""
  return hasattr(jax.nn, "scaled_matmul")


def use_blackwell_path() -> bool:
  """True on GPUs with native block-scaled FP4 MMA (compute capability >= 10) when jax exposes it."""
  if not has_scaled_matmul() or jax.default_backend() != "gpu":
    return False
  cc = compute_capability()
  return cc is not None and cc >= BLACKWELL_COMPUTE_CAPABILITY


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def cuda_lowering(device_kind: str = "NVIDIA H200", num_cores: int = H100_SM_COUNT):
  """A context under which kernels lower for `cuda` on a machine without a GPU (for AOT lowering and tests).

  Lowering a Pallas Triton kernel asks for the target GPU. jax 0.10 falls back to sm_90 when no GPU is present;
  jax 0.11 refuses unless the abstract mesh names an abstract GPU (`jax.sharding.AbstractDevice` under
  `jax.sharding.use_abstract_mesh`). This context supplies one when this jax has those APIs and no GPU is
  attached, and does nothing otherwise, so callers need not know the jax version. Use it around
  `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`.
  """
  sharding = jax.sharding
  if _has_gpu() or not all(hasattr(sharding, n) for n in ("AbstractDevice", "AbstractMesh", "use_abstract_mesh")):
    return contextlib.nullcontext()
  wanted = dict(device_kind=device_kind, num_cores=num_cores, platform="cuda")
  fields = {f.name for f in dataclasses.fields(sharding.AbstractDevice)} if dataclasses.is_dataclass(
      sharding.AbstractDevice) else set(wanted)
  device = sharding.AbstractDevice(**{k: v for k, v in wanted.items() if k in fields})
  # Auto axes: with Explicit ones (0.11's default) avals carry shardings and the Triton lowering of reductions
  # trips over them.
  auto = getattr(getattr(sharding, "AxisType", None), "Auto", None)
  kwargs = {"axis_types": (auto,)} if auto is not None else {}
  mesh = sharding.AbstractMesh((1,), ("cuda_lowering",), abstract_device=device, **kwargs)
  return sharding.use_abstract_mesh(mesh)


def lower_for_cuda(fn, *args):
  """`jax.jit(fn)` traced on `args` (arrays or ShapeDtypeStructs) and lowered for cuda on any machine."""
  with cuda_lowering():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
