"""Per-block statistics (fp4jax.blocks) against NumPy."""

import jax.numpy as jnp
import numpy as np

from fp4jax import blocks


def test_block_std_is_the_population_std_of_each_block():
  """ddof 0, per block: two 1x16 blocks per row, each compared with numpy's population std."""
  x = jnp.asarray(np.arange(64, dtype=np.float32).reshape(2, 32) ** 1.5 / 7.0)
  block = (1, 16)
  std = blocks.block_std(x, block, blocks.block_amax(x, block))
  want = np.asarray(x).reshape(2, 2, 16).std(axis=-1, ddof=0)
  assert std.shape == (2, 2)
  np.testing.assert_allclose(np.asarray(std), want, rtol=1e-5)
