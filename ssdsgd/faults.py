"""Fault injection for tests, driven by SSDSGD_TEST_FAULT="<kind>:<rank>:<value>".

  raise:<rank>:<step>     the worker of that rank raises at that step (a crashing worker)
  slow:<rank>:<seconds>   the worker of that rank sleeps that long every step (a straggler)
Unset in normal runs; the worker reads it once.
"""
import os
import time


class FaultPlan:
    def __init__(self, rank, spec=None):
        spec = os.environ.get("SSDSGD_TEST_FAULT", "") if spec is None else spec
        self.kind = None
        if spec:
            kind, who, value = spec.split(":")
            if int(who) == rank:
                self.kind, self.value = kind, float(value)

    def at_step(self, step):
        if self.kind == "raise" and step == int(self.value):
            raise RuntimeError(f"injected fault at step {step} (SSDSGD_TEST_FAULT)")
        if self.kind == "slow":
            time.sleep(self.value)
