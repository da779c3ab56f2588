"""Tests for the sparsifying gradient compressor on the push path (ssdsgd.compression): codec,
selection, error feedback, SAFusion ('ahead') vs fuse-then-sparsify ('behind'), the buffer plan and
its cost model, the server-side decode+sum, and a real 2-worker top-k job. Every check is against an
independent numpy reference written here."""
import itertools
import os

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT

from ssdsgd.compression.codec import WireFormat
from ssdsgd.compression.compressor import RandomK, SampledThreshold, TopK
from ssdsgd.compression.encoders import SparseEncoder, make_encoders, tensor_counts
from ssdsgd.compression.fusion import make_plan, plan_cost_model
from ssdsgd.compression.memory import Memory
from ssdsgd.config import load_config
from ssdsgd.ps.keys import KEY_HASH, place_buffers
from ssdsgd.ps.rounds import BufferState

TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"


def comp_config(*overrides):
    """The demo's compression section (top-k, error feedback, ahead, cost-model buffers) with
    overrides; buffers default to 'one' here, since the cost model needs link measurements."""
    return load_config(os.path.join(ROOT, TOPK_CONFIG),
                       ["compression.buffers=one"] + list(overrides)).compression


def np_decode(payload, size, k, bitmap=False):
    """Independent reference decoder: first k entries are indices, next k values; repeats add.
    bitmap: first ceil(size / 24) entries are 24-bit words of the selection mask (most significant
    bit first), then the k values in increasing index order."""
    payload = np.asarray(payload, np.float64)
    if bitmap:
        words = (size + 23) // 24
        assert payload.shape == (words + k,)
        idx = [24 * w + bit for w, word in enumerate(payload[:words].tolist())
               for bit in range(24) if (int(word) >> (23 - bit)) & 1]
        assert all(word == int(word) for word in payload[:words].tolist()), "bitmap words must be integers"
        idx = np.array(idx, np.int64)
        assert idx.size == k and (idx.size == 0 or idx.max() < size)
        return np.bincount(idx, weights=payload[words:], minlength=size), idx, payload[words:]
    assert payload.shape == (2 * k,)
    idx = payload[:k]
    assert np.all(idx == np.round(idx)), "indices must be exact integers"
    idx = idx.astype(np.int64)
    assert idx.min() >= 0 and idx.max() < size
    return np.bincount(idx, weights=payload[k:], minlength=size), idx, payload[k:]


def np_topk_set(x, k):
    return set(np.argsort(-np.abs(x), kind="stable")[:k].tolist())


def untied(rng, n):
    """Random data whose magnitudes are all distinct (no ties for top-k)."""
    mags = rng.permutation(np.arange(1, n + 1)).astype(np.float32) / n + 0.01
    return (mags * rng.choice([-1.0, 1.0], n)).astype(np.float32)


# ------------------------------------------------------------------------------------------ 1. codec

def test_sparse_codec_round_trip_against_numpy_scatter():
    rng = np.random.default_rng(0)
    size, k = 200, 37
    idx = rng.choice(size, k, replace=False)
    vals = rng.standard_normal(k).astype(np.float32)
    payload = np.concatenate([idx.astype(np.float32), vals])
    want = np.zeros(size, np.float32)
    want[idx] = vals                                    # numpy scatter (distinct indices)
    sparse = WireFormat("sparse", size, k).decode(payload)
    assert sparse.idx.shape == (k,) and sparse.vals.dtype == np.float32    # O(k), not a dense array
    got = sparse.to_dense()
    assert got.shape == (size,) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)

    # Repeated indices add up.
    idx = np.array([5, 5, 0, 199, 5, 0], np.int64)
    vals = np.array([1.0, 2.5, -1.0, 4.0, 0.25, 3.0], np.float32)
    want = np.zeros(size, np.float64)
    for i, v in zip(idx, vals):
        want[i] += v
    got = WireFormat("sparse", size, 6).decode(np.concatenate([idx.astype(np.float32), vals])).to_dense()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert got[5] == pytest.approx(3.75) and got[0] == pytest.approx(2.0)

    # Indices near the 2**24 cap stay exact in float32.
    big = 1 << 24
    idx = np.array([big - 1, big - 2, 0], np.int64)
    got = WireFormat("sparse", big, 3).decode(np.concatenate([idx.astype(np.float32),
                                                         np.array([1, 2, 3], np.float32)])).to_dense()
    assert got[big - 1] == 1 and got[big - 2] == 2 and got[0] == 3 and got.sum() == 6


def test_dense_codec_is_identity_and_codecs_validate():
    x = np.random.default_rng(1).standard_normal(13).astype(np.float32)
    np.testing.assert_array_equal(WireFormat("dense", 13).decode(x), x)
    with pytest.raises(ValueError):
        WireFormat("dense", 13).decode(x[:12])
    with pytest.raises(ValueError):
        WireFormat("dense", 13).decode(np.zeros(14, np.float32))
    dec = WireFormat("sparse", 10, 3).decode
    for bad_len in (5, 7, 3, 0):
        with pytest.raises(ValueError):
            dec(np.zeros(bad_len, np.float32))
    for bad_index in (10, 11, -1, 1e6):
        with pytest.raises(ValueError):
            dec(np.array([0, bad_index, 2, 1, 1, 1], np.float32))
    # in range at both ends is fine
    np.testing.assert_array_equal(dec(np.array([0, 9, 9, 1, 2, 3], np.float32)).to_dense(),
                                  np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 5], np.float32))


# ------------------------------------------------------------------------------------------ 2. top-k

@pytest.mark.parametrize("n,k", [(1, 1), (10, 1), (10, 10), (57, 5), (1000, 1), (1000, 10),
                                 (1000, 1000), (4096, 300)])
def test_topk_selects_numpy_largest_magnitudes(n, k):
    rng = np.random.default_rng(n * 31 + k)
    x = untied(rng, n)
    idx = TopK().select(x, k, key=0, step=0)
    assert idx.shape == (k,)
    assert np.all(idx == np.round(idx))
    assert set(idx.astype(int).tolist()) == np_topk_set(x, k)
    assert np.all(np.diff(idx) > 0)                 # increasing: memory is walked in order


def test_topk_counts_a_nan_above_every_number_and_still_sends_exactly_k():
    x = np.array([1.0, np.nan, -3.0, 2.0, np.nan, 0.5], np.float32)
    np.testing.assert_array_equal(TopK().select(x, 3, key=0, step=0), [1, 2, 4])
    np.testing.assert_array_equal(TopK().select(x, 2, key=0, step=0), [1, 4])
    np.testing.assert_array_equal(TopK().select(x, 1, key=0, step=0), [1])
    x[:] = np.nan
    np.testing.assert_array_equal(TopK().select(x, 4, key=0, step=0), [0, 1, 2, 3])


def test_repeat_check_takes_increasing_indices_without_a_scatter_and_still_finds_repeats():
    from ssdsgd.compression.codec import has_repeats
    assert not has_repeats(np.array([0, 3, 9], np.int64), 10)
    assert not has_repeats(np.array([9, 3, 0], np.int64), 10)        # distinct, not increasing
    assert has_repeats(np.array([0, 3, 3, 9], np.int64), 10)         # non-decreasing is not increasing
    assert has_repeats(np.array([9, 0, 9], np.int64), 10)


# ---------------------------------------------------------------------------- 3. DGC and random-k

@pytest.mark.parametrize("n,k", [(1, 1), (5, 5), (300, 1), (300, 3), (1000, 10), (20000, 200),
                                 (20000, 20000), (257, 256)])
def test_sampled_threshold_returns_exactly_k_distinct_in_range(n, k):
    rng = np.random.default_rng(7 + n + k)
    sel = SampledThreshold(seed=3)
    for step in range(3):
        x = rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 10)
        idx = sel.select(x, k, key=5, step=step)
        assert idx.shape == (k,)
        assert np.all(idx == np.round(idx))
        idx = idx.astype(np.int64)
        assert idx.min() >= 0 and idx.max() < n
        assert len(set(idx.tolist())) == k


@pytest.mark.parametrize("n,k", [(100, 5), (256, 10),           # sample covers the whole vector
                                 (1000, 10), (5000, 1), (20000, 20), (50000, 500)])
def test_sampled_threshold_finds_clearly_largest_entries(n, k):
    """k entries of magnitude ~100 among N(0,1) noise: the DGC selection must send those k."""
    rng = np.random.default_rng(n + 13 * k)
    sel = SampledThreshold(seed=0)
    for step in range(4):
        x = rng.standard_normal(n).astype(np.float32)
        top = rng.choice(n, k, replace=False)
        x[top] = rng.choice([-1.0, 1.0], k) * (100 + rng.random(k))
        idx = sel.select(x, k, key=2, step=step).astype(np.int64)
        assert set(idx.tolist()) == set(top.tolist()), (
            f"step {step}: missed {len(set(top.tolist()) - set(idx.tolist()))} of the {k} largest")


def test_random_k_is_exact_distinct_and_aligned_across_workers():
    n, k = 1000, 25
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    w0, w1 = RandomK(seed=11), RandomK(seed=11)          # two workers, same job seed
    a = w0.select(x, k, key=4, step=9)
    b = w1.select(np.zeros(n, np.float32), k, key=4, step=9)   # data does not matter
    assert a.shape == (k,) and np.all(a == np.round(a))
    ia = a.astype(np.int64)
    assert len(set(ia.tolist())) == k and ia.min() >= 0 and ia.max() < n
    np.testing.assert_array_equal(a, b)
    other_step = w0.select(x, k, key=4, step=10)
    other_key = w0.select(x, k, key=5, step=9)
    assert set(other_step.tolist()) != set(a.tolist())
    assert set(other_key.tolist()) != set(a.tolist())
    # negative keys/steps (behind-fusion keys, the startup timing run) work and stay aligned
    np.testing.assert_array_equal(w0.select(x, k, key=-1, step=-2), w1.select(x, k, key=-1, step=-2))
    full = w0.select(x, n, key=1, step=0).astype(np.int64)
    assert sorted(full.tolist()) == list(range(n))


# ------------------------------------------------------------------------------ 4. error feedback

SHAPES3 = [(20, 30), (30,), (10, 20)]


def _one_buffer(shapes, comp):
    sizes, counts, whole = tensor_counts(shapes, comp)
    (buf,) = make_plan(shapes, 1, counts=counts, codec="sparse")
    return buf, whole


def _split(buf, dense):
    """Buffer-space vector -> {param index: its slice}."""
    return {p: dense[o:o + n] for p, o, n in zip(buf.params, buf.offsets, buf.sizes)}


@pytest.mark.parametrize("compressor", [TopK(), RandomK(seed=1), SampledThreshold(seed=1)],
                         ids=["topk", "randomk", "dgc"])
def test_error_feedback_loses_nothing(compressor):
    comp = comp_config("compression.density=0.1")
    buf, whole = _one_buffer(SHAPES3, comp)
    assert not any(whole)
    assert buf.counts == [max(1, int(0.1 * n)) for n in buf.sizes]
    memory = Memory(error_feedback=True)
    enc = SparseEncoder(buf, compressor, memory, [whole[i] for i in buf.params])
    rng = np.random.default_rng(5)
    total_g = {i: np.zeros(int(np.prod(s))) for i, s in enumerate(SHAPES3)}
    total_sent = np.zeros(buf.size)
    for step in range(30):
        grads = [rng.standard_normal(s).astype(np.float32) * rng.uniform(0.5, 2) for s in SHAPES3]
        for i, g in enumerate(grads):
            total_g[i] += g.reshape(-1)
        payload = enc.encode([mx.nd.array(grads[i]) for i in buf.params], step).asnumpy()
        dense, idx, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
        # exactly k_i distinct indices inside each tensor's range
        for o, n, c in zip(buf.offsets, buf.sizes, buf.counts):
            mine = idx[(idx >= o) & (idx < o + n)]
            assert mine.size == c and np.unique(mine).size == c
        total_sent += dense
    sent = _split(buf, total_sent)
    assert set(memory.residual) == set(buf.params)
    for i in buf.params:
        residual = memory.residual[i].reshape(-1)
        np.testing.assert_allclose(sent[i] + residual, total_g[i], rtol=1e-4,
                                   atol=1e-4 * np.abs(total_g[i]).max(), err_msg=f"tensor {i}")
        assert np.abs(residual).max() > 0          # something really was delayed


def test_without_error_feedback_each_step_sends_its_own_topk():
    comp = comp_config("compression.density=0.1", "compression.error_feedback=false")
    buf, whole = _one_buffer(SHAPES3, comp)
    memory = Memory(error_feedback=comp.error_feedback)
    enc = SparseEncoder(buf, TopK(), memory, [whole[i] for i in buf.params])
    rng = np.random.default_rng(6)
    for step in range(10):
        grads = [untied(rng, int(np.prod(s))).reshape(s) for s in SHAPES3]
        payload = enc.encode([mx.nd.array(grads[i]) for i in buf.params], step).asnumpy()
        dense, idx, vals = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
        for p, o, n, c in zip(buf.params, buf.offsets, buf.sizes, buf.counts):
            g = grads[p].reshape(-1)
            mine = idx[(idx >= o) & (idx < o + n)] - o
            assert set(mine.tolist()) == np_topk_set(g, c)
            want = np.zeros(n)
            want[list(np_topk_set(g, c))] = g[list(np_topk_set(g, c))]
            np.testing.assert_array_equal(dense[o:o + n], want)
    assert memory.residual == {}
    assert memory.residual_norm() == 0.0


def test_memory_state_dict_round_trip_keeps_checkpoint_names():
    """Memory.state_dict names its arrays residual<key>/velocity<key> (what worker checkpoints
    hold); load_state_dict of a whole checkpoint's arrays restores exactly that state."""
    rng = np.random.default_rng(3)
    memory = Memory(error_feedback=True, momentum=0.9)
    for key in (0, 2, -1):                                  # -1: a behind-fusion key
        acc = memory.accumulate(key, rng.standard_normal(6).astype(np.float32))
        memory.update(key, acc, np.array([1, 4]))
    state = memory.state_dict()
    assert sorted(state) == ["residual-1", "residual0", "residual2", "velocity-1", "velocity0", "velocity2"]
    other = Memory(error_feedback=True, momentum=0.9)
    other.load_state_dict(dict(state, state0=np.zeros(3), pullbuf0=np.zeros(2)))
    assert sorted(other.residual) == sorted(other.velocity) == [-1, 0, 2]
    for key in (0, 2, -1):
        np.testing.assert_array_equal(other.residual[key], memory.residual[key])
        np.testing.assert_array_equal(other.velocity[key], memory.velocity[key])


# ------------------------------------------------------------------ 5. every tensor sends (ahead)

BIG_SMALL = [(1000, 100), (3,), (1,)]


def test_ahead_fusion_sends_every_tensor_its_own_k():
    comp = comp_config("compression.density=0.001", "compression.fusion=ahead")
    buffers, encoders = make_encoders(BIG_SMALL, 1, comp, 0)
    (buf,), (enc,) = buffers, encoders
    want_counts = {0: 100, 1: 1, 2: 1}                   # max(1, floor(0.001 * n_i))
    assert dict(zip(buf.params, buf.counts)) == want_counts
    rng = np.random.default_rng(8)
    grads = [untied(rng, int(np.prod(s))).reshape(s) * (100.0 if i == 0 else 1e-3)
             for i, s in enumerate(BIG_SMALL)]
    payload = enc.encode([mx.nd.array(grads[i]) for i in buf.params], 0).asnumpy()
    assert payload.shape == (buf.wire.length - 2,) == (2 * 102,)
    dense, idx, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
    for p, o, n in zip(buf.params, buf.offsets, buf.sizes):
        mine = idx[(idx >= o) & (idx < o + n)]
        assert mine.size == want_counts[p] >= 1, f"tensor {p}"
        g = grads[p].reshape(-1)
        assert set((mine - o).tolist()) == np_topk_set(g, want_counts[p])
        np.testing.assert_array_equal(dense[o:o + n][mine - o], g[mine - o])
    assert idx.size == sum(want_counts.values())


def test_behind_fusion_lets_the_big_tensor_take_every_slot():
    """Fuse-then-sparsify (OMGS/SyncEA): the same total k, but the tiny tensors get nothing when the
    gradient mass sits in the big one. This is the "tensor missing" problem SAFusion avoids."""
    comp = comp_config("compression.density=0.001", "compression.fusion=behind")
    (buf,), (enc,) = make_encoders(BIG_SMALL, 1, comp, 0)
    assert enc.behind and buf.topk_count == 102
    rng = np.random.default_rng(8)
    grads = [untied(rng, int(np.prod(s))).reshape(s) * (100.0 if i == 0 else 1e-3)
             for i, s in enumerate(BIG_SMALL)]
    payload = enc.encode([mx.nd.array(grads[i]) for i in buf.params], 0).asnumpy()
    assert payload.shape == (2 * 102,)
    dense, idx, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
    fused = np.concatenate([grads[p].reshape(-1) for p in buf.params])
    assert set(idx.tolist()) == np_topk_set(fused, 102)          # one top-k over the fused buffer
    for p, o, n in zip(buf.params, buf.offsets, buf.sizes):
        count = int(((idx >= o) & (idx < o + n)).sum())
        if p == 0:
            assert count == 102
        else:
            assert count == 0 and not dense[o:o + n].any(), f"tiny tensor {p} should be missing"


# ---------------------------------------------------------------------------- 6. min_dense_bytes

def test_tensors_below_min_dense_bytes_are_sent_whole():
    shapes = [(50, 40), (40,), (10,), (3, 3), (1,)]      # 8000, 160, 40, 36, 4 bytes
    comp = comp_config("compression.density=0.05", "compression.min_dense_bytes=64")
    sizes, counts, whole = tensor_counts(shapes, comp)
    assert whole == [False, False, True, True, True]
    assert counts == [100, 2, 10, 9, 1]
    (buf,), (enc,) = make_encoders(shapes, 1, comp, 0)
    rng = np.random.default_rng(9)
    for step in range(3):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        payload = enc.encode([mx.nd.array(grads[i]) for i in buf.params], step).asnumpy()
        dense, idx, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
        for p, o, n in zip(buf.params, buf.offsets, buf.sizes):
            mine = idx[(idx >= o) & (idx < o + n)]
            if whole[p]:
                assert sorted((mine - o).tolist()) == list(range(n)), f"tensor {p}"
                np.testing.assert_array_equal(dense[o:o + n], grads[p].reshape(-1))
            else:
                assert mine.size == counts[p] < n


# ------------------------------------------------------------------- 7. identical plans on workers

SMALL_CNN_LIKE = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 512), (64,), (10, 64), (10,)]


def _plan_fields(buffers):
    return [(b.id, b.params, b.offsets, b.sizes, b.counts, b.server, b.weight_key, b.mailbox_key,
             b.clock_key, b.codec, b.topk_count, b.wire.length) for b in buffers]


@pytest.mark.parametrize("buffers,servers", [("one", 1), ("one", 2), ("fixed", 2), ("cost_model", 1),
                                             ("cost_model", 3)])
def test_workers_build_identical_plans(buffers, servers):
    comp = comp_config(f"compression.buffers={buffers}", "compression.buffer_bytes=8192")
    cost = {"alpha": 1e-4, "beta": 2e-7, "backward": 0.01} if buffers == "cost_model" else None
    plan0, enc0 = make_encoders(SMALL_CNN_LIKE, servers, comp, 0, cost=cost)
    plan1, enc1 = make_encoders(SMALL_CNN_LIKE, servers, comp, 1, cost=dict(cost or {}) or None)
    assert _plan_fields(plan0) == _plan_fields(plan1)
    sizes = [int(np.prod(s)) for s in SMALL_CNN_LIKE]
    # every parameter in exactly one buffer, backward order, contiguous offsets
    assert [p for b in plan0 for p in b.params] == list(range(len(sizes)))[::-1]
    place_buffers(plan0, servers)
    keys = []
    for b in plan0:
        assert b.offsets == list(np.cumsum([0] + b.sizes[:-1]))
        assert b.counts == [max(1, int(0.01 * sizes[p])) for p in b.params]
        assert b.wire.length == 2 + 2 * sum(b.counts)
        for key in (b.weight_key, b.mailbox_key, b.clock_key):
            assert (key * KEY_HASH) % servers == b.server
            keys.append(key)
    assert len(set(keys)) == len(keys)
    # both workers' real messages have the planned length
    rng = np.random.default_rng(10)
    for b, e0, e1 in zip(plan0, enc0, enc1):
        grads = [mx.nd.array(rng.standard_normal(SMALL_CNN_LIKE[p])) for p in b.params]
        assert e0.encode(grads, 0).shape == e1.encode(grads, 0).shape == (b.wire.length - 2,)


# ------------------------------------------------------------------------------- 8. cost model

def _model_end(groups, sizes_fwd, counts_fwd, alpha, beta, backward, sparse=True):
    """Independent implementation of the planner's timing model. groups: backward positions."""
    sizes, counts = sizes_fwd[::-1], counts_fwd[::-1]
    total = float(sum(sizes))
    ready = backward * np.cumsum(sizes) / total
    t = 0.0
    for g in groups:
        vals = sum(counts[p] for p in g)
        t = max(t, ready[g[-1]]) + alpha + beta * 4 * (2 + (2 * vals if sparse else vals))
    return t


def _all_partitions(n):
    for cuts in itertools.product([False, True], repeat=n - 1):
        groups, cur = [], [0]
        for p, cut in zip(range(1, n), cuts):
            if cut:
                groups.append(cur)
                cur = []
            cur.append(p)
        groups.append(cur)
        yield groups


def test_cost_model_extremes():
    sizes = [1000, 10, 5000, 20, 3000, 10]
    counts = [10, 1, 50, 1, 30, 1]
    # sending is dominated by a huge per-message cost: one buffer
    assert plan_cost_model(sizes, counts, True, alpha=10.0, beta=1e-9, backward=1e-3) == [list(range(6))]
    # free messages, slow link, long backward: overlap the push with backward using several buffers
    groups = plan_cost_model(sizes, counts, True, alpha=0.0, beta=1e-3, backward=10.0)
    assert len(groups) > 1
    assert [p for g in groups for p in g] == list(range(6))


@pytest.mark.parametrize("seed", range(6))
def test_cost_model_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n = 6
    sizes = [int(v) for v in rng.integers(1, 20000, n)]
    counts = [max(1, int(0.01 * s)) for s in sizes]
    alpha = float(10 ** rng.uniform(-5, -2))
    beta = float(10 ** rng.uniform(-8, -4))
    backward = float(10 ** rng.uniform(-3, 0))
    sparse = bool(seed % 2 == 0)
    groups = plan_cost_model(sizes, counts if sparse else sizes, sparse, alpha, beta, backward)
    assert [p for g in groups for p in g] == list(range(n))
    assert all(g == list(range(g[0], g[-1] + 1)) for g in groups)
    c = counts if sparse else sizes
    chosen = _model_end(groups, sizes, c, alpha, beta, backward, sparse)
    best = min(_model_end(g, sizes, c, alpha, beta, backward, sparse) for g in _all_partitions(n))
    assert chosen == pytest.approx(best, rel=1e-9, abs=1e-15)


# ------------------------------------------------------------------ 9. server decode + sum

def test_buffer_state_applies_scatter_summed_sparse_rounds():
    size, k, workers, batch, mu, wd = 40, 6, 2, 8, 0.9, 1e-3
    lr = lambda t: 0.2 / t                                    # noqa: E731  (1-based update count)
    state = BufferState(size, workers, batch, mu, wd, lr, [WireFormat("sparse", size, k)])
    rng = np.random.default_rng(11)
    w0 = rng.standard_normal(size).astype(np.float32)
    state.bind(w0)
    rounds = 5
    msgs, sums = [], []
    for r in range(rounds):
        g_sum = np.zeros(size)
        for rank in range(workers):
            idx = rng.choice(size, k, replace=False)
            if rank == 1:
                idx[0] = msgs[-1][2]                        # overlap with worker 0: must add up
            vals = rng.standard_normal(k).astype(np.float32)
            for i, v in zip(idx, vals):
                g_sum[i] += v
            msgs.append(np.concatenate([[r, rank], idx.astype(np.float32), vals]).astype(np.float32))
        sums.append(g_sum)
    # deliver out of order: worker 1 runs two rounds ahead of worker 0
    order = [1, 3, 0, 2, 5, 4, 7, 6, 9, 8]
    applied = [state.receive(msgs[i]) for i in order]
    assert sum(applied) == rounds and state.version == rounds
    w, v = w0.astype(np.float64), np.zeros(size)
    for r in range(rounds):
        v = mu * v - lr(r + 1) * (sums[r] / (workers * batch) + wd * w)
        w = w + v
    np.testing.assert_allclose(state.weights, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.mom, v, rtol=1e-5, atol=1e-6)


def test_encoder_messages_decode_on_the_server_to_the_sent_topk():
    """Worker encoders -> [round, rank, payload] as RoundClient builds it -> BufferState: the update
    uses exactly the sum of each worker's per-tensor top-k (no error feedback here)."""
    shapes = [(8, 6), (6,), (3,)]
    comp = comp_config("compression.density=0.2", "compression.error_feedback=false")
    encs = [make_encoders(shapes, 1, comp, rank) for rank in range(2)]
    (buf,) = encs[0][0]
    lr, batch = (lambda t: 0.05), 4                           # noqa: E731
    state = BufferState(buf.size, 2, batch, 0.0, 0.0, lr, [buf.wire])
    state.bind(np.zeros(buf.size, np.float32))
    rng = np.random.default_rng(12)
    w = np.zeros(buf.size)
    for step in range(3):
        g_sum = np.zeros(buf.size)
        for rank in range(2):
            grads = [untied(rng, int(np.prod(s))).reshape(s) for s in shapes]
            enc = encs[rank][1][0]
            msg = enc.message([mx.nd.array(grads[p]) for p in buf.params], step, rank)
            assert msg.shape == (buf.wire.length,)
            state.receive(msg.asnumpy())
            for p, o, c in zip(buf.params, buf.offsets, buf.counts):
                g = grads[p].reshape(-1)
                sel = sorted(np_topk_set(g, c))
                g_sum[o + np.array(sel)] += g[sel]
        w -= 0.05 * g_sum / (2 * batch)
        assert state.version == step + 1
        np.testing.assert_allclose(state.weights, w, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 10. real 2-worker job


# ------------------------------------------------------------------- 11. DGC momentum correction

def _np_dgc_select(u, v, g, m, k):
    """u = m*u + g; v = v + u; the top-k of |v| are sent and zeroed in v (u, v updated in place).
    Returns what is sent and the sent positions."""
    u *= m
    u += g
    v += u
    top = np.argsort(-np.abs(v), kind="stable")[:k]
    want = np.zeros_like(v)
    want[top] = v[top]
    v[top] = 0
    return want, top


def _np_dgc_send(u, v, g, m, k, masking=True):
    """DGC's momentum correction in numpy: _np_dgc_select, then, with momentum factor masking, u is
    zeroed where values were sent. Returns what is sent."""
    want, top = _np_dgc_select(u, v, g, m, k)
    if masking:
        u[top] = 0
    return want


@pytest.mark.parametrize("small,min_dense_bytes", [(5, 40), (1, 0)],
                         ids=["sent whole by min_dense_bytes", "one element, k = n"])
def test_momentum_correction_against_numpy_dgc(small, min_dense_bytes):
    """Sparse tensor: u = m*u + g; v = v + u; send top-k of |v|; zero v and u there (DGC's momentum
    factor masking). A tensor all of whose values go out every step (min_dense_bytes, or k = n):
    u = m*u + g is sent and keeps its momentum, i.e. momentum SGD, as DGC sends uncompressed tensors."""
    shapes, m = [(200,), (small,)], 0.9
    comp = comp_config("compression.density=0.05", f"compression.min_dense_bytes={min_dense_bytes}",
                       "compression.momentum_correction=true")
    (buf,), (enc,) = make_encoders(shapes, 1, comp, 0, momentum=m)
    assert enc.memory.momentum == m
    pos = {p: j for j, p in enumerate(buf.params)}
    assert buf.counts[pos[0]] == 10 and buf.counts[pos[1]] == small      # top-10 of 200; all of the small one
    rng = np.random.default_rng(21)
    u = {0: np.zeros(200), 1: np.zeros(small)}
    v = np.zeros(200)
    for step in range(12):
        grads = [untied(rng, 200), rng.standard_normal(small).astype(np.float32)]
        payload = enc.encode([mx.nd.array(grads[p]) for p in buf.params], step).asnumpy()
        dense, _, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
        sent = _split(buf, dense)
        want = _np_dgc_send(u[0], v, grads[0], m, 10)
        np.testing.assert_allclose(sent[0], want, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        u[1] = m * u[1] + grads[1]
        np.testing.assert_allclose(sent[1], u[1], rtol=1e-5, atol=1e-5, err_msg=f"step {step}")


def test_momentum_correction_without_masking_sends_the_momentum_sgd_updates_delayed():
    """compression.momentum_masking: false keeps u where values were sent: u = m*u + g; v = v + u;
    top-k of |v| sent and zeroed in v only. What was sent plus what is held back is then, at every
    step, the sum of momentum SGD's updates u_1 + ... + u_t (nothing of the momentum is dropped)."""
    m = 0.9
    comp = comp_config("compression.density=0.05", "compression.momentum_correction=true",
                       "compression.momentum_masking=false")
    (buf,), (enc,) = make_encoders([(200,)], 1, comp, 0, momentum=m)
    assert enc.memory.masking is False
    rng = np.random.default_rng(5)
    u, v, u_ref = np.zeros(200), np.zeros(200), np.zeros(200)
    sent_total, u_total = np.zeros(200), np.zeros(200)
    for step in range(12):
        g = untied(rng, 200)
        payload = enc.encode([mx.nd.array(g)], step).asnumpy()
        sent, _, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
        want = _np_dgc_send(u, v, g, m, 10, masking=False)
        np.testing.assert_allclose(sent, want, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        u_ref = m * u_ref + g
        u_total += u_ref
        sent_total += sent
        np.testing.assert_allclose(sent_total + enc.memory.residual[0], u_total, rtol=1e-4, atol=1e-4)
    masked = Memory(error_feedback=True, momentum=m)
    acc = masked.accumulate(0, np.ones(4, np.float32))
    masked.update(0, acc, np.array([1]))
    assert masked.velocity[0][1] == 0 and masked.velocity[0][0] == 1     # the default masks


def test_rescaled_memory_applies_each_gradient_at_its_own_steps_rate():
    """compression.rescale_held: true, no masking, a learning rate that changes every step: what the
    servers apply (lr_t times what step t sent) plus what is held back (lr_t times the residual) is at
    every step the sum of MXNet's momentum SGD updates, V_t = m*V_{t-1} + lr_t*g_t, the momentum in weight
    units as the SSGD baseline's optimizer keeps it. Without rescaling the same sum comes out different."""
    m = 0.9
    lrs = [0.1 * 0.7 ** t for t in range(12)]
    rng = np.random.default_rng(8)
    grads = [untied(rng, 200) for _ in lrs]
    totals = {}
    for rescale in (True, False):
        comp = comp_config("compression.density=0.05", "compression.momentum_correction=true",
                           "compression.momentum_masking=false", f"compression.rescale_held={str(rescale).lower()}")
        (buf,), (enc,) = make_encoders([(200,)], 1, comp, 0, momentum=m)
        applied, V, V_total = np.zeros(200), np.zeros(200), np.zeros(200)
        for step, (lr, g) in enumerate(zip(lrs, grads)):
            enc.memory.set_carry(lrs[step - 1] / lr if step else 1.0)
            payload = enc.encode([mx.nd.array(g)], step).asnumpy()
            sent, _, _ = np_decode(payload, buf.size, buf.topk_count, buf.wire.bitmap)
            applied += lr * sent
            V = m * V + lr * g
            V_total += V
            totals[rescale] = (applied + lr * enc.memory.residual[0], V_total.copy())
            if rescale:
                np.testing.assert_allclose(totals[rescale][0], V_total, rtol=1e-4, atol=1e-6, err_msg=f"step {step}")
    held, want = totals[False]
    assert not np.allclose(held, want, rtol=1e-2, atol=1e-4)


def test_held_carry_is_the_ratio_of_consecutive_rounds_rates_and_1_where_a_rate_is_0():
    from ssdsgd.schedule import LRSchedule, held_carry
    sched = LRSchedule("cosine", base_lr=0.1, total_updates=20, warmup_updates=4)
    assert held_carry(sched, 0) == 1.0                      # nothing held before round 0
    assert held_carry(sched, 2) == pytest.approx(sched(2) / sched(3)) and held_carry(sched, 2) < 1   # ramp up
    assert held_carry(sched, 10) == pytest.approx(sched(10) / sched(11)) and held_carry(sched, 10) > 1
    assert sched(20) == 0 and held_carry(sched, 19) == 1.0  # the last round applies nothing
    mem = Memory(error_feedback=True, rescale=False)
    mem.set_carry(2.0)
    assert mem.carry == 1.0                                 # off: the held values keep their scale


# ------------------------------------------------------- 12. allocation by the accumulated gradient

def _np_global_topk_counts(mags, budget):
    """Reference: how many of a global top-`budget` over the concatenated magnitudes fall in each tensor."""
    flat = np.concatenate(mags)
    owner = np.concatenate([np.full(len(m), j) for j, m in enumerate(mags)])
    top = np.argsort(-flat, kind="stable")[:budget]
    return np.bincount(owner[top], minlength=len(mags))


@pytest.mark.parametrize("seed", range(4))
def test_allocate_by_threshold_matches_global_topk(seed):
    from ssdsgd.compression.quotas import allocate_by_threshold
    rng = np.random.default_rng(seed)
    sizes = [50, 7, 200, 3, 31, 120]
    whole = {3}                              # tensor 3 is sent whole
    counts = [n if j in whole else max(1, int(0.1 * n)) for j, n in enumerate(sizes)]
    # Distinct magnitudes, tensor by tensor on very different scales (so the budget moves), and each
    # non-whole tensor's largest value above every other value, so the floor of one never binds.
    values = rng.permutation(sum(sizes)).astype(np.float64) + 1
    accs, mags, start = [], [], 0
    scales = rng.permutation([0.01, 0.1, 1.0, 5.0, 30.0, 100.0])
    for j, n in enumerate(sizes):
        m = values[start:start + n] * scales[j]
        start += n
        m[rng.integers(n)] = 1e7 * (j + 1)
        mags.append(m)
        accs.append((m * rng.choice([-1, 1], n)).astype(np.float32))
    part = [j for j in range(len(sizes)) if j not in whole]
    budget = sum(counts[j] for j in part)
    expected = _np_global_topk_counts([mags[j] for j in part], budget)
    assert expected.min() >= 1

    new = allocate_by_threshold(accs, counts, whole)
    assert len(new) == len(counts) and all(isinstance(c, int) for c in new)
    assert new[3] == counts[3] == 3
    assert sum(new[j] for j in part) == budget
    np.testing.assert_array_equal([new[j] for j in part], expected)
    assert new != counts                     # it really re-allocated
    assert all(1 <= new[j] <= sizes[j] for j in part)


def test_allocate_by_threshold_floor_of_one_keeps_total():
    from ssdsgd.compression.quotas import allocate_by_threshold
    rng = np.random.default_rng(5)
    counts = [4, 1, 6, 1]                    # tensor sizes 40, 10, 60, 5
    big = rng.permutation(100) + 1000.0      # distinct, interleaved between tensors 0 and 2
    mags = [big[:40], rng.permutation(10) * 1e-3 + 1e-3,       # tensor 1: all tiny
            big[40:], rng.permutation(5) * 1e-3 + 2e-3]        # tensor 3: all tiny
    accs = [np.asarray(m, np.float32) for m in mags]
    ref = _np_global_topk_counts(mags, 12)
    assert ref[1] == ref[3] == 0 and ref[0] >= 3 and ref[2] >= 3     # the floor binds
    new = allocate_by_threshold(accs, counts, set())
    assert sum(new) == sum(counts) == 12
    assert new[1] == 1 and new[3] == 1       # the floor: every tensor still sends
    # The two floor slots come out of the large tensors' global top-k shares.
    assert new[0] + new[2] == 10
    assert ref[0] - 2 <= new[0] <= ref[0] and ref[2] - 2 <= new[2] <= ref[2]


@pytest.mark.parametrize("whole", [set(), {0}], ids=["none_whole", "first_whole"])
def test_allocate_by_threshold_all_zero_accumulators_keep_total(whole):
    from ssdsgd.compression.quotas import allocate_by_threshold
    sizes = [5, 30, 2, 64]
    counts = [5 if 0 in whole else 1, 3, 1, 6]
    accs = [np.zeros(n, np.float32) for n in sizes]
    new = allocate_by_threshold(accs, counts, whole)
    part = [j for j in range(4) if j not in whole]
    assert sum(new[j] for j in part) == sum(counts[j] for j in part)
    assert all(1 <= new[j] <= sizes[j] for j in part)
    assert all(new[j] == counts[j] for j in whole)


def test_allocate_by_threshold_single_sparse_tensor_unchanged():
    from ssdsgd.compression.quotas import allocate_by_threshold
    accs = [np.arange(10.0, dtype=np.float32), np.arange(4.0, dtype=np.float32)]
    assert allocate_by_threshold(accs, [2, 4], {1}) == [2, 4]


def test_allocate_by_threshold_sends_every_nonzero_when_budget_allows():
    """Mostly-zero accumulators (ties at 0): the global top-k takes every nonzero entry first."""
    from ssdsgd.compression.quotas import allocate_by_threshold
    a = np.zeros(20)
    a[[2, 9, 15]] = [0.5, -3.0, 1.0]
    c = np.zeros(30)
    c[[0, 29]] = [-0.25, 2.0]
    accs = [a.astype(np.float32), np.zeros(20, np.float32), c.astype(np.float32)]
    new = allocate_by_threshold(accs, [2, 2, 3], set())
    assert sum(new) == 7
    assert new[0] >= 3 and new[2] >= 2 and new[1] >= 1


# ------------------------------------------------------------------ 10. quantised link costs

from ssdsgd.algorithms.probe import quantise_costs  # noqa: E402


def _q(x, steps_per_octave=2):
    return quantise_costs({"x": x}, steps_per_octave)["x"]


@pytest.mark.parametrize("steps_per_octave", [2, 4])
def test_quantise_costs_lands_on_nearest_grid_point(steps_per_octave):
    rng = np.random.default_rng(7)
    values = 10.0 ** rng.uniform(-9, 2, 200)
    ks = np.arange(-40 * steps_per_octave, 10 * steps_per_octave)
    grid = 2.0 ** (ks / steps_per_octave)
    for x in values:
        got = _q(float(x), steps_per_octave)
        assert type(got) is float
        k = np.log2(got) * steps_per_octave
        assert k == pytest.approx(round(k), abs=1e-9)                   # on the 2**(k/s) grid
        nearest = grid[np.argmin(np.abs(np.log2(grid) - np.log2(x)))]   # nearest in log scale
        assert got == pytest.approx(nearest, rel=1e-12)
        assert abs(np.log2(got / x)) <= 0.5 / steps_per_octave + 1e-12
    # default is half-octaves
    assert quantise_costs({"a": 3.0}) == {"a": 2.0 ** 1.5}
    assert quantise_costs({"a": 1.0, "b": 2.0 ** -20}) == {"a": 1.0, "b": 2.0 ** -20}


def test_quantise_costs_within_15_percent_of_a_grid_point_agree():
    for k in range(-60, 8):
        g = 2.0 ** (k / 2)
        quantised = {f: _q(g * f) for f in (0.85, 0.9, 0.97, 1.0, 1.04, 1.1, 1.15)}
        assert len(set(quantised.values())) == 1, (k, quantised)       # exactly equal
        assert quantised[1.0] == pytest.approx(g, rel=1e-12), (k, quantised)
        # the cells are 2**(1/4) (~19%) either way: 25% off is in the neighbouring cell
        assert _q(g * 1.25) == pytest.approx(g * 2 ** 0.5, rel=1e-12)
        assert _q(g / 1.25) == pytest.approx(g / 2 ** 0.5, rel=1e-12)


def test_quantise_costs_keeps_zero_and_names():
    cost = {"alpha": 0.0, "beta": 3.1e-9, "backward": 0.0123}
    q = quantise_costs(cost)
    assert list(q) == ["alpha", "beta", "backward"]
    assert q["alpha"] == 0.0 and type(q["alpha"]) is float
    assert q["beta"] == pytest.approx(2.0 ** -28.5, rel=1e-12)        # log2(3.1e-9) = -28.27
    assert q["backward"] == pytest.approx(2.0 ** -6.5, rel=1e-12)     # log2(0.0123) = -6.35
    assert cost == {"alpha": 0.0, "beta": 3.1e-9, "backward": 0.0123}  # input untouched


def test_cost_model_plan_is_stable_under_10_percent_noise_once_quantised():
    """Costs measured within +-10% of a grid point give one plan after quantise_costs, although the
    raw costs give several different plans (so the quantisation is what makes them agree)."""
    sizes = [432, 16, 16, 2304, 16, 16, 2304, 16, 16, 4608, 32, 32, 9216, 32, 32, 18432, 64, 64,
             36864, 64, 64, 640, 10]
    counts = [max(1, s // 100) for s in sizes]
    at_grid = {"alpha": 2.0 ** -9, "beta": 2.0 ** -25, "backward": 2.0 ** -6}
    assert quantise_costs(at_grid) == at_grid
    plan = plan_cost_model(sizes, counts, True, **at_grid)
    assert 1 < len(plan) < len(sizes)
    assert [p for g in plan for p in g] == list(range(len(sizes)))
    raw_plans = set()
    for factors in itertools.product((0.9, 1.0, 1.1), repeat=3):
        noisy = {name: v * f for (name, v), f in zip(at_grid.items(), factors)}
        raw_plans.add(str(plan_cost_model(sizes, counts, True, **noisy)))
        assert plan_cost_model(sizes, counts, True, **quantise_costs(noisy)) == plan, factors
    assert len(raw_plans) > 1
