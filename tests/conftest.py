"""Test setup: 4 forced CPU devices (set before JAX initialises) so sharding tests run on any machine."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile("ci", deadline=None, max_examples=40, derandomize=True)
hypothesis.settings.load_profile("ci")
