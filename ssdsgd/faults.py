"""Fault injection for tests, driven by SSDSGD_TEST_FAULT="<kind>:<rank>:<value>".

  raise:<rank>:<step>     the worker of that rank raises at that step (a crashing worker)
  slow:<rank>:<seconds>   the worker of that rank sleeps that long every step (a straggler)
  nan:<rank>:<step>       that worker's batch at that step is NaN (a numerical fault)
  finish:<rank>:0         the worker of that rank raises as it finishes, after the last checkpoint and
                          before the summary, if it trained a step in this process (so a restarted
                          attempt, which has nothing left to train, does not fail again)
  pickle:<rank>:<step>    that worker sends the servers an unsigned pickled command at that step,
                          as a stranger reaching the server port could; the payload, if ever
                          unpickled, creates the file named by SSDSGD_TEST_PICKLE_MARKER
Unset in normal runs; the worker reads it once.

SSDSGD_TEST_COST_SCALE="alpha=1e-6[,beta=F][,backward=F]" multiplies the link costs a worker measures
for compression.buffers: cost_model (a link that looks different from the one a checkpoint was planned on);
"up_rate=F[,down_rate=F]" the link rates compression.density: auto measures.
"""
import os
import pickle
import time

from ssdsgd.env import COST_SCALE_ENV, FAULT_ENV, PICKLE_MARKER_ENV


def cost_scale(spec=None):
    """{cost name: factor} from SSDSGD_TEST_COST_SCALE; empty in normal runs."""
    spec = os.environ.get(COST_SCALE_ENV, "") if spec is None else spec
    return {name: float(factor) for name, factor in (item.split("=") for item in spec.split(",") if item)}


class FaultPlan:
    def __init__(self, rank, spec=None):
        spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
        self.kind = None
        if spec:
            kind, who, value = spec.split(":")
            if int(who) == rank:
                self.kind, self.value = kind, float(value)

    def at_step(self, step, kv=None):
        if self.kind == "raise" and step == int(self.value):
            raise RuntimeError(f"injected fault at step {step} (SSDSGD_TEST_FAULT)")
        if self.kind == "slow":
            time.sleep(self.value)
        if self.kind == "pickle" and step == int(self.value):
            kv._send_command_to_servers(0, malicious_pickle(os.environ[PICKLE_MARKER_ENV]))

    def at_finish(self, trained_steps):
        if self.kind == "finish" and trained_steps > 0:
            raise RuntimeError("injected fault at the end of training (SSDSGD_TEST_FAULT)")

    def batch(self, step, data):
        if self.kind == "nan" and step == int(self.value):
            return data * float("nan")
        return data


class _CreateFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        # Unpickling this calls open(path, "w"): proof that the payload ran.
        return (open, (self.path, "w"))


def malicious_pickle(path):
    """Protocol-0 pickle (ASCII, as MXNet's set_optimizer sends) that creates `path` when loaded."""
    return pickle.dumps(_CreateFile(path), protocol=0).decode("latin-1")