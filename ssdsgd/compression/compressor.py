"""Sparsifiers: pick exactly k entries of a flat gradient, on the host (numpy).

Exactly k, always: every worker then pushes the same number of values per tensor, so mailbox
sizes are fixed and equal across workers (SAFusion's inter-worker alignment). select(x, k, key,
step) takes a 1-D float32 numpy array and returns k distinct int64 indices, in any order.

Why on the host: see encoders.py, which copies each sparse buffer's gradient there once per step.

Each class registers its compression.type name (registry.py).
"""
import numpy as np

from ssdsgd.compression.registry import register


@register("topk")
class TopK:
    """The k largest magnitudes."""

    def __init__(self, seed=0):          # no randomness; the seed is taken for a uniform constructor
        self.seed = seed

    def select(self, x, k, key, step):
        return top_magnitudes(np.abs(x), k)


@register("randomk")
class RandomK:
    """k uniformly random positions, the same on every worker (seeded by tensor key and step)."""

    def __init__(self, seed=0):
        self.seed = seed

    def select(self, x, k, key, step):
        return _rng(self.seed, key, step).choice(x.shape[0], size=k, replace=False).astype(np.int64)


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
        n = x.shape[0]
        if k >= n:
            return np.arange(n)
        m = min(n, max(self.min_sample, int(n * self.sample_fraction)))
        rng = _rng(self.seed, key, step)
        a = np.abs(x)
        sample = a[rng.choice(n, size=m, replace=False)]
        k_sample = max(1, int(round(m * k / n)))
        thr = np.partition(sample, m - k_sample)[m - k_sample]      # the k_sample-th largest
        # Above-threshold entries outrank every other; within each group, larger magnitudes first.
        score = a + (a >= thr) * (a.max() + 1)
        return top_magnitudes(score, k)


def top_magnitudes(a, k):
    """Indices of the k largest entries of the non-negative array a (all of them if k >= a.size)."""
    n = a.shape[0]
    if k >= n:
        return np.arange(n)
    return np.argpartition(a, n - k)[n - k:]


def _rng(seed, key, step):
    # SeedSequence wants non-negative entries; keys and steps can be negative (behind-fusion keys,
    # the startup timing run).
    return np.random.default_rng([seed % 2**32, key % 2**32, step % 2**32])

