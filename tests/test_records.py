"""Records of the on-disk format: the compact form of quantization levels in JSON."""

import json

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from inshrink_jax import records


@hypothesis.given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64))
def test_levels_written_with_fewest_digits_read_back_bit_exactly(values):
    x = np.asarray(values, np.float32)
    back = np.asarray(json.loads(json.dumps(records.float32_list(x))), np.float32)
    assert back.tobytes() == x.tobytes()


def test_levels_take_a_float32_number_of_digits():
    x = (np.random.default_rng(0).standard_normal(1000) * 0.01).astype(np.float32)
    short = json.dumps(records.float32_list(x))
    full = json.dumps([float(v) for v in x])
    assert len(short) < 0.7 * len(full)
    assert max(len(t) for t in short.strip("[]").split(", ")) <= 16  # sign, 9 digits, point, exponent


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
