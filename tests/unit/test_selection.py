"""compression.selection: sampled (issue 36, item 6): the sampled top-k search finds the exact top-k
set, falls back where its estimate fails, is deterministic given the seed, gives the encoders the
same messages and memory as exact selection, and a job runs with it."""
import os

import mxnet as mx
import numpy as np
import pytest

import ssdsgd.compression.compressor as compressor
from support.jobs import ROOT
from ssdsgd.compression.compressor import SampledThreshold, sampled_candidates, top_magnitudes
from ssdsgd.compression.encoders import copy_to_host, host_views, make_encoders
from ssdsgd.compression.quotas import allocate_by_threshold, allocate_from_candidates, quotas_from_candidates
from ssdsgd.config import ConfigError, load_config

TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"


def untied(rng, n):
    """Magnitudes all distinct (so the top-k set is unique), random order and signs."""
    mags = rng.permutation(np.arange(1, n + 1)).astype(np.float32) / n + 0.01
    return mags * rng.choice([-1.0, 1.0], n).astype(np.float32)


def exact_set(a, k):
    return set(np.argsort(-a, kind="stable")[:k].tolist())


@pytest.mark.parametrize("n,k", [(100_000, 4000), (300_000, 3000), (50_000, 2500), (1 << 20, 10_486)])
def test_sampled_top_k_is_the_exact_set(n, k):
    rng = np.random.default_rng(n + k)
    a = np.abs(untied(rng, n))
    found = sampled_candidates(a, k, np.random.default_rng(1))
    assert found is not None, "the sample should narrow the search at this size"
    assert k <= found.size < n // 4                       # a narrow superset ...
    assert np.all(np.diff(found) > 0)                     # ... increasing ...
    rest = np.setdiff1d(np.arange(n), found)
    assert a[found].min() > a[rest].max()                 # ... of the largest entries
    idx = top_magnitudes(a, k, np.random.default_rng(2))
    assert idx.shape == (k,) and len(set(idx.tolist())) == k
    assert set(idx.tolist()) == exact_set(a, k) == set(top_magnitudes(a, k).tolist())


def test_sampled_search_is_deterministic_given_the_seed_even_among_ties():
    # Mostly zeros: the k-th largest is 0 and the choice among the zeros is arbitrary, but repeatable.
    rng = np.random.default_rng(3)
    a = np.zeros(200_000, np.float32)
    a[rng.choice(a.size, 500, replace=False)] = rng.random(500).astype(np.float32) + 0.1
    k = 2000
    one = top_magnitudes(a, k, compressor.step_rng(7, 4, 9))
    two = top_magnitudes(a, k, compressor.step_rng(7, 4, 9))
    np.testing.assert_array_equal(one, two)
    assert len(set(one.tolist())) == k and set(np.flatnonzero(a).tolist()) <= set(one.tolist())


@pytest.mark.parametrize("levels", [3, 50, 4000])
def test_ties_at_the_kth_largest_go_to_the_first_entries_either_way(levels):
    """Equal magnitudes (a grayscale image copied into three channels makes the first convolution's
    gradient come in equal triples): the exact partition and the sampled search take the same set,
    every entry above the k-th largest and then the first of those equal to it."""
    rng = np.random.default_rng(levels)
    n, k = 300_000, 3000
    a = np.repeat(rng.integers(0, levels, n // 3).astype(np.float32), 3)
    want = np.argsort(-a, kind="stable")[:k]               # stable: equal values in index order
    exact = top_magnitudes(a, k)
    sampled = top_magnitudes(a, k, np.random.default_rng(1))
    np.testing.assert_array_equal(exact, np.sort(want))    # the same set, in increasing order
    np.testing.assert_array_equal(sampled, np.sort(want))


def test_an_estimate_above_the_kth_largest_falls_back_to_the_exact_partition(monkeypatch):
    rng = np.random.default_rng(4)
    a = np.abs(untied(rng, 100_000))
    assert sampled_candidates(a, 4000, np.random.default_rng(0)) is not None
    # A negative margin puts the threshold above the k-th largest: too few candidates.
    monkeypatch.setattr(compressor, "SAMPLE_MARGIN", -12)
    assert sampled_candidates(a, 4000, np.random.default_rng(0)) is None
    assert set(top_magnitudes(a, 4000, np.random.default_rng(0)).tolist()) == exact_set(a, 4000)


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (5000, 4000)])
def test_small_or_dense_searches_are_left_to_the_partition(n, k):
    a = np.abs(untied(np.random.default_rng(n), n))
    assert sampled_candidates(a, k, np.random.default_rng(0)) is None
    assert set(top_magnitudes(a, k, np.random.default_rng(0)).tolist()) == exact_set(a, k)


def test_counts_of_the_search_stay_near_k():
    """Over many searches the candidates are a few tenths above k, never below it."""
    rng = np.random.default_rng(5)
    n, k = 400_000, 4000
    sizes = []
    for step in range(20):
        a = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(10 ** rng.uniform(-3, 3))
        found = sampled_candidates(a, k, np.random.default_rng(step))
        sizes.append(found.size)
    assert min(sizes) >= k and max(sizes) < 1.6 * k, sizes


def test_dgc_selects_the_top_k_set_through_the_shared_search():
    rng = np.random.default_rng(6)
    x = untied(rng, 200_000)
    idx = SampledThreshold(seed=2).select(x, 2000, key=1, step=3)
    assert set(idx.tolist()) == exact_set(np.abs(x), 2000)


@pytest.mark.parametrize("seed", range(4))
def test_allocation_from_candidates_equals_the_exact_allocation(seed):
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(2000, 60_000, 12)]
    accs = [rng.standard_normal(n).astype(np.float32) * np.float32(10 ** rng.uniform(-2, 0)) for n in sizes]
    if seed % 2:                                          # ties at the threshold: a tensor of zeros
        accs[3][:] = 0.0
    whole = {5} if seed >= 2 else set()
    counts = [n if j in whole else max(1, n // 100) for j, n in enumerate(sizes)]
    if seed % 2:
        counts = [n if j in whole else max(1, n // 10) for j, n in enumerate(sizes)]
    mag = np.concatenate([-np.ones(n, np.float32) if j in whole else np.abs(a) for j, (n, a) in
                          enumerate(zip(sizes, accs))])
    budget = sum(c for j, c in enumerate(counts) if j not in whole)
    found = sampled_candidates(mag, budget, np.random.default_rng(seed))
    assert found is not None
    bounds = np.searchsorted(found, np.concatenate([[0], np.cumsum(sizes)]))
    got = allocate_from_candidates(mag[found], bounds, counts, whole)
    assert got == allocate_by_threshold(accs, counts, whole)
    assert sum(got) == sum(counts) and min(got) >= 1


def _digits_shapes():
    # The demo model's parameters plus two larger tensors, so that the buffer-wide search samples.
    return [(64, 64), (64,), (10, 64), (10,), (300, 400), (400,), (200, 300)]


@pytest.mark.parametrize("overrides", [
    ["compression.allocation=gradient"],
    ["compression.allocation=size"],
    ["compression.fusion=behind", "compression.allocation=size"],
    ["compression.allocation=gradient", "compression.min_dense_bytes=1024", "compression.fp16_values=true"],
    ["compression.allocation=gradient", "compression.momentum_correction=false", "compression.density=0.1"],
    ["compression.allocation=gradient", "compression.type=randomk"],
], ids=["gradient", "size", "behind", "whole_fp16", "no_momentum", "randomk"])
def test_sampled_encoders_send_what_exact_encoders_send(overrides, monkeypatch):
    """Same gradients into an exact and a sampled encoder set: the same messages (ties at the k-th
    largest resolved alike) and the same memory, step after step; the sampled searches did narrow."""
    import ssdsgd.compression.encoders as encoders_module
    narrowed = []

    def counted(*args, **kwargs):
        found = sampled_candidates(*args, **kwargs)
        narrowed.append(found is not None)
        return found

    def allocated(*args, **kwargs):       # quotas from a buffer-wide search that narrowed (the fused one too)
        narrowed.append(True)
        return quotas_from_candidates(*args, **kwargs)
    monkeypatch.setattr(encoders_module, "sampled_candidates", counted)
    monkeypatch.setattr(compressor, "sampled_candidates", counted)
    monkeypatch.setattr(encoders_module, "quotas_from_candidates", allocated)
    shapes = _digits_shapes()
    encoders = {}
    for selection in ("exact", "sampled"):
        cfg = load_config(os.path.join(ROOT, TOPK_CONFIG), ["compression.buffers=one", "compression.density=0.05",
                                                            f"compression.selection={selection}", *overrides])
        encoders[selection] = make_encoders(shapes, 1, cfg.compression, 0, momentum=0.9, seed=3)
    rng = np.random.default_rng(8)
    for step in range(6):
        grads = [mx.nd.array(untied(rng, int(np.prod(s))).reshape(s) * np.float32(10 ** rng.uniform(-2, 0)))
                 for s in shapes]
        if step % 2:                  # equal magnitudes in pairs: the same choice among them either way
            grads = [mx.nd.array(np.repeat(g.asnumpy().reshape(-1)[::2], 2)[:g.size].reshape(g.shape))
                     for g in grads]
        msgs = {}
        for selection, (buffers, encs) in encoders.items():
            msgs[selection] = [e.message([grads[i] for i in b.params], step, 0).asnumpy()
                               for b, e in zip(buffers, encs)]
        for exact, sampled in zip(msgs["exact"], msgs["sampled"]):
            assert exact.shape == sampled.shape
            np.testing.assert_array_equal(_pairs(exact), _pairs(sampled))
    assert any(narrowed)
    memories = [encs[0].memory.state_dict() for _, encs in encoders.values()]
    assert memories[0].keys() == memories[1].keys()
    for name in memories[0]:
        np.testing.assert_array_equal(memories[0][name], memories[1][name])


def _pairs(msg):
    """A list-coded fp32 or fp16 message's (index, value) pairs, sorted by index."""
    payload = msg[2:].astype(np.float64) if msg.dtype == np.float32 else msg[3:].astype(np.float64)
    if msg.dtype == np.float32:
        k = payload.size // 2
        idx, val = payload[:k], payload[k:]
    else:
        k = payload.size // 3
        idx, val = payload[:k] * 2048 + payload[k:2 * k], payload[2 * k:]
    order = np.argsort(idx)
    return np.stack([idx[order], val[order]])


def test_copy_to_host_copies_each_gradient_into_its_slot_and_refuses_a_mismatch():
    arrays = [mx.nd.array(np.arange(6, dtype=np.float32).reshape(2, 3)), mx.nd.array([7.0, 8.0])]
    out = np.full(9, -1.0, np.float32)
    copy_to_host(arrays, out, [0, 7], [6, 2])
    np.testing.assert_array_equal(out, [0, 1, 2, 3, 4, 5, -1, 7, 8])
    with pytest.raises(ValueError, match="slot of 3 float32"):
        copy_to_host(arrays[1:], out, [0], [3])
    with pytest.raises(ValueError, match="float64"):
        copy_to_host(arrays, out.astype(np.float64), [0, 7], [6, 2])


def test_host_views_read_mxnets_memory_after_pending_writes_and_refuse_what_is_not_host_float32():
    a = mx.nd.zeros((2, 3))
    b = mx.nd.array([7.0, 8.0])
    a += 5                                     # a pending write: the view must see it
    views = host_views([a, b])
    np.testing.assert_array_equal(views[0], np.full(6, 5.0, np.float32))
    np.testing.assert_array_equal(views[1], [7.0, 8.0])
    assert not views[0].flags.writeable        # the encoder never writes a gradient
    b[:] = 9.0                                 # no copy: MXNet's next write shows through
    b.wait_to_read()
    np.testing.assert_array_equal(views[1], [9.0, 9.0])
    assert host_views([a, mx.nd.array([1, 2], dtype=np.float16)]) is None     # copied instead


@pytest.mark.parametrize("overrides", [[], ["compression.fp16_values=true", "compression.min_dense_bytes=4096"],
                                       ["compression.error_feedback=false"]], ids=["shipped", "whole_fp16", "no_ef"])
def test_encoders_reading_mxnets_memory_send_what_encoders_reading_a_copy_send(overrides, monkeypatch):
    """Fusion ahead reads the gradients in place (host_views); with the views refused it copies them
    (copy_to_host): the same messages and the same memory, step after step, and the gradients untouched."""
    import ssdsgd.compression.encoders as encoders_module
    shapes = _digits_shapes()
    cfg = load_config(os.path.join(ROOT, TOPK_CONFIG), ["compression.buffers=one", "compression.density=0.05",
                                                        *overrides])
    viewing = make_encoders(shapes, 1, cfg.compression, 0, momentum=0.9, seed=3)
    copying = make_encoders(shapes, 1, cfg.compression, 0, momentum=0.9, seed=3)
    rng = np.random.default_rng(4)
    for step in range(4):
        grads = [mx.nd.array(untied(rng, int(np.prod(s))).reshape(s)) for s in shapes]
        before = [g.asnumpy() for g in grads]
        msgs = []
        for (buffers, encs), views in ((viewing, True), (copying, False)):
            with monkeypatch.context() as m:
                if not views:
                    m.setattr(encoders_module, "host_views", lambda arrays: None)
                msgs.append([e.message([grads[i] for i in b.params], step, 0).asnumpy()
                             for b, e in zip(buffers, encs)])
        for viewed, copied in zip(*msgs):
            np.testing.assert_array_equal(viewed, copied)
        for g, was in zip(grads, before):
            np.testing.assert_array_equal(g.asnumpy(), was)
    assert viewing[1][0].host is None and copying[1][0].host is not None    # each took its own path
    memories = [encs[0].memory.state_dict() for _, encs in (viewing, copying)]
    for name in memories[0]:
        np.testing.assert_array_equal(memories[0][name], memories[1][name])


def test_selection_config_defaults_and_refusal():
    comp = load_config(os.path.join(ROOT, TOPK_CONFIG), []).compression
    assert comp.selection == "sampled"                  # auto, with a sparsifier
    dense = load_config(os.path.join(ROOT, "configs/demo_digits_ssd.yaml"), []).compression
    assert dense.selection == "exact"
    with pytest.raises(ConfigError, match="compression.selection: only the sparse encoders select"):
        load_config(os.path.join(ROOT, "configs/demo_digits_ssd.yaml"), ["compression.selection=sampled"])
    with pytest.raises(ConfigError, match="compression.selection"):
        load_config(os.path.join(ROOT, TOPK_CONFIG), ["compression.selection=approximate"])


def test_the_sampled_search_counts_a_nan_above_every_number_as_the_partition_does():
    rng = np.random.default_rng(8)
    a = np.abs(rng.standard_normal(200_000).astype(np.float32))
    a[rng.choice(a.size, 30, replace=False)] = np.nan
    for k in (3000, 12_000, 40_000):
        np.testing.assert_array_equal(top_magnitudes(a, k, np.random.default_rng(k)), top_magnitudes(a, k))
        assert np.isnan(a[top_magnitudes(a, k, np.random.default_rng(k))]).sum() == 30
