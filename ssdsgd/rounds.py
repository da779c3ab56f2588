"""The global update of SSD-SGD as the servers run it, in plain numpy (no mxnet: unit-testable).

One `BufferState` per fused buffer that lives on this server. Workers push one mailbox message per
buffer per step: [round, rank, payload...], laid out as ssdsgd.compression.codec describes (one
format per density stage of the compression warm-up, each with its own mailbox key). The payload is
decoded and added into that round's accumulator: a dense payload with one array add, a sparse one
scattered in at its indices, so a sparse message costs O(k), not O(size). Once all N workers'
contributions for a round are in, and every earlier round has been applied, the round is applied:

    G_t = sum_i g_i;   v <- mu*v - eta_g(t) * (G_t/(N*B) + lambda*w);   w <- w + v

which is MXNet's sgd_mom_update on the summed gradient, so a run that stays synchronous reproduces
the stock dist_sync baseline. Rounds may arrive in any order and a fast worker may be several rounds
ahead; their accumulators wait in `pending` until they can be applied in order.
"""
import numpy as np

from ssdsgd.compression.codec import SparseGrad
from ssdsgd.schedule import LRSchedule

class RoundError(RuntimeError):
    pass


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
        self.formats = formats        # codec.MailboxFormat per density stage
        self.weights = None           # np.float32 (size,), set by bind()
        self.mom = np.zeros(size, np.float32)
        self.version = 0              # number of rounds applied
        self.pending = {}             # round -> [sum array, set of ranks]

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
            entry = self.pending[rnd] = [np.zeros(self.size, np.float32), set()]
        if rank in entry[1]:
            raise RoundError(f"rank {rank} pushed round {rnd} twice")
        if isinstance(grad, SparseGrad):
            grad.add_to(entry[0])         # scatter-add: O(values sent)
        else:
            entry[0] += grad
        entry[1].add(rank)
        applied = 0
        while self.version in self.pending and len(self.pending[self.version][1]) == self.num_workers:
            grad_sum, _ = self.pending.pop(self.version)
            self.apply(grad_sum)
            applied += 1
        return applied

    def apply(self, grad_sum):
        lr = np.float32(self.schedule(self.version + 1))     # MXNet counts updates from 1
        self.mom *= np.float32(self.momentum if self.version < self.warmup else self.delay_momentum)
        self.mom -= lr * (grad_sum * np.float32(self.scale) + np.float32(self.wd) * self.weights)
        self.weights += self.mom
        self.version += 1

    def state_dict(self):
        return {"weights": self.weights, "mom": self.mom, "version": self.version,
                "pending": {r: (s, sorted(ranks)) for r, (s, ranks) in self.pending.items()}}

    def load_state_dict(self, d):
        self.weights = np.asarray(d["weights"], np.float32).copy()
        self.mom = np.asarray(d["mom"], np.float32).copy()
        self.version = int(d["version"])
        self.pending = {int(r): [np.asarray(s, np.float32).copy(), set(ranks)]
                        for r, (s, ranks) in d["pending"].items()}


def schedule_from_dict(d):
    return LRSchedule(**d)
