"""The contract between the training loop (ssdsgd/worker/loop.py) and a client (how one algorithm moves
gradients and weights between a worker and the servers).

Per job the worker calls, in order: kvstore_environment/kvstore_type (before the KVStore exists),
the constructor, setup(), load_state() when resuming, then per step after_backward(step) (which
returns a StepRecord), global_weights() for evaluation, state()/plan_record() for checkpoints,
residual_norm() for the log, finish() at the end; `stats` goes into the run summary.
"""
from dataclasses import dataclass
from typing import Optional

from ssdsgd.config import runner_of


@dataclass
class StepRecord:
    """What one step cost: the bytes of the arrays pushed and pulled, the staleness of the weights
    the step computed on (rounds missing; None when not tracked) and the seconds spent waiting for
    the servers (None when the client does not measure it)."""
    push_bytes: int
    pull_bytes: int
    staleness: Optional[int] = None
    wait_seconds: Optional[float] = None


class Client:
    """Base class of the clients, each registered by name with what it declares (ssdsgd.registry)."""

    def __init__(self, kv, params, cfg, schedule, log, total_steps=None, measure_backward=None,
                 steps_per_epoch=None):
        self.kv = kv
        self.params = params                 # the trainable parameters, in a fixed order
        self.cfg = cfg
        self.schedule = schedule             # the global learning-rate schedule (ssdsgd.schedule)
        self.log = log                       # MetricsLog
        self.stats = {}                      # what the run summary records of this client

    @classmethod
    def kvstore_type(cls, cfg):
        """The MXNet KVStore type this client runs on (a query: no side effects)."""
        raise NotImplementedError

    @classmethod
    def kvstore_environment(cls):
        """Environment variables mx.kv.create must see for this client."""
        return {}

    def setup(self, resume_dir=None, saved_meta=None, saved_plan=None):
        """Install the servers' side, initialise the keys, load the weights (or, resuming, have the
        servers load resume_dir; saved_meta/saved_plan: this worker's and the manifest's records)."""
        raise NotImplementedError

    def after_backward(self, step):
        """Push this step's gradients, pull and update the local weights; returns a StepRecord."""
        raise NotImplementedError

    def global_weights(self, steps_done):
        """(weights per parameter, or None when the parameters hold them; bytes pulled for them)."""
        raise NotImplementedError

    def plan_record(self):
        """What the checkpoint manifest records of the servers' layout (ssdsgd/checkpoint.py): the plan
        form the algorithm's entry declares, and what that form needs (a stock plan: "keys")."""
        return {"kind": runner_of(self.cfg).plan}

    def state(self):
        """This worker's algorithm state for a checkpoint: (arrays, meta)."""
        return {}, {}

    def load_state(self, arrays, meta):
        """The inverse of state(), after setup()."""

    def residual_norm(self):
        """L2 norm of the error-feedback residuals, or None when there are none to report."""
        return None

    def finish(self):
        import mxnet as mx
        mx.nd.waitall()
