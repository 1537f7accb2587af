"""Orbax's v1 training-checkpointer test base (`checkpointer_test_base.CheckpointerTestBase`, shipped in the
orbax-checkpoint wheel), run with every pytree saved and loaded by inshrink_jax: during each test, v1's global
handler registry holds the entries of `ij.v1_registry(...)` (our PyTreeHandler in place of Orbax's), in lossless
mode so that its exact-equality assertions apply. (The registry is swapped globally, not through an outer
`ocp.v1.Context`: the base's tests enter contexts of their own, and a checkpointer re-entering one of them
returns to the outer context on exit.) Skips, each with its reason, are listed in
docs/limitations.md."""

import unittest
from unittest import mock

import pytest

pytest.importorskip("chex")  # Orbax's test utilities import it (the dev extra installs it)
absl_flags = pytest.importorskip("absl.flags")
absl_flags.FLAGS(["pytest"], known_only=True)  # absltest's temporary directories read its flags

from orbax.checkpoint.experimental import v1 as ocp_v1  # noqa: E402
from orbax.checkpoint.experimental.v1._src.handlers import registration  # noqa: E402
from orbax.checkpoint.experimental.v1._src.training import checkpointer_test_base  # noqa: E402

import inshrink_jax as ij  # noqa: E402

LOSSLESS = ij.CompressionConfig(min_compress_size=2**62, optimizer="lossless")


class TestV1Checkpointer(checkpointer_test_base.CheckpointerTestBase.Test):
    def setUp(self):
        super().setUp()
        ours, glob = ij.v1_registry(LOSSLESS), registration.global_registry()
        self.enter_context(mock.patch.object(glob, "_registry", list(ours._registry)))
        self.enter_context(mock.patch.object(glob, "_secondary_typestrs", dict(ours._secondary_typestrs)))

    # test_close and test_context_manager_close assert that the step's temporary directory exists as soon as
    # save_async returns. Under v1's default AsyncOptions (create_directories_asynchronously=True) that directory is
    # made by a background thread, so the assertion races it (it failed on a loaded 2-core CI run); with directories
    # made synchronously the order is the one the assertion means, and everything else the tests check is unchanged.
    def _with_sync_directories(self, test):
        context = ocp_v1.Context()
        context.async_options.create_directories_asynchronously = False
        with context:
            test()

    def test_close(self):
        self._with_sync_directories(super().test_close)

    def test_context_manager_close(self):
        self._with_sync_directories(super().test_context_manager_close)

    @unittest.skip("asserts Orbax's OCDBT data files (d/ and their mtimes), which inshrink_jax does not write")
    def test_save_async(self):
        pass

    def test_context_constructor_override(self):
        # Its local_context_override case asserts that Orbax's manifest.ocdbt was written; the others apply.
        def check(cond, msg=None):
            if "manifest.ocdbt" not in str(msg):
                unittest.TestCase.assertTrue(self, cond, msg)

        with mock.patch.object(self, "assertTrue", check):
            super().test_context_constructor_override()


# v1 finds the pytree of `metadata(step)`, `load(step)` and a save decision's metadata without a checkpointable name
# by Orbax's own `_METADATA` file, which inshrink_jax does not write (`checkpointables_metadata(step)` and
# `load(step, abstract)` work: docs/limitations.md).
for _name in [n for n in dir(TestV1Checkpointer) if n.startswith("test_metadata")] + ["test_custom_save_decision_policy"]:
    setattr(TestV1Checkpointer, _name, unittest.skip(
        "needs Orbax's _METADATA file to resolve the pytree's name (AUTO layout resolution)")(lambda self: None))
