"""Round-based client: SSD-SGD (warm-up, then steps delay with GLU) and compressed SSGD.

Talks to the round service of ssdsgd.ps.server through three keys per fused buffer (see fusion.py):
  mailbox  every step: [round, rank, payload] (dense gradient, or sparse pieces from a compressor;
           one mailbox key per density stage when compression.warmup is set);
  weight   the global weights of the buffer plus their version (rounds applied) in the last slot;
  clock    the version alone, one float: polled cheaply while waiting for a round;
  with compression.downlink: sparse, more: per density stage, the ring of the last R rounds'
           aggregated sparse updates (ssdsgd.ps.rounds.DownlinkRing), pulled instead of the weights and
           applied to a replica of the buffer's server state, and the momentum (with its version)
           from which that replica is rebuilt when it cannot catch up from the ring.
The KVStore is dist_async, so a push is acknowledged as soon as the server has filed it and never
blocks on the other workers; the rounds are synchronous on the server side.

Per step t (after backward):
  warm-up (t < T_w): push, wait until round t is applied (version t+1), pull: plain synchronous SGD.
  delay stage:       land the in-flight pull if it has arrived (refresh local weights and the
                     GLU snapshot); if the next step would compute on weights more than S rounds
                     old, wait for the pull or for fresher weights (logged); local update with this
                     worker's gradient; push; every k steps issue an asynchronous pull that
                     overlaps the following steps' compute.
When S = k (the default) or in strict mode, a pull is issued only once the round it asks for is
applied (cheap clock polls), so every refresh carries exactly the round its pull was issued for (it
cannot be newer: this worker has not pushed the next round yet), and it is landed at the next step.
That is the bound the original implementation got from dist_sync's push acknowledgement, and it
makes runs reproducible step by step. With S > k the pull goes out at once, may carry an older
round, and may land up to S - k steps later: on a slow link the transfer then hides behind several
steps of compute instead of one.
"""
import threading
import time
from typing import NamedTuple

import mxnet as mx
import numpy as np

from ssdsgd.algorithms.base import Client, StepRecord
from ssdsgd.algorithms.glu import GLU, GlobalMomentum, LocalSGD
from ssdsgd.compression.codec import MAX_ROUND_FP16, use_bitmap
from ssdsgd.compression.encoders import flatten, local_clip_bound, make_stages, time_encoding
from ssdsgd.compression.flatviews import FlatBuffer, FlatViews
from ssdsgd.compression.fusion import KeyAllocator
from ssdsgd.compression.registry import is_sparsifier
from ssdsgd.config import ROUNDS, ssd_warmup_steps
from ssdsgd.env import BIGARRAY_BOUND_ENV
from ssdsgd.errors import CheckpointError
from ssdsgd.faults import cost_scale
from ssdsgd.ps import commands
from ssdsgd.ps.commands import num_servers
from ssdsgd.ps.rounds import BufferState, ReplicaMismatch, RingLayout, read_ring
from ssdsgd.schedule import LRSchedule


class BufferViews(NamedTuple):
    """A buffer's arrays as flat views (ssdsgd.compression.flatviews), made once per buffer (_buffer_views)."""
    params: FlatViews             # the parameters' data
    states: object                # the local optimizer's state_views of their states (None: no state)
    pulled: FlatBuffer            # the pull buffer's weights (its last element, the version, left out)
    staged: FlatBuffer            # the staging buffer (a replica's weights)
    made_of: list                 # the parameters' arrays, states, pull and staging buffers, in that order


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


def density_stage(step, steps_per_epoch, num_stages):
    """Index into RoundClient.stages for a step: epoch e < len(compression.warmup) is stage e, every
    later epoch the steady state (the last stage)."""
    if num_stages == 1:
        return 0
    return min(step // steps_per_epoch, num_stages - 1)


PROBE_KEYS = (1 << 20, (1 << 20) + 1, (1 << 20) + 2)   # far above any plan key


def probe_elements(num_params):
    """Size of the large probe: a quarter of the model, between 16 KB and 1 MB, so that measuring
    the link never costs more traffic than a few training steps do."""
    return int(min(1 << 18, max(1 << 12, num_params // 4)))


def probe_costs(kv, measure_backward, num_params, repeats=3):
    """alpha (s per message) and beta (s per byte) from timed pulls, plus the backward time.

    Every worker measures, then the measurements go through kv.init, where only rank 0's value
    counts, and are pulled back: all workers plan from identical numbers, hence identical plans."""
    small, big, shared = PROBE_KEYS
    n = probe_elements(num_params)
    kv.init([small, big], [mx.nd.zeros(1), mx.nd.zeros(n)])
    a, b = mx.nd.zeros(1), mx.nd.zeros(n)

    def timed(key, out):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            kv.pull(key, out=out)
            out.wait_to_read()
            times.append(time.perf_counter() - t0)
        return sorted(times)[repeats // 2]

    t_small, t_big = timed(small, a), timed(big, b)
    backward = measure_backward() if measure_backward else 0.0
    mine = mx.nd.array([t_small, max(t_big - t_small, 1e-12) / (4 * n), backward])
    kv.init(shared, mine)
    agreed = mx.nd.zeros(3)
    kv.pull(shared, out=agreed)
    alpha, beta, backward = (float(v) for v in agreed.asnumpy())
    cost = {"alpha": alpha, "beta": beta, "backward": backward}
    for name, factor in cost_scale().items():          # tests only: a link that looks different
        cost[name] *= factor
    return quantise_costs(cost)


def quantise_costs(cost, steps_per_octave=2):
    """Round each measured cost to a grid of 2**(1/steps_per_octave) (half-octaves by default).

    The timings vary by tens of percent from run to run on a shared machine; planned from the raw
    numbers, the same config got 22 to 65 buffers on one machine, so no two runs were comparable.
    On the grid, noise below ~19% either way cannot change the plan."""
    def q(x):
        return float(2.0 ** (round(np.log2(x) * steps_per_octave) / steps_per_octave)) if x > 0 else 0.0
    return {name: q(v) for name, v in cost.items()}


def _describe_plan(sizes):
    if not isinstance(sizes, list):
        return repr(sizes)
    return f"{len(sizes)} buffers of {', '.join(map(str, sizes[:12]))}{'...' if len(sizes) > 12 else ''} elements"


def ring_zeros(size, down, ring):
    """Zeros the length of a sparse-downlink ring key (`down`: a buffer's downlink plan, `ring`: one
    stage's ring in it): its init and bind values, and the worker's pull target."""
    return mx.nd.zeros(RingLayout.of_plan(size, down, ring).length)


class RoundClient(Client):
    kind = ROUNDS

    def __init__(self, kv, params, cfg, schedule, log, total_steps, measure_backward=None,
                 steps_per_epoch=None):
        super().__init__(kv, params, cfg, schedule, log)
        alg = cfg.algorithm
        self.synchronous = alg.type == "ssgd"
        self.warmup = total_steps if self.synchronous else ssd_warmup_steps(alg, steps_per_epoch)
        self.k = alg.delay
        self.S = alg.max_staleness
        self.strict = alg.strict
        self.measure_backward = measure_backward
        self.steps_per_epoch = steps_per_epoch      # density stages of compression.warmup are epochs
        if cfg.compression.warmup and not steps_per_epoch:
            raise ValueError("compression.warmup needs steps_per_epoch")
        if cfg.compression.fp16_values and total_steps - 1 > MAX_ROUND_FP16:
            raise ValueError(f"compression.fp16_values: this run has {total_steps} steps, but the fp16 wire "
                             f"header counts rounds up to {MAX_ROUND_FP16}; use float32 values")
        # The steps-delay stage may run with its own momentum (algorithm.momentum), on the servers,
        # in the local optimizer and in the compressor's momentum correction alike.
        self.delay_momentum = cfg.train.momentum if alg.momentum is None else alg.momentum
        # DGC momentum correction moves the gradients' momentum to the workers; the servers then run
        # plain SGD, or (compression.decay_momentum) keep a momentum for the weight decay only.
        mc = cfg.compression.momentum_correction
        self.decay_only = mc and cfg.compression.decay_momentum
        self.lookahead = cfg.compression.lookahead   # see _look_ahead
        self.server_momentum = 0.0 if mc and not self.decay_only else cfg.train.momentum
        self.server_delay_momentum = 0.0 if mc and not self.decay_only else self.delay_momentum
        self.buffers = self.encoders = None         # planned in setup() (may need a link probe)
        self.memory = None                          # the encoders' error-feedback memory, if any
        self.stages = None                          # (buffers, encoders) per density stage
        self.versions = []                          # version of the global weights under w_loc
        self.pending_pull = None                    # step at which the in-flight pull was issued
        self.watch = None                           # tells when that pull has landed
        self.local_opt, self.local_states = self._make_local_optimizer(total_steps)
        self.pull_bytes = 0
        self.downlink = []                          # per buffer: sparse downlink settings, or None
        self.replicas = []                          # per buffer: BufferState mirroring the server's
        self.pulled_ring = []                       # per buffer: the density stage whose ring the last pull
                                                    # issued was, None if it pulled the dense weights
        # A round awaited longer than the server timeout is reported once per wait, naming the server
        # that holds the buffer; the job goes on (a worker may just be behind; the stall timeout decides).
        self.wait_note = cfg.cluster.server_timeout or None

    # ---- setup -------------------------------------------------------------------------------
    def _make_local_optimizer(self, total_steps):
        alg, train = self.cfg.algorithm, self.cfg.train
        scale = 1.0 / (self.kv.num_workers * train.batch_size)
        local_sched = self.schedule.scaled(alg.local.lr / train.lr if alg.local.lr else alg.local.lr_scale)
        # The first local update is global step `warmup` (1-based count warmup + 1), so the local
        # schedule stays in step with the servers' (milestones, the end of a cosine).
        common = dict(learning_rate=local_sched.base_lr, wd=train.wd, rescale_grad=scale,
                      lr_scheduler=local_sched, begin_num_update=min(self.warmup, total_steps))
        if alg.local.optimizer == "glu":
            opt = GLU(c=alg.local.c, **common)
        elif alg.local.optimizer == "global_momentum":
            opt = GlobalMomentum(momentum=self.delay_momentum, **common)
        else:
            opt = LocalSGD(momentum=0.0, **common)
        states = [opt.create_state(i, p.data()) for i, p in enumerate(self.params)]
        return opt, states

    @classmethod
    def kvstore_type(cls, cfg):
        return "dist_async"

    @classmethod
    def kvstore_environment(cls):
        # Large buffers must reach one server whole (their keys were placed there on purpose).
        return {BIGARRAY_BOUND_ENV: str(1 << 30)}

    def _plan(self, saved_cost=None):
        """Buffers and encoders. A resumed run plans from the costs its checkpoint recorded, so it gets
        the plan the servers saved, whatever the link and the load are now."""
        comp, kv = self.cfg.compression, self.kv
        cost = None
        if comp.buffers == "cost_model":
            cost = saved_cost or probe_costs(kv, self.measure_backward, sum(p.data().size for p in self.params))
            self.stats["cost_model"] = cost
        shapes = [p.shape for p in self.params]
        clip = local_clip_bound(comp.clip_norm, self.cfg.train.batch_size, kv.num_workers)
        self.stages = make_stages(shapes, num_servers(kv), comp, kv.rank, momentum=self.cfg.train.momentum,
                                  cost=cost, seed=self.cfg.seed, clip=clip,
                                  lr_of=lambda step: self.schedule(step + 1))   # round r is update r + 1
        self.buffers, self.encoders = self.stages[-1]          # the steady state
        self.memory = self.encoders[0].memory                   # error feedback, shared by every encoder
        if comp.fusion == "behind" and is_sparsifier(comp.type) and all(len(b.params) == 1 for b in self.buffers):
            raise ValueError(f"compression.fusion: behind over {len(self.buffers)} buffers of one tensor each "
                             f"is sparsification ahead of fusion under another name; use compression.buffers: "
                             f"one or fixed (a global top-k per buffer), or fusion: ahead")
        total = sum(b.size for b in self.buffers)
        self.stats.update(buffers=len(self.buffers), buffer_sizes=[b.size for b in self.buffers],
                          density_sent=sum(b.k for b in self.buffers) / total)
        if len(self.stages) > 1:
            self.stats["warmup_density_sent"] = [sum(b.k for b in bufs) / total for bufs, _ in self.stages[:-1]]
        if is_sparsifier(comp.type):
            self.stats["compress_seconds_per_step"] = time_encoding(self.buffers, self.encoders, shapes)
        self.pull_bufs = [mx.nd.zeros(b.size + 1) for b in self.buffers]
        self.staging = [mx.nd.zeros(b.size) for b in self.buffers]   # a replica's weights, on their way in
        self.views = [None] * len(self.buffers)                     # see _buffer_views
        self.clock_bufs = [mx.nd.zeros(1) for b in self.buffers]
        self.versions = [0] * len(self.buffers)
        self._plan_downlink()

    def _plan_downlink(self):
        """compression.downlink: sparse. Per buffer and density stage, the server keeps the last R
        rounds' aggregated updates in a ring key: R = S (at least k; 1 for synchronous SGD, which
        pulls every round), each slot [round, count, checksum, N*k_b indices or the round's bitmap
        (compression.index_coding, whichever is smaller), N*k_b values] with k_b the values one worker
        sends per step in that stage (rounds.DownlinkRing). A stage's rounds are pulled from its ring only if
        one ring pull is smaller than one dense pull; the decisions are logged once (rank 0) and
        kept in the run's stats."""
        n = len(self.buffers)
        self.downlink, self.replicas = [None] * n, [None] * n
        self.pulled_ring = [None] * n
        self.ring_bufs = [None] * n
        if self.cfg.compression.downlink != "sparse":
            return
        kv, train = self.kv, self.cfg.train
        slots = 1 if self.synchronous else max(self.S, self.k)
        # Fresh keys after every key of every density stage, so no existing key moves.
        used = max(max(b.weight_key, b.mailbox_key, b.clock_key) for bufs, _ in self.stages for b in bufs)
        keys = KeyAllocator(num_servers(kv), start=used + 1)
        first_rounds = [stage * (self.steps_per_epoch or 0) for stage in range(len(self.stages))]
        decisions = []
        for bi, b in enumerate(self.buffers):
            rings = []
            for stage, (bufs, _) in enumerate(self.stages):
                cap = min(kv.num_workers * bufs[bi].k, b.size)
                bitmap = use_bitmap(b.size, cap, self.cfg.compression.index_coding)   # the ring is fp32
                layout = RingLayout(slots, cap, b.size, bitmap)
                ring_bytes, dense_bytes = 4 * layout.length, 4 * (b.size + 1)
                sparse = ring_bytes < dense_bytes
                decisions.append({"buffer": bi, "stage": stage, "downlink": "sparse" if sparse else "dense",
                                  "slots": slots, "slot_bytes": 4 * layout.slot_length,
                                  "ring_bytes": ring_bytes, "dense_bytes": dense_bytes,
                                  "indices": "bitmap" if bitmap else "list"})
                rings.append({"key": keys.on(b.server), "cap": cap, "bitmap": bitmap} if sparse else None)
            if not any(rings):
                continue
            self.downlink[bi] = {"rings": rings, "first_rounds": first_rounds, "mom_key": keys.on(b.server),
                                 "slots": slots, "check_every": self.cfg.compression.downlink_check_every}
            self.replicas[bi] = BufferState(
                b.size, kv.num_workers, train.batch_size, self.server_momentum, train.wd,
                LRSchedule.from_dict(self.schedule.to_dict()), [], self.server_delay_momentum, self.warmup,
                self.decay_only)
            self.ring_bufs[bi] = [ring_zeros(b.size, self.downlink[bi], r) if r else None for r in rings]
        self.stats["downlink"] = decisions
        self.stats["downlink_resyncs"] = 0
        self.stats["downlink_checks"] = 0
        if kv.rank == 0:
            for d in decisions:
                stage = f", density stage {d['stage']}" if len(self.stages) > 1 else ""
                print(f"downlink: buffer {d['buffer']}{stage}: {d['downlink']} (ring of {d['slots']} rounds, "
                      f"{d['ring_bytes']} bytes a pull with an index {d['indices']}, against "
                      f"{d['dense_bytes']} for the dense weights)", flush=True)

    def plan_record(self):
        """What the checkpoint manifest records of the servers' layout (ssdsgd/checkpoint.py)."""
        return {"kind": self.kind, "buffer_sizes": [b.size for b in self.buffers],
                "cost_model": self.stats.get("cost_model")}

    def setup(self, resume_dir=None, saved_meta=None, saved_plan=None):
        """Plan, install the plan on the servers, initialise and bind the keys, get the weights.

        On resume the plan is made from the costs the checkpoint recorded (never measured again) and
        must be the checkpoint's plan (saved_plan, from the manifest) before anything reaches the
        servers; the servers load their buffers from the checkpoint and the parameters already hold
        this worker's saved local weights (see load_state), so nothing is pulled here."""
        kv, train = self.kv, self.cfg.train
        saved_meta = saved_meta or {}
        if resume_dir and self.cfg.compression.buffers == "cost_model" and not saved_meta.get("cost_model"):
            raise CheckpointError(f"{resume_dir}: compression.buffers is cost_model but the checkpoint has no "
                                  f"recorded costs, so its buffer plan cannot be made again; resume refused")
        self._plan(saved_cost=saved_meta.get("cost_model"))
        if resume_dir and saved_plan is not None:
            mine = [b.size for b in self.buffers]
            if saved_plan.get("buffer_sizes") != mine:
                raise CheckpointError(
                    f"{resume_dir}: the checkpoint's buffer plan ({_describe_plan(saved_plan.get('buffer_sizes'))}) "
                    f"is not the plan this run makes from the same config and costs ({_describe_plan(mine)}); "
                    f"its server files cannot be served, resume refused")
        if kv.rank == 0:
            sizes = [b.size for b in self.buffers]
            print(f"buffer plan ({self.cfg.compression.buffers}): {len(sizes)} buffers of "
                  f"{', '.join(map(str, sizes)) if len(sizes) <= 12 else f'{min(sizes)}..{max(sizes)}'} elements"
                  + (f", from costs {self.stats['cost_model']}" if "cost_model" in self.stats else ""), flush=True)
        per_buffer = list(zip(*[bufs for bufs, _ in self.stages]))     # buffer -> itself per stage
        if kv.rank == 0:
            commands.send(
                kv, commands.ROUND_PLAN, num_workers=kv.num_workers, batch_size=train.batch_size,
                momentum=self.server_momentum, delay_momentum=self.server_delay_momentum,
                decay_only=self.decay_only, warmup=self.warmup, wd=train.wd, schedule=self.schedule.to_dict(),
                buffers=[dict(b.to_dict(list(stages)), downlink=down)
                         for b, stages, down in zip(self.buffers, per_buffer, self.downlink)])
        keys, vals = [], []
        for b, stages in zip(self.buffers, per_buffer):
            flat = flatten([self.params[i].data() for i in b.params])
            keys += [b.weight_key, b.clock_key]
            vals += [mx.nd.concat(flat, mx.nd.zeros(1), dim=0), mx.nd.zeros(1)]
            for sb in stages:
                keys.append(sb.mailbox_key)
                vals.append(mx.nd.zeros(sb.mailbox_len, dtype=sb.mailbox_dtype))
        for b, down in zip(self.buffers, self.downlink):
            if down:
                for ring in filter(None, down["rings"]):
                    keys.append(ring["key"])
                    vals.append(ring_zeros(b.size, down, ring))
                keys.append(down["mom_key"])
                vals.append(mx.nd.zeros(b.size + 1))
        kv.init(keys, vals)               # rank 0's values count; ends with a barrier
        if kv.rank == 0:
            # Bind pushes: hand the server's updater the stored weight and clock arrays once.
            for b, down in zip(self.buffers, self.downlink):
                kv.push(b.weight_key, mx.nd.zeros(b.size + 1))
                kv.push(b.clock_key, mx.nd.zeros(1))
                if down:
                    for ring in filter(None, down["rings"]):
                        kv.push(ring["key"], ring_zeros(b.size, down, ring))
                    kv.push(down["mom_key"], mx.nd.zeros(b.size + 1))
            mx.nd.waitall()
            if resume_dir:
                commands.send(kv, commands.LOAD, dir=resume_dir)
        kv._barrier()
        if not resume_dir:
            for bi in range(len(self.buffers)):
                if self.downlink[bi]:
                    self._resync(bi)               # the replica: weights, momentum and version
                    self._refresh_from_replica(bi)
                else:
                    self._pull_weights(bi)
                    self._apply_pull(bi)
        mx.nd.waitall()

    def state(self):
        """This worker's algorithm state for a checkpoint: (arrays, meta)."""
        arrays = {f"state{i}": s.asnumpy() for i, s in enumerate(self.local_states) if s is not None}
        arrays.update({f"pullbuf{bi}": buf.asnumpy() for bi, buf in enumerate(self.pull_bufs)})
        for bi, rep in enumerate(self.replicas):
            if rep is not None and rep.weights is not None:
                arrays.update({f"replica_w{bi}": rep.weights, f"replica_mom{bi}": rep.mom})
                if self.pulled_ring[bi] is not None:
                    arrays[f"ringbuf{bi}"] = self.ring_bufs[bi][self.pulled_ring[bi]].asnumpy()
        if self.memory is not None:
            arrays.update(self.memory.state_dict())
        meta = {"versions": self.versions, "pending_pull": self.pending_pull, "pulled_rings": self.pulled_ring,
                "replica_versions": [None if r is None or r.weights is None else r.version for r in self.replicas],
                "cost_model": self.stats.get("cost_model"),
                "tensor_counts": [[e.counts for e in encs] for _, encs in self.stages],
                "local_counts": {str(k): c for k, c in self.local_opt._index_update_count.items()},
                "local_num_update": self.local_opt.num_update}
        return arrays, meta

    def load_state(self, arrays, meta):
        for i, s in enumerate(self.local_states):
            if s is not None:
                s[:] = arrays[f"state{i}"]
        for bi, buf in enumerate(self.pull_bufs):
            buf[:] = arrays[f"pullbuf{bi}"]
        if self.memory is not None:
            self.memory.load_state_dict(arrays)
        for (_, encs), counts in zip(self.stages, meta.get("tensor_counts", [])):
            for e, c in zip(encs, counts):
                if c is not None:          # compression.allocation: gradient re-allocates them
                    e.counts = list(c)
        self.versions = list(meta["versions"])
        self.pending_pull = meta["pending_pull"]
        # Sparse downlink: the replica and the in-flight ring pull as saved. A checkpoint without
        # them (taken with the dense downlink) leaves the replica unbound: the first ring refresh
        # then rebuilds it from the servers' dense state.
        # Checkpoints from before the per-stage rings say only 'ring' or 'dense' per buffer ("pulled"),
        # and their ring was the steady stage's (the last).
        n = len(self.buffers)
        if "pulled_rings" in meta:
            self.pulled_ring = list(meta["pulled_rings"])
        else:
            steady = len(self.stages) - 1
            self.pulled_ring = [steady if p == "ring" else None for p in meta.get("pulled", ["dense"] * n)]
        for bi, (rep, v) in enumerate(zip(self.replicas, meta.get("replica_versions", [None] * n))):
            if rep is None:
                self.pulled_ring[bi] = None
            elif v is not None and f"replica_w{bi}" in arrays:
                rep.bind(arrays[f"replica_w{bi}"], version=v)
                rep.mom = np.asarray(arrays[f"replica_mom{bi}"], np.float32).copy()
            if self.pulled_ring[bi] is not None:
                if rep.weights is None or f"ringbuf{bi}" not in arrays:
                    raise ValueError(f"checkpoint: buffer {bi} has a ring pull in flight but no replica")
                self.ring_bufs[bi][self.pulled_ring[bi]][:] = arrays[f"ringbuf{bi}"]
        self.watch = PullWatch([])         # the saved pull buffers have landed
        self.local_opt._index_update_count = {int(k): c for k, c in meta["local_counts"].items()}
        self.local_opt.num_update = meta["local_num_update"]

    # ---- communication pieces ------------------------------------------------------------------
    def _ring_for(self, bi, rnd):
        """The density stage whose ring carries round `rnd` of buffer bi, or None when that round is
        to be pulled dense (no sparse downlink, or that stage's ring would not be smaller)."""
        down = self.downlink[bi]
        if down is None:
            return None
        stage = density_stage(rnd, self.steps_per_epoch, len(self.stages))
        return stage if down["rings"][stage] is not None else None

    def _pull_weights(self, bi, ring=None):
        """Issue the pull of buffer bi: the ring of density stage `ring`, or (None) the dense weights."""
        b = self.buffers[bi]
        if ring is not None:
            buf = self.ring_bufs[bi][ring]
            self.kv.pull(self.downlink[bi]["rings"][ring]["key"], out=buf, priority=-b.params[-1])
            self.pull_bytes += 4 * buf.size
        else:
            self.kv.pull(b.weight_key, out=self.pull_bufs[bi], priority=-b.params[-1])
            self.pull_bytes += 4 * (b.size + 1)
        self.pulled_ring[bi] = ring

    def _inflight(self):
        return [self.pull_bufs[bi] if self.pulled_ring[bi] is None else self.ring_bufs[bi][self.pulled_ring[bi]]
                for bi in range(len(self.buffers))]

    def _resync(self, bi):
        """Rebuild buffer bi's replica from the servers' dense state (weights and momentum, both
        with their version; pulled again if a round was applied in between). Blocking."""
        b, down = self.buffers[bi], self.downlink[bi]
        w, m = mx.nd.zeros(b.size + 1), mx.nd.zeros(b.size + 1)
        for _ in range(100):
            self.kv.pull(b.weight_key, out=w)
            self.kv.pull(down["mom_key"], out=m)
            self.pull_bytes += 8 * (b.size + 1)
            wn, mn = w.asnumpy(), m.asnumpy()
            if wn[-1] == mn[-1]:
                rep = self.replicas[bi]
                rep.bind(wn[:-1], version=int(wn[-1]))
                rep.mom = mn[:-1].copy()
                self.stats["downlink_resyncs"] += 1
                return
        raise RuntimeError(f"downlink: buffer {bi}: weights and momentum never came at the same version")

    def _refresh_from_replica(self, bi):
        """Copy the replica's weights into the parameters (and refresh the local optimizer, as a dense
        pull does); returns its version."""
        rep = self.replicas[bi]
        staging = self.staging[bi]
        staging[:] = rep.weights            # one host-to-NDArray copy of the buffer
        return self._set_buffer(bi, rep.version, from_replica=True)

    def _land_ring(self, bi):
        """A landed ring pull: apply every round newer than the replica's version, in order (or
        rebuild the replica from the dense state if a round it needs has left the ring or did not
        fit its slot), then refresh the parameters from it. Rounds that carry the servers'
        checksum (every downlink_check_every-th) are checked on the way (rounds.catch_up)."""
        b, down, rep, stage = self.buffers[bi], self.downlink[bi], self.replicas[bi], self.pulled_ring[bi]
        ring = down["rings"][stage]
        rounds = read_ring(self.ring_bufs[bi][stage].asnumpy(), RingLayout.of_plan(b.size, down, ring),
                           from_round=rep.version)                                          # waits
        try:
            caught_up = rep.catch_up(rounds)
        except ReplicaMismatch as e:
            raise RuntimeError(f"downlink: buffer {bi} (keys {b.weight_key}/{ring['key']}): {e}") from None
        if not caught_up:
            self._resync(bi)
        self.stats["downlink_checks"] = sum(r.checks for r in self.replicas if r is not None)
        return self._refresh_from_replica(bi)

    def _apply_pull(self, bi):
        """Copy a landed weight pull into the parameters; returns its version."""
        if self.pulled_ring[bi] is not None:
            return self._land_ring(bi)
        b, buf = self.buffers[bi], self.pull_bufs[bi]
        version = int(buf[b.size].asscalar())           # waits for the pull to land
        return self._set_buffer(bi, version, from_replica=False)

    def _set_buffer(self, bi, version, from_replica):
        """Load buffer bi's global weights at `version`, which are in its staging buffer (from_replica)
        or its pull buffer, into the parameters and refresh the local optimizer's state; returns
        the version."""
        views = self._buffer_views(bi)
        new = views.staged if from_replica else views.pulled
        views.params.copy_from(new)
        if views.states is not None:
            self.local_opt.refresh_buffer(views.states, new, version - self.versions[bi])
        self.versions[bi] = version
        return version

    def _buffer_views(self, bi):
        """Buffer bi's parameters, its local optimizer's states and the pieces of its pull and staging
        buffers as flat views (ssdsgd.compression.flatviews), made once; made again if any of those arrays was
        replaced (load_state and _plan write them in place, so this is a guard, not the usual case)."""
        b = self.buffers[bi]
        states = [self.local_states[i] for i in b.params]
        made_of = [self.params[i].data() for i in b.params] + states + [self.pull_bufs[bi], self.staging[bi]]
        views = self.views[bi]
        if views is None or any(x is not y for x, y in zip(made_of, views.made_of)):
            params = FlatViews(made_of[:len(b.params)])
            views = self.views[bi] = BufferViews(
                params, self.local_opt.state_views(states),
                params.buffer(self.pull_bufs[bi][:b.size]), params.buffer(self.staging[bi]), made_of)
        return views

    def _poll_clock(self, bi, version):
        """Poll the clock key until the buffer's global version is at least `version`."""
        b, clock = self.buffers[bi], self.clock_bufs[bi]
        delay = 0.0005
        start, noted = time.monotonic(), False
        while True:
            self.kv.pull(b.clock_key, out=clock)
            self.pull_bytes += 4
            if int(clock.asscalar()) >= version:
                return
            if not noted and self.wait_note and time.monotonic() - start > self.wait_note:
                print(f"rank {self.kv.rank}: waited {self.wait_note:g} s for round {version - 1} of buffer {bi}, "
                      f"held by server rank {b.server}: another worker is behind, or the connection to that "
                      f"server is lost", flush=True)
                noted = True
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _wait_for_version(self, bi, version, ring=None):
        """Wait until round `version - 1` is applied, then pull the weights into the parameters."""
        self._poll_clock(bi, version)
        self._pull_weights(bi, ring)
        got = self._apply_pull(bi)
        if got < version:
            raise RuntimeError(f"buffer {bi}: clock said version {version} but weights are version {got}")
        return got

    def _push(self, step):
        """Push this step's mailbox messages; returns the bytes of the arrays actually pushed."""
        pushed = 0
        buffers, encoders = self.stages[density_stage(step, self.steps_per_epoch, len(self.stages))]
        for b, enc in zip(buffers, encoders):
            grads = [self.params[i].grad() for i in b.params]
            msg = enc.message(grads, step, self.kv.rank)
            self.kv.push(b.mailbox_key, msg, priority=-b.params[-1])
            pushed += msg.size * np.dtype(msg.dtype).itemsize      # shape and dtype: no sync
        return pushed

    # ---- one step --------------------------------------------------------------------------------
    def after_backward(self, step):
        self.pull_bytes = 0
        staleness = step - min(self.versions)          # rounds missing from the weights just used
        wait = 0.0
        if step < self.warmup:
            pushed = self._push(step)
            t0 = time.perf_counter()
            for bi in range(len(self.buffers)):
                self._wait_for_version(bi, step + 1, self._ring_for(bi, step))
            wait += time.perf_counter() - t0
            self._look_ahead(step)
            return self._record(pushed, staleness, wait)

        pull_step = (step - self.warmup + 1) % self.k == 0
        need = step + 1 - self.S           # the next step may not compute on anything older
        if self.pending_pull is not None:
            # Land the in-flight pull once it has arrived; wait for it only when it is due: in strict
            # mode (always the next step), when the weights would get too stale, or when the next
            # pull is about to be issued into the same buffers.
            must = self.strict or min(self.versions) < need or pull_step
            if must or self.watch.landed():
                t0 = time.perf_counter()
                self._land_pull()
                wait += time.perf_counter() - t0
        stale = [bi for bi, v in enumerate(self.versions) if v < need]
        if stale:
            t0 = time.perf_counter()
            for bi in stale:
                self._wait_for_version(bi, need, self._ring_for(bi, need - 1))
            waited = time.perf_counter() - t0
            wait += waited
            self.log.write(event="staleness_wait", step=step, need_version=need, seconds=round(waited, 6))
        self._local_update()
        if self.memory is not None and self.memory.momentum:
            self.memory.momentum = self.delay_momentum      # momentum correction: the stage's momentum
        pushed = self._push(step)
        self._look_ahead(step)
        if (step - self.warmup + 1) % self.k == 0:
            if self.strict or self.S <= self.k:
                # The refresh must carry round `step` itself, or the weights it lands would be too
                # old before the next refresh. Wait (cheap clock polls) until every worker's push of
                # this round is in, as the stock dist_sync push acknowledgement did in the original
                # implementation; the weight pull itself still overlaps the next step's compute.
                t0 = time.perf_counter()
                for bi in range(len(self.buffers)):
                    self._poll_clock(bi, step + 1)
                wait += time.perf_counter() - t0
            for bi in range(len(self.buffers)):
                self._pull_weights(bi, self._ring_for(bi, step))
            self.pending_pull = step
            self.watch = PullWatch(self._inflight())
        return self._record(pushed, staleness, wait)

    def _local_update(self):
        """This worker's own gradient into its local weights (the steps-delay stage). One operator per
        parameter: multi_sgd_mom_update would save a few calls, but it reads the learning rate with
        another parser than sgd_mom_update, so some rates (below 1e-4, late in a cosine schedule)
        would differ by a float32 ulp from the servers' rule."""
        for i, p in enumerate(self.params):
            self.local_opt.update(i, p.data(), p.grad(), self.local_states[i])

    def _look_ahead(self, step):
        """compression.lookahead: move the weights the next gradient is computed on by what the
        held-back values will do once sent. Error feedback's virtual iterate, the weights minus
        every worker's residual at the servers' lr, follows plain (momentum) SGD exactly when the
        gradients are taken there (Stich & Karimireddy's analysis of error feedback); this worker
        knows only its own residual and stands it in for all N (the factor N of scale = 1/(N*B)
        cancels). The servers' weights, what is evaluated, are not changed."""
        if not self.lookahead:
            return
        factor = self.lookahead * self.schedule(step + 2) / self.cfg.train.batch_size   # next round's lr
        for b in self.buffers:
            behind = self.memory.residual.get(-1 - b.id)
            for i, off, n in zip(b.params, b.offsets, b.sizes):
                res = behind[off:off + n] if behind is not None else self.memory.residual.get(i)
                if res is not None:
                    p = self.params[i].data()
                    p -= mx.nd.array(res.reshape(p.shape), dtype=np.float32) * factor

    def _land_pull(self):
        issued = self.pending_pull
        self.pending_pull = None
        for bi in range(len(self.buffers)):
            got = self._apply_pull(bi)
            if self.strict and got != issued + 1:
                raise RuntimeError(f"strict mode: pull issued for version {issued + 1} got {got}")

    def _record(self, pushed, staleness, wait):
        return StepRecord(pushed, self.pull_bytes, staleness, wait)

    def global_weights(self, steps_done):
        """Global weights after all workers' first `steps_done` rounds, per parameter (for eval).

        Pulled into fresh arrays, so the local weights and the GLU snapshots stay untouched."""
        self.pull_bytes = 0
        out = [None] * len(self.params)
        for bi, b in enumerate(self.buffers):
            self._poll_clock(bi, steps_done)
            tmp = mx.nd.zeros(b.size + 1)
            self.kv.pull(b.weight_key, out=tmp)
            self.pull_bytes += 4 * (b.size + 1)
            for i, off, n in zip(b.params, b.offsets, b.sizes):
                out[i] = tmp[off:off + n].reshape(self.params[i].shape).copy()
        return out, self.pull_bytes

    def residual_norm(self):
        """L2 norm of the error-feedback residuals (None without a sparsifier). Synchronises."""
        return self.memory.residual_norm() if self.memory is not None else None
