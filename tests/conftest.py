"""Test setup: 8 simulated CPU devices (for mesh tests) must be configured before jax is imported.

Tests mirror the packages (tests/fp4jax, tests/pretrain, tests/analysis, tests/pallas_kernels, tests/experiments);
`reference.py` (the NumPy float64 reference) sits here and is importable from all of them.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_TESTS))
sys.path.insert(1, _TESTS)
