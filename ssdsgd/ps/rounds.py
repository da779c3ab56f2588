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

Each applied round is published in the buffer's downlink ring (ssdsgd.ps.ring), if it has one. Under the
compressed downlink (a ring stage with a packed slot) the servers apply, and publish, not G_t
itself but its top-`cap` values after adding the servers' own error feedback (as DoubleSqueeze does),
rounded to the packed slot's one-byte values and cut to what fits its bytes (ssdsgd.ps.ring_packing):
C_t = pack(G_t + e_t), e_{t+1} = G_t + e_t - C_t. e stays in gradient units whatever
compression.rescale_held says: the decaying rate damps its stale sums (why: docs/design.md, "Held
values at their own step's learning rate"). The servers' weights are then
exactly what the workers' replicas rebuild from the published rounds; what the rounds have not yet
carried waits in e.
"""
import zlib

import numpy as np

from ssdsgd.compression.codec import SparseGrad
from ssdsgd.ps import ring_packing


APPLY_CHUNK = 1 << 16                 # elements per step of BufferState.apply (256 KiB of float32)


class RoundError(RuntimeError):
    pass


class ReplicaMismatch(RoundError):
    """A worker's replica of a buffer's server state is not the servers' (sparse downlink guard)."""


class BufferState:
    def __init__(self, size, num_workers, batch_size, momentum, wd, schedule, formats,
                 delay_momentum=None, warmup=0, delay_lr_factor=1.0):
        self.size = size
        self.num_workers = num_workers
        self.scale = 1.0 / (num_workers * batch_size)
        self.momentum = momentum
        # SSD-SGD's steps-delay stage (rounds >= warmup) runs with its own momentum and rate: see
        # docs/design.md, "The delay stage's rate".
        self.delay_momentum = momentum if delay_momentum is None else delay_momentum
        self.warmup = warmup
        self.delay_lr_factor = delay_lr_factor     # ... and its own rate (algorithm.lr / train.lr)
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
        self._scratch = None          # apply's two chunk-sized scratch arrays
        self._spare = []              # zeroed round arrays for the next rounds (_zeroed_round)
        self._carried = self._magnitude = None      # squeezed's reused arrays (compressed downlink)

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
            entry = self.pending[rnd] = [self._zeroed_round(), set(), {}]   # once per round, not per message
        if rank in entry[1]:
            raise RoundError(f"rank {rank} pushed round {rnd} twice")
        entry[1].add(rank)
        entry[2][rank] = grad
        self._add_in_rank_order(entry)
        applied = 0
        while self.version in self.pending and len(self.pending[self.version][1]) == self.num_workers \
                and not self.pending[self.version][2]:
            grad_sum = self.pending.pop(self.version)[0]
            carried, nonzero = self.squeezed(grad_sum)
            self.apply(carried, nonzero)
            if carried is not grad_sum:
                carried[nonzero] = 0.0                # zero again for the next compressed round
            grad_sum.fill(0.0)
            self._spare.append(grad_sum)
            applied += 1
        return applied

    def _zeroed_round(self):
        """A zeroed array of the buffer's size for a round's sum, from those given back once applied
        (zeroed again): fresh zeroed memory faults its pages in as the sums scatter into it."""
        return self._spare.pop() if self._spare else np.zeros(self.size, np.float32)

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
        if self._carried is None:     # the carried round (zeros between rounds) and its magnitudes
            self._carried, self._magnitude = np.zeros((2, self.size), np.float32)
        self.residual += grad_sum
        return ring_packing.take_round(self.residual, layout.cap, layout.packed_words, self.version,
                                       self._carried, self._magnitude)

    def apply(self, grad_sum, nonzero=None):
        """Apply one round's sum; `nonzero`: its non-zero indices, ascending, if known (no ring scan).
        mom <- mu*mom - lr*(grad_sum*scale + wd*weights); weights += mom, in chunks through two small
        scratch arrays: as whole-array expressions it allocated four buffer-sized temporaries a round,
        which at ResNet-50's size cost more than the arithmetic. Same float32 operations per element."""
        lr = self.schedule(self.version + 1)                 # MXNet counts updates from 1
        if self.version >= self.warmup:
            lr *= self.delay_lr_factor                       # (x 1.0 is exact: no cap, SSGD's rate)
        lr = np.float32(lr)
        mu = np.float32(self.momentum if self.version < self.warmup else self.delay_momentum)
        scale, wd = np.float32(self.scale), np.float32(self.wd)
        if self._scratch is None:
            self._scratch = np.empty((2, min(self.size, APPLY_CHUNK)), np.float32)
        for a in range(0, self.size, APPLY_CHUNK):
            b = min(a + APPLY_CHUNK, self.size)
            step, decay, mom = self._scratch[0, :b - a], self._scratch[1, :b - a], self.mom[a:b]
            mom *= mu
            np.multiply(grad_sum[a:b], scale, out=step)
            np.multiply(wd, self.weights[a:b], out=decay)
            step += decay
            step *= lr
            mom -= step
            self.weights[a:b] += mom
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
            grad_sum = self._zeroed_round()
            grad_sum[entry.indices] = entry.values
            self.apply(grad_sum)
            grad_sum[entry.indices] = 0.0             # zero again in O(values)
            self._spare.append(grad_sum)
            if entry.checksum is not None:
                mine = weights_checksum(self.weights)
                if mine != entry.checksum:
                    raise ReplicaMismatch(f"the replica of the global weights at version {self.version} "
                                          f"differs from the servers' (CRC-32 {mine:#010x}, servers' "
                                          f"{entry.checksum:#010x})")
                self.checks += 1
        return True


def weights_checksum(weights):
    """CRC-32 of a float32 array's bytes: equal for bit-identical arrays."""
    return zlib.crc32(np.ascontiguousarray(weights, np.float32).view(np.uint8))
