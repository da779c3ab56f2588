"""The link's costs for compression.buffers: cost_model, measured at job start: alpha (seconds per
message) and beta (seconds per byte) from timed pulls, and the backward pass's time; every worker plans
from rank 0's numbers, rounded to a grid so that noise cannot change the plan."""
import time

import mxnet as mx
import numpy as np

from ssdsgd.faults import cost_scale

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
        return median_seconds(lambda: (kv.pull(key, out=out), out.wait_to_read()), repeats)

    t_small, t_big = timed(small, a), timed(big, b)
    backward = measure_backward() if measure_backward else 0.0
    mine = mx.nd.array([t_small, max(t_big - t_small, 1e-12) / (4 * n), backward])
    kv.init(shared, mine)
    agreed = mx.nd.zeros(3)
    kv.pull(shared, out=agreed)
    alpha, beta, backward = (float(v) for v in agreed.asnumpy())
    cost = {"alpha": alpha, "beta": beta, "backward": backward}
    for name, factor in cost_scale().items():          # tests only: a link that looks different
        if name in cost:                                # (up_rate, down_rate: measure_link's)
            cost[name] *= factor
    return quantise_costs(cost)


def median_seconds(run, repeats, before=None):
    """The median wall time of `repeats` calls of run(), each after an untimed call of before() if given."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def quantise_costs(cost, steps_per_octave=2):
    """Round each measured cost to a grid of 2**(1/steps_per_octave) (half-octaves by default).

    The timings vary by tens of percent from run to run on a shared machine; planned from the raw
    numbers, the same config got 22 to 65 buffers on one machine, so no two runs were comparable.
    On the grid, noise below ~19% either way cannot change the plan."""
    def q(x):
        return float(2.0 ** (round(np.log2(x) * steps_per_octave) / steps_per_octave)) if x > 0 else 0.0
    return {name: q(v) for name, v in cost.items()}


def measure_link(kv, num_params, mine, repeats=3):
    """compression.density: auto's link probe, collective: every worker times pushes and pulls of a small
    and a large key at the same moment (a barrier before each), as training steps load the links, so
    each latency and rate is what this worker's link achieves while every worker's traffic shares the
    servers'. `mine`: what else this worker measured (a list of floats); returns every worker's
    [up latency, up rate, down latency, down rate, *mine], by rank (the same numbers on every worker)."""
    from ssdsgd.ps.keys import LINK_PROBE_KEYS
    small, big, gather = LINK_PROBE_KEYS
    n = probe_elements(num_params)
    fields = 4 + len(mine)
    kv.init([small, big, gather], [mx.nd.zeros(1), mx.nd.zeros(n), mx.nd.zeros(kv.num_workers * fields)])
    a, b = mx.nd.zeros(1), mx.nd.zeros(n)

    def timed(move):
        # every worker at once; a push is done when its server has answered
        return median_seconds(lambda: (move(), mx.nd.waitall()), repeats, before=kv._barrier)

    measured = []
    for move in (kv.push, lambda key, arr: kv.pull(key, out=arr)):
        t_small, t_big = timed(lambda: move(small, a)), timed(lambda: move(big, b))
        # The rate over the whole large transfer, its latency included: on a fast link the difference of
        # two timings this short is noise (even negative), and on a slow one the latency is negligible.
        measured += [t_small, 4 * n / t_big]
    scale = cost_scale()                 # tests only: a link that looks slower than it is
    measured[1] *= scale.get("up_rate", 1.0)
    measured[3] *= scale.get("down_rate", 1.0)
    share = np.zeros(kv.num_workers * fields, np.float32)
    share[kv.rank * fields:(kv.rank + 1) * fields] = measured + list(mine)
    kv.push(gather, mx.nd.array(share))
    mx.nd.waitall()
    kv._barrier()                        # every worker's share is in
    agreed = mx.nd.zeros(kv.num_workers * fields)
    kv.pull(gather, out=agreed)
    return agreed.asnumpy().reshape(kv.num_workers, fields).tolist()
