"""Test setup: 4 forced CPU devices (set before JAX initialises) so sharding tests run on any machine; a digits
CNN trained a little, shared by the handler tests."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
hypothesis.settings.load_profile("ci")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def trained():
    """(TrainState with adam after 40 steps on the digits, its last gradients, (train x, train y, val x, val y))."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import digits

    tx, ty, vx, vy = digits.load()
    state = digits.create_state(0)
    stream = digits.batches(tx, ty, 64, 0)
    for _ in range(40):
        state, _, grads = digits.train_step(state, *next(stream))
    return state, grads, (tx, ty, vx, vy)
