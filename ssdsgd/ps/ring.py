"""The sparse downlink's ring, as the servers publish it and the workers read it: per buffer, one
pullable float32 key holding the aggregated update of each of the last rounds the buffer applied
(ssdsgd.ps.rounds.BufferState records each round in it), so a worker rebuilds the global weights from
the rounds' sparse sums instead of pulling them dense (ssdsgd.algorithms.downlink)."""
import bisect
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from ssdsgd.compression.codec import bitmap_indices, bitmap_words, pack_bitmap
from ssdsgd.ps import ring_packing
from ssdsgd.ps.rounds import RoundError, weights_checksum

# A ring of the last `slots` rounds a buffer applied, published by the server in one pullable
# float32 key: slot (round mod slots) = [round, count, crc_high, crc_low, indices, values].
#   index list (default): cap words, the count indices then (cap - count) unused;
#   bitmap (compression.index_coding: auto, where bitmap_words(size) < cap): the round's selection
#     mask as codec.pack_bitmap words (count bits set);
#   values: cap words, the count values in index order, then (cap - count) unused.
# Round -1: an empty slot. Count -1: that round's sum has more than `cap` non-zero entries (or is
# not representable), so a replica must pull the dense state. crc_high/crc_low: the two 16-bit
# halves of the CRC-32 of the server's weights after the round (each exact in float32), on every
# check_every-th round; -1 on the others. The replica checks its own weights against it, so the
# guard costs 8 bytes a slot instead of a dense pull.
RING_HEADER = 4
RING_EXACT = 1 << 24                  # float32 holds every integer below 2**24 exactly


@dataclass(frozen=True)
class RingLayout:
    """The shape of one ring key: `slots` slots of [RING_HEADER words, the index words, `cap` values]
    for a buffer of `size` elements; `bitmap`: the index words are the round's selection bitmap
    (codec.pack_bitmap words), else an index list of `cap` words. The server (DownlinkRing) and the
    workers (read_ring, the length of their pull buffer) build it from the same plan entry."""
    slots: int
    cap: int
    size: int
    bitmap: bool = False
    packed_words: int = 0             # > 0: a compressed ring, its slots' payload ring_packing words

    def __post_init__(self):
        if self.bitmap and self.size <= 0:
            raise RoundError("a bitmap ring slot needs the buffer's size")
        if self.packed_words and (self.bitmap or self.cap > ring_packing.payload_bytes(self.packed_words) // 2):
            raise RoundError(f"a packed ring slot of {self.packed_words} words holds fewer than {self.cap} values")

    @classmethod
    def packed(cls, slots, size, words):
        """A compressed ring: slots of `words` packed payload words, up to the pairs they can hold
        at their smallest (2 bytes a pair)."""
        return cls(slots, min(size, ring_packing.payload_bytes(words) // 2), size, False, words)

    @classmethod
    def of_plan(cls, size, down, ring):
        """The layout of a buffer's ring key from its downlink plan (`down`: the buffer's entry,
        `ring`: one density stage's ring in it), as the server and the workers both build it."""
        return cls(down["slots"], ring["cap"], size, ring["bitmap"], ring.get("packed_words", 0))

    @property
    def compressed(self):
        return self.packed_words > 0

    @property
    def index_coding(self):
        """How a slot carries its indices: "packed" (gaps, ring_packing), "bitmap" or "list"."""
        return "packed" if self.compressed else "bitmap" if self.bitmap else "list"

    @property
    def index_words(self):
        return 0 if self.compressed else bitmap_words(self.size) if self.bitmap else self.cap

    @property
    def values_at(self):
        """Where a slot's values (or its packed payload) start."""
        return RING_HEADER + self.index_words

    @property
    def slot_length(self):
        return self.values_at + (self.packed_words if self.compressed else self.cap)

    @property
    def length(self):
        return self.slots * self.slot_length


class RingRound(NamedTuple):
    indices: np.ndarray               # int64
    values: np.ndarray                # float32
    checksum: Optional[int]           # CRC-32 of the server's weights after the round, or None


class DownlinkRing:
    """Server side: the aggregated update of each of the last `slots` rounds, exactly as `apply`
    got it. What is kept is every entry of the round's sum whose bits are not those of +0.0 (a
    subset of the union of the workers' indices), so zeros(size) with those entries put back is
    the same float32 array bit for bit, -0.0 and NaN included. check_every > 0: every
    check_every-th round (rounds r with (r + 1) % check_every == 0) carries the weights' checksum."""

    def __init__(self, layout, check_every=0):
        if layout.size >= RING_EXACT:
            raise RoundError(f"a buffer of {layout.size} elements cannot carry its indices as float32")
        # A compressed (packed) layout: its rounds are first cut to what a slot holds
        # (BufferState.squeezed); an exact ring's round may overflow its slot.
        self.layout, self.check_every = layout, check_every
        self.array = np.zeros(layout.length, np.float32)
        self.array[::layout.slot_length] = -1.0

    def compressed_layout(self, rnd):
        return self.layout if self.layout.compressed else None

    def record(self, rnd, grad_sum, weights=None, nonzero=None):
        """Publish round `rnd`'s sum; `weights`: the server's weights after it (for the checksum);
        `nonzero`: the sum's non-zero indices, ascending, if known."""
        lay = self.layout
        s = (rnd % lay.slots) * lay.slot_length
        slot = self.array[s:s + lay.slot_length]
        # != 0 first: numpy's nonzero on a bool mask is several times faster than on uint32
        idx = np.flatnonzero(grad_sum.view(np.uint32) != 0) if nonzero is None else nonzero
        if rnd >= RING_EXACT:
            slot[0] = -1.0            # the round number itself would not be exact: an empty slot
            return
        slot[0] = rnd
        slot[2:4] = -1.0
        if weights is not None and self.check_every and (rnd + 1) % self.check_every == 0:
            crc = weights_checksum(weights)
            slot[2:4] = crc >> 16, crc & 0xFFFF
        payload = None
        if lay.compressed and idx.size <= lay.cap:
            payload = ring_packing.encode(idx, grad_sum[idx], lay.packed_words)
        if idx.size > lay.cap or (lay.compressed and payload is None):
            slot[1] = -1.0
            return
        n = idx.size
        slot[1] = n
        if lay.compressed:
            slot[RING_HEADER:] = payload
            return
        if lay.bitmap:
            slot[RING_HEADER:lay.values_at] = pack_bitmap(idx, lay.size)
        else:
            slot[RING_HEADER:RING_HEADER + n] = idx
        slot[lay.values_at:lay.values_at + n] = grad_sum[idx]


class StagedRings:
    """Server side of the sparse downlink under a density warm-up (compression.warmup): one
    DownlinkRing per density stage, its slots sized for that stage's density, so a warm-up stage
    pulls its rounds sparse too instead of the dense weights. Stage s holds the rounds from
    first_rounds[s] up to the next stage's first; a stage whose ring would not be smaller than the
    dense weights has None and publishes nothing (its rounds are pulled dense)."""

    def __init__(self, rings, first_rounds):
        if len(rings) != len(first_rounds) or list(first_rounds) != sorted(first_rounds) or first_rounds[0] != 0:
            raise RoundError(f"downlink rings: {len(rings)} rings for stages starting at rounds {list(first_rounds)}")
        self.rings, self.first_rounds = list(rings), list(first_rounds)
        # Stages whose ring changed since the server last published it; all of them at first, so
        # the first publication replaces the keys' zero-initialised arrays with empty rings.
        self.changed = {s for s, r in enumerate(self.rings) if r is not None}

    def stage_of(self, rnd):
        return bisect.bisect_right(self.first_rounds, rnd) - 1

    def compressed_layout(self, rnd):
        """The packed RingLayout round `rnd` is published in under the compressed downlink, or None
        (exact or dense)."""
        ring = self.rings[self.stage_of(rnd)]
        return None if ring is None else ring.compressed_layout(rnd)

    def record(self, rnd, grad_sum, weights=None, nonzero=None):
        stage = self.stage_of(rnd)
        if self.rings[stage] is not None:
            self.rings[stage].record(rnd, grad_sum, weights, nonzero)
            self.changed.add(stage)


def read_ring(array, layout, from_round=0):
    """A pulled ring of this RingLayout (the DownlinkRing's) -> {round: RingRound, or None where the
    slot says the round needs a dense pull}. Rounds before from_round (a replica's version: already
    applied) are left out undecoded."""
    slot_len, values = layout.slot_length, layout.values_at
    if array.shape != (layout.length,):
        raise RoundError(f"ring of {array.shape[0]} values, expected {layout.slots} slots of {slot_len}")
    out = {}
    for s in range(layout.slots):
        slot = array[s * slot_len:(s + 1) * slot_len]
        rnd, n = int(slot[0]), int(slot[1])
        if rnd < max(0, from_round):
            continue
        if n < 0:
            out[rnd] = None
            continue
        checksum = None if slot[2] < 0 else (int(slot[2]) << 16) | int(slot[3])
        if layout.compressed:
            try:
                out[rnd] = RingRound(*ring_packing.decode(slot[RING_HEADER:], n, layout.size), checksum)
            except ValueError as e:
                raise RoundError(f"ring slot of round {rnd}: {e}") from None
            continue
        if layout.bitmap:
            try:
                idx = bitmap_indices(slot[RING_HEADER:values], layout.size, n)
            except ValueError as e:
                raise RoundError(f"ring slot of round {rnd}: {e}") from None
        else:
            idx = slot[RING_HEADER:RING_HEADER + n].astype(np.int64)
        out[rnd] = RingRound(idx, slot[values:values + n].astype(np.float32), checksum)
    return out
