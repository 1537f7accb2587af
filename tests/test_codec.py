"""Entropy codecs: bit-exact round trips for every codec id, and run-length coding of mostly-zero data."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from inshrink_jax import codec


@hypothesis.given(st.integers(0, 5000), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1),
                  st.sampled_from([codec.ZSTD, codec.ZSTD_RLE]))
def test_uint8_streams_round_trip(n, density, seed, which):
    rng = np.random.default_rng(seed)
    a = np.where(rng.random(n) < density, rng.integers(1, 256, n), 0).astype(np.uint8)
    blob, used = codec.compress_best(a, which, codec.CODE_LEVEL)
    assert used in (which, codec.RAW)
    np.testing.assert_array_equal(np.frombuffer(codec.decompress(blob, used, a.size), np.uint8), a)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint32])
def test_byte_planes_round_trip(dtype):
    a = (np.random.default_rng(0).normal(size=1001) * 100).astype(dtype)
    blob, used = codec.compress_best(a, codec.ZSTD_PLANES)
    out = np.frombuffer(codec.decompress(blob, used, a.nbytes, a.dtype.itemsize), dtype)
    np.testing.assert_array_equal(out, a)


def test_lossless_data_takes_the_smaller_of_planes_and_plain_zstd():
    rng = np.random.default_rng(0)
    trained_like = rng.normal(size=50_000).astype(np.float32) * 0.05
    repeated_values = rng.random(16).astype(np.float32)[rng.integers(0, 16, 50_000)]
    for a, best in ((trained_like, codec.ZSTD_PLANES), (repeated_values, codec.ZSTD)):
        blob, used = codec.compress_best(a, codec.LOSSLESS_CODECS)
        assert used == best
        assert len(blob) == min(len(codec.compress(a, c)) for c in (codec.ZSTD, codec.ZSTD_PLANES))
        np.testing.assert_array_equal(np.frombuffer(codec.decompress(blob, used, a.nbytes, 4), np.float32), a)


def test_run_lengths_beat_plain_zstd_near_the_order0_bound():
    rng = np.random.default_rng(1)
    a = np.where(rng.random(200_000) < 0.1, rng.choice([1, 9], 200_000), 0).astype(np.uint8)
    h0 = codec.order0_entropy_bytes(a)
    plain = len(codec.compress(a, codec.ZSTD, codec.CODE_LEVEL))
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used == codec.ZSTD_RUNS and len(blob) < 0.6 * plain and len(blob) < 1.05 * h0
    rle = codec.compress(a, codec.ZSTD_RLE, codec.CODE_LEVEL)  # still read: checkpoints of format 9 and older
    assert len(blob) < len(rle) and codec.decompress(rle, codec.ZSTD_RLE, a.size) == a.tobytes()


def test_unknown_codec_is_refused():
    with pytest.raises(codec.CodecError, match="unknown codec 'lz4'"):
        codec.decompress(b"", "lz4", 0)


@hypothesis.given(st.integers(0, 3000), st.integers(1, 15), st.integers(0, 2**31 - 1))
def test_packed_small_values_round_trip(n, top, seed):
    a = np.random.default_rng(seed).integers(0, top + 1, n).astype(np.uint8)
    blob = codec.compress(a, codec.ZSTD_PACKED, codec.CODE_LEVEL)
    np.testing.assert_array_equal(np.frombuffer(codec.decompress(blob, codec.ZSTD_PACKED, n), np.uint8), a)


@hypothesis.given(st.integers(0, 3000), st.integers(0, 15), st.integers(0, 2**31 - 1))
def test_radix_small_values_round_trip(n, top, seed):
    a = np.random.default_rng(seed).integers(0, top + 1, n).astype(np.uint8)
    blob = codec.compress(a, codec.ZSTD_RADIX, codec.CODE_LEVEL)
    np.testing.assert_array_equal(np.frombuffer(codec.decompress(blob, codec.ZSTD_RADIX, n), np.uint8), a)


def test_radix_reaches_one_bit_per_two_level_code():
    """zstd's Huffman literals cost >= 1 bit per byte; packed in base 3 (radix) or, its codes 1 and 2 ranked 0 and
    1, in base 2 (rank), a balanced 2-level code stream costs ~1 bit per code (closed-loop residuals), and
    compress_best picks the ranks."""
    a = np.random.default_rng(0).integers(1, 3, 100_000).astype(np.uint8)
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used == codec.RANKS and len(blob) <= 1.01 * codec.order0_entropy_bytes(a) + 64
    assert len(blob) <= len(codec.compress(a, codec.ZSTD_RADIX, codec.CODE_LEVEL))
    assert len(blob) <= len(codec.compress(a, codec.ZSTD_RANK, codec.CODE_LEVEL)) - 9  # no radix header
    assert len(codec.compress(a, codec.ZSTD, codec.CODE_LEVEL)) > 1.4 * len(blob)


@pytest.mark.parametrize("p", [[0.05, 0.3, 0.3, 0.3, 0.05], [0.02, 0.4, 0.08, 0.08, 0.4, 0.02]])
def test_radix_codes_a_few_level_stream_within_4_percent_of_its_entropy(p):
    """Skewed memoryless code streams of 5-6 symbols (a first moment at 2 levels per sign, a residual at 4):
    Huffman on one symbol a byte pays up to ~0.2 bit per symbol over the entropy; three to a byte share it."""
    a = np.random.default_rng(1).choice(len(p), 200_000, p=p).astype(np.uint8)
    h0 = codec.order0_entropy_bytes(a)
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used == codec.RANKS and len(blob) <= 1.04 * h0
    assert len(codec.compress(a, codec.ZSTD, codec.CODE_LEVEL)) > 1.07 * h0


def test_a_radix_stream_with_a_bad_base_or_digit_is_refused():
    blob = codec.compress(np.array([0, 1, 2, 3, 4, 5] * 50, np.uint8), codec.ZSTD_RADIX)
    with pytest.raises(codec.CodecError, match="base"):
        codec.decompress(b"\x11" + blob[1:], codec.ZSTD_RADIX, 300)
    forged = bytes([6]) + blob[1:9] + codec.compress(np.full(100, 250, np.uint8), codec.ZSTD)  # 250 >= 6**3
    with pytest.raises(codec.CodecError, match="digits"):
        codec.decompress(forged, codec.ZSTD_RADIX, 300)


def test_a_packed_stream_with_a_bad_width_is_refused():
    blob = codec.compress(np.ones(100, np.uint8), codec.ZSTD_PACKED)
    with pytest.raises(codec.CodecError, match="width"):
        codec.decompress(b"\x03" + blob[1:], codec.ZSTD_PACKED, 100)


@pytest.mark.parametrize("which", [codec.ZSTD, codec.ZSTD_RLE, codec.ZSTD_RUNS, codec.ZSTD_PLANES,
                                   codec.ZSTD_PACKED, codec.ZSTD_RADIX, codec.ZSTD_RANK, codec.ZSTD_ESCAPE,
                                   codec.RANKS, codec.MODE])
def test_a_stream_of_another_size_is_refused_before_allocating(which):
    # As bytes, and as the restore takes it: a read-only array starting at a multiple of 64 bytes (JAX's CPU client
    # uses it in place).
    a = np.zeros(1 << 16, np.uint8)  # codec.ALIGNED_FROM: a smaller one is decoded as it comes
    a[::5] = 7
    blob = codec.compress(a, which)
    assert codec.decompress(blob, which, a.size) == a.tobytes()
    out = codec.decompress_array(blob, which, a.size)
    assert out.dtype == np.uint8 and out.ctypes.data % 64 == 0 and not out.flags.writeable
    assert out.tobytes() == a.tobytes()
    for decode in (codec.decompress, codec.decompress_array):
        for size in (a.size - 1, a.size + 1, 2**40):
            with pytest.raises(codec.CodecError):
                decode(blob, which, size)
        with pytest.raises(codec.CodecError):
            decode(blob[: len(blob) // 2], which, a.size)


@hypothesis.given(st.integers(0, 5000), st.floats(0.0, 1.0), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_runs_and_ranks_round_trip(n, density, distinct, seed):
    rng = np.random.default_rng(seed)
    alphabet = np.sort(rng.choice(np.arange(1, 256), size=distinct, replace=False)).astype(np.uint8)
    a = np.where(rng.random(n) < density, rng.choice(alphabet, size=n), 0).astype(np.uint8)
    for which in (codec.ZSTD_RUNS, codec.ZSTD_RANK, codec.RANKS):
        blob = codec.compress(a, which, codec.CODE_LEVEL)
        if which in (codec.ZSTD_RANK, codec.RANKS) and np.unique(a).size > 16:
            continue  # 16 distinct values and a zero: not rank-coded (compress_best never picks it)
        np.testing.assert_array_equal(np.frombuffer(codec.decompress(blob, which, n), np.uint8), a)


@pytest.mark.parametrize("p0", [0.6, 0.9, 0.97])
def test_a_delta_stream_is_coded_within_5_percent_of_its_entropy(p0):
    """Open-loop level deltas: 0, +1 and -1 modulo the modulus (here 32). Run lengths with radix-packed values
    (mostly zeros), ranks radix-packed (denser) or a mask of the zeros and the rest ("mode") reach the order-0 bound
    within 5%; zstd-rle took 1.11x at 97% zeros, plain zstd 2x."""
    rng = np.random.default_rng(0)
    a = rng.choice(np.array([0, 1, 31], np.uint8), size=200_000, p=[p0, (1 - p0) / 2, (1 - p0) / 2])
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used in (codec.ZSTD_RUNS, codec.RANKS, codec.MODE)
    assert len(blob) <= 1.05 * codec.order0_entropy_bytes(a)
    assert codec.decompress(blob, used, a.size) == a.tobytes()


def test_a_runs_or_rank_stream_with_a_bad_header_is_refused():
    a = np.array([0, 0, 0, 1, 31, 0, 0, 1] * 40, np.uint8)
    runs = codec.compress(a, codec.ZSTD_RUNS)
    with pytest.raises(codec.CodecError, match="value codec"):
        codec.decompress(runs[:16] + b"\x09" + runs[17:], codec.ZSTD_RUNS, a.size)
    rank = codec.compress(a, codec.ZSTD_RANK)
    assert rank[:4] == b"\x03\x00\x01\x1f"
    with pytest.raises(codec.CodecError, match="ascending"):
        codec.decompress(b"\x03\x00\x1f\x01" + rank[4:], codec.ZSTD_RANK, a.size)
    with pytest.raises(codec.CodecError, match="alphabet"):
        codec.decompress(b"\x11" + rank[1:], codec.ZSTD_RANK, a.size)
    with pytest.raises(codec.CodecError, match="rank 2 of an alphabet of 2"):
        codec.decompress(b"\x02\x00\x01" + rank[4:], codec.ZSTD_RANK, a.size)


@pytest.mark.parametrize("codecs", [(codec.ZSTD_RUNS,), (codec.ZSTD_RANK,), (codec.ZSTD_RADIX, codec.ZSTD_RANK),
                                    (codec.RANKS,)])
def test_compress_best_with_only_the_new_codecs(codecs):
    """compress_best takes the byte histogram these codecs' choice needs whichever of them it is given."""
    a = np.array([0, 0, 0, 1, 31, 0, 0, 1] * 40, np.uint8)
    blob, used = codec.compress_best(a, codecs, codec.CODE_LEVEL)
    assert used in codecs and codec.decompress(blob, used, a.size) == a.tobytes()


@hypothesis.given(st.integers(0, 300_000), st.integers(1, 256), st.integers(0, 2**31 - 1))
@hypothesis.settings(max_examples=30, deadline=None)
def test_byte_counts_is_the_byte_histogram(n, top, seed):
    a = np.random.default_rng(seed).integers(0, top, n).astype(np.uint8)
    np.testing.assert_array_equal(codec.byte_counts(a), np.bincount(a, minlength=256))


def test_a_large_stream_that_packs_skips_plain_zstd(monkeypatch):
    """From `_PACKED_ONLY_SIZE` values, a stream radix or rank packing can code is not also coded by plain zstd
    (a pass that rarely wins there); a smaller one still is, and both round-trip."""
    tried = []
    compress = codec.compress
    monkeypatch.setattr(codec, "compress", lambda data, c=codec.ZSTD, level=codec.DEFAULT_LEVEL, counts=None: (
        tried.append((np.asarray(data).size, c)), compress(data, c, level, counts))[1])
    rng = np.random.default_rng(0)
    for n, plain in ((codec._PACKED_ONLY_SIZE, False), (codec._PACKED_ONLY_SIZE - 1, True)):
        a = (rng.integers(0, 3, n) * 7).astype(np.uint8)
        tried.clear()
        blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
        assert ((n, codec.ZSTD) in tried) == plain and used == codec.RANKS
        assert codec.decompress(blob, used, n) == a.tobytes()


def test_a_corrupt_stream_leaves_the_reused_contexts_working():
    """Compression and decompression contexts are kept per thread; one stream that fails to decode (corrupt, or
    larger than its record says) does not affect the next."""
    a = (np.arange(20_000) % 7).astype(np.uint8)
    blob = codec.compress(a, codec.ZSTD, codec.CODE_LEVEL)
    for bad, size in ((blob[:20] + bytes(len(blob) - 20), a.size), (blob, 100)):
        with pytest.raises(codec.CodecError):
            codec.decompress(bad, codec.ZSTD, size)
        assert codec.decompress(blob, codec.ZSTD, a.size) == a.tobytes()
        assert codec.compress(a, codec.ZSTD, codec.CODE_LEVEL) == blob


def test_byte_counts_refuses_other_dtypes():
    with pytest.raises(TypeError, match="uint8"):
        codec.byte_counts(np.zeros(10, np.int64))


@hypothesis.given(st.integers(0, 5000), st.integers(1, 40), st.floats(0.0, 0.5), st.integers(0, 2**31 - 1))
def test_escape_streams_round_trip(n, distinct, tail, seed):
    """"zstd-escape": any uint8 stream, few or many distinct values, any share of them outside the five kept."""
    rng = np.random.default_rng(seed)
    alphabet = rng.choice(256, size=distinct, replace=False).astype(np.uint8)
    p = np.where(np.arange(distinct) < 5, 1.0, tail)
    a = rng.choice(alphabet, size=n, p=p / p.sum()).astype(np.uint8)
    blob = codec.compress(a, codec.ZSTD_ESCAPE, codec.CODE_LEVEL)
    np.testing.assert_array_equal(np.frombuffer(codec.decompress(blob, codec.ZSTD_ESCAPE, n), np.uint8), a)


@pytest.mark.parametrize("step", [1.5, 2.0, 2.5])
def test_many_cell_codes_with_a_rare_tail_cost_about_what_five_cells_do(step):
    """Codes of a uniform quantizer with 63 cells (values 1..63, the centre 32) of a heavy-tailed residual: most
    values in the central five cells, a rare tail in the others. "zstd-escape" is chosen and stores them within
    4% of the bytes of the same codes clipped to the five central cells (plain zstd, one value a byte: 1.3-1.75x
    their order-0 entropy)."""
    rng = np.random.default_rng(1)
    r = rng.standard_t(4, size=400_000)
    a = (np.clip(np.round(r / (step * r.std())), -31, 31) + 32).astype(np.uint8)
    five = np.clip(a, 30, 34)
    assert np.unique(a).size > 5
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used in (codec.ZSTD_ESCAPE, codec.MODE)  # "mode" where the central cell is half the stream
    clipped = len(codec.compress_best(five, codec.CODE_CODECS, codec.CODE_LEVEL)[0])
    assert len(blob) <= 1.04 * clipped, (len(blob), clipped)
    assert len(codec.compress(a, codec.ZSTD, codec.CODE_LEVEL)) > 1.3 * codec.order0_entropy_bytes(a)
    assert codec.decompress(blob, used, a.size) == a.tobytes()


def test_an_escape_stream_with_a_bad_header_is_refused():
    a = np.repeat(np.array([32, 31, 33, 30, 34, 9, 60], np.uint8), [40, 20, 15, 10, 8, 4, 3])
    blob = codec.compress(np.tile(a, 20), codec.ZSTD_ESCAPE)
    a = np.tile(a, 20)
    assert blob[:6] == bytes([5, 30, 31, 32, 33, 34])
    with pytest.raises(codec.CodecError, match="ascending"):
        codec.decompress(blob[:1] + bytes([31, 30]) + blob[3:], codec.ZSTD_ESCAPE, a.size)
    with pytest.raises(codec.CodecError, match="zstd-escape stream has no valid alphabet"):
        codec.decompress(b"\x06" + blob[1:], codec.ZSTD_ESCAPE, a.size)
    with pytest.raises(codec.CodecError, match="ranked part"):
        codec.decompress(blob[:6] + np.array([2**40], "<u8").tobytes() + blob[14:], codec.ZSTD_ESCAPE, a.size)
    with pytest.raises(codec.CodecError, match="base"):
        codec.decompress(blob[:14] + b"\x05" + blob[15:], codec.ZSTD_ESCAPE, a.size)
    ranked_end = 14 + int(np.frombuffer(blob[6:14], "<u8")[0])
    short = blob[:ranked_end] + codec.compress(np.zeros(3, np.uint8), codec.ZSTD)
    with pytest.raises(codec.CodecError, match="3 other values for 140 escapes"):
        codec.decompress(short, codec.ZSTD_ESCAPE, a.size)
    none = blob[:ranked_end] + codec.compress(np.zeros(0, np.uint8), codec.ZSTD)
    with pytest.raises(codec.CodecError, match="0 other values for some escapes"):
        codec.decompress(none, codec.ZSTD_ESCAPE, a.size)
    kept = np.arange(a.size, dtype=np.uint8) % 5  # five values: no escapes
    plain = codec.compress(kept, codec.ZSTD_ESCAPE)
    assert np.array_equal(np.frombuffer(codec.decompress(plain, codec.ZSTD_ESCAPE, a.size), np.uint8), kept)
    end = 14 + int(np.frombuffer(plain[6:14], "<u8")[0])
    with pytest.raises(codec.CodecError, match="3 other values for 0 escapes"):
        codec.decompress(plain[:end] + codec.compress(np.ones(3, np.uint8), codec.ZSTD), codec.ZSTD_ESCAPE, a.size)


def test_escape_is_not_tried_on_near_uniform_levels():
    """Codes of 16 near-equally used levels (a keyframe's k-means codes): the values outside any five are over 1/8
    of the stream, so "zstd-escape" (a byte per such value) cannot win and takes no pass; a 63-cell residual's
    codes, nearly all in five cells, do."""
    rng = np.random.default_rng(2)
    flat = rng.integers(1, 17, 100_000).astype(np.uint8)
    assert not codec._can_win(codec.ZSTD_ESCAPE, codec.byte_counts(flat))
    r = rng.standard_t(4, 100_000)
    tail = (np.clip(np.round(r / (1.5 * r.std())), -31, 31) + 32).astype(np.uint8)
    assert codec._can_win(codec.ZSTD_ESCAPE, codec.byte_counts(tail))


def test_a_zstd_frame_without_its_size_in_the_header_decodes_as_an_array_within_the_stated_size():
    import zstandard

    a = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    blob = zstandard.ZstdCompressor(write_content_size=False).compress(a.tobytes())
    assert zstandard.get_frame_parameters(blob).content_size == zstandard.CONTENTSIZE_UNKNOWN
    out = codec.decompress_array(blob, codec.ZSTD, a.size)
    assert out.tobytes() == a.tobytes() and out.ctypes.data % 64 == 0
    with pytest.raises(codec.CodecError):
        codec.decompress_array(blob, codec.ZSTD, a.size - 1)


@pytest.mark.parametrize("base", range(2, 17))
def test_unpacking_digits_through_the_table_equals_digit_arithmetic(base):
    """`codec._unpack` (one table lookup per packed byte; 1, 2, 4 or 8-byte words, 3 digits as padded words, 5 as
    5-byte items) gives alphabet[digit] of `_digits` for every base, at every size (a partial last byte too),
    into a 64-byte aligned array when not empty (handed to a kernel without a copy)."""
    rng = np.random.default_rng(base)
    per = codec._radix_digits(base)
    alphabet = rng.permutation(256)[:base].astype(np.uint8)
    for size in (0, 1, per - 1, per, 1000, 12_345):
        packed = rng.integers(0, base ** per, -(-size // per)).astype(np.uint8)
        out = codec._unpack(packed, base, size, alphabet.tobytes())
        assert out.dtype == np.uint8 and (out.ctypes.data % 64 == 0 or size == 0), size
        assert np.array_equal(out, alphabet[codec._digits(packed, base, size)])


@hypothesis.settings(deadline=None)
@hypothesis.given(st.integers(1, 5000), st.integers(1, 15), st.integers(0, 2**31 - 1), st.integers(0, 300),
                  st.sampled_from([codec.ZSTD_RADIX, codec.ZSTD_RANK, codec.RANKS, codec.PREFIX]))
def test_a_stream_left_packed_holds_the_values_it_decodes_to(n, top, seed, slack, which):
    """`codec.packed_values`: value i of a "zstd-radix", "zstd-rank", "ranks" or "prefix" stream is
    rows[packed[i // per], i % per],
    exactly what `decompress` gives; the packed bytes are 64-byte aligned and hold at least `slots` values, those
    past the stream's zeros; a rank stream of one value (ranks in another base) and other codecs are None."""
    values = np.random.default_rng(seed).integers(0, top + 1, n).astype(np.uint8)
    blob = codec.compress(values, which)
    got = codec.packed_values(blob, which, n, n + slack)
    if which == codec.ZSTD_RANK and np.unique(values).size == 1:
        assert got is None
        return
    packed, rows = got
    per = rows.shape[1]
    assert rows.shape == (256, per) and packed.ctypes.data % 64 == 0
    assert packed.size == max(-(-n // per), -(-(n + slack) // per)) and not packed[-(-n // per):].any()
    i = np.arange(n)
    assert np.array_equal(rows[packed[i // per], i % per], np.frombuffer(codec.decompress(blob, which, n), np.uint8))
    assert codec.packed_values(codec.compress(values, codec.ZSTD), codec.ZSTD, n) is None


def test_a_stream_left_packed_with_a_bad_header_or_digit_is_refused():
    values = np.array([0, 1, 2, 3, 4, 5] * 50, np.uint8)
    blob = codec.compress(values, codec.ZSTD_RADIX)
    with pytest.raises(codec.CodecError, match="states 300 values; expected 299"):
        codec.packed_values(blob, codec.ZSTD_RADIX, 299)
    with pytest.raises(codec.CodecError, match="base"):
        codec.packed_values(b"\x11" + blob[1:], codec.ZSTD_RADIX, 300)
    forged = bytes([6]) + blob[1:9] + codec.compress(np.full(100, 250, np.uint8), codec.ZSTD)  # 250 >= 6**3
    with pytest.raises(codec.CodecError, match="digits"):
        codec.packed_values(forged, codec.ZSTD_RADIX, 300)
    short = bytes([6]) + blob[1:9] + codec.compress(np.zeros(99, np.uint8), codec.ZSTD)  # 300 values need 100
    with pytest.raises(codec.CodecError, match="expected 100"):
        codec.packed_values(short, codec.ZSTD_RADIX, 300)
    rank = codec.compress(values, codec.ZSTD_RANK)
    with pytest.raises(codec.CodecError, match="alphabet"):
        codec.packed_values(b"\x00" + rank[1:], codec.ZSTD_RANK, 300)


@pytest.mark.parametrize("n", [64, 3000])  # the packed ranks as they are, and as a zstd frame
def test_a_ranks_stream_with_a_bad_header_size_or_padding_is_refused(n):
    """A "ranks" stream states no value count: its packed bytes must be exactly those `size` values take (a raw
    part's length, a frame's stated size, checked before allocating), its alphabet ascending and of 1 to 16 values,
    each byte's ranks below the alphabet's size, and the last byte's padding rank 0."""
    a = np.array([0, 0, 0, 1, 31, 0, 0, 1] * (n // 8), np.uint8)
    blob = codec.compress(a, codec.RANKS, codec.CODE_LEVEL)
    assert blob[:4] == bytes([3 | (codec._RANKS_ZSTD if n == 3000 else 0)]) + b"\x00\x01\x1f"
    assert codec.decompress(blob, codec.RANKS, n) == a.tobytes()
    for size in (n - 5, n + 5, 2**40):  # 5 values a byte: one byte fewer or more
        with pytest.raises(codec.CodecError, match="packed bytes, expected"):
            codec.decompress(blob, codec.RANKS, size)
    with pytest.raises(codec.CodecError, match="ascending"):
        codec.decompress(blob[:1] + b"\x00\x1f\x01" + blob[4:], codec.RANKS, n)
    with pytest.raises(codec.CodecError, match="alphabet"):
        codec.decompress(b"\x11" + blob[1:], codec.RANKS, n)
    raw = b"\x03\x00\x01\x1f"
    with pytest.raises(codec.CodecError, match="is not 5 ranks below 3"):
        codec.decompress(raw + bytes([243]) * (n // 5), codec.RANKS, n // 5 * 5)
    with pytest.raises(codec.CodecError, match="more than 4 values"):
        codec.decompress(raw + bytes([81]), codec.RANKS, 4)  # 81 = 3**4: a fifth value of rank 1
    assert codec.decompress(raw + bytes([80]), codec.RANKS, 4) == bytes([31, 31, 31, 31])
    one = codec.compress(np.full(n, 9, np.uint8), codec.RANKS)  # an alphabet of one value: every rank 0
    assert codec.decompress(one, codec.RANKS, n) == bytes([9]) * n
    with pytest.raises(codec.CodecError, match="ranks below 1"):
        codec.decompress(b"\x01\x09" + b"\x01" + bytes(-(-n // 8) - 1), codec.RANKS, n)


@pytest.mark.parametrize("size", [65_535, 65_536, 65_537, 200_001])
@pytest.mark.parametrize("base", [2, 6, 7, 11, 16])
def test_packing_by_a_table_of_pairs_writes_the_bytes_of_digit_by_digit_packing(size, base):
    """`codec._pack` of a large stream of two values a byte (bases 7-16) looks each pair up in a table, with the
    stream's relabelling (ranks) folded in: the same bytes as relabelling, padding and combining the digits one
    by one (the format's definition), odd lengths included; and the "ranks" stream decodes to the values."""
    rng = np.random.default_rng(size + base)
    alphabet = np.sort(rng.choice(256, base, replace=False)).astype(np.uint8)
    arr = alphabet[rng.integers(0, base, size)]
    ranks = np.searchsorted(alphabet, arr).astype(np.uint8)
    per = codec._radix_digits(base)
    padded = np.zeros(-(-size // per) * per, np.uint8)
    padded[:size] = ranks
    want = np.zeros(padded.size // per, np.int64)
    for j in reversed(range(per)):
        want = want * base + padded[j::per]
    got = codec._pack(arr, base, codec._rank_table(alphabet, 0))
    assert got.dtype == np.uint8 and np.array_equal(got, want.astype(np.uint8))
    assert np.array_equal(codec._pack(ranks, base), want.astype(np.uint8))
    blob = codec.compress(arr, codec.RANKS)
    assert np.array_equal(codec.decompress_array(blob, codec.RANKS, size), arr)


@hypothesis.settings(deadline=None)
@hypothesis.given(st.integers(0, 20_000), st.integers(1, 16), st.floats(0.0, 6.0), st.integers(0, 2**31 - 1))
def test_prefix_streams_round_trip(n, distinct, skew, seed):
    """"prefix": any stream of 1 to 16 distinct values (a few values, a rare one, heavily skewed, empty) decodes
    to itself (left packed: `test_a_stream_left_packed_holds_the_values_it_decodes_to`)."""
    rng = np.random.default_rng(seed)
    p = np.exp(-skew * np.arange(distinct))
    values = (rng.choice(distinct, n, p=p / p.sum()) * 13 + 5).astype(np.uint8)
    assert codec.decompress(codec.compress(values, codec.PREFIX), codec.PREFIX, n) == values.tobytes()


@pytest.mark.parametrize("n,p", [(64, [0.7, 0.15, 0.15]), (4096, [0.7, 0.15, 0.15]),
                                 (4096, [0.05, 0.3, 0.3, 0.3, 0.05]), (12_000, [0.6, 0.1, 0.1, 0.1, 0.05, 0.05]),
                                 (16_000, [0.9, 0.05, 0.05])])
def test_prefix_codes_a_small_stream_near_its_entropy_where_zstd_frames_do_not(n, p):
    """The streams of a model of many small leaves (a few thousand codes of 3 to 6 levels each): zstd's frame
    and Huffman table cost tens of bytes a stream; "prefix" states a model of a few bits per level and codes the
    packed ranks with the Huffman code it implies, within 3% of the order-0 entropy plus a few bytes, and
    compress_best takes it."""
    a = np.random.default_rng(2).choice(len(p), n, p=p).astype(np.uint8)
    h0 = codec.order0_entropy_bytes(a)
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used == codec.PREFIX and len(blob) <= 1.03 * h0 + len(p) + 8, (len(blob), h0)
    assert len(blob) < len(codec.compress(a, codec.RANKS, codec.CODE_LEVEL))


def test_prefix_is_not_offered_past_its_size_bound():
    """A stream of `PREFIX_BELOW` values or more is left to zstd: finding its codewords' starts takes a pass per
    doubling of their count over all bit offsets."""
    a = np.random.default_rng(3).choice(3, 1 << 14, p=[0.7, 0.15, 0.15]).astype(np.uint8)
    assert codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)[1] != codec.PREFIX
    assert codec.compress_best(a[:-1], codec.CODE_CODECS, codec.CODE_LEVEL)[1] == codec.PREFIX


def test_a_prefix_stream_with_a_bad_header_model_length_or_padding_is_refused():
    """A "prefix" stream states no value count and no code table: its alphabet ascending and of 1 to 16 values,
    its precision within what its alphabet allows, its model k frequencies of at least 1 summing to 2**p, and its
    codewords for exactly `size` values ending in its last byte, the rest of that byte zeros, the last packed
    byte's padding rank 0."""
    a = np.array([0, 0, 0, 1, 31, 0, 0, 1, 0, 0] * 40, np.uint8)
    blob = codec.compress(a, codec.PREFIX)
    assert blob[:4] == bytes([3, 0, 1, 31]) and codec.decompress(blob, codec.PREFIX, a.size) == a.tobytes()
    with pytest.raises(codec.CodecError, match="alphabet"):
        codec.decompress(blob[:1] + b"\x00\x1f\x01" + blob[4:], codec.PREFIX, a.size)
    with pytest.raises(codec.CodecError, match="precision"):
        codec.decompress(blob[:4] + b"\x01" + blob[5:], codec.PREFIX, a.size)  # 2 bits at least for 3 values
    with pytest.raises(codec.CodecError, match="precision"):
        codec.decompress(blob[:4], codec.PREFIX, a.size)
    p = blob[4]
    with pytest.raises(codec.CodecError, match="model"):  # the first frequency all ones: the rest sum past 2**p
        bits = np.unpackbits(np.frombuffer(blob[5:], np.uint8))
        bits[:p] = 1
        codec.decompress(blob[:5] + np.packbits(bits).tobytes(), codec.PREFIX, a.size)
    with pytest.raises(codec.CodecError, match="do not end"):
        codec.decompress(blob[:-1], codec.PREFIX, a.size)
    with pytest.raises(codec.CodecError, match="do not end"):
        codec.decompress(blob + b"\x00", codec.PREFIX, a.size)
    with pytest.raises(codec.CodecError, match="do not end|more than"):
        codec.decompress(blob, codec.PREFIX, a.size - 5)
    with pytest.raises(codec.CodecError, match="cannot hold"):
        codec.decompress(blob, codec.PREFIX, 10 * a.size)
    with pytest.raises(codec.CodecError, match="cannot hold"):  # more bits than 400 codewords of 57 bits take
        codec.decompress(blob + bytes(400 * 57 // 8), codec.PREFIX, a.size)
    with pytest.raises(codec.CodecError, match="decodes at most"):  # refused before its arrays are allocated
        codec.decompress(blob[:5] + bytes(1 << 20), codec.PREFIX, 1 << 24)
    refused = 0
    for bit in range(8):  # a bit of the last byte flipped: other codewords, or a one in its padding, refused
        tail = blob[:-1] + bytes([blob[-1] ^ (1 << bit)])
        try:
            assert codec.decompress(tail, codec.PREFIX, a.size) != a.tobytes()
        except codec.CodecError as e:
            refused += 1
            assert "do not end" in str(e) or "more than" in str(e)
    assert refused
    five = np.array([1, 0, 0, 2, 2], np.uint8)  # 3 values: 5 ranks a byte
    assert codec.decompress(codec.compress(five, codec.PREFIX), codec.PREFIX, 5) == five.tobytes()
    with pytest.raises(codec.CodecError, match="more than 4"):  # its fifth rank (2) is no padding
        codec.decompress(codec.compress(five, codec.PREFIX), codec.PREFIX, 4)
    one = codec.compress(np.full(100, 9, np.uint8), codec.PREFIX)  # one value: its alphabet alone
    assert one == b"\x01\x09" and codec.decompress(one, codec.PREFIX, 100) == bytes([9]) * 100
    with pytest.raises(codec.CodecError, match="one value"):
        codec.decompress(one + b"\x00", codec.PREFIX, 100)


def test_prefix_codes_an_extremely_skewed_stream_at_a_bit_a_byte():
    """Two values, one of them once in 65,535: its bytes of 8 ranks cost a bit each (a prefix code's least), and
    compress_best takes a zstd codec there instead."""
    a = np.zeros(65_535, np.uint8)
    a[12_345] = 7
    blob = codec.compress(a, codec.PREFIX)
    assert codec.decompress(blob, codec.PREFIX, a.size) == a.tobytes()
    assert len(blob) <= -(-a.size // 8) / 8 + 16
    assert codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)[1] != codec.PREFIX


def test_a_prefix_code_longer_than_a_window_holds_is_flattened(monkeypatch):
    """A model whose Huffman code would have a codeword longer than the decoder's window holds (57 bits; here
    lowered to 12, which the models below exceed) gets flattened weights: every codeword within the bound, and
    streams of it still decode (the encoder and the decoder build the same code)."""
    a = np.zeros(16_000, np.uint8)
    a[[100, 5000]] = [1, 2]
    codec._prefix_code.cache_clear()
    assert int(codec._prefix_code(3, (4094, 1, 1))[0].max()) > 12
    monkeypatch.setattr(codec, "_PREFIX_LONGEST", 12)
    codec._prefix_code.cache_clear()
    try:
        assert int(codec._prefix_code(3, (4094, 1, 1))[0].max()) <= 12
        blob = codec.compress(a, codec.PREFIX)
        assert codec.decompress(blob, codec.PREFIX, a.size) == a.tobytes()
    finally:
        codec._prefix_code.cache_clear()


@hypothesis.settings(deadline=None)
@hypothesis.given(st.lists(st.integers(1, 2**40), min_size=2, max_size=256))
def test_prefix_code_lengths_are_optimal_and_complete(weights):
    """The code lengths "prefix" builds from a model are a Huffman code's: their weighted total is the least any
    prefix code reaches (a heap Huffman's), and they fill the code space exactly (Kraft sum 1), so every window a
    decoder reads names a codeword."""
    import heapq
    w = np.asarray(weights, np.int64)
    lengths = codec._huffman_lengths(w)
    heap, best = list(weights), 0
    heapq.heapify(heap)
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        best += merged
        heapq.heappush(heap, merged)
    assert int((lengths * w).sum()) == best
    top = int(lengths.max())
    assert sum(1 << (top - int(n)) for n in lengths) == 1 << top


@hypothesis.given(st.integers(0, 5000), st.integers(1, 40), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1),
                  st.booleans())
def test_mode_streams_round_trip(n, distinct, others, seed, small):
    """"mode": any uint8 stream, its mode a small or large share, the other values few (coded as ranks) or many
    (zstd, zstd-escape), none at all, or the mode's own value among them."""
    rng = np.random.default_rng(seed)
    alphabet = rng.choice(256, size=distinct, replace=False).astype(np.uint8)
    p = np.where(np.arange(distinct) == 0, 1.0, others / max(distinct - 1, 1))
    a = rng.choice(alphabet, size=n, p=p / p.sum()).astype(np.uint8)
    if small:
        a = a[:64]
    blob = codec.compress(a, codec.MODE, codec.CODE_LEVEL)
    np.testing.assert_array_equal(codec.decompress_array(blob, codec.MODE, a.size), a)


@pytest.mark.parametrize("p0,ranks_over", [(0.75, 1.03), (0.85, 1.1), (0.93, 1.4)])
def test_a_peaked_stream_is_coded_by_mode_within_6_percent_of_its_entropy(p0, ranks_over):
    """Codes of a first moment's uniform cells, most of them in the central one: packed several to a byte, their
    bytes still cost zstd's Huffman literals whole bits ("ranks" over the order-0 entropy by more the more peaked
    the stream); "mode" codes the mask and the rest each near its own entropy, whose sum is the stream's (what is
    left over it is mostly the three parts' headers, on a stream of a few kB)."""
    rng = np.random.default_rng(0)
    n = 100_000
    p = np.r_[[0.1, 0.4], [p0 / (1 - p0)], [0.4, 0.1]] * (1 - p0)
    a = rng.choice(np.arange(30, 35, dtype=np.uint8), size=n, p=p / p.sum()).astype(np.uint8)
    h0 = codec.order0_entropy_bytes(a)
    blob, used = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
    assert used == codec.MODE and len(blob) <= 1.06 * h0, (used, len(blob), h0)
    assert len(codec.compress(a, codec.RANKS, codec.CODE_LEVEL)) > ranks_over * h0
    assert codec.decompress(blob, used, n) == a.tobytes()


def test_mode_is_offered_only_where_one_value_is_half_of_a_mid_sized_stream():
    def counts(n, top):  # `top` of one value, the other n - top spread over seven others
        return np.bincount(np.r_[np.zeros(top, np.uint8), np.arange(n - top) % 7 + 1], minlength=256)
    assert codec._can_win(codec.MODE, counts(codec._MODE_FROM, codec._MODE_FROM // 2))
    assert not codec._can_win(codec.MODE, counts(codec._MODE_FROM, codec._MODE_FROM // 2 - 1))
    assert not codec._can_win(codec.MODE, counts(codec._MODE_FROM - 1, codec._MODE_FROM - 1))
    assert not codec._can_win(codec.MODE, counts(codec._PACKED_ONLY_SIZE, codec._PACKED_ONLY_SIZE))


@pytest.mark.parametrize("p", [0.45, 0.02])  # a dense mask (packed ranks) and a sparse one (the gaps between 1s)
def test_a_mode_stream_with_a_bad_header_mask_or_rest_is_refused(p):
    rng = np.random.default_rng(0)
    a = np.where(rng.random(8003) < p, rng.choice(np.array([30, 33], np.uint8), 8003), 31).astype(np.uint8)
    blob = codec.compress(a, codec.MODE, codec.CODE_LEVEL)
    mask_codec = codec._MODE_MASK_CODECS[blob[1] >> 4]
    assert blob[0] == 31 and mask_codec == (codec.RANKS if p > 0.1 else codec.ZSTD_RUNS)
    n = int(np.frombuffer(blob[2:6], "<u4")[0])
    mask, rest = blob[6:6 + n], blob[6 + n:]
    decode = lambda b: codec.decompress(b, codec.MODE, a.size)
    assemble = lambda m: blob[:2] + np.array([len(m)], "<u4").tobytes() + m + rest
    assert decode(blob) == a.tobytes() == decode(assemble(mask))
    for cut in (0, 1, 5):
        with pytest.raises(codec.CodecError):
            decode(blob[:cut])
    with pytest.raises(codec.CodecError, match="no valid mode"):
        decode(blob[:1] + bytes([len(codec._MODE_MASK_CODECS) << 4]) + blob[2:])
    with pytest.raises(codec.CodecError, match="no valid mode"):
        decode(blob[:1] + bytes([blob[1] & 0xF0 | len(codec._MODE_REST_CODECS)]) + blob[2:])
    with pytest.raises(codec.CodecError, match="mask of"):
        decode(blob[:2] + np.array([len(blob)], "<u4").tobytes() + blob[6:])
    other = (a != 31).astype(np.uint8)
    # A mask of another size; a mask holding a value other than 0 and 1; a mask marking far more values than the
    # rest holds (the segment's CRC32 guards against a flipped bit: "ranks" pads with rank 0, a value).
    with pytest.raises(codec.CodecError):
        decode(assemble(codec.compress(other[:-64], mask_codec, codec.CODE_LEVEL)))
    two = other.copy()
    two[np.flatnonzero(two)[0]] = 2
    with pytest.raises(codec.CodecError, match="not 0 or 1"):
        decode(assemble(codec.compress(two, mask_codec, codec.CODE_LEVEL)))
    with pytest.raises(codec.CodecError):
        decode(assemble(codec.compress(np.ones_like(other), codec.RANKS, codec.CODE_LEVEL)))


@hypothesis.settings(deadline=None, max_examples=60)
@hypothesis.given(st.integers(0, 3000), st.integers(1, 16), st.sampled_from([2, 4, 10, 64, 1 << 18]),
                  st.integers(0, 2**31 - 1))
def test_block_by_block_passes_write_the_bytes_of_one_pass_over_the_stream(n, distinct, block, seed):
    """Histograms, rank lookups and packing run `codec._BLOCK` values at a time: whatever the block (odd ones and
    ones that do not hold whole bytes of packed values included), the same histogram and the same stream bytes as
    one pass over the whole stream (the format's definition: digit by digit, the first value least significant),
    and every stream decodes to its values."""
    rng = np.random.default_rng(seed)
    alphabet = np.sort(rng.choice(256, distinct, replace=False)).astype(np.uint8)
    arr = alphabet[rng.integers(0, distinct, n)]
    whole = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(codec, "_BLOCK", 1 << 62)
        m.setattr(codec, "_PAIR_TABLE_FROM", 0)  # the table of pairs on any stream of two values a byte
        for c in codec.CODE_CODECS:
            whole[c] = codec.compress(arr, c, codec.CODE_LEVEL)
        whole["counts"] = codec.byte_counts(arr)
        whole["pack"] = codec._pack(arr, 16, codec._rank_table(np.unique(arr) if n else alphabet, 0))
        m.setattr(codec, "_BLOCK", block)
        np.testing.assert_array_equal(codec.byte_counts(arr), whole["counts"])
        np.testing.assert_array_equal(codec.byte_counts(arr), np.bincount(arr, minlength=256))
        np.testing.assert_array_equal(
            codec._pack(arr, 16, codec._rank_table(np.unique(arr) if n else alphabet, 0)), whole["pack"])
        for c in codec.CODE_CODECS:
            blob = codec.compress(arr, c, codec.CODE_LEVEL)
            assert blob == whole[c], c
            if codec._can_win(c, codec.byte_counts(arr)) and n:
                np.testing.assert_array_equal(codec.decompress_array(blob, c, n), arr)
