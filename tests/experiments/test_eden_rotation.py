"""experiments.probes.eden_rotation: MS-EDEN's dY estimate behind the RHT keeps a bias floor that a uniformly random
rotation removes (why Quartet II's Wgrad does not average to the quantized forward's gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.probes import eden_rotation


def _tensors():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x_MxK = jax.random.normal(k1, (512, 16))
  # Token gradients of very different sizes (log-normal, sigma 2): a few tokens carry most of dY, as in an LM.
  scale_Mx1 = jnp.exp(2.0 * jax.random.normal(k3, (512, 1)))
  dy_MxN = (0.5 * x_MxK + jax.random.normal(k2, (512, 16))) * scale_Mx1
  return x_MxK, dy_MxN


def test_rotations_are_orthogonal_and_undone():
  v = jax.random.normal(jax.random.key(2), (64, 3))
  for kind in eden_rotation.ROTATIONS:
    rot = eden_rotation._rotation(kind, 32, jax.random.key(3))  # pylint: disable=protected-access
    np.testing.assert_allclose(np.asarray(rot @ rot.T), np.eye(32), atol=1e-5)
    back = eden_rotation._apply(eden_rotation._apply(v, rot, False), rot, True)  # pylint: disable=protected-access
    np.testing.assert_allclose(np.asarray(back), np.asarray(v), atol=1e-5)
  with pytest.raises(ValueError, match="rotation must be"):
    eden_rotation._rotation("dct", 32, jax.random.key(3))  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="multiple of the rotation size"):
    eden_rotation.dy_estimate(v[:48], "rht", 32, jax.random.key(3))


def test_eden_floor_is_the_rht_not_the_quantizer():
  # 128 draws, fixed keys. Measured: RHT floor 0.021, Haar 0.000 (floor estimate noise ~0.003 at zero bias).
  x, dy = _tensors()
  got = {kind: eden_rotation.wgrad_floor(x, dy, kind, 32, jax.random.key(1), num_draws=128)
         for kind in eden_rotation.ROTATIONS}
  assert got["rht"]["floor"] > 0.015
  assert got["haar"]["floor"] < 0.006
  # The noise falls like 1/sqrt(K) behind the Haar rotation: the mean of 128 draws is mostly noise left over.
  assert got["haar"]["bias"] < 2.0 * got["haar"]["err"] / np.sqrt(128)


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
  """--draws 1 gave floor = nan (a 0 / 0), and a missing checkpoint a CheckpointError traceback."""
  with pytest.raises(SystemExit) as e:
    eden_rotation.main(["--draws", "1"])
  assert e.value.code == 2 and "--draws must be >= 2" in capsys.readouterr().err
  assert eden_rotation.main(["--checkpoint", str(tmp_path / "nope"), "--draws", "4"]) == 2
  assert capsys.readouterr().err.startswith("error: ")
