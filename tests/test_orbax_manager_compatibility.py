"""Orbax's v1 manager-compatibility test base (`manager_compatibility_test_base`, shipped in the orbax-checkpoint
wheel with the checkpoints it reads: written by Orbax's v0 CheckpointManager and its v1 Checkpointer), run with
`ij.v1_registry(...)` as the handler registry: every pytree of those Orbax-written steps is loaded through
inshrink_jax's PyTreeHandler, as a run that moved to inshrink_jax reads the steps Orbax wrote before it."""

import pytest

pytest.importorskip("chex")  # Orbax's test utilities import it (the dev extra installs it)
absl_flags = pytest.importorskip("absl.flags")
absl_flags.FLAGS(["pytest"], known_only=True)  # absltest's temporary directories read its flags

from orbax.checkpoint.experimental.v1._src.testing.compatibility import manager_compatibility_test_base  # noqa: E402

import inshrink_jax as ij  # noqa: E402


class TestManagerCompatibility(manager_compatibility_test_base.ManagerCompatibilityTestBase):
    def setup_registry(self):
        return ij.v1_registry(ij.CompressionConfig(min_compress_size=2**62, optimizer="lossless"))
