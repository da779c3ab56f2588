"""The compressed downlink's packed slot (ssdsgd.ps.ring_packing): one-byte values, LEB128 index gaps,
three bytes a float32 word; what the servers apply is what every replica decodes, bit for bit."""
import numpy as np
import pytest

from ssdsgd.ps import ring_packing as rp


def bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_values_keep_four_significant_bits_within_sixteen_octaves():
    v = np.array([8, 15, -9, 0.96875, 1000.0, 2.0 ** -4, 2.0 ** -6, 0.0, 1.03], np.float32)
    r, keep = rp.round_values(v)
    # 8 .. 15 are exact; 0.96875 = 31/32 carries to 1.0; 1000 -> 1024 (4 bits: 1000 = 0.9766 * 2**10);
    # the largest is 2**10, so 2**-4 (14 octaves below) stays and 2**-6 (16 below) and 0 do not
    assert r.tolist() == [8, 15, -9, 1.0, 1024.0, 2.0 ** -4, 0.0, 0.0, 1.0]
    assert keep.tolist() == [True] * 6 + [False, False, True]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10000).astype(np.float32)
    r, keep = rp.round_values(x)
    rel = np.abs(r[keep] - x[keep]) / np.abs(x[keep])
    assert rel.max() <= 1 / 16 + 1e-7           # half a step of 1/8 on a mantissa in [1, 2)
    assert bits_equal(rp.round_values(r[keep])[0], r[keep])       # rounding twice changes nothing


@pytest.mark.parametrize("seed", range(5))
def test_encode_decode_is_exact_for_any_gaps(seed):
    rng = np.random.default_rng(seed)
    size = 1 << 23
    # gaps of every varint length: 1-byte, 2-byte (>= 128), 3-byte (>= 2**14) and 4-byte (>= 2**21)
    idx = np.unique(np.concatenate([rng.choice(5000, 300, replace=False), [6000, 40000, 3_000_000],
                                    rng.choice(np.arange(4_000_000, size), 50, replace=False), [size - 1]]))
    values, keep = rp.round_values(rng.standard_normal(idx.size).astype(np.float32) * 1e-3)
    idx, values = idx[keep], values[keep]
    words = 1 + -(-rp.encoded_bytes(idx) // 3)
    payload = rp.encode(idx, values, words)
    assert payload.dtype == np.float32 and np.all(payload == np.rint(payload)) and payload.max() < 2 ** 24
    got_idx, got_values = rp.decode(payload, idx.size, size)
    assert np.array_equal(got_idx, idx) and bits_equal(got_values, values)
    assert rp.encode(idx, values, words - 1) is None          # one word short: does not fit


def test_a_few_percent_density_packs_about_two_bytes_a_pair():
    """At 8 workers x 1% of ResNet-20's 272,474 values the round sum has about 16,600 entries: about
    2 bytes each, so two pushes' bytes (43,952) carry nearly all of them instead of 5,492 fp32 pairs."""
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(272474, 16600, replace=False))
    assert rp.encoded_bytes(idx) <= 2.001 * idx.size
    budget = rp.payload_bytes(43952 // 4 - 4)
    mags = rng.random(idx.size)
    kept = rp.fit(idx, mags, budget)
    assert rp.encoded_bytes(idx[kept]) <= budget and kept.size > 16300
    dropped = np.setdiff1d(np.arange(idx.size), kept)
    assert mags[dropped].max() <= mags[kept].min()             # the smallest magnitudes are left out
    assert np.array_equal(kept, np.sort(kept))


def test_values_that_are_not_rounded_and_short_payloads_are_refused():
    with pytest.raises(ValueError, match="not rounded"):
        rp.encode(np.array([1, 2]), np.array([1.0, 1.1], np.float32), 10)
    payload = rp.encode(np.array([3, 900]), np.array([1.0, -0.5], np.float32), 3)
    assert rp.decode(payload, 2, 1000)[0].tolist() == [3, 900]
    with pytest.raises(ValueError, match="fewer than 3 index gaps"):
        rp.decode(payload[:2], 3, 1000)
    with pytest.raises(ValueError, match="outside a buffer of 500"):
        rp.decode(payload, 2, 500)
    empty_idx, empty_values = rp.decode(rp.encode(np.zeros(0, np.int64), np.zeros(0, np.float32), 2), 0, 10)
    assert empty_idx.size == empty_values.size == 0


def test_fit_drops_the_smallest_and_the_first_of_equal_ones():
    """Which pairs are left out decides the run: the smallest magnitudes, and of equal ones (common
    among one-byte values) the first, as a stable sort would order them."""
    rng = np.random.default_rng(4)
    idx = np.sort(rng.choice(100000, 3000, replace=False))
    mags = rng.integers(1, 6, idx.size).astype(np.float32)          # many ties
    budget = rp.encoded_bytes(idx) - 700
    kept = rp.fit(idx, mags, budget)
    assert rp.encoded_bytes(idx[kept]) <= budget
    dropped = np.setdiff1d(np.arange(idx.size), kept)
    assert np.array_equal(np.sort(np.argsort(mags, kind="stable")[:dropped.size]), dropped)


def test_subnormal_and_tiny_rounds_still_pack_exactly():
    """A round whose values are all float32 subnormals (or round to zero) packs and decodes bit for bit
    instead of stopping the server."""
    # all subnormal: 6e-42 is about 2**-137, -2.1e-44 = -15 * 2**-149, 2.9e-44 = 21 * 2**-149 (rounds to
    # 20 * 2**-149), 1e-45 = 2**-149, the smallest; 2e-46 is 0 in float32; 3e-38 (2**-125) would put
    # 2**-149 more than 16 octaves below and leave it out
    v = np.array([6e-42, -2.1e-44, 2.9e-44, 1e-45, 2e-46], np.float32)
    r, keep = rp.round_values(v)
    assert keep.tolist() == [True, True, True, True, False] and np.all(r[keep] != 0)
    assert r[2] == np.float32(20 * 2.0 ** -149)
    assert rp.round_values(np.array([3e-38, 1e-45], np.float32))[1].tolist() == [True, False]
    idx = np.flatnonzero(keep)
    got_idx, got_values = rp.decode(rp.encode(idx, r[keep], 4), idx.size, 10)
    assert np.array_equal(got_idx, idx) and bits_equal(got_values, r[keep])
