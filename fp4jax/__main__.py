"""`python -m fp4jax train|eval ...`: the pretraining CLI (fp4jax.pretrain.cli)."""

import sys

from fp4jax.pretrain.cli import main

if __name__ == "__main__":
  sys.exit(main())
