"""compression.density: auto, the decision: from what every worker measured (its step's compute, its
encoding time per candidate density, the latency and rate its pushes and pulls achieved while every
worker pushed and pulled) and the bytes each candidate moves (the plan's own mailbox messages and
downlink rings), the highest candidate whose predicted step stays within compression.auto_slack of the
compute bound. Pure: no MXNet, no processes (the measuring is probe.measure_link's), so every case is
tested from a table (tests/unit/test_density_choice.py).

The step predicted at density d, for each worker (algorithms/policy.py says when a worker waits):
  host          compute + encode(d)     (forward and backward, then the selection and encoding)
  up            messages * latency + bytes / rate of one step's pushes
  down          the same of one pull (every k = algorithm.delay steps)
  SSGD + top-k  host + up + down        (synchronous: every step waits for its round)
  SSD-SGD, S = k  per k steps: k * host + up + max(0, down - k * host), at least k * up and down
                (the k-th step waits until its round is in, then the pull has k steps' compute to land)
  SSD-SGD, S > k  max(host, up, down / k)  (nothing waits: pushes and pulls overlap the compute)
and stock SSGD's: compute + the dense model up and down. The compute bound is `compute` alone.
"""
from dataclasses import dataclass

from ssdsgd.algorithms.downlink import ring_choice, ring_slots
from ssdsgd.algorithms.policy import StepPolicy
from ssdsgd.compression.fusion import plan_for_config, tensor_counts
from ssdsgd.schema import RING_DOWNLINKS

MBIT = 1e6 / 8          # bytes per second in a Mbit/s


@dataclass(frozen=True)
class Measured:
    """One worker's measurements (seconds, bytes per second); encode: seconds per step per candidate."""
    compute: float
    up_latency: float
    up_rate: float
    down_latency: float
    down_rate: float
    encode: tuple


@dataclass(frozen=True)
class Traffic:
    """What one worker sends each step and receives each pull at one density (steady state)."""
    push_messages: int
    push_bytes: int
    pull_messages: int
    pull_bytes: int
    pull_every: int = 1               # steps between pulls (k)
    waits: bool = True                # a pull waits for the round it asks for (StepPolicy.pulls_wait)
    synchronous: bool = False         # every step waits for its round (warm-up, SSGD + top-k)


@dataclass(frozen=True)
class Choice:
    density: float
    predicted: float      # the slowest worker's predicted step at `density`, seconds
    compute: float        # that worker's compute bound, seconds
    up_rate: float        # the slowest links measured, bytes per second
    down_rate: float
    verdict: str          # "fits", "network-bound" (no candidate is compute-bound) or "no gain" (SSGD is as fast)

    def line(self):
        """The line rank 0 prints at the choice."""
        share = 100 * self.compute / self.predicted
        head = (f"compression: auto chose density {self.density:g} (link {self.up_rate / MBIT:.1f} Mbit/s up, "
                f"{self.down_rate / MBIT:.1f} down, step {self.compute:.3g} s compute, predicted {share:.0f}% of "
                f"the compute bound)")
        if self.verdict == "no gain":
            return head + ": compression does not pay on this link: SSGD trains as fast"
        if self.verdict == "network-bound":
            return head + ": no density keeps this link compute-bound; this one is within slack of the fastest"
        return head

    def record(self):
        """What the run summary keeps of the choice."""
        return {"density": self.density, "predicted_step_seconds": self.predicted,
                "compute_seconds": self.compute, "up_mbit": self.up_rate / MBIT, "down_mbit": self.down_rate / MBIT,
                "verdict": self.verdict}


def traffic(shapes, comp, density, workers, servers, algorithm, cost=None):
    """Traffic of one worker's steady state at `density` under the `compression` section `comp`: a mailbox
    message per buffer each step; each buffer's downlink ring (or, where it would not be smaller, its dense
    weights) every algorithm.delay steps (SSD-SGD) or every step (synchronous)."""
    counted = tensor_counts(shapes, comp, density)
    buffers = plan_for_config(shapes, servers, comp, cost, counted)
    slots = ring_slots(algorithm)
    pull = 0
    for b in buffers:
        kind, layout = ring_choice(comp, slots, b.size, b.topk_count, workers) \
            if comp.downlink in RING_DOWNLINKS else ("dense", None)
        pull += 4 * (b.size + 1) if kind == "dense" else 4 * layout.length
    if algorithm.type != "ssd":
        return Traffic(len(buffers), sum(b.wire.bytes for b in buffers), len(buffers), pull, synchronous=True)
    policy = StepPolicy(0, algorithm.delay, algorithm.max_staleness, algorithm.strict)
    return Traffic(len(buffers), sum(b.wire.bytes for b in buffers), len(buffers), pull, algorithm.delay,
                   policy.pulls_wait)


def predicted_step(m, t, encode):
    """Seconds of one step for measurements m, traffic t and encoding time `encode` (see the module)."""
    host = m.compute + encode
    up = t.push_messages * m.up_latency + t.push_bytes / m.up_rate
    down = t.pull_messages * m.down_latency + t.pull_bytes / m.down_rate
    k = t.pull_every
    if t.synchronous:
        return host + up + down
    if t.waits:
        return max(k * host + up + max(0.0, down - k * host), k * up, down) / k
    return max(host, up, down / k)


def ssgd_step(m, model_bytes):
    """Stock SSGD's step: compute, then the dense gradients up and the dense weights down."""
    return m.compute + m.up_latency + model_bytes / m.up_rate + m.down_latency + model_bytes / m.down_rate


def choose(measured, densities, traffics, slack, model_bytes):
    """The Choice for every worker's Measured (`measured`), candidates `densities` (increasing) with their
    Traffic (`traffics`): the highest whose predicted step is within (1 + slack) of every worker's bound,
    "fits"; "no gain" where stock SSGD's dense step is within it already (the highest candidate then).
    A worker's bound is its compute, or, where no candidate comes within slack of it, the fastest
    candidate's step ("network-bound"): the lowest density on a link whose bytes bound the step, a higher
    one where the step is bound by what does not shrink with the density (the messages' latency)."""
    steps = [[predicted_step(m, t, m.encode[i]) for m in measured] for i, t in enumerate(traffics)]
    fastest = [min(steps[i][w] for i in range(len(densities))) for w in range(len(measured))]
    compute_bound = all(fastest[w] <= (1 + slack) * m.compute for w, m in enumerate(measured))
    bound = [m.compute if compute_bound else max(m.compute, fastest[w]) for w, m in enumerate(measured)]
    fits = [i for i in range(len(densities)) if all(steps[i][w] <= (1 + slack) * bound[w]
                                                    for w in range(len(measured)))]
    no_gain = all(ssgd_step(m, model_bytes) <= (1 + slack) * bound[w] for w, m in enumerate(measured))
    i = len(densities) - 1 if no_gain else max(fits)
    verdict = "no gain" if no_gain else ("fits" if compute_bound else "network-bound")
    w = max(range(len(measured)), key=lambda w: steps[i][w] / measured[w].compute)   # the slowest, relatively
    return Choice(densities[i], steps[i][w], measured[w].compute, min(m.up_rate for m in measured),
                  min(m.down_rate for m in measured), verdict)
