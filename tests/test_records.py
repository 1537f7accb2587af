"""Records of the on-disk format: the compact form of value tables in JSON, checksums, leaf entries."""

import json

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from inshrink_jax import records


@hypothesis.given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64))
def test_tables_rounded_by_the_encoders_are_stored_as_16_bit_ints_and_read_back_bit_exactly(values):
    """Format 16: every value table leaves the encoders rounded to bfloat16 (`quantize.bf16_table`: the nearest,
    toward zero where the nearest would pass the limit) and the records store each entry's upper 16 bits, read back
    bit for bit through JSON."""
    from inshrink_jax import quantize

    x = np.asarray(quantize.bf16_table(np.asarray(values, np.float32), float(np.finfo(np.float32).max)))
    # (within 2^-8 of itself, or of bfloat16's smallest step among float32's subnormals)
    assert np.all(np.isfinite(x)) and np.all(
        np.abs(x - np.asarray(values, np.float32)) <= np.maximum(np.abs(x) * 2.0**-8, 2.0**-133))
    bits = json.loads(json.dumps(records.table_bits(x)))
    assert all(type(b) is int and 0 <= b < 1 << 16 for b in bits)
    assert records.bits_table(bits).tobytes() == x.tobytes()


def test_a_table_that_is_not_finite_bfloat16_values_is_not_stored_and_not_read():
    with pytest.raises(ValueError, match="not finite bfloat16"):
        records.table_bits(np.float32([0.1]))  # not rounded: a bug of the encoder, never written
    with pytest.raises(ValueError, match="not finite bfloat16"):
        records.table_bits(np.float32([np.inf]))
    for bad in ([0x7F80], [1 << 16], [-1], [1.5], ["1"]):  # infinity, out of range, not an int
        with pytest.raises(records.RecordError):
            records.Leaf.from_json(_leaf(method="moments", bins=1, centres16=bad))
        with pytest.raises(records.RecordError, match="levels16"):
            records.Segment.from_json({"offset": 0, "length": 1, "crc32": 0, "codec": "zstd", "levels16": bad})
    with pytest.raises(records.RecordError, match="levels16"):  # both forms at once
        records.Segment.from_json({"offset": 0, "length": 1, "crc32": 0, "codec": "zstd", "levels": [0.5],
                                   "levels16": [0x3F00]})
    with pytest.raises(records.RecordError, match="centres16"):
        records.Leaf.from_json(_leaf(method="weights", bins=1, centres=[0.5], centres16=[0x3F00]))
    seg = records.Segment.from_json({"offset": 0, "length": 1, "crc32": 0, "codec": "zstd", "levels16": [0x3F00]})
    assert seg.table().tolist() == [0.5]


def test_a_record_reads_back_as_written_and_as_any_tool_rewrites_it_but_not_changed(tmp_path):
    # The reader checks the checksum over the body's bytes as write_json wrote them; a file that a tool rewrote
    # in another layout (indented, keys reordered) is checked against the body's canonical form instead; a change
    # of one value fails both.
    from inshrink_jax import store

    body = {"b": [1, 2.5, "x"], "a": {"nested": None, "n": 7}}
    path = tmp_path / "record.json"
    raw = store.write_json(path, body)
    assert store.read_json(path, "record", tmp_path)[0] == body
    wrapped = json.loads(raw)
    path.write_text(json.dumps({"body": wrapped["body"], "crc32": wrapped["crc32"]}, indent=2))
    assert store.read_json(path, "record", tmp_path)[0] == body
    for text in (raw.replace(b"7", b"8"), json.dumps({"body": {**body, "a": {"n": 8}}, "crc32": wrapped["crc32"]},
                                                     indent=1).encode()):
        path.write_bytes(text)
        with pytest.raises(store.CheckpointCorruptError, match="checksum mismatch"):
            store.read_json(path, "record", tmp_path)


def _leaf(**fields) -> dict:
    return {"path": [["d", "w"]], "keystr": "['w']", "kind": "quantized", "shape": [4], "dtype": "float32",
            **fields}


def test_a_second_moments_table_is_stored_by_its_positive_half_and_read_back_whole():
    """Format 13: a second moment's symmetric value table is stored by its positive half and `Leaf.table` gives
    the whole table bit for bit; a full table (older formats, or a first moment) is taken as it is; a closed-loop
    parameter has no centres in the manifest (its links' levels are in the offset tables), any other quantized
    leaf must have them, as many as its bins (or the half, for a second moment only)."""
    half = [1e-8, 3.5e-7, 2.25e-5]
    leaf = records.Leaf.from_json(_leaf(method="moments", bins=6, centres=half))
    assert leaf.halved
    whole = np.asarray([-2.25e-5, -3.5e-7, -1e-8, 1e-8, 3.5e-7, 2.25e-5], np.float32)
    assert leaf.table().tobytes() == whole.tobytes()
    old = records.Leaf.from_json(_leaf(method="moments", bins=6, centres=whole.tolist()))
    assert not old.halved and old.table().tobytes() == whole.tobytes()
    closed = records.Leaf.from_json(_leaf(method="weights", bins=63, coding=records.CLOSED_LOOP))
    assert closed.centres is None and closed.stored_centres(np.arange(63)) is None
    # The writer's side (format 16: bfloat16 bit patterns): a symmetric moment table is halved (and rebuilt
    # exactly), an asymmetric one kept whole.
    rounded = np.float32([-2.25e-5, -3.5e-7, -1e-8, 1e-8, 3.5e-7, 2.25e-5]).astype(np.float32)
    rounded = (rounded.view(np.uint32) & 0xFFFF0000).view(np.float32)
    stored = records.Leaf.from_json(_leaf(method="moments", bins=6, centres=half)).stored_centres(rounded)
    assert stored == records.table_bits(rounded[3:])
    again = records.Leaf.from_json(_leaf(method="moments", bins=6, centres16=stored))
    assert again.halved and again.table().tobytes() == rounded.tobytes()
    lopsided = rounded.copy()
    lopsided[0] *= 2
    assert records.Leaf.from_json(_leaf(method="moments", bins=6, centres=half)).stored_centres(lopsided) == \
        records.table_bits(lopsided)
    for bad in (_leaf(method="moments", bins=6, centres=half, scale_leaf="['v']"),  # a first moment: whole
                _leaf(method="weights", bins=6, centres=half),
                _leaf(method="weights", bins=6),  # open loop: its levels are only here
                _leaf(method="moments", bins=5, centres=half)):
        with pytest.raises(records.RecordError, match="invalid bins / centres"):
            records.Leaf.from_json(bad)


def test_a_save_writes_compact_centres_and_restores_the_same_state(tmp_path):
    """Through the handler, with Adam: each second moment's manifest entry holds half its table, each closed-loop
    parameter's none; each restored second moment is on the table `Leaf.table` rebuilds."""
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp

    import inshrink_jax as ij
    from inshrink_jax import store

    rng = np.random.default_rng(0)
    params = {f"layer{i}": {"kernel": jnp.asarray(rng.standard_normal((64, 32)) * 0.05, jnp.float32),
                            "bias": jnp.asarray(rng.standard_normal(32) * 0.01, jnp.float32)} for i in range(4)}
    tx = optax.adam(1e-3)
    opt = tx.init(params)
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) * 0.1, params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    state = {"params": params, "opt": opt}
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    mngr.save(0, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    reader = store.Reader(tmp_path / "0" / "default")
    seconds = [m for m in reader.manifest.leaves if m.method == "moments" and m.scale_leaf is None]
    closed = [m for m in reader.manifest.leaves if m.coding == records.CLOSED_LOOP and m.kind == "quantized"]
    assert seconds and closed and all(m.halved for m in seconds) and all(m.centres is None for m in closed)
    restored = mngr.restore(0, args=ij.InshrinkRestore(state))
    nus = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored["opt"])[0]}
    for m in seconds:
        got = np.asarray(nus[m.keystr.removeprefix("['opt']")])
        assert np.isin(got[got != 0], m.table()).all()
    mngr.close()
