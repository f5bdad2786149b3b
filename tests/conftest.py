"""Simulated devices: set before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8


@pytest.fixture(autouse=True, scope="session")
def _check_devices():
    assert jax.device_count() == NUM_DEVICES, "conftest must run before JAX initialises"


@pytest.fixture
def rng():
    return np.random.default_rng(0)
