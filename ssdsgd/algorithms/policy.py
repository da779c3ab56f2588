"""When an SSD-SGD worker pushes, waits, pulls and lands a pull: the step policy, pure (no MXNet, no
processes), so every case can be tested from a table (tests/unit/test_step_policy.py).

The global weights of a buffer have a version, the number of rounds the servers applied to it; a
worker's local weights carry the version of the pull they were last refreshed from. Per step t, after
backward, with a synchronous warm-up of T_w steps, delay k and staleness bound S >= k:
  warm-up (t < T_w): push, wait until round t is applied (version t + 1) in every buffer, pull it:
                     plain synchronous SGD.
  delay stage:       land the pull in flight if it has arrived, or at once when it is due: in strict
                     mode (always the next step), when the next step would compute on weights more
                     than S rounds old, or when the next pull is about to be issued into the same
                     buffers; then wait for every buffer still older than version t + 1 - S (logged);
                     local update with this worker's gradient; push; at every k-th step of the stage,
                     issue an asynchronous pull that overlaps the following steps' compute.
When S = k (the default) or in strict mode, a pull is issued only once the round it asks for is
applied (cheap clock polls), so every refresh carries exactly the round its pull was issued for (it
cannot be newer: this worker has not pushed the next round yet), and it is landed at the next step.
That is the bound the original implementation got from dist_sync's push acknowledgement, and it
makes runs reproducible step by step. With S > k the pull goes out at once, may carry an older
round, and may land up to S - k steps later: on a slow link the transfer then hides behind several
steps of compute instead of one.
"""
from dataclasses import dataclass
from typing import NamedTuple


class StepPlan(NamedTuple):
    """What one step does after backward (StepPolicy.plan)."""
    synchronous: bool      # warm-up: push, then wait for round `step` in every buffer and pull it
    land: bool             # land the pull in flight before the local update
    oldest_version: int    # no buffer may be older than this when the next step computes
    pull: bool             # issue a pull after the push
    pull_waits: bool       # ... only once round `step` is applied (the pull then carries exactly it)


@dataclass(frozen=True)
class StepPolicy:
    warmup: int            # synchronous steps first (T_w)
    delay: int             # k: a pull every k steps of the delay stage
    max_staleness: int     # S: the most rounds the weights a step computes on may miss
    strict: bool = False   # every pull carries its own round and lands at the next step

    def __post_init__(self):
        if self.delay < 1 or self.max_staleness < self.delay or self.warmup < 0:
            raise ValueError(f"step policy: warm-up {self.warmup}, delay {self.delay}, max_staleness "
                             f"{self.max_staleness} (needs delay >= 1, max_staleness >= delay, warm-up >= 0)")

    @property
    def pulls_wait(self):
        """Whether a delay-stage pull is issued only once the round it asks for is applied (see the module)."""
        return self.strict or self.max_staleness <= self.delay

    def plan(self, step, versions, pull_in_flight=False, pull_landed=False):
        """The plan of step `step` given the versions of the local weights (per buffer) and whether a
        pull is in flight and, if so, whether it has already arrived."""
        if step < self.warmup:
            return StepPlan(True, False, step + 1, False, False)
        pull = (step - self.warmup + 1) % self.delay == 0
        oldest = step + 1 - self.max_staleness
        land = pull_in_flight and (self.strict or min(versions) < oldest or pull or pull_landed)
        return StepPlan(False, land, oldest, pull, pull and self.pulls_wait)

    @staticmethod
    def stale(versions, oldest_version):
        """The buffers to wait for: those whose version is below the plan's oldest_version."""
        return [bi for bi, v in enumerate(versions) if v < oldest_version]

    def landed_version_problem(self, issued, got):
        """Strict mode: a pull issued at step `issued` must bring exactly version issued + 1."""
        if self.strict and got != issued + 1:
            return f"strict mode: pull issued for version {issued + 1} got {got}"
        return None

    @staticmethod
    def staleness(step, versions):
        """Rounds missing from the weights step `step` computed on."""
        return step - min(versions)


def density_stage(step, steps_per_epoch, num_stages):
    """Index into the density stages of a plan for a step: epoch e < len(compression.warmup) is stage
    e, every later epoch the steady state (the last stage)."""
    if num_stages == 1:
        return 0
    return min(step // steps_per_epoch, num_stages - 1)
