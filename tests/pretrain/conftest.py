"""Fixtures shared by the pretraining tests."""

import pytest

from fp4jax.pretrain import data
from fp4jax.pretrain import steps as steps_lib


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """A per-module data cache folder and compile cache, so a module's tiny runs compile each graph once."""
  return {"data": data.DataConfig(cache_dir=str(tmp_path_factory.mktemp("data_cache"))),
          "cache": steps_lib.CompileCache()}
