"""Baselines on MXNet's stock KVStore: SSGD (dist_sync) and ASGD (dist_async), optionally 2-bit.

Per step and per parameter: push the gradient, pull the weights, highest priority for the first
layers (needed first by the next forward). The servers run MXNet's own momentum SGD, built from a
signed `stock_optimizer` command (data, not a pickle) with rescale_grad = 1/(N*B): in dist_sync the
server sums the N gradients of a round before one update; in dist_async every push is applied on
its own, so N pushes of g/(N*B) make one synchronous step's worth of progress.

The parameters' keys are chosen so that each lands on the least-loaded server (ssdsgd.ps.keys.balanced_keys).
"""
import os

import mxnet as mx

from ssdsgd.algorithms.base import Client, StepRecord
from ssdsgd.compression.registry import NATIVE_2BIT
from ssdsgd.env import BIGARRAY_BOUND_ENV
from ssdsgd.errors import CheckpointError
from ssdsgd.ps import commands
from ssdsgd.ps.keys import MXNET_BIGARRAY_BOUND, balanced_keys


class StockClient(Client):
    def __init__(self, kv, params, cfg, schedule, log, total_steps=None, measure_backward=None,
                 steps_per_epoch=None):
        super().__init__(kv, params, cfg, schedule, log)
        bound = int(os.environ.get(BIGARRAY_BOUND_ENV, MXNET_BIGARRAY_BOUND))
        self.keys = balanced_keys([p.data().size for p in params], commands.num_servers(kv), bound)
        self.two_bit = cfg.compression.type == NATIVE_2BIT
        n = sum(p.data().size for p in params)
        # 2-bit packs 16 gradient values into one float32 on the wire (MXNet's GradientCompression).
        self.push_bytes_per_step = sum(-(-p.data().size // 16) * 4 for p in params) if self.two_bit else 4 * n
        self.pull_bytes_per_step = 4 * n
        self.staleness = 0 if cfg.algorithm.type == "ssgd" else None     # dist_async: not tracked

    @classmethod
    def kvstore_type(cls, cfg):
        return "dist_sync" if cfg.algorithm.type == "ssgd" else "dist_async"

    def setup(self, resume_dir=None, saved_meta=None, saved_plan=None):     # saved_*: unused here
        """On resume the parameters hold the checkpoint's weights (rank 0's become the servers'),
        and the servers reload their optimizer state."""
        kv, cfg = self.kv, self.cfg
        if resume_dir and saved_plan is not None:
            # The servers saved their optimizer state by key: resume on the checkpoint's keys (their
            # form is checked with the manifest, in checkpoint.py; the count needs the model).
            saved = saved_plan["keys"]
            if len(saved) != len(self.params):
                raise CheckpointError(f"{resume_dir}: plan keys: {len(saved)} keys for {len(self.params)} "
                                      f"parameters; resume refused")
            self.keys = saved
        if self.two_bit:
            kv.set_gradient_compression({"type": NATIVE_2BIT, "threshold": cfg.compression.threshold})
        if kv.rank == 0:
            commands.send(
                kv, commands.STOCK_OPTIMIZER, lr=cfg.train.lr, momentum=cfg.train.momentum,
                wd=cfg.train.wd, rescale_grad=1.0 / (kv.num_workers * cfg.train.batch_size),
                schedule=self.schedule.to_dict())
        # Only rank 0's values count; kv.init ends with a barrier, so the optimizer is in place
        # before any worker pushes. Copies, not the parameter arrays: arrays an inference-mode forward
        # left in oneDNN layouts cannot be read by kv.init (see build_net in worker.py).
        kv.init(self.keys, [p.data().copy() for p in self.params])
        if resume_dir and kv.rank == 0:
            commands.send(kv, commands.LOAD, dir=resume_dir)
        kv._barrier()
        kv.pull(self.keys, out=[p.data() for p in self.params])
        mx.nd.waitall()

    def after_backward(self, step):
        for i, p in zip(self.keys, self.params):
            self.kv.push(i, p.grad(), priority=-i)
            self.kv.pull(i, out=p.data(), priority=-i)
        return StepRecord(self.push_bytes_per_step, self.pull_bytes_per_step, self.staleness)

    def plan_record(self):
        return dict(super().plan_record(), keys=self.keys)

    def global_weights(self, steps_done):
        """The weights to evaluate: after the step's pulls, the parameters are the global ones."""
        mx.nd.waitall()
        return None, 0

    # state/load_state: nothing beyond the parameters (the servers save the optimizer state);
    # residual_norm: None, MXNet keeps the 2-bit residual inside the C++ KVStore.
