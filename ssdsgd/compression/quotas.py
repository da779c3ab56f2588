"""The per-tensor quotas of compression.allocation: gradient (sparsification ahead of fusion): how many
of a buffer's values each tensor sends this step, the buffer's total fixed. The encoders (encoders.py)
call them on the accumulated gradients, or on the candidates of a sampled search."""
import numpy as np

from ssdsgd.compression import kernels


def allocate_by_threshold(accs, counts, whole):
    """New k_i for the sparsified tensors of one buffer, same total (the message size is fixed):
    as many values from each tensor as a top-k over the whole buffer would take (the entries at or
    above the buffer's K-th largest magnitude), but at least one per tensor, so every tensor still
    sends every step (sparsification ahead's guarantee). Tensors sent whole keep their counts.

    Per-tensor quotas proportional to size starve tensors whose few values carry large gradients
    (the classifier, the first convolution, BatchNorm); this spends the same budget where the
    accumulated gradient is. It costs one O(n) partition of the buffer;
    compression.allocate_every sets how often it runs (every step by default; why: docs/design.md,
    "Sparsification ahead of fusion").
    accs: the tensors' accumulated gradients (1-D numpy); whole: indices of tensors sent whole."""
    part = [j for j in range(len(accs)) if j not in whole]
    budget = sum(counts[j] for j in part)
    if len(part) < 2:
        return list(counts)
    flat = np.abs(np.concatenate([accs[j] for j in part]))
    sizes = np.array([accs[j].shape[0] for j in part])
    mags = np.split(flat, np.cumsum(sizes)[:-1])
    tau = np.partition(flat, flat.size - budget)[flat.size - budget]
    above = np.array([int((m > tau).sum()) for m in mags])
    ties = np.array([int((m == tau).sum()) for m in mags])
    return _quotas(counts, part, above, ties, budget)


def allocate_from_candidates(values, bounds, counts, whole):
    """allocate_by_threshold's quotas from a sampled candidate search (compression.selection:
    sampled): values, the magnitudes of every entry of the buffer at or above a threshold, at least
    the budget of them (compressor.sampled_candidates), tensor j's in values[bounds[j]:bounds[j + 1]].
    The budget's largest magnitude and every entry equal to it are among them, so the quotas are the
    exact ones, found in O(len(values))."""
    return quotas_from_candidates(values, bounds, counts, whole)[0]


def quotas_from_candidates(values, bounds, counts, whole):
    """allocate_from_candidates' quotas, the threshold they come from (the budget's largest magnitude)
    and per tensor its candidates above it and equal to it (kernels.count_around); the threshold and
    counts None where there are fewer than two tensors to share the budget."""
    part = [j for j in range(len(counts)) if j not in whole]
    budget = sum(counts[j] for j in part)
    if len(part) < 2:
        return list(counts), None, None, None
    tau = kth_smallest(values, values.size - budget)
    above, ties = kernels.count_around(values, np.asarray(bounds, np.int64), tau)
    return _quotas(counts, part, above[part], ties[part], budget), tau, above, ties


def kth_largest(values, bounds, counts, fits, around):
    """For every tensor j with fits[j] (its quota counts[j] at most its candidates, values[bounds[j]:
    bounds[j + 1]]): a threshold with which kernels.top_among takes its counts[j] largest as
    top_magnitudes does: the counts[j]-th largest (-inf for all of them; NaN where it is a NaN), by a
    partition, or, where quotas_from_candidates gave around = (tau, above, ties) and the quota takes
    every candidate above tau and some equal to it, tau itself, found without one."""
    tau, above, ties = around if around is not None and not np.isnan(values).any() else (None, None, None)
    kths = np.full(len(counts), -np.inf)
    for j in np.flatnonzero(fits):
        n, k = bounds[j + 1] - bounds[j], counts[j]
        if k >= n:
            continue
        if tau is not None and above[j] <= k <= above[j] + ties[j]:
            kths[j] = tau
        else:
            kths[j] = kth_smallest(values[bounds[j]:bounds[j + 1]], n - k)
    return kths


def kth_smallest(values, k):
    """np.partition(values, k)[k]: kernels.kth_smallest for thousands of magnitudes (about 5 times
    faster at 100,000), numpy's partition for a few or where a value is negative."""
    done, kth = kernels.kth_smallest(values, k) if values.size >= 4096 else (False, None)
    return values.dtype.type(kth) if done else np.partition(values, k)[k]


def _quotas(counts, part, above, ties, budget):
    """counts with the sparsified tensors' (part) quotas replaced: `above` the budget's threshold
    and a share of the `ties` at it, at least one each, `budget` in all."""
    # Entries equal to tau (all of them when most are 0) fill the rest of the budget in tensor order.
    want = above + np.minimum(ties, np.maximum(0, budget - above.sum() - np.concatenate([[0], np.cumsum(ties)[:-1]])))
    new = np.maximum(want, 1)
    # The floor of one can overshoot by at most one per tensor: take the excess from the largest quotas.
    for _ in range(int(new.sum()) - budget):
        new[int(np.argmax(new))] -= 1
    out = list(counts)
    for j, c in zip(part, new):
        out[j] = int(c)
    return out
