"""`python -m experiments.probes --preset {smoke,cpu,gpu} --out DIR`: see experiments/probes/__init__.py."""

import sys

from experiments.probes import run

if __name__ == "__main__":
  sys.exit(run.main())
