"""The sparse downlink's worker side (compression.downlink: sparse or compressed): a replica of each
buffer's server state, refreshed from the ring of the last rounds' aggregated sparse updates instead of
a pull of the dense weights (the ring itself, server side: ssdsgd.ps.ring.DownlinkRing).

sparse: a round's slot holds the exact sum of the N workers' pushes, up to N pushes' values, so the
pull grows with N. compressed: where that exact slot would be larger than two pushes' bytes, the servers
apply and publish only the largest values of each round's sum, rounded to one byte each and packed with
their index gaps into two pushes' bytes (ssdsgd.ps.ring_packing; their own error feedback keeps the rest
for later rounds: ssdsgd.ps.rounds.BufferState.squeezed), so the pull stays at two pushes at any N.

Per buffer and density stage the server keeps the last R rounds' aggregated updates in a ring key:
R = S (at least k; 1 for synchronous SGD, which pulls every round), each slot [round, count,
checksum, N*k_b indices or the round's bitmap (compression.index_coding, whichever is smaller), N*k_b
values] with k_b the values one worker sends per step in that stage. A stage's rounds are pulled from
its ring only if one ring pull is smaller than one dense pull; the decisions are logged once (rank 0)
and kept in the run's stats. A landed ring pull is applied to the replica with the servers' own
numpy update (bit for bit); a replica that cannot catch up from the ring (a round left it, or did
not fit its slot) is rebuilt from the servers' dense weights and momentum (the momentum key).
"""
import mxnet as mx
import numpy as np

from ssdsgd.algorithms.policy import density_stage
from ssdsgd.compression.codec import WireFormat, use_bitmap
from ssdsgd.config import RING_DOWNLINKS
from ssdsgd.ps.commands import num_servers
from ssdsgd.ps.keys import KeyAllocator
from ssdsgd.ps.ring import RING_HEADER, RingLayout, read_ring
from ssdsgd.ps.rounds import ReplicaMismatch


def ring_zeros(size, down, ring):
    """Zeros the length of a sparse-downlink ring key (`down`: a buffer's downlink plan, `ring`: one
    stage's ring in it): the worker's pull target."""
    return mx.nd.zeros(RingLayout.of_plan(size, down, ring).length)


# A compressed round takes this many pushes' bytes: the pull stays at twice a push at any N (why two:
# docs/design.md, "Compressed downlink").
COMPRESSED_PUSHES = 2


def ring_slots(alg):
    """Rounds a buffer's ring keeps: a worker of SSD-SGD lands rounds up to max(S, k) behind the newest;
    compressed SSGD lands each round before the next."""
    return max(alg.max_staleness, alg.delay) if alg.type == "ssd" else 1


def ring_choice(comp, slots, size, topk_count, workers):
    """(kind, RingLayout) of one buffer's ring in one density stage: kind "sparse" (the exact round
    sums: up to `workers` pushes' values each), "compressed" (the servers' largest values of them,
    packed into two pushes' bytes: compression.downlink compressed, where the exact ring would be
    larger) or "dense" (no ring: the chosen ring would not be smaller than one pull of the dense
    weights)."""
    cap = min(workers * topk_count, size)
    kind, chosen = "sparse", RingLayout(slots, cap, size, use_bitmap(size, cap, comp.index_coding))  # fp32 ring
    if comp.downlink == "compressed":
        push = WireFormat.planned(size, topk_count, comp.fp16_values, comp.index_coding)
        words = COMPRESSED_PUSHES * push.bytes // 4 - RING_HEADER
        squeezed = RingLayout.packed(slots, size, words)
        if chosen.length > squeezed.length:
            kind, chosen = "compressed", squeezed
    return ("dense" if chosen.length >= size + 1 else kind), chosen


class Downlink:
    """Per buffer: its downlink plan (None: dense pulls only), its replica (a ps.rounds.BufferState
    made by `make_replica(size)`), its ring pull buffers, and what its last pull was: the density stage
    whose ring it pulled, or None for the dense weights (`pulled`). `transport`: the RoundTransport that
    pulls; `stats`: the client's run statistics, which get the decisions and counters."""

    def __init__(self, transport, stats, slots, steps_per_epoch, comp=None, make_replica=None):
        self.transport = transport
        self.stats = stats
        self.steps_per_epoch = steps_per_epoch
        self.stages = transport.stages
        n = len(transport.buffers)
        self.plans, self.replicas, self.ring_bufs, self.pulled = [None] * n, [None] * n, [None] * n, [None] * n
        if comp is None or comp.downlink not in RING_DOWNLINKS:
            return
        decisions = self._plan(slots, comp, make_replica)
        self.stats.update(downlink=decisions, downlink_resyncs=0, downlink_checks=0)
        if transport.kv.rank == 0:
            for d in decisions:
                stage = f", density stage {d['stage']}" if len(self.stages) > 1 else ""
                print(f"downlink: buffer {d['buffer']}{stage}: {d['downlink']} (ring of {d['slots']} rounds, "
                      f"{d['ring_bytes']} bytes a pull with an index {d['indices']}, against "
                      f"{d['dense_bytes']} for the dense weights)", flush=True)

    def _plan(self, slots, comp, make_replica):
        kv, buffers = self.transport.kv, self.transport.buffers
        # Fresh keys after every key of every density stage, so no existing key moves.
        used = max(max(b.weight_key, b.mailbox_key, b.clock_key) for bufs, _ in self.stages for b in bufs)
        keys = KeyAllocator(num_servers(kv), start=used + 1)
        first_rounds = [stage * (self.steps_per_epoch or 0) for stage in range(len(self.stages))]
        decisions = []
        for bi, b in enumerate(buffers):
            rings = []
            for stage, (bufs, _) in enumerate(self.stages):
                kind, layout = ring_choice(comp, slots, b.size, bufs[bi].topk_count, kv.num_workers)
                decisions.append({"buffer": bi, "stage": stage, "downlink": kind, "slots": slots,
                                  "slot_bytes": 4 * layout.slot_length, "ring_bytes": 4 * layout.length,
                                  "dense_bytes": 4 * (b.size + 1), "indices": layout.index_coding})
                rings.append(None if kind == "dense" else
                             {"key": keys.on(b.server), "cap": layout.cap, "bitmap": layout.bitmap,
                              "packed_words": layout.packed_words})
            if not any(rings):
                continue
            self.plans[bi] = {"rings": rings, "first_rounds": first_rounds, "mom_key": keys.on(b.server),
                              "slots": slots, "check_every": comp.downlink_check_every}
            self.replicas[bi] = make_replica(b.size)
            self.ring_bufs[bi] = [ring_zeros(b.size, self.plans[bi], r) if r else None for r in rings]
        return decisions

    def keys(self, bi):
        """[(key, length)] of buffer bi's ring keys and momentum key, for kv.init and the bind pushes."""
        down, size = self.plans[bi], self.transport.buffers[bi].size
        if down is None:
            return []
        return ([(ring["key"], RingLayout.of_plan(size, down, ring).length) for ring in filter(None, down["rings"])]
                + [(down["mom_key"], size + 1)])

    def ring_for(self, bi, rnd):
        """The density stage whose ring carries round `rnd` of buffer bi, or None when that round is
        to be pulled dense (no sparse downlink, or that stage's ring would not be smaller)."""
        down = self.plans[bi]
        if down is None:
            return None
        stage = density_stage(rnd, self.steps_per_epoch, len(self.stages))
        return stage if down["rings"][stage] is not None else None

    def pull(self, bi, rnd):
        """Issue the pull of buffer bi that brings round `rnd`: its stage's ring, or the dense weights."""
        stage = self.ring_for(bi, rnd)
        if stage is None:
            self.transport.pull_weights(bi)
        else:
            b = self.transport.buffers[bi]
            self.transport.pull(self.plans[bi]["rings"][stage]["key"], self.ring_bufs[bi][stage],
                                priority=-b.params[-1])
        self.pulled[bi] = stage

    def in_flight(self):
        """The arrays the last pull of every buffer writes into."""
        return [self.transport.pull_bufs[bi] if stage is None else self.ring_bufs[bi][stage]
                for bi, stage in enumerate(self.pulled)]

    def land(self, bi):
        """A landed ring pull of buffer bi: apply every round newer than the replica's version, in
        order (or rebuild the replica from the dense state if a round it needs has left the ring or
        did not fit its slot); returns the replica. None when the last pull was of the dense weights.
        Rounds that carry the servers' checksum (every downlink_check_every-th) are checked on the
        way (rounds.catch_up)."""
        stage = self.pulled[bi]
        if stage is None:
            return None
        b, down, rep = self.transport.buffers[bi], self.plans[bi], self.replicas[bi]
        ring = down["rings"][stage]
        rounds = read_ring(self.ring_bufs[bi][stage].asnumpy(), RingLayout.of_plan(b.size, down, ring),
                           from_round=rep.version)                                          # waits
        try:
            caught_up = rep.catch_up(rounds)
        except ReplicaMismatch as e:
            raise RuntimeError(f"downlink: buffer {bi} (keys {b.weight_key}/{ring['key']}): {e}") from None
        if not caught_up:
            self.resync(bi)
        self.stats["downlink_checks"] = sum(r.checks for r in self.replicas if r is not None)
        return rep

    def resync(self, bi):
        """Rebuild buffer bi's replica from the servers' dense state (weights and momentum, both
        with their version; pulled again if a round was applied in between). Blocking."""
        b, down = self.transport.buffers[bi], self.plans[bi]
        w, m = mx.nd.zeros(b.size + 1), mx.nd.zeros(b.size + 1)
        for _ in range(100):
            self.transport.pull(b.weight_key, w)
            self.transport.pull(down["mom_key"], m)
            wn, mn = w.asnumpy(), m.asnumpy()
            if wn[-1] == mn[-1]:
                rep = self.replicas[bi]
                rep.bind(wn[:-1], version=int(wn[-1]))
                rep.mom = mn[:-1].copy()
                self.stats["downlink_resyncs"] += 1
                return rep
        raise RuntimeError(f"downlink: buffer {bi}: weights and momentum never came at the same version")

    def state(self):
        """(arrays, meta) of the replicas and the ring pulls in flight, for the worker's checkpoint."""
        arrays = {}
        for bi, rep in enumerate(self.replicas):
            if rep is not None and rep.weights is not None:
                arrays.update({f"replica_w{bi}": rep.weights, f"replica_mom{bi}": rep.mom})
                if self.pulled[bi] is not None:
                    arrays[f"ringbuf{bi}"] = self.ring_bufs[bi][self.pulled[bi]].asnumpy()
        meta = {"pulled_rings": self.pulled,
                "replica_versions": [None if r is None or r.weights is None else r.version for r in self.replicas]}
        return arrays, meta

    def load_state(self, arrays, meta):
        """The inverse of state(). A checkpoint without replicas (taken with the dense downlink) leaves
        them unbound: the first ring refresh then rebuilds them from the servers' dense state."""
        self.pulled = list(meta["pulled_rings"])
        for bi, (rep, v) in enumerate(zip(self.replicas, meta["replica_versions"])):
            if rep is None:
                self.pulled[bi] = None
            elif v is not None and f"replica_w{bi}" in arrays:
                rep.bind(arrays[f"replica_w{bi}"], version=v)
                rep.mom = np.asarray(arrays[f"replica_mom{bi}"], np.float32).copy()
            if self.pulled[bi] is not None:
                if rep.weights is None or f"ringbuf{bi}" not in arrays:
                    raise ValueError(f"checkpoint: buffer {bi} has a ring pull in flight but no replica")
                self.ring_bufs[bi][self.pulled[bi]][:] = arrays[f"ringbuf{bi}"]
