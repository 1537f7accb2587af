import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from inshrink_jax import CompressionConfig, QuantConfig, codec, quantize, search, sketch, threshold

CFG = CompressionConfig()


def weights(shape, seed, scale=0.05):
    return (np.random.default_rng(seed).standard_t(3, size=shape) * scale).astype(np.float32)


def top(s, k):
    return set(np.argsort(-s.ravel(), kind="stable")[:k])


def test_partition_fractions_are_exact():
    qc = QuantConfig(bins=8, prune_fraction=0.3, protect_fraction=0.01, prune_metric="sensitivity")
    shapes = [(64, 128), (3, 3, 16, 32), (32, 64), (300,)]
    xs = [weights(s, i) for i, s in enumerate(shapes)]
    gs = [np.random.default_rng(10 + i).normal(size=s).astype(np.float32) for i, s in enumerate(shapes)]
    kinds = ["dense", "conv", "dense", "other"]
    encs = quantize.encode_tensors([jnp.asarray(x) for x in xs], [jnp.asarray(g) for g in gs], kinds, qc, CFG)
    prunable = {"dense": 0, "conv": 0}
    pruned = {"dense": 0, "conv": 0}
    for x, g, kind, enc in zip(xs, gs, kinds, encs):
        codes = enc.codes.ravel()
        k = int(np.floor(0.01 * x.size + 0.5))
        expect = top(np.abs(x), k) | top(np.abs(g * x), k)
        assert set(np.flatnonzero(codes == 9)) == expect
        if kind == "other":
            assert not np.any(codes == 0)  # 1-D leaves are never pruned
        else:
            prunable[kind] += x.size - len(expect)
            pruned[kind] += int(np.sum(codes == 0))
            # pruned = the least sensitive of the unprotected
            sens = np.abs(g * x).ravel()
            free = codes != 9
            assert sens[codes == 0].max() < sens[free & (codes != 0)].min()
    for kind in prunable:
        assert pruned[kind] == int(np.floor(0.3 * prunable[kind] + 0.5))


def test_no_pruning_skips_the_prune_threshold_in_the_same_kernel():
    """prune_fraction 0 prunes nothing (the prune threshold's passes are skipped at run time), a positive fraction
    prunes exactly that fraction of the unprotected weights, and one compiled encoder serves both."""
    xs = [jnp.asarray(weights((48, 40), 40 + i)) for i in range(2)]
    before = quantize._encode._cache_size()
    none = quantize.encode_tensors(xs, [None, None], ["dense"] * 2, QuantConfig(bins=6, protect_fraction=0.01), CFG)
    some = quantize.encode_tensors(xs, [None, None], ["dense"] * 2,
                                   QuantConfig(bins=6, prune_fraction=0.3, protect_fraction=0.01), CFG)
    assert quantize._encode._cache_size() - before <= 1
    assert not any(np.any(e.codes == quantize.PRUNED) for e in none)
    free = sum(int(np.sum(e.codes != 7)) for e in some)  # code 7: protected (6 bins)
    assert sum(int(np.sum(e.codes == quantize.PRUNED)) for e in some) == int(np.floor(0.3 * free + 0.5))


def test_magnitude_prune_metric_and_no_grads():
    x = weights((128, 128), 3)
    qc = QuantConfig(bins=4, prune_fraction=0.5, protect_fraction=0.005)
    (enc,) = quantize.encode_tensors([jnp.asarray(x)], [None], ["dense"], qc, CFG)
    codes = enc.codes.ravel()
    k = int(np.floor(0.005 * x.size + 0.5))
    assert set(np.flatnonzero(codes == 5)) == top(np.abs(x), k)  # without grads: magnitude alone
    assert int(np.sum(codes == 0)) == int(np.floor(0.5 * (x.size - k) + 0.5))
    assert np.abs(x).ravel()[codes == 0].max() < np.abs(x).ravel()[(codes > 0) & (codes < 5)].min()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("protected_dtype", ["bfloat16", "float32"])
def test_round_trip(dtype, protected_dtype):
    cfg = CompressionConfig(protected_dtype=protected_dtype)
    x = weights((96, 80), 4).astype(dtype)
    x = np.asarray(x)
    x[0, :3] = [np.nan, np.inf, -np.inf]
    qc = QuantConfig(bins=6, prune_fraction=0.2, protect_fraction=0.01)
    (enc,) = quantize.encode_tensors([jnp.asarray(x)], [None], ["dense"], qc, cfg)
    y = np.asarray(quantize.decode(enc))
    assert y.dtype == np.dtype(dtype)
    codes = enc.codes
    assert np.all(y[codes == 0] == 0)
    level = (codes >= 1) & (codes <= 6)
    np.testing.assert_array_equal(y[level], enc.centres.astype(dtype)[codes[level] - 1])
    prot = codes == 7
    assert np.isnan(y[0, 0]) and y[0, 1] == np.inf and y[0, 2] == -np.inf and prot[0, :3].all()
    xp, yp = x[prot].astype(np.float64), y[prot].astype(np.float64)
    fin = np.isfinite(xp)
    if np.dtype(dtype).itemsize == 2 or protected_dtype == "float32":
        np.testing.assert_array_equal(yp[fin], xp[fin])  # exact
    else:
        assert np.all(np.abs(yp[fin] - xp[fin]) <= 2.0**-8 * np.abs(xp[fin]))  # bfloat16 rounding
    # Quantized weights went to their nearest centre.
    c = enc.centres.astype(np.float64)
    xq = x[level].astype(np.float64)
    assert np.all(np.abs(xq - c[codes[level] - 1]) <= np.min(np.abs(xq[:, None] - c[None, :]), axis=1) + 1e-6)


def test_all_zero_constant_and_tiny_tensors():
    qc = QuantConfig(bins=4, prune_fraction=0.0, protect_fraction=0.01)
    # Zeros are exact; a constant decodes to its sketch bucket's representative (within alpha); a tensor too
    # small to protect anything still round-trips within alpha.
    for x, exact in [(np.zeros((50, 40), np.float32), True), (np.full((50, 40), 0.125, np.float32), False),
                     (np.array([[1.5, -2.0]], np.float32), False)]:
        (enc,) = quantize.encode_tensors([jnp.asarray(x)], [None], ["dense"], qc, CFG)
        y = np.asarray(quantize.decode(enc))
        if exact:
            np.testing.assert_array_equal(y, x)
        else:
            assert np.all(np.abs(y - x) <= (CFG.alpha + 1e-6) * np.abs(x))


def test_sharded_encode_is_bit_identical_to_single_device():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    xs = [weights((256, 128), 5), weights((3, 3, 32, 64), 6)]
    gs = [np.random.default_rng(7 + i).normal(size=x.shape).astype(np.float32) for i, x in enumerate(xs)]
    qc = QuantConfig(bins=12, prune_fraction=0.2, protect_fraction=0.005, prune_metric="sensitivity")
    kinds = ["dense", "conv"]
    single = quantize.encode_tensors([jnp.asarray(x) for x in xs], [jnp.asarray(g) for g in gs], kinds, qc, CFG)
    shardings = [sh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "a", "b"))]
    sharded = quantize.encode_tensors([jax.device_put(x, s) for x, s in zip(xs, shardings)],
                                      [jax.device_put(g, s) for g, s in zip(gs, shardings)], kinds, qc, CFG)
    for a, b in zip(single, sharded):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.centres, b.centres)
        np.testing.assert_array_equal(a.protected.view(np.uint16), b.protected.view(np.uint16))


def test_large_tensors_encode_tensor_by_tensor_with_the_same_result(monkeypatch):
    """Stacked tensors at or above threshold.MAP_MIN_SIZE run their scatter passes one tensor at a time (lax.map),
    below it vmapped: the same codes, levels and protected values either way."""
    xs = [jnp.asarray(weights((64, 48), 20 + i)) for i in range(3)]
    gs = [jnp.asarray(np.random.default_rng(30 + i).normal(size=(64, 48)).astype(np.float32)) for i in range(3)]
    qc = QuantConfig(bins=5, step=1.0, prune_fraction=0.2, protect_fraction=0.01, prune_metric="sensitivity")
    vmapped = quantize.encode_tensors(xs, gs, ["dense"] * 3, qc, CFG)
    monkeypatch.setattr(threshold, "MAP_MIN_SIZE", 64 * 48)
    jax.clear_caches()  # the encoder is traced again, with the new size
    mapped = quantize.encode_tensors(xs, gs, ["dense"] * 3, qc, CFG)
    for a, b in zip(vmapped, mapped):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.centres, b.centres)
        np.testing.assert_array_equal(np.asarray(a.protected, np.float32), np.asarray(b.protected, np.float32))
    assert np.mean(vmapped[0].codes == quantize.PRUNED) == pytest.approx(0.2, abs=0.01)


def test_large_single_device_tensors_fit_levels_to_a_sample(monkeypatch):
    """A tensor of sketch.SAMPLE_MIN_SIZE elements or more on one device fits its levels to a sampled histogram
    (constants shrunk here so that 64 x 48 is large: stride 5): the partition stays exact, the levels change
    little; the same tensor sharded over two devices is histogrammed whole, as before."""
    from inshrink_jax import sketch
    x = weights((64, 48), 40)
    qc = QuantConfig(bins=8, protect_fraction=0.01)

    def encode(arr):
        jax.clear_caches()  # the encoder is traced again, with the constants of the moment
        return quantize.encode_tensors([arr], [None], ["dense"], qc, CFG)[0]

    whole = encode(jnp.asarray(x))
    monkeypatch.setattr(sketch, "HISTOGRAM_SAMPLES", 512)
    monkeypatch.setattr(sketch, "SAMPLE_MIN_SIZE", 3 * 512)
    assert sketch.sample_stride(x.shape, True) == 5
    sampled = encode(jnp.asarray(x))
    assert not np.array_equal(sampled.centres, whole.centres)
    for enc in (whole, sampled):
        assert np.count_nonzero(enc.codes == quantize.protected_code(8)) == round(0.01 * x.size)

    def mse(enc):
        return float(np.mean((np.asarray(quantize.decode(enc), np.float64) - x) ** 2))

    assert mse(sampled) <= 1.15 * mse(whole)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharded = encode(jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))))
    np.testing.assert_array_equal(sharded.codes, whole.codes)
    np.testing.assert_array_equal(sharded.centres, whole.centres)


@pytest.mark.parametrize(
    "path,shape,kind",
    [
        ("params/Dense_0/kernel", (64, 32), "dense"),
        ("params/Dense_0/bias", (32,), "other"),
        ("params/Conv_0/kernel", (3, 3, 1, 16), "conv"),
        ("params/encoder/attention/query/kernel", (64, 4, 16), "attention"),
        ("params/Embed_0/embedding", (1000, 64), "embedding"),
        ("params/block/mlp/w", (3, 4, 5), "conv"),
        ("params/monkey/kernel", (8, 8), "dense"),
        ("['model']['hidden']['kernel'].value", (64, 32), "dense"),  # NNX state: `.value` is the Variable's
        ("['model']['conv1']['kernel'].value", (3, 3, 1, 16), "conv"),
        ("['model']['attn']['value']['kernel'].value", (64, 4, 16), "attention"),
        ("['params']['value']['kernel']", (64, 32), "attention"),  # a Linen module named "value" is a part
    ],
)
def test_default_layer_type_rule(path, shape, kind):
    assert quantize.layer_type(path, shape) == kind


def test_layer_type_rules_override():
    assert quantize.layer_type("params/head/kernel", (8, 8), (("head", "embedding"),)) == "embedding"
    with pytest.raises(ValueError, match="layer_type_rules"):
        CompressionConfig(layer_type_rules=(("head", "lstm"),))


def test_embedding_bins_used_for_embeddings():
    qc = QuantConfig(bins=4, embedding_bins=16, protect_fraction=0.0)
    x = jnp.asarray(weights((200, 64), 8))
    dense, emb = quantize.encode_tensors([x, x], [None, None], ["dense", "embedding"], qc, CFG)
    assert dense.bins == 4 and emb.bins == 16
    assert np.mean((np.asarray(quantize.decode(emb)) - x) ** 2) < np.mean((np.asarray(quantize.decode(dense)) - x) ** 2)


def test_corrupt_protected_count_is_an_error():
    (enc,) = quantize.encode_tensors([jnp.asarray(weights((64, 64), 9))], [None], ["dense"], QuantConfig(), CFG)
    with pytest.raises(ValueError, match="protected"):
        quantize.decode(enc._replace(protected=enc.protected[:-1]))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="bins"):
        QuantConfig(bins=300)
    with pytest.raises(ValueError, match="prune_metric"):
        QuantConfig(prune_metric="random")


@pytest.mark.parametrize("count", [2, 12])
def test_the_encoder_returns_one_stack_per_bucket_not_one_array_per_tensor(count, monkeypatch):
    """XLA compiles each output buffer of a jitted function as a kernel of its own: the encoder's outputs are
    stacks of alike tensors (3 per bucket: codes, levels, protected values) whatever their count, and each
    tensor gets its own rows of them back, in the order it was given (here interleaved with another bucket)."""
    shapes = [(16, 8) if i % 2 else (8, 16) for i in range(2 * count)] + [(40,)]
    xs = [jnp.asarray(weights(s, i)) for i, s in enumerate(shapes)]
    kinds = ["dense"] * (2 * count) + ["other"]
    returned = []
    encode = quantize._encode

    def spy(*args, **kwargs):
        out = encode(*args, **kwargs)
        returned.append(out)
        return out

    monkeypatch.setattr(quantize, "_encode", spy)
    devs = quantize.encode_on_device(xs, [None] * len(xs), kinds, QuantConfig(bins=4, protect_fraction=0.05), CFG)
    [[dense, other]] = returned
    assert [[a.shape for a in bucket] for bucket in dense + other] == [
        [(count, 8, 16), (count, CFG.bins_capacity), (count, 8, 16)],
        [(count, 16, 8), (count, CFG.bins_capacity), (count, 16, 8)],
        [(1, 40), (1, CFG.bins_capacity), (1, 40)]]
    for i, d in enumerate(devs):
        bucket, row = (other[0], 0) if i == len(xs) - 1 else (dense[i % 2], i // 2)
        for got, stack in zip((d.codes, d.centres, d.protected_in_place), bucket):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(stack)[row])
        assert d.codes.shape == shapes[i]


def test_without_protection_the_kernel_skips_the_protect_pass_and_encodes_the_same(monkeypatch):
    """protect_fraction 0 compiles the encoder without its per-tensor selection of the largest values (a static
    flag): codes, levels and protected values (the non-finite ones) are those of the kernel with that pass."""
    qc = QuantConfig(bins=4, prune_fraction=0.5, protect_fraction=0.0)
    xs = [weights((64, 128), 0), weights((3, 3, 16, 32), 1), weights((300,), 2)]
    xs[0][3, 5], xs[1][0, 0, 0, 1] = np.nan, -np.inf
    args = ([jnp.asarray(x) for x in xs], [None] * 3, ["dense", "conv", "other"], qc, CFG)
    flags = []
    encode = quantize._encode
    monkeypatch.setattr(quantize, "_encode", lambda *a, **kw: (flags.append(kw["protects"]), encode(*a, **kw))[1])
    without = quantize.encode_tensors(*args)
    monkeypatch.setattr(quantize, "_encode", lambda *a, **kw: encode(*a, **{**kw, "protects": True}))
    with_pass = quantize.encode_tensors(*args)
    assert flags == [False]
    for a, b in zip(without, with_pass):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.centres, b.centres)
        assert a.protected.tobytes() == b.protected.tobytes()  # bit for bit (NaN included)
    assert without[0].protected.size == 1 and np.isnan(without[0].protected[0])


@pytest.mark.parametrize("shape", [(37, 29), (32, 32), (5,)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_chain_decodes_to_its_links_sum_bit_for_bit_padded_or_not(shape, dtype, monkeypatch):
    """A small tensor's chain is decoded padded to a power of two (fewer kernel sizes to compile), a large one's as
    it is, and one that takes packed codes to a multiple of `PACKED_MULTIPLE`: the result is the link-by-link sum
    of levels and protected values in the save's formula (plus_offset) each way, and on another device than the
    default one, there whether its small host arrays go to the kernels as they are or are put first."""
    rng = np.random.default_rng(0)
    n, bins = int(np.prod(shape)), 6

    def link(first):
        codes = rng.integers(0, bins + 1, shape).astype(np.uint8)
        codes.reshape(-1)[rng.choice(n, 2, replace=False)] = bins + 1  # two protected weights
        centres = np.sort(rng.normal(size=bins)).astype(np.float32)
        protected = rng.normal(size=2).astype(np.float32).astype(jnp.bfloat16)
        return quantize.EncodedTensor(codes, centres, protected, dtype)

    links = [link(True)] + [link(False) for _ in range(6)]  # a keyframe and two groups of residuals
    expect = None
    for k, e in enumerate(links):
        work = np.dtype(jnp.dtype(dtype)) if k == 0 else np.float32
        values = np.concatenate([[0.0], e.centres, [0.0]]).astype(work)[e.codes.reshape(-1)]
        values[np.flatnonzero(e.codes.reshape(-1) == bins + 1)] = e.protected.astype(work)
        expect = values if k == 0 else np.asarray(quantize.plus_offset(jnp.asarray(values), jnp.asarray(expect),
                                                                       jnp.dtype(dtype)))
    padded = quantize.decode_chain([(e, None) for e in links])
    # On another device than the default one: a small chain's host arrays go to the kernels as they are and follow
    # the sum there; put first, the same.
    elsewhere = jax.devices()[2]
    as_arguments = quantize.decode_chain([(e, None) for e in links], elsewhere)
    monkeypatch.setattr(quantize, "_AS_ARGUMENT_BELOW", 0)
    put_first = quantize.decode_chain([(e, None) for e in links], elsewhere)
    assert as_arguments.devices() == put_first.devices() == {elsewhere}
    monkeypatch.setattr(quantize, "_CHAIN_PADDED_BELOW", 0)
    assert quantize.chain_size(n) == n and not quantize.takes_packed(n)
    plain = quantize.decode_chain([(e, None) for e in links])
    monkeypatch.setattr(quantize, "_PACKED_FROM", 0)
    assert quantize.takes_packed(n) and quantize.chain_size(n) == -(-n // 120) * 120
    to_120 = quantize.decode_chain([(e, None) for e in links])
    for out in (padded, as_arguments, put_first, plain, to_120):
        assert out.shape == shape and out.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expect.reshape(shape).view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(129, 130), (100,)])
def test_decode_hands_its_host_values_to_the_device_without_a_copy_from_64_kib(shape, dtype, monkeypatch):
    """`quantize.decode` looks an open-loop tensor's levels up on the host: from `codec.ALIGNED_FROM` bytes of
    values into a 64-byte aligned buffer, which JAX's CPU client takes as the device array's own memory (an
    unaligned one it copies); smaller ones as they come. The values are the
    table lookup and protected values bit for bit either way."""
    rng = np.random.default_rng(1)
    n, bins = int(np.prod(shape)), 5
    codes = rng.integers(0, bins + 2, shape).astype(np.uint8)
    centres = np.sort(rng.normal(size=bins)).astype(np.float32)
    protected = rng.normal(size=int((codes == bins + 1).sum())).astype(np.float32).astype(jnp.bfloat16)
    enc = quantize.EncodedTensor(codes, centres, protected, dtype)
    expect = np.concatenate([[0.0], centres, [0.0]]).astype(jnp.dtype(dtype))[codes]
    expect.reshape(-1)[np.flatnonzero(codes.reshape(-1) == bins + 1)] = protected.astype(jnp.dtype(dtype))
    made = []
    real = codec.aligned_empty
    monkeypatch.setattr(codec, "aligned_empty", lambda size: made.append(real(size)) or made[-1])
    out = quantize.decode(enc)
    assert out.shape == shape and out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expect.view(np.uint8))
    if n * jnp.dtype(dtype).itemsize >= codec.ALIGNED_FROM:
        assert len(made) == 1 and out.unsafe_buffer_pointer() == made[0].ctypes.data
    else:
        assert not made


@pytest.mark.parametrize("first_link", ["keyframe codes", "exact values"])
@pytest.mark.parametrize("shape", [(37, 29), (24, 40)])
def test_a_large_chain_is_summed_in_its_shape_and_returned_without_a_copy(first_link, shape, monkeypatch):
    """A tensor that takes packed codes (every tensor here, with the threshold lowered) is summed in its own shape:
    the array `decode_chain` returns is the buffer its first kernel wrote, updated in place by every later one (no
    kernel after the sums copies the whole tensor into shape),
    whether or not its size is a multiple of `PACKED_MULTIPLE` (a padded tail cut inside the kernels), with
    protected weights, and bit for bit the chain decoded flat."""
    rng = np.random.default_rng(5)
    bins = 6
    n = int(np.prod(shape))

    def link():
        codes = rng.integers(0, bins + 1, shape).astype(np.uint8)
        codes.reshape(-1)[rng.choice(n, 3, replace=False)] = bins + 1
        return quantize.EncodedTensor(codes, np.sort(rng.normal(size=bins)).astype(np.float32),
                                      rng.normal(size=3).astype(np.float32).astype(jnp.bfloat16), "float32")

    first = link() if first_link == "keyframe codes" else rng.normal(size=shape).astype(np.float32)
    chain = [(first, None)] + [(link(), None) for _ in range(5)]
    expect = np.asarray(quantize.decode_chain(chain))  # flat, padded to a power of two
    monkeypatch.setattr(quantize, "_PACKED_FROM", 1)
    assert quantize.chain_size(n) == -(-n // quantize.PACKED_MULTIPLE) * quantize.PACKED_MULTIPLE
    written = []  # the buffer of each array of the tensor's shape a kernel or a put made, as it was made

    def recorded(real):
        def call(*a, **k):
            out = real(*a, **k)
            if isinstance(out, jax.Array) and out.shape == shape:
                written.append(out.unsafe_buffer_pointer())
            return out
        return call

    for name in ("_chain_start", "_put_at"):
        monkeypatch.setattr(quantize, name, recorded(getattr(quantize, name)))
    monkeypatch.setattr(jax, "device_put", recorded(jax.device_put))
    out = quantize.decode_chain(chain)
    assert out.shape == shape
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), expect.view(np.uint32))
    # The first link's values (the keyframe's lookup kernel, or the exact values put on the device), then the
    # protected values put in: the returned array is the buffer the last kernel wrote, and a keyframe's, the
    # buffer of its first one (exact values put from a NumPy array may share its memory: the first sum copies
    # them).
    assert len(written) == 2 and out.unsafe_buffer_pointer() == written[1]
    if first_link == "keyframe codes":
        assert written[0] == written[1]


@pytest.mark.parametrize("case", ["an Inf in the exact first link", "a sum that overflows"])
def test_a_large_chain_whose_sums_leave_the_finite_range_decodes_by_the_formula(case, monkeypatch):
    """A large tensor's chain is added by plain sums (`quantize._chain_sum`) only where no sum can leave the finite
    range; an exact first link holding an Inf, or levels whose sum could overflow, are added by the save's formula
    (non-finite offsets replaced by 0): the result is the formula's, bit for bit."""
    rng = np.random.default_rng(3)
    shape = (23, 31)
    first = rng.normal(size=shape).astype(np.float32)
    if case.startswith("an Inf"):
        first[2, 5] = np.inf
    else:
        first[4, 4] = np.finfo(np.float32).max
    links = [(first, None)]
    for _ in range(6):
        codes = rng.integers(0, 4, size=shape).astype(np.uint8)
        centres = np.array([-1.0, 1.0, 3e38], np.float32) if case.endswith("overflows") else \
            np.sort(rng.normal(size=3)).astype(np.float32)
        links.append((quantize.EncodedTensor(codes, centres, np.zeros(0, np.float32), "float32"), None))
    exact = np.asarray(quantize.decode_chain(links))  # a small tensor: the formula's kernels
    monkeypatch.setattr(quantize, "_PACKED_FROM", 1)
    calls = []
    for name in ("_chain_sum", "_chain_group"):
        monkeypatch.setattr(quantize, name, lambda *a, real=getattr(quantize, name), name=name, **k: calls.append(
            name) or real(*a, **k))
    out = np.asarray(quantize.decode_chain(links))
    assert calls == ["_chain_group"] * 2
    np.testing.assert_array_equal(out.view(np.uint32), exact.view(np.uint32))
    # Levels within range: plain sums, the same values as the formula's.
    links = [(np.clip(first, -10, 10), None)] + [
        (e._replace(centres=np.array([-1.0, 0.5, 2.0], np.float32)), None) for e, _ in links[1:]]
    monkeypatch.setattr(quantize, "_PACKED_FROM", 1 << 40)
    exact = np.asarray(quantize.decode_chain(links))
    calls.clear()
    monkeypatch.setattr(quantize, "_PACKED_FROM", 1)
    out = np.asarray(quantize.decode_chain(links))
    assert calls == ["_chain_sum"] * 2
    np.testing.assert_array_equal(out.view(np.uint32), exact.view(np.uint32))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["float32", "bfloat16", "float16"]), st.integers(1, 9), st.sampled_from([-3, 0, 3, 4.5, 38]),
       st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_a_chain_by_plain_sums_is_the_formulas_bit_for_bit(dtype, links, scale, keyframe, packed, seed):
    """Whatever the dtype, the chain's length and its levels' magnitude (up to sums that overflow float16 or
    float32), a chain decoded the way a large tensor's is (plain sums where the host's bound allows, packed codes
    or not) is bit for bit the chain decoded by the save's formula."""
    rng = np.random.default_rng(seed)
    shape, bins = (7, 11), 5
    n = shape[0] * shape[1]
    if keyframe:
        first = quantize.EncodedTensor(rng.integers(0, bins + 1, shape).astype(np.uint8),
                                       np.sort(rng.normal(size=bins)).astype(np.float32) * 10.0 ** scale,
                                       np.zeros(0, np.float32), dtype)
    else:
        first = np.asarray(jnp.asarray(rng.normal(size=shape) * 10.0 ** scale, dtype))
    chain = [(first, None)]
    for _ in range(links):
        codes = rng.integers(0, bins + 1, shape).astype(np.uint8)
        chain.append((quantize.EncodedTensor(codes, np.sort(rng.normal(size=bins)).astype(np.float32)
                                             * 10.0 ** scale, np.zeros(0, np.float32), dtype), None))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(quantize, "_PACKED_FROM", 1 << 40)
        expect = np.asarray(quantize.decode_chain(chain))
        m.setattr(quantize, "_PACKED_FROM", 1)
        if packed:
            for k in range(1, len(chain)):
                e = chain[k][0]
                got = codec.packed_values(codec.compress(e.codes, codec.ZSTD_RADIX), codec.ZSTD_RADIX, n,
                                          quantize.chain_size(n))
                chain[k] = (e._replace(codes=quantize.PackedCodes(got[0], got[1], shape)), None)
        out = np.asarray(quantize.decode_chain(chain))
    np.testing.assert_array_equal(out.view(np.uint8), expect.view(np.uint8))


def test_uniform_levels_without_pruning_compile_no_prune_threshold_and_encode_the_same(monkeypatch):
    """A uniform configuration without pruning (every candidate of the default residual space) runs a kernel
    without the prune threshold's passes (`prunes` False), and encodes exactly what the kernel with them encodes
    at prune fraction 0: codes, levels and protected values, bit for bit; k-means and pruning configurations keep
    the kernel with them."""
    rng = np.random.default_rng(3)
    xs = [jnp.asarray(rng.standard_t(3, size=s).astype(np.float32)) for s in ((96, 64), (96, 64), (64,), (40, 8))]
    offsets = [x + jnp.asarray(rng.normal(0, 0.01, x.shape).astype(np.float32)) for x in xs]
    cfg = CompressionConfig()
    calls = []
    original = quantize._encode

    def recorded(*a, **k):
        calls.append(k["prunes"])
        return original(*a, **k)

    monkeypatch.setattr(quantize, "_encode", recorded)
    uniform = QuantConfig(bins=15, prune_fraction=0.0, protect_fraction=0.0, step=0.5)
    lean = quantize.encode_on_device(xs, [None] * 4, ["dense"] * 4, uniform, cfg, offsets=offsets)
    monkeypatch.setattr(quantize, "_encode", lambda *a, **k: recorded(*a, **{**k, "prunes": True}))
    full = quantize.encode_on_device(xs, [None] * 4, ["dense"] * 4, uniform, cfg, offsets=offsets)
    assert calls == [False, True]
    for a, b in zip(lean, full):
        for name in ("codes", "centres", "protected_in_place"):
            np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    monkeypatch.setattr(quantize, "_encode", recorded)
    calls.clear()
    quantize.encode_on_device(xs, [None] * 4, ["dense"] * 4, QuantConfig(bins=8, prune_fraction=0.0), cfg)
    quantize.encode_on_device(xs, [None] * 4, ["dense"] * 4, dataclasses.replace(uniform, prune_fraction=0.1),
                              cfg, offsets=offsets)
    assert calls == [True, True]


def test_uniform_cells_outside_the_range_of_the_codes_are_stored_as_zero():
    """A uniform residual's levels: the cells from the lowest to the highest code a quantized value takes keep
    their level (a cell inside that range that no value takes too: it is never decoded), those outside it are 0;
    a non-finite value (protected, code bins + 1) does not widen the range."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    x[x > 0] *= 0.1  # positive side squeezed: the cells above about +1 RMS hold nothing
    x[0, 0] = np.inf
    off = np.zeros_like(x)
    q = QuantConfig(bins=63, protect_fraction=0.0, prune_fraction=0.0, step=0.25)
    [d] = quantize.encode_on_device([jnp.asarray(x)], [None], ["dense"], q, CompressionConfig(),
                                    offsets=[jnp.asarray(off)], sigma=quantize.RESIDUAL_SIGMA)
    codes, centres = np.asarray(d.codes), np.asarray(d.centres)[:63]
    assert codes[0, 0] == 64
    used = codes[codes <= 63]
    lo, hi = int(used.min()), int(used.max())
    assert 1 < lo and hi < 63  # both tails of the range lie inside the 63 cells
    inside = np.arange(1, 64)[(np.arange(1, 64) >= lo) & (np.arange(1, 64) <= hi)]
    assert np.count_nonzero(centres[inside - 1]) == inside.size - 1  # all but the cell centred on 0 (code 32)
    assert lo <= 32 <= hi and centres[31] == 0
    assert np.all(centres[:lo - 1] == 0) and np.all(centres[hi:] == 0)
    table = np.concatenate([[0.0], centres, [0.0]])
    decoded = np.where(codes == 64, x, table[np.minimum(codes, 64)])
    assert np.array_equal(decoded, np.asarray(d.dequantize(jnp.float32)))


@pytest.mark.parametrize("non_finite", [False, True])
def test_proxy_sums_are_plain_when_finite_and_masked_otherwise(non_finite, monkeypatch):
    """`search.proxy_degradation` sums over every element (`quantize.error_sums` plain) when all terms are finite:
    the float64 ratio, within float32 rounding; where a term is not finite it sums over the finite elements
    (masked), a second kernel call; `quantize.uniform_residual_scores` likewise."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 70)).astype(np.float32)
    d = x + 0.01 * rng.standard_normal(x.shape).astype(np.float32)
    ref = x + 0.1 * rng.standard_normal(x.shape).astype(np.float32)
    if non_finite:
        x[5, 5] = d[5, 5] = np.inf
    calls = []
    sums = search._proxy_sums
    monkeypatch.setattr(search, "_proxy_sums", lambda *a, masked: calls.append(masked) or sums(*a, masked=masked))
    got = search.proxy_degradation([jnp.asarray(x)], [jnp.asarray(d)], [None], [jnp.asarray(ref)])
    fin = np.isfinite(x)
    x64, d64, r64 = (np.asarray(a, np.float64)[fin] for a in (x, d, ref))
    assert isinstance(got, np.float32) and np.isfinite(got)
    assert float(got) == pytest.approx(np.sum((x64 - d64) ** 2) / np.sum((x64 - r64) ** 2), rel=1e-5)
    assert calls == ([False, True] if non_finite else [False])
    q = QuantConfig(bins=63, protect_fraction=0.0, prune_fraction=0.0, step=1.5)
    scored = quantize.uniform_residual_scores([jnp.asarray(x)], [jnp.asarray(ref)], None, ["dense"], [q, q], CFG)
    devs = quantize.encode_on_device([jnp.asarray(x)], [None], ["dense"], q, CFG, offsets=[jnp.asarray(ref)],
                                     sigma=quantize.RESIDUAL_SIGMA)
    encoded = search.proxy_degradation([jnp.asarray(x)], quantize.dequantize_all(devs, [jnp.float32]), [None],
                                       [jnp.asarray(ref)])
    assert scored.dtype == np.float32 and np.isfinite(scored).all()
    assert scored[0] == pytest.approx(float(encoded), rel=1e-5)


@pytest.mark.parametrize("qc", [QuantConfig(bins=63, protect_fraction=0.0, prune_fraction=0.0, step=1.5),
                                QuantConfig(bins=15, protect_fraction=0.01, prune_fraction=0.0, step=0.5),
                                QuantConfig(bins=8, protect_fraction=0.01, prune_fraction=0.2)],
                         ids=["residual cells", "protected cells", "k-means and pruning"])
def test_large_tensors_of_uniform_levels_without_pruning_encode_alone_with_the_same_result(qc, monkeypatch):
    """Uniform levels without pruning: each tensor of `quantize.ALONE_FROM` values or more is encoded by a call of
    its own (no stacking), the others together; codes, levels and protected values as when every tensor goes
    into the joint call, bit for bit (a non-finite value, residuals against offsets, two layer types, one tensor
    sharded over two devices). k-means or pruning (a threshold shared by a layer type) keep the joint call."""
    rng = np.random.default_rng(5)
    shapes = [(64, 48), (64, 48), (300,), (96, 40), (32, 16)]
    xs = [jnp.asarray(rng.standard_t(3, s).astype(np.float32) * 0.02) for s in shapes]
    xs[0] = xs[0].at[2, 3].set(jnp.nan)
    offs = [x + jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * 1e-3) for x in xs]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    xs[3], offs[3] = jax.device_put(xs[3], sh), jax.device_put(offs[3], sh)
    lts = ["dense", "dense", "other", "dense", "embedding"]

    def encode():
        devs = quantize.encode_on_device(xs, [None] * 5, lts, qc, CFG, offsets=offs, sigma=quantize.RESIDUAL_SIGMA)
        return [quantize.to_host(d.codes, d.centres, d.protected_in_place, d.bins, jnp.float32) for d in devs]

    joint = encode()
    calls = []
    alone = quantize._encode_alone
    monkeypatch.setattr(quantize, "_encode_alone", lambda *a, **kw: calls.append(len(a[0][0])) or alone(*a, **kw))
    monkeypatch.setattr(quantize, "ALONE_FROM", 64 * 48)
    separate = encode()
    assert calls == ([1, 1, 1] if qc.step > 0 else [])  # the two 64x48 tensors and the sharded 96x40 one
    for a, b in zip(joint, separate):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.centres, b.centres)
        assert a.protected.tobytes() == b.protected.tobytes()
    assert np.isnan(joint[0].protected).sum() == 1


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 3), st.integers(1, 200), st.integers(1, 62), st.booleans(), st.floats(0.0, 1.0),
       st.integers(0, 2**31 - 1))
def test_the_range_of_the_codes_is_that_of_the_quantized_values(tensors, n, bins, pruned, protected, seed):
    """`quantize._taken_range` per stacked tensor: the cells between the lowest and the highest code of a
    quantized value (1..bins), whatever pruned (0, only where `pruned`) and protected (bins + 1) codes it holds
    besides, and none for a tensor without one; the uint8 reductions without a select (nothing pruned, nothing
    protected) give what the masked ones give."""
    rng = np.random.default_rng(seed)
    code = rng.integers(1 if not pruned else 0, bins + 1, (tensors, n))
    code[rng.random(code.shape) < protected] = bins + 1
    code = code.astype(np.uint8)
    got = np.asarray(jax.jit(quantize._taken_range, static_argnums=(2, 3))(
        jnp.asarray(code), jnp.int32(bins), 63, pruned))
    for t in range(tensors):
        q = code[t][(code[t] >= 1) & (code[t] <= bins)]
        slot = np.arange(1, 64)
        want = (slot >= q.min()) & (slot <= q.max()) if q.size else np.zeros(63, bool)
        np.testing.assert_array_equal(got[t], want)


def test_uniform_cells_take_a_width_reference():
    """`uniform_levels`' `reference`: [1, 1] gives each tensor's own RMS bit for bit (what None gives); [S, p]
    cells of step * max(S * RMS^p, RMS / 8), the lower end where the reference would leave 63 cells short of
    the tensor's values."""
    spec = sketch.SketchSpec(CFG.alpha)
    x = jnp.asarray(weights((4096,), 3))
    h = sketch.histogram(x, spec)
    plain = quantize.uniform_levels(h, spec, 63, 1.5, quantize.UNIFORM_SLOTS)
    ones = quantize.uniform_levels(h, spec, 63, 1.5, quantize.UNIFORM_SLOTS, reference=jnp.ones(2, jnp.float32))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(plain, ones))
    rms = float(plain[1]) / 1.5
    for scale, power in ((3.0, 0.0), (0.2, 0.5), (0.01, 0.5), (1e-6, 0.0)):
        levels, width = quantize.uniform_levels(h, spec, 63, 1.5, quantize.UNIFORM_SLOTS,
                                                reference=jnp.asarray([scale, power], jnp.float32))
        assert float(width) == pytest.approx(1.5 * max(scale * rms ** power, rms / 8), rel=1e-5)
        assert float(levels[31]) == 0.0 and float(levels[32]) == pytest.approx(float(width), rel=1e-6)


def test_the_width_reference_is_the_rms_of_the_whole_residual():
    """`residual_reference`: [G^(1 - p), p], G the RMS of every tensor's residual x - offset (its finite values;
    divided by weighting's M = 2^K where a tensor has factors); None at power 1 or for a residual of zeros."""
    rng = np.random.default_rng(1)
    offs = [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in ((64, 32), (500,))]
    xs = [o + jnp.asarray(rng.standard_normal(o.shape).astype(np.float32) * a) for o, a in zip(offs, (1e-3, 1e-1))]

    def rms(parts):
        vals = np.concatenate([np.ravel(p) for p in parts]).astype(np.float64)
        vals = vals[np.isfinite(vals)]
        return np.sqrt((vals ** 2).mean())

    res = [np.asarray(x) - np.asarray(o) for x, o in zip(xs, offs)]
    assert quantize.residual_reference(xs, offs, None, 1.0) is None
    assert quantize.residual_reference(offs, offs, None, 0.5) is None
    for p in (0.0, 0.5):
        np.testing.assert_allclose(quantize.residual_reference(xs, offs, None, p), [rms(res) ** (1 - p), p], rtol=1e-5)
    holed = [xs[0].at[1, 2].set(jnp.nan), xs[1].at[7].set(jnp.inf)]
    res_holed = [np.asarray(x) - np.asarray(o) for x, o in zip(holed, offs)]
    np.testing.assert_allclose(quantize.residual_reference(holed, offs, None, 0.0), [rms(res_holed), 0.0], rtol=1e-5)
    # K = floor((4 + 0 + 2) / 4) = 1 for every element of the first tensor: its residual counts halved
    factors = [(jnp.full((64,), 4, jnp.int32), jnp.zeros((32,), jnp.int32)), None]
    np.testing.assert_allclose(quantize.residual_reference(xs, offs, factors, 0.0), [rms([res[0] / 2, res[1]]), 0.0],
                               rtol=1e-5)
