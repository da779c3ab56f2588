"""The worker's side of the round service's keys (ssdsgd.ps.server.RoundService): installing a plan on
the servers, pushing mailbox messages, pulling weights and polling clocks.

Three keys per fused buffer (see ssdsgd.compression.fusion):
  mailbox  every step: [round, rank, payload] (dense gradient, or sparse pieces from a compressor;
           one mailbox key per density stage when compression.warmup is set);
  weight   the global weights of the buffer plus their version (rounds applied) in the last slot;
  clock    the version alone, one float: polled cheaply while waiting for a round.
(The sparse downlink adds its ring and momentum keys: ssdsgd.algorithms.downlink.)
The KVStore is dist_async, so a push is acknowledged as soon as the server has filed it and never
blocks on the other workers; the rounds are synchronous on the server side.
"""
import threading
import time

import mxnet as mx
import numpy as np

from ssdsgd.algorithms.policy import density_stage
from ssdsgd.compression.encoders import flatten
from ssdsgd.ps import commands


class PullWatch:
    """Tells, without blocking the training loop, whether pulled arrays have landed.

    MXNet has no non-blocking readiness query; a daemon thread waits on the arrays instead
    (wait_to_read releases the GIL inside the engine call)."""

    def __init__(self, arrays):
        self._landed = threading.Event()
        if not arrays:
            self._landed.set()
            return
        threading.Thread(target=self._wait, args=(list(arrays),), daemon=True).start()

    def _wait(self, arrays):
        for a in arrays:
            a.wait_to_read()
        self._landed.set()

    def landed(self):
        return self._landed.is_set()


class RoundTransport:
    """Pull buffers, clock buffers and the bytes pulled for one worker's plan (`stages`: (buffers,
    encoders) per density stage, the steady state last). `pull_bytes` counts every byte pulled since
    the caller last reset it."""

    def __init__(self, kv, stages, steps_per_epoch, wait_note=None):
        self.kv = kv
        self.stages = stages
        self.buffers = stages[-1][0]
        self.steps_per_epoch = steps_per_epoch
        # A round awaited longer than this is reported once per wait, naming the server that holds the
        # buffer; the job goes on (a worker may just be behind; the stall timeout decides).
        self.wait_note = wait_note
        self.pull_bufs = [mx.nd.zeros(b.size + 1) for b in self.buffers]
        self.clock_bufs = [mx.nd.zeros(1) for _ in self.buffers]
        self.pull_bytes = 0

    def pull(self, key, out, priority=0):
        self.kv.pull(key, out=out, priority=priority)
        self.pull_bytes += 4 * out.size

    def pull_weights(self, bi):
        """Issue the dense pull of buffer bi into its pull buffer (the version rides in the last slot)."""
        b = self.buffers[bi]
        self.pull(b.weight_key, self.pull_bufs[bi], priority=-b.params[-1])

    def pulled_version(self, bi):
        """The version of buffer bi's landed dense pull (waits for it to land)."""
        return int(self.pull_bufs[bi][self.buffers[bi].size].asscalar())

    def poll_clock(self, bi, version):
        """Poll the clock key until the buffer's global version is at least `version`."""
        b, clock = self.buffers[bi], self.clock_bufs[bi]
        delay = 0.0005
        start, noted = time.monotonic(), False
        while True:
            self.pull(b.clock_key, clock)
            if int(clock.asscalar()) >= version:
                return
            if not noted and self.wait_note and time.monotonic() - start > self.wait_note:
                print(f"rank {self.kv.rank}: waited {self.wait_note:g} s for round {version - 1} of buffer {bi}, "
                      f"held by server rank {b.server}: another worker is behind, or the connection to that "
                      f"server is lost", flush=True)
                noted = True
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def push(self, step, grads):
        """Push this step's mailbox messages (grads: the parameters' gradient arrays); returns the bytes
        of the arrays actually pushed."""
        pushed = 0
        buffers, encoders = self.stages[density_stage(step, self.steps_per_epoch, len(self.stages))]
        for b, enc in zip(buffers, encoders):
            msg = enc.message([grads[i] for i in b.params], step, self.kv.rank)
            self.kv.push(b.mailbox_key, msg, priority=-b.params[-1])
            pushed += msg.size * np.dtype(msg.dtype).itemsize      # shape and dtype: no sync
        return pushed

    def install(self, plan, params, extra_keys, resume_dir=None):
        """Install `plan` (the ROUND_PLAN command's fields, sent by rank 0), initialise every key (the
        weight keys from this worker's parameters; `extra_keys`: per buffer, [(key, length)] of its
        downlink's float32 keys), bind the stored arrays to the servers' updater, and on resume have
        the servers load their state."""
        kv = self.kv
        if kv.rank == 0:
            commands.send(kv, commands.ROUND_PLAN, **plan)
        keys, vals = [], []
        for bi, b in enumerate(self.buffers):
            flat = flatten([params[i].data() for i in b.params])
            keys += [b.weight_key, b.clock_key]
            vals += [mx.nd.concat(flat, mx.nd.zeros(1), dim=0), mx.nd.zeros(1)]
            for bufs, _ in self.stages:
                keys.append(bufs[bi].mailbox_key)
                vals.append(mx.nd.zeros(bufs[bi].wire.length, dtype=bufs[bi].wire.dtype))
        keys += [key for extra in extra_keys for key, _ in extra]
        vals += [mx.nd.zeros(n) for extra in extra_keys for _, n in extra]
        kv.init(keys, vals)               # rank 0's values count; ends with a barrier
        if kv.rank == 0:
            # Bind pushes: hand the server's updater the stored weight, clock (and downlink) arrays once.
            for b, extra in zip(self.buffers, extra_keys):
                kv.push(b.weight_key, mx.nd.zeros(b.size + 1))
                kv.push(b.clock_key, mx.nd.zeros(1))
                for key, n in extra:
                    kv.push(key, mx.nd.zeros(n))
            mx.nd.waitall()
            if resume_dir:
                commands.send(kv, commands.LOAD, dir=resume_dir)
        kv._barrier()

    def global_weights(self, steps_done, shapes):
        """The global weights after the first `steps_done` rounds, per parameter (fresh arrays)."""
        out = [None] * len(shapes)
        for bi, b in enumerate(self.buffers):
            self.poll_clock(bi, steps_done)
            tmp = mx.nd.zeros(b.size + 1)
            self.pull(b.weight_key, tmp)
            for i, off, n in zip(b.params, b.offsets, b.sizes):
                out[i] = tmp[off:off + n].reshape(shapes[i]).copy()
        return out
