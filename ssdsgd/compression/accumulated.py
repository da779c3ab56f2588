"""What the encoders' compensation step (encoders.py) hands a sparsifier's select_buffer: one buffer's
accumulated gradients for this step, with their quotas, and what the memory's pass learned of their
magnitudes on the way (compression.selection: sampled): the magnitudes themselves and a buffer-wide
candidate search. A sparsifier that takes the k largest magnitudes (top-k) finds them here with
largest_magnitudes instead of searching every tensor again.
"""
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ssdsgd.compression import kernels
from ssdsgd.compression.compressor import top_magnitudes
from ssdsgd.compression.quotas import kth_largest


@dataclass
class Accumulated:
    tensors: list                  # each tensor's accumulated gradient (1-D float32, the memory's own array)
    counts: list                   # this step's quota k_j of each tensor
    keys: list                     # each tensor's memory key (the sparsifier's `key`)
    part: list                     # the tensors to select from (the others are sent whole)
    offsets: list                  # each tensor's offset in the buffer
    step: int
    rng: Any = None                # compression.selection: sampled: the step's generator of its searches
    mag: Optional[np.ndarray] = None   # sampled: the buffer's magnitudes array
    mag_written: bool = True       # it holds the tensors' magnitudes (the fused pass collects candidates instead)
    found: Optional[np.ndarray] = None   # a buffer-wide candidate search: increasing buffer indices,
    values: Optional[np.ndarray] = None  # their magnitudes,
    bounds: Any = None             # tensor j's at bounds[j]:bounds[j + 1],
    around: Any = None             # (tau, above, ties) of the quotas' threshold (quotas_from_candidates) or None,
    tops: Any = None               # and each tensor's largest magnitude's position (the fused pass)

    def largest_magnitudes(self):
        """{tensor j: increasing indices of its counts[j] largest magnitudes} for every j in part, as
        top_magnitudes takes them: from the candidates where a tensor's quota fits in them, otherwise
        a search of its own (sampled, among the magnitudes; exact, a partition)."""
        if self.rng is None or self.mag is None:
            return {j: top_magnitudes(np.abs(self.tensors[j]), self.counts[j]) for j in self.part}
        picks, counts = {}, np.array(self.counts, np.int64)
        fits = np.zeros(len(counts), bool)
        if self.found is not None:            # the tensors whose quota fits in their candidates, in one call
            bounds = np.asarray(self.bounds, np.int64)
            fits[self.part] = counts[self.part] <= np.diff(bounds)[self.part]
            taken = np.empty(int(counts[fits].sum()), np.int64)
            kths = kth_largest(self.values, bounds, counts, fits, self.around)
            kernels.top_among(self.found, self.values, bounds, counts, fits, kths, taken)
            ends = np.cumsum(np.where(fits, counts, 0))
            for j in np.flatnonzero(fits):
                picks[int(j)] = taken[ends[j] - counts[j]:ends[j]] - self.offsets[j]
        for j in self.part:
            off, n, k = self.offsets[j], self.tensors[j].shape[0], self.counts[j]
            if not fits[j] and k == 1 and self.tops is not None:
                picks[j] = np.array([self.tops[j]])
            elif not fits[j]:                 # a search of its own
                if not self.mag_written:
                    np.abs(self.tensors[j], out=self.mag[off:off + n])
                picks[j] = top_magnitudes(self.mag[off:off + n], k, self.rng)
        return picks
