"""compression.density: auto: the choice from given measurements (links and step times to densities), the
traffic it is predicted from, and the config keys around it."""
import math
import os

import pytest
from support.jobs import ROOT

from ssdsgd.algorithms.density_choice import MBIT, Measured, Traffic, choose, predicted_step, traffic
from ssdsgd.compression.fusion import plan_for_config, tensor_counts
from ssdsgd.config import ConfigError, auto_densities, density_note, load_config, with_density
from ssdsgd.schema import AUTO_DENSITIES

TOPK = os.path.join(ROOT, "configs", "fmnist_resnet20_ssd_topk.yaml")
# ResNet-20's parameter shapes (cifar_resnet20_v1): 272,474 values in convolutions, BatchNorm and the dense layer.
RESNET20 = ([(16, 3, 3, 3)] + [(16, 16, 3, 3)] * 6 + [(32, 16, 3, 3)] + [(32, 32, 3, 3)] * 5 + [(32, 16, 1, 1)]
            + [(64, 32, 3, 3)] + [(64, 64, 3, 3)] * 5 + [(64, 32, 1, 1)] + [(10, 64), (10,)]
            + [(16,)] * 14 + [(32,)] * 14 + [(64,)] * 14)


def _auto(*sets):
    return load_config(TOPK, ["compression.density=auto", *sets])


def _measured(rate_mbit, compute=0.3, latency=0.0005, up=None):
    """A worker whose links achieve rate_mbit (up: another uplink rate) and whose encoding takes 2 ms plus
    0.1 s per unit of density."""
    return Measured(compute, latency, (up or rate_mbit) * MBIT, latency, rate_mbit * MBIT,
                    tuple(0.002 + 0.1 * d for d in AUTO_DENSITIES))


def _choice(workers, cfg=None, slack=0.05):
    cfg = cfg or _auto()
    traffics = [traffic(RESNET20, cfg.compression, d, len(workers), 1, cfg.algorithm) for d in AUTO_DENSITIES]
    return choose(workers, list(AUTO_DENSITIES), traffics, slack, 4 * sum(map(math.prod, RESNET20)))


# Per-worker link rates as the probe measures them (every worker's traffic sharing the server's link:
# on per-host links of R Mbit/s, two workers see about R / 2 each), ResNet-20 at 0.3 s a step, S = k = 1:
# each step waits for its push, so the push's seconds count in full (1%: 21.7 KB, 17 ms at 10 Mbit/s,
# 6% of the step, over the 5% slack; 0.5%: 11 KB, 9 ms, 4%).
@pytest.mark.parametrize("rate, density, verdict", [
    (0.05, 0.001, "network-bound"),
    (0.5, 0.001, "network-bound"),
    (2, 0.001, "fits"),
    (10, 0.005, "fits"),
    (20, 0.01, "fits"),
    (100, 0.02, "fits"),
    (1000, 0.1, "fits"),           # 20%: its 22 ms of encoding alone are over the slack
    (10000, 0.2, "no gain"),
])
def test_the_choice_from_links_to_densities(rate, density, verdict):
    got = _choice([_measured(rate), _measured(rate)])
    assert (got.density, got.verdict) == (density, verdict), got


def test_the_slowest_worker_decides():
    fast, slow = _measured(100), _measured(10)
    assert _choice([fast, slow]).density == _choice([slow, slow]).density == 0.005
    assert _choice([fast, slow]).down_rate == 10 * MBIT


def test_a_slow_uplink_alone_lowers_the_density():
    assert _choice([_measured(100, up=10)] * 2).density < _choice([_measured(100)] * 2).density


def test_a_shorter_step_needs_a_sparser_push():
    """Beside a GPU (a step 10x shorter) the same link takes a lower density."""
    cpu, gpu = _choice([_measured(100)] * 2), _choice([_measured(100, compute=0.03)] * 2)
    assert gpu.density < cpu.density


def test_a_latency_bound_step_takes_the_highest_density_within_slack_of_the_fastest():
    """A tiny model on a fast link: no density reaches the compute bound (the messages' latency does not
    shrink with the density), so the densest whose step is within slack of the fastest one's."""
    tiny = Measured(0.002, 0.0005, 10000 * MBIT, 0.0005, 10000 * MBIT, (0.0001,) * len(AUTO_DENSITIES))
    cfg = _auto()
    fastest = min(predicted_step(tiny, traffic(RESNET20, cfg.compression, d, 2, 1, cfg.algorithm), 0.0001)
                  for d in AUTO_DENSITIES)
    got = _choice([tiny, tiny])
    assert got.verdict == "network-bound" and got.density >= 0.05 and got.predicted <= 1.05 * fastest, got


def test_a_larger_slack_allows_a_higher_density():
    assert _choice([_measured(10)] * 2, slack=0.5).density > _choice([_measured(10)] * 2).density


def test_the_line_says_what_was_chosen_and_why():
    line = _choice([_measured(20), _measured(20)]).line()
    assert line.startswith("compression: auto chose density 0.01 (link 20.0 Mbit/s up, 20.0 down, step 0.3 s "
                           "compute, predicted ") and line.endswith("% of the compute bound)"), line
    assert _choice([_measured(10000)] * 2).line().endswith(
        ": compression does not pay on this link: SSGD trains as fast")


def test_traffic_is_the_plans_mailbox_messages_and_downlink_rings():
    cfg = _auto()
    t = traffic(RESNET20, cfg.compression, 0.01, 2, 1, cfg.algorithm)
    buffers = plan_for_config(RESNET20, 1, cfg.compression, None, tensor_counts(RESNET20, cfg.compression, 0.01))
    assert t.push_bytes == sum(b.wire.bytes for b in buffers) and t.push_messages == len(buffers)
    assert t.push_bytes < t.pull_bytes <= 2 * t.push_bytes + 64      # the ring holds up to both workers' values
    sizes = [traffic(RESNET20, cfg.compression, d, 2, 1, cfg.algorithm) for d in AUTO_DENSITIES]
    assert all(a.push_bytes < b.push_bytes and a.pull_bytes <= b.pull_bytes for a, b in zip(sizes, sizes[1:]))
    dense = traffic(RESNET20, _auto("compression.downlink=dense").compression, 0.01, 2, 1, cfg.algorithm)
    assert dense.pull_bytes == 4 * (sum(map(math.prod, RESNET20)) + 1)


def test_predicted_steps_follow_the_step_policy():
    m = Measured(0.3, 0.0, 1.0, 0.0, 1.0, ())
    # bytes = seconds at 1 byte/s: up 0.1, down 0.2
    sync = Traffic(1, 0.1, 1, 0.2, synchronous=True)
    k1 = Traffic(1, 0.1, 1, 0.2)                         # S = k = 1: the push waited for, the pull overlapped
    k1_slow = Traffic(1, 0.1, 1, 0.5)
    overlapped = Traffic(1, 0.1, 1, 0.2, pull_every=2, waits=False)
    assert predicted_step(m, sync, 0.0) == pytest.approx(0.6)
    assert predicted_step(m, k1, 0.0) == pytest.approx(0.4)
    assert predicted_step(m, k1_slow, 0.0) == pytest.approx(0.6)
    assert predicted_step(m, overlapped, 0.01) == pytest.approx(0.31)


def test_auto_resolves_the_density_warmup_as_the_number_would():
    """A run with auto is the run of the config giving the chosen number: with_density resolves the keys whose
    default follows the density (the density warm-up under an lr warm-up) as load_config does."""
    for sets in ([], ["train.lr_schedule.warmup_epochs=1"]):
        for d in AUTO_DENSITIES:
            by_hand = load_config(TOPK, [f"compression.density={d}", *sets]).to_dict()
            chosen = with_density(_auto(*sets), d).to_dict()
            chosen["compression"]["auto_slack"] = by_hand["compression"]["auto_slack"]
            assert chosen == by_hand, (d, sets)


def test_auto_keys_are_checked():
    assert _auto().compression.density == "auto" and _auto().compression.warmup is None
    with pytest.raises(ConfigError, match=r"compression.density: expected float or auto, got 'often'"):
        load_config(TOPK, ["compression.density=often"])
    dense = load_config(TOPK, ["compression.density=auto", "compression.type=none", "compression.downlink=auto",
                               "compression.allocation=auto"])
    assert any(n.startswith("compression.density = 'auto' has no effect") for n in dense.ignored), dense.ignored
    with pytest.raises(ConfigError, match="compression.warmup: ends at 0.0005, below every density"):
        _auto("compression.warmup=[0.0005]")
    assert auto_densities(_auto("compression.warmup=[0.25,0.01]").compression) == [0.001, 0.002, 0.005, 0.01]
    assert "compression.auto_slack" in load_config(TOPK, ["compression.density=0.01"]).idle
    assert "at the start of the synchronous warm-up" in density_note(_auto())
    assert density_note(load_config(TOPK, ["compression.density=0.01"])) is None
