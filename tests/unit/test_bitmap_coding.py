"""Bitmap index coding (compression.index_coding: auto): a sparse message or a sparse-downlink round
carries its indices as a selection mask of ceil(size / 24) float32 words instead of k indices, where
that is smaller. Checked against an independent pure-Python reading of the format, against the
index-list coding bit for bit, and in real jobs."""
import warnings

import numpy as np
import pytest

from ssdsgd.compression.codec import (
    BITMAP_BITS,
    WireFormat,
    bitmap_words,
    encode_sparse,
    pack_bitmap,
    unpack_bitmap,
    use_bitmap,
)
from ssdsgd.compression.fusion import make_plan, warmup_stages
from ssdsgd.ps.ring import DownlinkRing, RingLayout, read_ring
from ssdsgd.ps.rounds import BufferState, RoundError
from ssdsgd.schedule import LRSchedule


def reference_indices(words):
    """Word w, bit b (most significant first) is index 24 w + b: read with Python integers."""
    return [BITMAP_BITS * w + b for w, word in enumerate(np.asarray(words).tolist())
            for b in range(BITMAP_BITS) if (int(word) >> (BITMAP_BITS - 1 - b)) & 1]


def bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("size", [1, 23, 24, 25, 1000, 272474])
@pytest.mark.parametrize("fill", [0.0, 0.07, 1.0])
def test_pack_and_unpack_against_a_reference_reading(size, fill):
    rng = np.random.default_rng(size)
    idx = np.sort(rng.choice(size, int(fill * size), replace=False))
    if size > 1 and fill > 0:
        idx = np.union1d(idx, [0, size - 1])              # both ends of the buffer
    words = pack_bitmap(idx, size)
    assert words.dtype == np.float32 and words.shape == (bitmap_words(size),) == (-(-size // 24),)
    assert (words >= 0).all() and (words < 2 ** 24).all() and (words == np.round(words)).all()
    if size <= 1000:
        assert reference_indices(words) == idx.tolist()
    np.testing.assert_array_equal(unpack_bitmap(words, size), idx)


def test_unpack_refuses_what_pack_cannot_make():
    words = pack_bitmap(np.array([3, 30]), 40)
    with pytest.raises(ValueError, match="2 words, expected 1"):
        unpack_bitmap(words, 20)
    for bad, why in [(0.5, "not an integer"), (-1.0, "not an integer"), (2.0 ** 24, "not an integer"),
                     (np.nan, "not an integer"), (np.inf, "not an integer")]:
        w = words.copy()
        w[0] = bad
        with warnings.catch_warnings():
            warnings.simplefilter("error")           # refused before any cast of a NaN or inf word
            with pytest.raises(ValueError, match=why):
                unpack_bitmap(w, 40)
    w = pack_bitmap(np.array([47]), 48)                   # bit 47 of 48: fine for 48, beyond 41
    assert unpack_bitmap(w, 48).tolist() == [47]
    with pytest.raises(ValueError, match="index 47, beyond the buffer's 41 elements"):
        unpack_bitmap(w, 41)


def test_bitmap_only_where_it_is_smaller():
    # 240 elements: 10 words. A list of k indices costs k words.
    assert not use_bitmap(240, 10) and use_bitmap(240, 11)
    assert not use_bitmap(240, 200, "list")
    assert not use_bitmap(240, 200, fp16=True)           # the fp16 wire keeps its index digits
    with pytest.raises(ValueError, match="unknown index coding 'zip'"):
        use_bitmap(240, 200, "zip")
    assert WireFormat("sparse", 240, 11, bitmap=True).length == 2 + 10 + 11
    assert WireFormat("sparse", 240, 11).length == 2 + 2 * 11
    with pytest.raises(ValueError, match="fp32 wire only"):
        WireFormat("sparse", 240, 11, fp16=True, bitmap=True)
    with pytest.raises(ValueError, match="sparse payloads on the fp32 wire only"):
        WireFormat("dense", 240, bitmap=True)
    with pytest.raises(ValueError, match="fp32 wire only"):
        encode_sparse(np.array([1, 2]), np.ones(2, np.float32), fp16=True, bitmap_size=240)
    with pytest.raises(RoundError, match="needs the buffer's size"):
        RingLayout(1, 20, 0, bitmap=True)


def test_a_bitmap_message_decodes_to_the_index_list_message_bit_for_bit():
    rng = np.random.default_rng(3)
    size, k = 1000, 200
    idx = rng.choice(size, k, replace=False)              # unsorted, as a selection comes
    val = rng.standard_normal(k).astype(np.float32)
    val[:3] = [0.0, -0.0, np.nan]
    header = np.array([7, 1], np.float32)
    listed = WireFormat("sparse", size, k).parse(np.concatenate([header, encode_sparse(idx, val)]))[2]
    payload = encode_sparse(idx, val, bitmap_size=size)
    assert payload.shape == (bitmap_words(size) + k,)
    order = np.argsort(idx)
    assert reference_indices(payload[:bitmap_words(size)]) == np.sort(idx).tolist()
    assert bits_equal(payload[bitmap_words(size):], val[order])     # values in index order
    fmt = WireFormat("sparse", size, k, bitmap=True)
    assert fmt.length == 2 + bitmap_words(size) + k
    rnd, rank, got = fmt.parse(np.concatenate([header, payload]))
    assert (rnd, rank) == (7, 1)
    assert bits_equal(got.to_dense(), listed.to_dense())
    with pytest.raises(ValueError, match="marks 199 indices for 200 values"):
        short = encode_sparse(idx[:-1], val[:-1], bitmap_size=size)
        fmt.decode(np.concatenate([short, [0.0]]).astype(np.float32))
    with pytest.raises(ValueError, match="expected 242"):
        fmt.decode(payload[:-1])


def test_bitmap_encoding_refuses_repeated_indices():
    with pytest.raises(ValueError, match="distinct indices.*index_coding: list"):
        encode_sparse(np.array([4, 9, 4]), np.ones(3, np.float32), bitmap_size=100)


def test_plan_chooses_the_coding_per_buffer_and_per_density_stage():
    shapes = [(4800,), (48,)]
    dense_counts = [480, 4]                               # 10%: k = 484 > 202 words
    (buf,) = make_plan(shapes, 1, counts=dense_counts, codec="sparse", index_coding="auto")
    assert buf.wire.bitmap is True and buf.to_dict()["mailboxes"][0]["bitmap"] is True
    assert buf.wire.length == 2 + bitmap_words(4848) + 484
    (listed,) = make_plan(shapes, 1, counts=dense_counts, codec="sparse", index_coding="list")
    assert not listed.wire.bitmap and listed.wire.length == 2 + 2 * 484
    # A 1% stage (48 + 1 values) keeps the index list; the 10% steady state uses the bitmap.
    (stage,), = warmup_stages([buf], [[48, 1]])
    assert not stage.wire.bitmap and stage.wire.length == 2 + 2 * 49
    (dense,) = make_plan(shapes, 1, index_coding="auto")
    assert not dense.wire.bitmap and dense.wire == WireFormat("dense", 4848)


def _ring_pair(size, cap, bitmap_ring):
    sched = LRSchedule("cosine", base_lr=0.3, total_updates=50)
    server = BufferState(size, 2, 8, 0.9, 1e-4, sched, [WireFormat("sparse", size, cap // 2)])
    server.ring = DownlinkRing(RingLayout(3, cap, size, bitmap_ring), check_every=4)
    replica = BufferState(size, 2, 8, 0.9, 1e-4, LRSchedule("cosine", base_lr=0.3, total_updates=50), [])
    w0 = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    server.bind(w0)
    replica.bind(w0)
    return server, replica


def test_bitmap_ring_keeps_the_replica_bit_identical_and_is_smaller():
    size, k = 500, 60                                     # cap 120 > 21 words: bitmap pays
    rng = np.random.default_rng(5)
    states = {coding: _ring_pair(size, 2 * k, coding) for coding in (False, True)}
    assert states[True][0].ring.array.size == RingLayout(3, 2 * k, size, True).length == 3 * (4 + 21 + 120)
    assert states[False][0].ring.array.size == RingLayout(3, 2 * k, size).length == 3 * (4 + 240)
    for rnd in range(30):
        msgs = [np.concatenate([[rnd, rank], rng.choice(size, k, replace=False),
                                rng.standard_normal(k)]).astype(np.float32) for rank in range(2)]
        for bitmap_ring, (server, replica) in states.items():
            for m in msgs:
                server.receive(m)
            if rnd % 2:
                assert replica.catch_up(read_ring(server.ring.array.copy(), RingLayout(3, 2 * k, size, bitmap_ring)))
                assert bits_equal(replica.weights, server.weights)
    server = states[True][0]
    assert sorted(read_ring(server.ring.array, RingLayout(3, 2 * k, size, True))) == [27, 28, 29]
    assert sorted(read_ring(server.ring.array, RingLayout(3, 2 * k, size, True), from_round=29)) == [29]
    (s_list, r_list), (s_bit, r_bit) = states[False], states[True]
    assert bits_equal(s_bit.weights, s_list.weights) and bits_equal(r_bit.weights, r_list.weights)
    assert r_bit.checks == r_list.checks > 0


def test_bitmap_ring_keeps_negative_zero_and_nan_and_names_a_corrupt_slot():
    ring = DownlinkRing(RingLayout(1, 8, 30, bitmap=True))
    g = np.zeros(30, np.float32)
    g[[1, 5, 29]] = [-0.0, np.nan, 2.5]
    ring.record(0, g)
    (idx, vals, _), = read_ring(ring.array, ring.layout).values()
    back = np.zeros(30, np.float32)
    back[idx] = vals
    assert bits_equal(back, g)
    bad = ring.array.copy()
    bad[1] = 2                                            # the count no longer matches the mask
    with pytest.raises(RoundError, match="ring slot of round 0: bitmap marks 3 indices for 2 values"):
        read_ring(bad, ring.layout)
    bad = ring.array.copy()
    bad[4] = 0.5
    with pytest.raises(RoundError, match="round 0: bitmap word is not an integer"):
        read_ring(bad, ring.layout)


def test_config_index_coding_needs_a_sparsifier():
    import os

    from ssdsgd.config import ConfigError, load_config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with pytest.raises(ConfigError, match="compression.index_coding: only sparse messages carry indices"):
        load_config(os.path.join(root, "configs/demo_digits_ssd.yaml"), ["compression.index_coding=list"])
    with pytest.raises(ConfigError, match="index_coding"):
        load_config(os.path.join(root, "configs/demo_digits_ssd_topk.yaml"), ["compression.index_coding=bits"])
