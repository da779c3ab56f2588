"""Round-based client: SSD-SGD (warm-up, then steps delay with GLU) and compressed SSGD.

Three parts: when to push, wait, pull and land is the step policy (policy.py, pure); the keys, pull
buffers and clock polls are the round transport (transport.py); the sparse downlink's replica of the
servers' state is downlink.py. This module ties them together with the local optimizer (glu.py), the
encoders (ssdsgd.compression) and the checkpoint state.
"""
import time
from typing import NamedTuple

import mxnet as mx

from ssdsgd.algorithms.base import Client, StepRecord
from ssdsgd.algorithms.downlink import Downlink, ring_slots
from ssdsgd.algorithms.glu import GLU, GlobalMomentum, LocalSGD
from ssdsgd.algorithms.policy import StepPolicy
from ssdsgd.algorithms.probe import probe_costs
from ssdsgd.algorithms.transport import PullWatch, RoundTransport
from ssdsgd.compression.codec import MAX_ROUND_FP16
from ssdsgd.compression.encoders import make_stages, time_encoding
from ssdsgd.compression.flatviews import FlatBuffer, FlatViews
from ssdsgd.compression.fusion import describe_sizes
from ssdsgd.compression.registry import is_sparsifier
from ssdsgd.config import ssd_warmup_steps
from ssdsgd.env import BIGARRAY_BOUND_ENV
from ssdsgd.checkpoint import costs_problem, plan_problem
from ssdsgd.errors import CheckpointError
from ssdsgd.ps.commands import num_servers
from ssdsgd.ps.keys import place_stages
from ssdsgd.ps.rounds import BufferState
from ssdsgd.schedule import LRSchedule, held_carry


class BufferViews(NamedTuple):
    """A buffer's arrays as flat views (ssdsgd.compression.flatviews), made once per buffer (_buffer_views)."""
    params: FlatViews             # the parameters' data
    states: object                # the local optimizer's state_views of their states (None: no state)
    pulled: FlatBuffer            # the pull buffer's weights (its last element, the version, left out)
    staged: FlatBuffer            # the staging buffer (a replica's weights)
    made_of: list                 # the parameters' arrays, states, pull and staging buffers, in that order


class RoundClient(Client):
    def __init__(self, kv, params, cfg, schedule, log, total_steps, measure_backward=None,
                 steps_per_epoch=None):
        super().__init__(kv, params, cfg, schedule, log)
        alg = cfg.algorithm
        self.synchronous = alg.type == "ssgd"
        warmup = total_steps if self.synchronous else ssd_warmup_steps(alg, steps_per_epoch)
        self.policy = StepPolicy(warmup, alg.delay, alg.max_staleness, alg.strict)
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
        # ... and its own learning rate (algorithm.lr, at most algorithm.lr_cap): the servers' and the
        # local update's schedules are scaled by it from the first delay-stage step on.
        self.delay_lr_factor = 1.0 if alg.lr is None else alg.lr / cfg.train.lr
        # DGC momentum correction moves the gradients' momentum to the workers; the servers then run
        # plain SGD.
        mc = cfg.compression.momentum_correction
        self.server_momentum = 0.0 if mc else cfg.train.momentum
        self.server_delay_momentum = 0.0 if mc else self.delay_momentum
        self.transport = self.downlink = None       # made in _plan() (the plan may need a link probe)
        self.buffers = self.encoders = None         # the steady state's
        self.memory = None                          # the encoders' error-feedback memory, if any
        self.stages = None                          # (buffers, encoders) per density stage
        self.versions = []                          # version of the global weights under w_loc
        self.pending_pull = None                    # step at which the in-flight pull was issued
        self.watch = None                           # tells when that pull has landed
        self.local_opt, self.local_states = self._make_local_optimizer(total_steps)
        # A round awaited longer than the server timeout is reported once per wait (RoundTransport.poll_clock).
        self.wait_note = cfg.cluster.server_timeout or None

    @property
    def warmup(self):
        return self.policy.warmup

    # ---- setup -------------------------------------------------------------------------------
    def _make_local_optimizer(self, total_steps):
        alg, train = self.cfg.algorithm, self.cfg.train
        scale = 1.0 / (self.kv.num_workers * train.batch_size)
        local_sched = self.schedule.scaled(alg.local.lr / train.lr if alg.local.lr
                                           else alg.local.lr_scale * self.delay_lr_factor)
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
        """Buffers, encoders, transport and downlink. A resumed run plans from the costs its checkpoint
        recorded, so it gets the plan the servers saved, whatever the link and the load are now."""
        comp, kv = self.cfg.compression, self.kv
        cost = None
        if comp.buffers == "cost_model":
            cost = saved_cost or probe_costs(kv, self.measure_backward, sum(p.data().size for p in self.params))
            self.stats["cost_model"] = cost
        shapes = [p.shape for p in self.params]
        self.stages = make_stages(shapes, num_servers(kv), comp, kv.rank, momentum=self.cfg.train.momentum,
                                  cost=cost, seed=self.cfg.seed)
        place_stages([bufs for bufs, _ in self.stages], num_servers(kv))
        self.buffers, self.encoders = self.stages[-1]          # the steady state
        self.memory = self.encoders[0].memory                   # error feedback, shared by every encoder
        if comp.fusion == "behind" and is_sparsifier(comp.type) and all(len(b.params) == 1 for b in self.buffers):
            raise ValueError(f"compression.fusion: behind over {len(self.buffers)} buffers of one tensor each "
                             f"is sparsification ahead of fusion under another name; use compression.buffers: "
                             f"one or fixed (a global top-k per buffer), or fusion: ahead")
        total = sum(b.size for b in self.buffers)
        self.stats.update(buffers=len(self.buffers), buffer_sizes=[b.size for b in self.buffers],
                          density_sent=sum(b.topk_count for b in self.buffers) / total)
        if len(self.stages) > 1:
            self.stats["warmup_density_sent"] = [sum(b.topk_count for b in bufs) / total
                                                 for bufs, _ in self.stages[:-1]]
        if is_sparsifier(comp.type):
            self.stats["compress_seconds_per_step"] = time_encoding(self.buffers, self.encoders, shapes)
        self.transport = RoundTransport(kv, self.stages, self.steps_per_epoch, self.wait_note)
        self.staging = [mx.nd.zeros(b.size) for b in self.buffers]   # a replica's weights, on their way in
        self.views = [None] * len(self.buffers)                     # see _buffer_views
        self.versions = [0] * len(self.buffers)
        self.downlink = Downlink(self.transport, self.stats, ring_slots(self.cfg.algorithm), self.steps_per_epoch,
                                 comp, self._replica)

    def _replica(self, size):
        """A worker-side copy of a buffer's server state (the sparse downlink's replica)."""
        train = self.cfg.train
        return BufferState(size, self.kv.num_workers, train.batch_size, self.server_momentum, train.wd,
                           LRSchedule.from_dict(self.schedule.to_dict()), [], self.server_delay_momentum,
                           self.warmup, self.delay_lr_factor)

    def plan_record(self):
        """What the checkpoint manifest records of the servers' layout (ssdsgd/checkpoint.py)."""
        return dict(super().plan_record(), buffer_sizes=[b.size for b in self.buffers],
                    cost_model=self.stats.get("cost_model"))

    def setup(self, resume_dir=None, saved_meta=None, saved_plan=None):
        """Plan, install the plan on the servers, initialise and bind the keys, get the weights.

        On resume the plan is made from the costs the checkpoint recorded (never measured again) and
        must be the checkpoint's plan (saved_plan, from the manifest) before anything reaches the
        servers; the servers load their buffers from the checkpoint and the parameters already hold
        this worker's saved local weights (see load_state), so nothing is pulled here."""
        kv, train = self.kv, self.cfg.train
        saved_meta = saved_meta or {}
        if resume_dir:
            self._refuse(resume_dir, costs_problem(self.cfg, saved_meta.get("cost_model"), "the checkpoint"))
        self._plan(saved_cost=saved_meta.get("cost_model"))
        sizes = [b.size for b in self.buffers]
        if resume_dir and saved_plan is not None:
            self._refuse(resume_dir, plan_problem(saved_plan.get("buffer_sizes"), sizes))
        if kv.rank == 0:
            print(f"buffer plan ({self.cfg.compression.buffers}): {describe_sizes(sizes)}"
                  + (f", from costs {self.stats['cost_model']}" if "cost_model" in self.stats else ""), flush=True)
        per_buffer = list(zip(*[bufs for bufs, _ in self.stages]))     # buffer -> itself per stage
        plan = dict(num_workers=kv.num_workers, batch_size=train.batch_size,
                    momentum=self.server_momentum, delay_momentum=self.server_delay_momentum,
                    delay_lr_factor=self.delay_lr_factor, warmup=self.warmup, wd=train.wd,
                    schedule=self.schedule.to_dict(),
                    buffers=[dict(b.to_dict(list(stages)), downlink=down)
                             for b, stages, down in zip(self.buffers, per_buffer, self.downlink.plans)])
        self.transport.install(plan, self.params, [self.downlink.keys(bi) for bi in range(len(self.buffers))],
                               resume_dir)
        if not resume_dir:
            for bi in range(len(self.buffers)):
                if self.downlink.plans[bi]:
                    self.downlink.resync(bi)               # the replica: weights, momentum and version
                    self._refresh_from_replica(bi)
                else:
                    self.transport.pull_weights(bi)
                    self._apply_pull(bi)
        mx.nd.waitall()

    @staticmethod
    def _refuse(resume_dir, problem):
        if problem:
            raise CheckpointError(f"{resume_dir}: {problem}; resume refused")

    def state(self):
        """This worker's algorithm state for a checkpoint: (arrays, meta)."""
        arrays = {f"state{i}": s.asnumpy() for i, s in enumerate(self.local_states) if s is not None}
        arrays.update({f"pullbuf{bi}": buf.asnumpy() for bi, buf in enumerate(self.transport.pull_bufs)})
        down_arrays, down_meta = self.downlink.state()
        arrays.update(down_arrays)
        if self.memory is not None:
            arrays.update(self.memory.state_dict())
        meta = {"versions": self.versions, "pending_pull": self.pending_pull, **down_meta,
                "cost_model": self.stats.get("cost_model"),
                "tensor_counts": [[e.counts for e in encs] for _, encs in self.stages],
                "local_counts": {str(k): c for k, c in self.local_opt._index_update_count.items()},
                "local_num_update": self.local_opt.num_update}
        return arrays, meta

    def load_state(self, arrays, meta):
        # SSGD never takes a local step: its local optimizer is not part of the run (algorithm.local is
        # idle there, and a resume may change it), so its saved state is not read back.
        if not self.synchronous:
            for i, s in enumerate(self.local_states):
                if s is not None:
                    s[:] = arrays[f"state{i}"]
        for bi, buf in enumerate(self.transport.pull_bufs):
            buf[:] = arrays[f"pullbuf{bi}"]
        if self.memory is not None:
            self.memory.load_state_dict(arrays)
        for (_, encs), counts in zip(self.stages, meta.get("tensor_counts", [])):
            for e, c in zip(encs, counts):
                if c is not None:          # compression.allocation: gradient re-allocates them
                    e.counts = list(c)
        self.versions = list(meta["versions"])
        self.pending_pull = meta["pending_pull"]
        self.downlink.load_state(arrays, meta)
        self.watch = PullWatch([])         # the saved pull buffers have landed
        if not self.synchronous:
            self.local_opt._index_update_count = {int(k): c for k, c in meta["local_counts"].items()}
            self.local_opt.num_update = meta["local_num_update"]

    # ---- loading pulled weights into the parameters ------------------------------------------------
    def _refresh_from_replica(self, bi):
        """Copy the replica's weights into the parameters (and refresh the local optimizer, as a dense
        pull does); returns its version."""
        rep = self.downlink.replicas[bi]
        self.staging[bi][:] = rep.weights            # one host-to-NDArray copy of the buffer
        return self._set_buffer(bi, rep.version, from_replica=True)

    def _apply_pull(self, bi):
        """Copy a landed pull (ring or dense weights) into the parameters; returns its version."""
        if self.downlink.land(bi) is not None:
            return self._refresh_from_replica(bi)
        return self._set_buffer(bi, self.transport.pulled_version(bi), from_replica=False)  # waits

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
        b, pull_buf = self.buffers[bi], self.transport.pull_bufs[bi]
        states = [self.local_states[i] for i in b.params]
        made_of = [self.params[i].data() for i in b.params] + states + [pull_buf, self.staging[bi]]
        views = self.views[bi]
        if views is None or any(x is not y for x, y in zip(made_of, views.made_of)):
            params = FlatViews(made_of[:len(b.params)])
            views = self.views[bi] = BufferViews(
                params, self.local_opt.state_views(states),
                params.buffer(pull_buf[:b.size]), params.buffer(self.staging[bi]), made_of)
        return views

    def _wait_for_version(self, bi, version):
        """Wait until round `version - 1` is applied, then pull the weights into the parameters."""
        self.transport.poll_clock(bi, version)
        self.downlink.pull(bi, version - 1)
        got = self._apply_pull(bi)
        if got < version:
            raise RuntimeError(f"buffer {bi}: clock said version {version} but weights are version {got}")
        return got

    # ---- one step --------------------------------------------------------------------------------
    def after_backward(self, step):
        """One step as the policy plans it (policy.py): land, wait, local update, push, pull."""
        self.transport.pull_bytes = 0
        staleness = self.policy.staleness(step, self.versions)
        in_flight = self.pending_pull is not None
        plan = self.policy.plan(step, self.versions, in_flight, in_flight and self.watch.landed())
        grads = [p.grad() for p in self.params]
        if self.memory is not None:
            self.memory.set_carry(held_carry(self.schedule, step))
        if plan.synchronous:
            pushed = self.transport.push(step, grads)
            wait = self._wait_until(plan.oldest_version, range(len(self.buffers)))
            return self._record(pushed, staleness, wait)
        wait = 0.0
        if plan.land:
            t0 = time.perf_counter()
            self._land_pull()
            wait += time.perf_counter() - t0
        stale = self.policy.stale(self.versions, plan.oldest_version)
        if stale:
            waited = self._wait_until(plan.oldest_version, stale)
            wait += waited
            self.log.write(event="staleness_wait", step=step, need_version=plan.oldest_version,
                           seconds=round(waited, 6))
        self._local_update()
        self._delay_stage_correction()
        pushed = self.transport.push(step, grads)
        if plan.pull:
            wait += self._issue_pulls(step, plan.pull_waits)
        return self._record(pushed, staleness, wait)

    def _delay_stage_correction(self):
        """Momentum correction runs at the steps-delay stage's momentum (algorithm.momentum), also where
        the warm-up had none (train.momentum 0)."""
        if self.memory is not None and self.cfg.compression.momentum_correction:
            self.memory.momentum = self.delay_momentum

    def _wait_until(self, version, buffers):
        """Bring the given buffers to at least `version` (a blocking pull each); returns the seconds."""
        t0 = time.perf_counter()
        for bi in self._poll_order(buffers):
            self._wait_for_version(bi, version)
        return time.perf_counter() - t0

    def _poll_order(self, buffers):
        """The buffers in the order to wait on their clocks, rotated by this worker's rank: most of a
        wait's clock polls fall on the first buffer polled, so with the same first buffer for every
        worker its server would take more than its share of the polls; rotated, the workers' polls
        spread over the servers (measured: docs/design.md, "Speed past two workers and one server")."""
        buffers = list(buffers)
        first = self.kv.rank % len(buffers) if buffers else 0
        return buffers[first:] + buffers[:first]

    def _issue_pulls(self, step, after_round):
        """Pull every buffer, asynchronously; returns the seconds spent waiting for round `step` first
        (after_round: the pull must carry that round, see policy.py)."""
        t0 = time.perf_counter()
        if after_round:
            # Cheap clock polls until every worker's push of this round is in, as the stock dist_sync
            # push acknowledgement did in the original implementation; the weight pull itself still
            # overlaps the next step's compute.
            for bi in self._poll_order(range(len(self.buffers))):
                self.transport.poll_clock(bi, step + 1)
        waited = time.perf_counter() - t0 if after_round else 0.0
        for bi in range(len(self.buffers)):
            self.downlink.pull(bi, step)
        self.pending_pull = step
        self.watch = PullWatch(self.downlink.in_flight())
        return waited

    def _local_update(self):
        """This worker's own gradient into its local weights (the steps-delay stage). One operator per
        parameter: multi_sgd_mom_update would save a few calls, but it reads the learning rate with
        another parser than sgd_mom_update, so some rates (below 1e-4, late in a cosine schedule)
        would differ by a float32 ulp from the servers' rule."""
        for i, p in enumerate(self.params):
            self.local_opt.update(i, p.data(), p.grad(), self.local_states[i])

    def _land_pull(self):
        issued = self.pending_pull
        self.pending_pull = None
        for bi in range(len(self.buffers)):
            problem = self.policy.landed_version_problem(issued, self._apply_pull(bi))
            if problem:
                raise RuntimeError(problem)

    def _record(self, pushed, staleness, wait):
        return StepRecord(pushed, self.transport.pull_bytes, staleness, wait)

    def global_weights(self, steps_done):
        """Global weights after all workers' first `steps_done` rounds, per parameter (for eval).

        Pulled into fresh arrays, so the local weights and the GLU snapshots stay untouched."""
        self.transport.pull_bytes = 0
        out = self.transport.global_weights(steps_done, [p.shape for p in self.params])
        return out, self.transport.pull_bytes

    def residual_norm(self):
        """L2 norm of the error-feedback residuals (None without a sparsifier). Synchronises."""
        return self.memory.residual_norm() if self.memory is not None else None
