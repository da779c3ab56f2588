"""Sparsifiers: pick exactly k entries of a flat gradient (asynchronous mx.nd ops, no host sync).

Exactly k, always: every worker then pushes the same number of values per tensor, so mailbox
sizes are fixed and equal across workers (SAFusion's inter-worker alignment). Indices come back as
float32 NDArrays (exact below 2**24, see codec.py).

Each class registers its compression.type name (registry.py). mxnet is imported inside select(),
not here, so that the registry's names can be read without importing mxnet.
"""
import numpy as np

from ssdsgd.compression.registry import register


@register("topk")
class TopK:
    """The k largest magnitudes."""

    def __init__(self, seed=0):          # no randomness; the seed is taken for a uniform constructor
        self.seed = seed

    def select(self, x, k, key, step):
        import mxnet as mx
        return mx.nd.topk(mx.nd.abs(x), k=k, ret_typ="indices", is_ascend=False)


@register("randomk")
class RandomK:
    """k uniformly random positions, the same on every worker (seeded by tensor key and step)."""

    def __init__(self, seed=0):
        self.seed = seed

    def select(self, x, k, key, step):
        import mxnet as mx
        rng = _rng(self.seed, key, step)
        idx = rng.choice(x.shape[0], size=k, replace=False)
        return mx.nd.array(idx, dtype="float32")


@register("dgc")
class SampledThreshold:
    """DGC's selection: estimate the top-k threshold from a random sample of magnitudes and take
    the entries above it. The push size must be exactly k (inter-worker alignment), so the
    candidates are then cut or filled by magnitude: above-threshold entries first, largest first.
    On this CPU build that costs a full top-k anyway and selects the top-k set whenever the
    estimate is not too high; it is kept for comparison with the DGC literature. What changes
    training in DGC is its momentum correction (compression.momentum_correction, memory.py)."""

    def __init__(self, sample_fraction=0.01, min_sample=256, seed=0):
        self.sample_fraction = sample_fraction
        self.min_sample = min_sample
        self.seed = seed

    def select(self, x, k, key, step):
        import mxnet as mx
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

