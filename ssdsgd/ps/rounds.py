"""The global update of SSD-SGD as the servers run it, in plain numpy (no mxnet: unit-testable).

One `BufferState` per fused buffer that lives on this server. Workers push one mailbox message per
buffer per step: [round, rank, payload...], laid out as ssdsgd.compression.codec describes (one
format per density stage of the compression warm-up, each with its own mailbox key). The payload is
decoded and added into that round's accumulator: a dense payload with one array add, a sparse one
scattered in at its indices, so a sparse message costs O(k), not O(size) (with the bitmap index
coding, O(size / 24) for the bitmap, which it carries only where that is below k). Once all N workers'
contributions for a round are in, and every earlier round has been applied, the round is applied:

    G_t = sum_i g_i;   v <- mu*v - eta_g(t) * (G_t/(N*B) + lambda*w);   w <- w + v

which is MXNet's sgd_mom_update on the summed gradient, so a run that stays synchronous reproduces
the stock dist_sync baseline. Under DGC's momentum correction the workers' pushes already carry the
momentum of their gradients, so the servers run the rule above with mu = 0, which also applies the
weight decay without momentum (1/(1 - mu) times weaker than SSGD's).

Rounds may arrive in any order and a fast worker may be several rounds ahead; their accumulators wait
in `pending` until they can be applied in order. Within a round the contributions are added in rank
order (one that arrives early is held until its turn): float32 addition is not associative, and with 3
or more workers the arrival order would otherwise change the sum, and so the run, from one run to the
next.

Under the compressed downlink (a ring stage with a packed slot) the servers apply, and publish, not G_t
itself but its top-`cap` values after adding the servers' own error feedback (as DoubleSqueeze does),
rounded to the packed slot's one-byte values and cut to what fits its bytes (ssdsgd.ps.ring_packing):
C_t = pack(G_t + e_t), e_{t+1} = G_t + e_t - C_t. e stays in gradient units whatever
compression.rescale_held says: carried to each round's rate like the workers' memory, its stale sums
reached the weights undamped late in a run and cost 2.9-3.8 points at 4 workers (seeds 0-1 of
results/accuracy_fmnist_scale_rescaled against _scale_compressed_rescaled). The servers' weights are then
exactly what the workers' replicas rebuild from the published rounds; what the rounds have not yet
carried waits in e.
"""
import bisect
import zlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from ssdsgd.compression.codec import SparseGrad, bitmap_indices, bitmap_words, pack_bitmap
from ssdsgd.ps import ring_packing


class RoundError(RuntimeError):
    pass


class ReplicaMismatch(RoundError):
    """A worker's replica of a buffer's server state is not the servers' (sparse downlink guard)."""


class BufferState:
    def __init__(self, size, num_workers, batch_size, momentum, wd, schedule, formats,
                 delay_momentum=None, warmup=0):
        self.size = size
        self.num_workers = num_workers
        self.scale = 1.0 / (num_workers * batch_size)
        self.momentum = momentum
        # SSD-SGD's steps-delay stage (rounds >= warmup) may run with its own momentum: stale
        # gradients act like extra momentum, see the README's Fashion-MNIST ablation.
        self.delay_momentum = momentum if delay_momentum is None else delay_momentum
        self.warmup = warmup
        self.wd = wd
        self.schedule = schedule
        self.formats = formats        # codec.WireFormat per density stage
        self.weights = None           # np.float32 (size,), set by bind()
        self.mom = np.zeros(size, np.float32)
        self.version = 0              # number of rounds applied
        self.pending = {}             # round -> [sum array, ranks received, {rank: contribution not yet added}]
        self.ring = None              # publishes each applied round (sparse downlink): StagedRings or a DownlinkRing
        self.checks = 0               # replica side: rounds whose published checksum this state matched
        self.residual = None          # compressed downlink: the servers' error feedback e (float32, size)

    def bind(self, weights, version=0):
        if weights.shape != (self.size,):
            raise RoundError(f"weight buffer has {weights.shape} elements, plan says {self.size}")
        self.weights = np.array(weights, dtype=np.float32, copy=True)
        self.version = int(version)

    def receive(self, message, stage=0):
        """Add one worker's mailbox message (in the format of `stage`). Returns the number of rounds
        applied by it."""
        if self.weights is None:
            raise RoundError("mailbox push before the weight buffer was bound")
        rnd, rank, grad = self.formats[stage].parse(message)
        if not 0 <= rank < self.num_workers:
            raise RoundError(f"mailbox from rank {rank}, but the job has {self.num_workers} workers")
        if rnd < self.version:
            raise RoundError(f"rank {rank} pushed round {rnd}, already applied (version {self.version})")
        entry = self.pending.get(rnd)
        if entry is None:
            # The round's accumulator: O(size), once per round (not per message).
            entry = self.pending[rnd] = [np.zeros(self.size, np.float32), set(), {}]
        if rank in entry[1]:
            raise RoundError(f"rank {rank} pushed round {rnd} twice")
        entry[1].add(rank)
        entry[2][rank] = grad
        self._add_in_rank_order(entry)
        applied = 0
        while self.version in self.pending and len(self.pending[self.version][1]) == self.num_workers \
                and not self.pending[self.version][2]:
            grad_sum = self.pending.pop(self.version)[0]
            self.apply(*self.squeezed(grad_sum))
            applied += 1
        return applied

    @staticmethod
    def _add_in_rank_order(entry):
        """Add the held contributions of a round [sum, ranks received, {rank: held}] whose turn has come:
        ranks 0, 1, 2, ... in that order whatever order they arrived in, so that with 3 or more
        workers the float32 sum, and so the run, does not depend on timing."""
        while True:
            turn = len(entry[1]) - len(entry[2])          # ranks 0 .. turn - 1 are in the sum
            grad = entry[2].pop(turn, None)
            if grad is None:
                return
            if isinstance(grad, SparseGrad):
                grad.add_to(entry[0])         # scatter-add: O(values sent)
            else:
                entry[0] += grad

    def squeezed(self, grad_sum):
        """(the round's sum as the servers apply it, its non-zero indices or None): the sum itself, or
        under a compressed ring stage its largest magnitudes after adding the residual e, rounded to
        the packed slot's values, as many as its bytes hold; the rest stays in e for later rounds."""
        layout = self.ring.compressed_layout(self.version) if self.ring is not None else None
        if layout is None:
            return grad_sum, None
        if self.residual is None:
            self.residual = np.zeros(self.size, np.float32)
        self.residual += grad_sum
        return ring_packing.take_round(self.residual, layout.cap, layout.packed_words, seed=self.version)

    def apply(self, grad_sum, nonzero=None):
        """Apply one round's sum; `nonzero`: its non-zero indices, ascending, if known (no ring scan)."""
        lr = np.float32(self.schedule(self.version + 1))     # MXNet counts updates from 1
        self.mom *= np.float32(self.momentum if self.version < self.warmup else self.delay_momentum)
        self.mom -= lr * (grad_sum * np.float32(self.scale) + np.float32(self.wd) * self.weights)
        self.weights += self.mom
        if self.ring is not None:
            self.ring.record(self.version, grad_sum, self.weights, nonzero)
        self.version += 1

    def state_dict(self):
        """The pending rounds as {round: (sum, ranks received, {rank: held contribution, dense})}."""
        return {"weights": self.weights, "mom": self.mom, "version": self.version, "residual": self.residual,
                "pending": {r: (s, sorted(ranks), {q: g.to_dense() if isinstance(g, SparseGrad) else g
                                                   for q, g in held.items()})
                            for r, (s, ranks, held) in self.pending.items()}}

    def load_state_dict(self, d):
        self.weights = np.asarray(d["weights"], np.float32).copy()
        self.mom = np.asarray(d["mom"], np.float32).copy()
        self.version = int(d["version"])
        self.residual = None if d.get("residual") is None else np.asarray(d["residual"], np.float32).copy()
        # A held sparse contribution comes back dense: adding it is bit for bit the same (SparseGrad.add_to).
        self.pending = {int(r): [np.asarray(s, np.float32).copy(), set(ranks),
                                 {int(q): np.asarray(g, np.float32).copy() for q, g in held.items()}]
                        for r, (s, ranks, held) in d["pending"].items()}

    def catch_up(self, rounds):
        """Replica side of the sparse downlink: apply the published rounds (`read_ring`) from this
        state's version on, in order, with the same `apply` as the server, so the state stays bit
        for bit the server's. Returns True when every round up to the newest given is applied (or
        this state is already newer), False when a round it needs is missing from `rounds` or is
        marked dense (None): the state is then still a valid server state of an older version.
        A round published with the checksum of the server's weights after it (every
        downlink_check_every-th round) is checked: ReplicaMismatch if this state's weights differ;
        `checks` counts the rounds that passed."""
        if self.weights is None:
            return False
        newest = max(rounds, default=-1)
        while self.version <= newest:
            entry = rounds.get(self.version)
            if entry is None:
                return False
            grad_sum = np.zeros(self.size, np.float32)
            grad_sum[entry.indices] = entry.values
            self.apply(grad_sum)
            if entry.checksum is not None:
                mine = weights_checksum(self.weights)
                if mine != entry.checksum:
                    raise ReplicaMismatch(f"the replica of the global weights at version {self.version} "
                                          f"differs from the servers' (CRC-32 {mine:#010x}, servers' "
                                          f"{entry.checksum:#010x})")
                self.checks += 1
        return True


# ---- sparse downlink ---------------------------------------------------------------------------
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


def weights_checksum(weights):
    """CRC-32 of a float32 array's bytes: equal for bit-identical arrays."""
    return zlib.crc32(np.ascontiguousarray(weights, np.float32).view(np.uint8))


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
        idx = np.flatnonzero(grad_sum.view(np.uint32)) if nonzero is None else nonzero
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
