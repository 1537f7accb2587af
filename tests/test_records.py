"""Records of the on-disk format: the compact form of quantization levels in JSON."""

import json

import hypothesis
import hypothesis.strategies as st
import numpy as np

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
