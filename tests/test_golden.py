"""Checkpoints written by every earlier on-disk format version this release reads (tests/data/format_v<N>,
each written once by the release of that version with tests/data/make_golden.py) restore bit for bit as that
release restored them, and verify; a newer version and the unread ones are refused with a clear error."""

import os
import shutil

import jax
import numpy as np
import pytest

import inshrink_jax as ij
from inshrink_jax import cli, store

DATA = os.path.join(os.path.dirname(__file__), "data")
VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)


def restored_as_numpy(directory) -> dict:
    out = ij.InshrinkCheckpointHandler().restore(directory, ij.InshrinkRestore())
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(out)[0]
            if hasattr(x, "shape")}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_readable_version_restores_exactly(tmp_path, version):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, f"format_v{version}", "ckpt"), root)
    assert store.read_manifest(root / "1" / "default")[0].version == version
    expected = np.load(os.path.join(DATA, f"format_v{version}", "expected.npz"))
    for step in (0, 1):
        got = restored_as_numpy(root / str(step) / "default")
        want = {k[1:]: expected[k] for k in expected.files if k.startswith(str(step))}
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"format {version}, step {step}, leaf {k}")
            assert got[k].dtype == want[k].dtype
    assert store.Reader(root / "1" / "default").own.commit["bases"]  # step 1 is a delta: the chain is decoded
    assert cli.main(["verify", str(root)]) == 0


def rewrite_manifest(directory, **changes):
    body, _ = store.read_json(directory / store.MANIFEST, "manifest", directory)
    store.write_json(directory / store.MANIFEST, {**body, **changes})


def test_a_newer_version_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, f"format_v{VERSIONS[-1]}", "ckpt"), root)
    rewrite_manifest(root / "0" / "default", version=store.FORMAT_VERSION + 1)
    with pytest.raises(ij.CheckpointCorruptError, match=rf"step 0.*format version {store.FORMAT_VERSION + 1}, "
                                                          rf"this release reads up to {store.FORMAT_VERSION}"):
        restored_as_numpy(root / "0" / "default")


def test_format_version_1_is_refused_by_name(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "format_v2", "ckpt"), root)
    rewrite_manifest(root / "0" / "default", version=1)
    with pytest.raises(ij.CheckpointCorruptError, match="format version 1"):
        restored_as_numpy(root / "0" / "default")
