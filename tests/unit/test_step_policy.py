"""The SSD-SGD step policy (ssdsgd.algorithms.policy), table-driven: no MXNet, no processes.

The (warm-up, delay k, staleness bound S, strict) settings are those the multi-process tests run:
  test_jobs:             full warm-up (100000, k 4); strict (5, 3, 3) against the numpy simulation;
                         slow worker (4, 2, 3); pull traffic (0, 4, 4)
  test_downlink:         strict sparse downlink (22, 5, 5) and its resume (24, 5, 5)
  test_wire_and_warmup:  fp16 and density warm-up (22, 5, 5)
  compressed SSGD:       warm-up = every step (delay 1)
"""
import pytest

from ssdsgd.algorithms.policy import StepPlan, StepPolicy, density_stage

JOBS = {                                        # name: (warmup, delay, max_staleness, strict, steps)
    "full_warmup": (100000, 4, 4, False, 44),
    "strict_simulation": (5, 3, 3, True, 44),
    "slow_worker": (4, 2, 3, False, 44),
    "pull_traffic": (0, 4, 4, False, 132),
    "strict_downlink": (22, 5, 5, True, 66),
    "downlink_resume": (24, 5, 5, True, 88),
    "fp16_warmup": (22, 5, 5, False, 44),
    "compressed_ssgd": (66, 1, 1, False, 66),
}

# One step each: (warmup, k, S, strict, step, versions, in flight, landed) -> StepPlan
# StepPlan(synchronous, land, oldest_version, pull, pull_waits)
TABLE = [
    # the warm-up: synchronous, whatever is in flight (nothing is)
    ((5, 3, 3, True, 0, [0], False, False), StepPlan(True, False, 1, False, False)),
    ((5, 3, 3, True, 4, [4], False, False), StepPlan(True, False, 5, False, False)),
    ((100000, 4, 4, False, 43, [43, 43], False, False), StepPlan(True, False, 44, False, False)),
    ((66, 1, 1, False, 65, [65], False, False), StepPlan(True, False, 66, False, False)),
    # strict (5, 3, 3): pulls at steps 7, 10, 13 ... (the 3rd, 6th ... step of the delay stage), waiting
    # for their own round; the pull in flight lands at the next step even before it has arrived
    ((5, 3, 3, True, 5, [5], False, False), StepPlan(False, False, 3, False, False)),
    ((5, 3, 3, True, 6, [5], False, False), StepPlan(False, False, 4, False, False)),
    ((5, 3, 3, True, 7, [5], False, False), StepPlan(False, False, 5, True, True)),
    ((5, 3, 3, True, 8, [5], True, False), StepPlan(False, True, 6, False, False)),
    ((5, 3, 3, True, 10, [8], False, False), StepPlan(False, False, 8, True, True)),
    # S = k, not strict: the pull in flight is due at the next step (its weights would be S + 1 old)
    ((0, 4, 4, False, 3, [0], False, False), StepPlan(False, False, 0, True, True)),
    ((0, 4, 4, False, 4, [0], True, False), StepPlan(False, True, 1, False, False)),
    ((0, 4, 4, False, 4, [0], True, True), StepPlan(False, True, 1, False, False)),
    ((0, 4, 4, False, 4, [1], True, False), StepPlan(False, False, 1, False, False)),        # not yet due
    ((0, 4, 4, False, 4, [1], True, True), StepPlan(False, True, 1, False, False)),          # arrived: land
    ((0, 4, 4, False, 5, [0, 4], True, False), StepPlan(False, True, 2, False, False)),      # one buffer too old
    ((0, 4, 4, False, 7, [4], True, False), StepPlan(False, True, 4, True, True)),           # next pull due
    # S > k (slow worker, 4, 2, 3): the pull goes out at once and may land one step later
    ((4, 2, 3, False, 5, [4], False, False), StepPlan(False, False, 3, True, False)),
    ((4, 2, 3, False, 6, [4], True, False), StepPlan(False, False, 4, False, False)),
    ((4, 2, 3, False, 7, [4], True, False), StepPlan(False, True, 5, True, False)),
    ((4, 2, 3, False, 7, [6], False, False), StepPlan(False, False, 5, True, False)),
    # strict with S > k still waits for the pull's own round
    ((4, 2, 3, True, 5, [4], False, False), StepPlan(False, False, 3, True, True)),
    # the downlink jobs (22 or 24, 5, 5): the first pull is the 5th step after the warm-up
    ((22, 5, 5, True, 26, [22], False, False), StepPlan(False, False, 22, True, True)),
    ((22, 5, 5, True, 27, [22], True, False), StepPlan(False, True, 23, False, False)),
    ((24, 5, 5, True, 38, [34], False, False), StepPlan(False, False, 34, True, True)),
    ((24, 5, 5, True, 43, [39], False, False), StepPlan(False, False, 39, True, True)),   # the checkpoint's pull
    ((24, 5, 5, True, 44, [39], True, False), StepPlan(False, True, 40, False, False)),   # the resumed run lands it
]


@pytest.mark.parametrize("args, want", TABLE)
def test_plan_of_one_step(args, want):
    warmup, k, s, strict, step, versions, in_flight, landed = args
    assert StepPolicy(warmup, k, s, strict).plan(step, versions, in_flight, landed) == want


def run(policy, steps, arrives_after=0, servers_behind=0):
    """Play a worker through `steps` steps under the policy: a pull issued at step t brings version
    t + 1 (the round it waited for) or, when it did not wait, t + 1 - servers_behind; it arrives
    `arrives_after` steps later (unless landed earlier because it is due). A wait brings the oldest
    version allowed. Returns per step (plan, versions the step computed on, versions after it)."""
    versions, issued, trace = [0, 0], None, []
    for t in range(steps):
        before = list(versions)
        plan = policy.plan(t, versions, issued is not None, issued is not None and t - issued[0] >= arrives_after)
        if plan.synchronous:
            versions = [t + 1] * len(versions)
        else:
            if plan.land:
                versions = [issued[1]] * len(versions)
                issued = None
            for bi in policy.stale(versions, plan.oldest_version):
                versions[bi] = plan.oldest_version
            if plan.pull:
                issued = (t, t + 1 if plan.pull_waits else max(0, t + 1 - servers_behind))
        trace.append((plan, before, list(versions)))
    return trace


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_job_pulls_every_kth_step_of_the_delay_stage_and_stays_within_s(name):
    warmup, k, s, strict, steps = JOBS[name]
    policy = StepPolicy(warmup, k, s, strict)
    for arrives_after, behind in ((0, 0), (1, 0), (s, 0), (0, s - k), (s, s - k)):
        trace = run(policy, steps, arrives_after, behind)
        pulls = [t for t, (plan, _, _) in enumerate(trace) if plan.pull]
        assert pulls == [t for t in range(warmup, steps) if (t - warmup + 1) % k == 0]
        for t, (plan, before, _) in enumerate(trace):
            assert plan.synchronous == (t < warmup)
            assert policy.staleness(t, before) <= (0 if t < warmup else s), (name, t, before)
        if strict or s == k:       # every pull waits for its round: versions as the numpy simulation's
            for t, (plan, before, _) in enumerate(trace):
                if t > warmup:
                    last_pull = max([p for p in pulls if p < t - 1], default=None)
                    want = warmup if last_pull is None else last_pull + 1
                    if strict or arrives_after == 0:
                        assert min(before) == max(want, t - s), (name, t)


def test_strict_lands_every_pull_at_the_next_step_with_its_own_round():
    policy = StepPolicy(5, 3, 3, strict=True)
    trace = run(policy, 44, arrives_after=10)            # arrival does not matter: strict lands at once
    lands = [t for t, (plan, _, _) in enumerate(trace) if plan.land]
    assert lands == [t + 1 for t, (plan, _, _) in enumerate(trace) if plan.pull and t + 1 < 44]
    for t in lands:
        assert trace[t][2] == [t, t]                    # the pull of step t - 1 brought version t
    assert policy.landed_version_problem(7, 8) is None
    assert policy.landed_version_problem(7, 7) == "strict mode: pull issued for version 8 got 7"
    assert StepPolicy(5, 3, 4).landed_version_problem(7, 7) is None


def test_a_straggling_pull_is_waited_for_only_when_due():
    """S = 3, k = 2: a pull that has not arrived is landed only when the weights would get too stale or
    the next pull is due; a pull that brings an older round is topped up by a wait."""
    policy = StepPolicy(4, 2, 3)
    trace = run(policy, 20, arrives_after=5, servers_behind=1)
    for t, (plan, before, after) in enumerate(trace):
        if t >= 4 and plan.land:
            assert plan.pull or min(before) < plan.oldest_version
        assert min(after) >= t + 1 - 3


@pytest.mark.parametrize("warmup, k, s", [(0, 0, 1), (0, 3, 2), (-1, 1, 1)])
def test_impossible_settings_are_refused(warmup, k, s):
    with pytest.raises(ValueError, match="step policy"):
        StepPolicy(warmup, k, s)


def test_stale_names_the_buffers_below_the_oldest_version():
    assert StepPolicy.stale([3, 5, 4, 2], 4) == [0, 3]
    assert StepPolicy.stale([4, 4], 4) == []


@pytest.mark.parametrize("step, steps_per_epoch, stages, want",
                         [(0, 22, 1, 0), (500, 22, 1, 0), (21, 22, 3, 0), (22, 22, 3, 1), (44, 22, 3, 2),
                          (400, 22, 3, 2)])
def test_density_stage(step, steps_per_epoch, stages, want):
    assert density_stage(step, steps_per_epoch, stages) == want


def test_the_reported_staleness_is_the_oldest_buffers():
    """A step's staleness is the rounds its oldest buffer misses, not its newest's: with two buffers at
    versions 7 and 9, step 10 computed on weights 3 rounds old (every job test has one buffer)."""
    assert StepPolicy.staleness(10, [9, 7]) == 3
    assert StepPolicy.staleness(10, [7, 9, 8]) == 3
    assert StepPolicy.staleness(10, [10, 10]) == 0
