"""Sparsifiers: pick exactly k entries of a flat gradient, on the host (numpy).

Exactly k, always: every worker then pushes the same number of values per tensor, so mailbox
sizes are fixed and equal across workers (SAFusion's inter-worker alignment).

The contract (stated here only): a sparsifier subclasses Sparsifier and implements select(x, k, key,
step): x is a 1-D float32 numpy array on the host (the tensor's accumulated gradient), and it returns
k distinct integer indices into x as a numpy array (int64), in any order (top-k's are increasing); key
and step name the tensor and the step, for seeded randomness. The encoders (encoders.py) call every
sparsifier the same way, once per buffer: select_buffer(acc) with the buffer's compensated tensors
(accumulated.Accumulated), which runs select on each by default; one whose selection is the k largest
magnitudes declares `magnitudes = True` and takes them from acc (TopK). The encoders then take the
values sent out of the memory and pack them for the wire (codec.py).

Why on the host: see encoders.py, which copies each sparse buffer's gradient there once per step.

Each class registers its compression.type name (registry.py).
"""
import numpy as np

from ssdsgd.compression.registry import register


class Sparsifier:
    """The base of the sparsifiers (see the module's docstring), built as cls(seed=seed)."""
    # The sparsifier reads the magnitudes of the accumulated tensors (Accumulated.largest_magnitudes):
    # with compression.selection: sampled the memory's pass then writes them, and searches for candidates.
    magnitudes = False

    def __init__(self, seed=0):          # no randomness needed: the seed is taken for a uniform constructor
        self.seed = seed

    def select(self, x, k, key, step):
        raise NotImplementedError

    def select_buffer(self, acc):
        """{tensor j: its indices} for every tensor j of acc.part (acc: the buffer's accumulated.Accumulated)."""
        return {j: self.select(acc.tensors[j], acc.counts[j], acc.keys[j], acc.step) for j in acc.part}


@register("topk")
class TopK(Sparsifier):
    """The k largest magnitudes."""
    magnitudes = True

    def select(self, x, k, key, step):
        return top_magnitudes(np.abs(x), k)

    def select_buffer(self, acc):
        return acc.largest_magnitudes()        # select's set, found among what the memory's pass wrote


@register("randomk")
class RandomK(Sparsifier):
    """k uniformly random positions, the same on every worker (seeded by tensor key and step)."""

    def select(self, x, k, key, step):
        return step_rng(self.seed, key, step).choice(x.shape[0], size=k, replace=False).astype(np.int64)


@register("dgc")
class SampledThreshold(Sparsifier):
    """DGC's selection: estimate the top-k threshold from a random sample of magnitudes (a fraction
    of the tensor, at least min_sample entries) and take the entries above it. The push size must
    be exactly k (inter-worker alignment), so the k largest are then taken among the entries above
    the estimate (a sampled_candidates search with DGC's sample size): the top-k set, found in one
    masked pass instead of a full partition. Kept for comparison with the DGC literature; what
    changes training in DGC is its momentum correction (compression.momentum_correction, memory.py),
    and compression.selection: sampled gives every top-k selection the same search."""

    def __init__(self, sample_fraction=0.01, min_sample=256, seed=0):
        self.sample_fraction = sample_fraction
        self.min_sample = min_sample
        self.seed = seed

    def select(self, x, k, key, step):
        n = x.shape[0]
        m = min(n, max(self.min_sample, int(n * self.sample_fraction)))
        return top_magnitudes(np.abs(x), k, step_rng(self.seed, key, step), sample=m)


# compression.selection: sampled. The threshold is the SAMPLE_HITS-th largest of a random sample, lowered
# by SAMPLE_MARGIN standard deviations of that count: below the k-th largest magnitude unless the
# sample is off by more than that (about 3e-5 of searches), when the search falls back to a partition.
SAMPLE_HITS = 256
SAMPLE_MARGIN = 4


def sampled_candidates(a, k, rng, sample=None):
    """Increasing indices of the entries of the non-negative array a at or above a threshold
    estimated from a random sample, at least k of them: a superset of the k largest (every entry
    left out is below every one taken). Costs a sample and one masked pass. None where a partition
    is as cheap (the sample would cover an eighth of a, or k is above a quarter of it: the
    candidates would be most of a) or the estimate came out above the k-th largest. sample: the
    sample size (default: SAMPLE_HITS entries expected above the threshold)."""
    n = a.shape[0]
    m = sample_size(n, k, sample)
    if m is None:
        return None
    threshold = sample_threshold(a[rng.integers(0, n, m)], n, k)   # with replacement: O(m), no permutation
    found = np.less(a, threshold)
    np.logical_not(found, out=found)                 # at or above it, NaN included (as top_magnitudes)
    found = np.flatnonzero(found)
    return found if found.size >= k else None


def sample_size(n, k, sample=None):
    """The entries a sampled_candidates search for the k largest of n draws, or None where it leaves
    the search to a partition."""
    m = sample or -(-SAMPLE_HITS * n // max(k, 1))
    return None if k > n // 4 or m > n // 8 else m


def sample_threshold(drawn, n, k):
    """The threshold of a sampled_candidates search for the k largest of n entries, from the
    magnitudes drawn (in any order: an order statistic of them)."""
    m = drawn.shape[0]
    hits = m * k / n
    r = min(m, int(hits + SAMPLE_MARGIN * hits ** 0.5) + 1)
    return np.partition(drawn, m - r)[m - r]         # the r-th largest of the sample


def top_magnitudes(a, k, rng=None, sample=None):
    """Increasing indices of the k largest entries of the non-negative array a (all of them if
    k >= a.size): every entry above the k-th largest, then the first of those equal to it (so the
    set does not depend on how a partition happens to order equal values); a NaN counts as above
    every number. Increasing, so that the gathers and scatters at them, on the worker and on the
    servers, walk memory in order. With rng (compression.selection: sampled): the same set, taken
    among sampled_candidates in O(n) with a small constant instead of a partition of all of a
    (every entry equal to the k-th largest is a candidate)."""
    n = a.shape[0]
    if k >= n:
        return np.arange(n)
    if k == 1:                        # one pass, no partition (the floor of one of gradient allocation)
        return np.array([np.argmax(a)])
    if rng is not None:
        found = sampled_candidates(a, k, rng, sample)
        if found is not None:
            return found[top_magnitudes(a[found], k)]
    # The k-th largest by a partition of the values, then one masked pass: cheaper than an
    # argpartition (no index array to move), and the mask gives the indices in order.
    kth = np.partition(a, n - k)[n - k]
    if kth != kth:                    # NaN: at least k of them (a partition puts NaN last)
        return np.flatnonzero(np.isnan(a))[:k]
    taken = np.less(a, kth)
    np.logical_not(taken, out=taken)  # at or above the k-th largest, NaN included
    extra = np.count_nonzero(taken) - k
    if extra:                         # more entries equal to it than the quota has room for
        taken[np.flatnonzero(a == kth)[-extra:]] = False
    return np.flatnonzero(taken)


def step_rng(seed, key, step):
    """The generator of one tensor's (or buffer's) selection at one step: the same on every worker."""
    # SeedSequence wants non-negative entries; keys and steps can be negative (behind-fusion keys,
    # the startup timing run).
    return np.random.default_rng([seed % 2**32, key % 2**32, step % 2**32])

