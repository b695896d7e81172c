"""Section `env`: one line naming what ran: jax, jaxlib, the CUDA plugin, Triton, the GPU, XLA_FLAGS."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess

from benchmarks.gpu import report


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def run(sec: report.Section) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  from pallas_kernels import platform  # pylint: disable=g-import-not-at-top
  plugins = [f"{d} {v}" for d in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                                  "jax-triton", "triton") if (v := _version(d))]
  dev = jax.devices()[0]
  ok, why = pallas_kernels.available(reason=True)
  line = (f"jax {jax.__version__}, jaxlib {jaxlib.__version__}; {', '.join(plugins) or 'no CUDA plugin'}; "
          f"backend {jax.default_backend()}, {len(jax.devices())} x {dev.device_kind} "
          f"(cc {platform.compute_capability(dev)}, {platform.core_count(dev)} SMs); "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  sec.add("environment", ok=ok if not sec.dry else None, note=line)
  sec.add("pallas kernels", note=why)
  if not sec.dry:
    try:
      smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,"
                            "power.draw,memory.used,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10, check=False)
      sec.add("nvidia-smi", note=(smi.stdout or smi.stderr).strip().replace("\n", "; "))
    except (OSError, subprocess.TimeoutExpired) as e:
      sec.add("nvidia-smi", note=f"unavailable: {e}")
  with open(os.path.join(sec.out, "env.txt"), "w", encoding="utf-8") as f:
    f.write(line + "\n" + why + "\n")
