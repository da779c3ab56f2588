"""Sparsifiers: pick exactly k entries of a flat gradient (asynchronous mx.nd ops, no host sync).

Exactly k, always: every worker then pushes the same number of values per tensor, so mailbox
sizes are fixed and equal across workers (SAFusion's inter-worker alignment). Indices come back as
float32 NDArrays (exact below 2**24, see codec.py).
"""
import mxnet as mx
import numpy as np


class TopK:
    """The k largest magnitudes."""
    name = "topk"

    def select(self, x, k, key, step):
        return mx.nd.topk(mx.nd.abs(x), k=k, ret_typ="indices", is_ascend=False)


class RandomK:
    """k uniformly random positions, the same on every worker (seeded by tensor key and step)."""
    name = "randomk"

    def __init__(self, seed=0):
        self.seed = seed

    def select(self, x, k, key, step):
        rng = _rng(self.seed, key, step)
        idx = rng.choice(x.shape[0], size=k, replace=False)
        return mx.nd.array(idx, dtype="float32")


class SampledThreshold:
    """DGC's selection: estimate the top-k threshold from a random sample of magnitudes and take
    the entries above it. The push size must be exactly k (inter-worker alignment), so the
    candidates are then cut or filled by magnitude: above-threshold entries first, largest first.
    On this CPU build that costs a full top-k anyway and selects the top-k set whenever the
    estimate is not too high; it is kept for comparison with the DGC literature. What changes
    training in DGC is its momentum correction (compression.momentum_correction, memory.py)."""
    name = "dgc"

    def __init__(self, sample_fraction=0.01, min_sample=256, seed=0):
        self.sample_fraction = sample_fraction
        self.min_sample = min_sample
        self.seed = seed

    def select(self, x, k, key, step):
        n = x.shape[0]
        if k >= n:
            return mx.nd.arange(n, dtype="float32")
        m = min(n, max(self.min_sample, int(n * self.sample_fraction)))
        rng = _rng(self.seed, key, step)
        a = mx.nd.abs(x)
        sample = mx.nd.take(a, mx.nd.array(rng.choice(n, size=m, replace=False)))
        k_sample = max(1, int(round(m * k / n)))
        thr = mx.nd.topk(sample, k=k_sample, ret_typ="value").min()
        above = mx.nd.broadcast_greater_equal(a, thr.reshape(1))
        score = a + above * (a.max() + 1)
        return mx.nd.topk(score, k=k, ret_typ="indices", is_ascend=False)


def _rng(seed, key, step):
    # SeedSequence wants non-negative entries; keys and steps can be negative (behind-fusion keys,
    # the startup timing run).
    return np.random.default_rng([seed % 2**32, key % 2**32, step % 2**32])


def make_compressor(kind, seed=0):
    if kind == "topk":
        return TopK()
    if kind == "randomk":
        return RandomK(seed)
    if kind == "dgc":
        return SampledThreshold(seed=seed)
    raise ValueError(f"compression.type {kind!r} is not a sparsifier")
