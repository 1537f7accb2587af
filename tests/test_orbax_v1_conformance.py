"""Orbax's v1 training-checkpointer test base (`checkpointer_test_base.CheckpointerTestBase`, shipped in the
orbax-checkpoint wheel), run with every pytree saved and loaded by inshrink_jax: during each test, v1's global
handler registry holds the entries of `ij.v1_registry(...)` (our PyTreeHandler in place of Orbax's), in lossless
mode so that its exact-equality assertions apply. (The registry is swapped globally, not through an outer
`ocp.v1.Context`: the base's tests enter contexts of their own, and a checkpointer re-entering one of them
returns to the outer context on exit.) Skips, each with its reason, are listed in
docs/limitations.md."""

import contextlib
import unittest
from unittest import mock

import pytest

pytest.importorskip("chex")  # Orbax's test utilities import it (the dev extra installs it)
absl_flags = pytest.importorskip("absl.flags")
absl_flags.FLAGS(["pytest"], known_only=True)  # absltest's temporary directories read its flags

from orbax.checkpoint import test_utils  # noqa: E402
from orbax.checkpoint.experimental import v1 as ocp_v1  # noqa: E402
from orbax.checkpoint.experimental.v1._src.handlers import registration  # noqa: E402
from orbax.checkpoint.experimental.v1._src.training import checkpointer_test_base  # noqa: E402

import inshrink_jax as ij  # noqa: E402

Checkpointer = ocp_v1.training.Checkpointer

LOSSLESS = ij.CompressionConfig(min_compress_size=2**62, optimizer="lossless")


class TestV1Checkpointer(checkpointer_test_base.CheckpointerTestBase.Test):
    def setUp(self):
        super().setUp()
        ours, glob = ij.v1_registry(LOSSLESS), registration.global_registry()
        self.enter_context(mock.patch.object(glob, "_registry", list(ours._registry)))
        self.enter_context(mock.patch.object(glob, "_secondary_typestrs", dict(ours._secondary_typestrs)))

    # Orbax's test_close and test_context_manager_close check two intermediate states of an async save right after
    # save_async returns: that the step's temporary directory exists and that the step is not finalized yet. Both
    # are races on a loaded machine: under v1's default AsyncOptions (create_directories_asynchronously=True) a
    # background thread makes that directory (one CI run failed on it), and a save this small can be finalized in
    # the background before the check (another run failed on that). Here directories are made synchronously, so
    # something of the step exists once save_async returns; whether it is finalized yet is not asserted; what
    # close() (or leaving the context) must do, finish the save, is, and the step then loads back exactly.
    def _closing(self, in_context: bool):
        context = ocp_v1.Context()
        context.async_options.create_directories_asynchronously = False
        step_path = self.directory / "0"
        with context:
            checkpointer = Checkpointer(self.directory)
            with checkpointer if in_context else contextlib.nullcontext():
                checkpointer.save_async(0, self.pytree)
                self.assertNotEmpty(list(self.directory.iterdir()))  # the temporary directory (or the step)
                if not in_context:
                    checkpointer.close()
            self.assertTrue(step_path.exists())
        with Checkpointer(self.directory) as checkpointer:
            test_utils.assert_tree_equal(self, self.pytree, checkpointer.load(0, self.abstract_pytree))

    def test_close(self):
        self._closing(in_context=False)

    def test_context_manager_close(self):
        self._closing(in_context=True)

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
