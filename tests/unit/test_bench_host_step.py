"""bench/bench_host_step.py: a tiny real run, its bit-for-bit check, and the refused configs."""
import os

import pytest

from bench import bench_host_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "fmnist_resnet20_ssd_topk.yaml")
# a small model on small images, so that a run takes seconds
TINY = bench_host_step.DEFAULT_SETS + ["model.name=small_cnn", "data.shape=[3,8,8]", "train.batch_size=8"]


def test_the_two_ways_must_end_bit_for_bit_equal(monkeypatch):
    """A per-parameter way that loads the weights differently is caught (the check is not vacuous)."""
    client, params, server, stage, fwd_bwd = bench_host_step.build(CONFIG, TINY)
    plain = bench_host_step.per_parameter_refresh

    def slightly_off(buffer, opt, weights, states, flat, rounds):
        plain(buffer, opt, weights, states, flat, rounds)
        first = weights[buffer.params[0]]
        first[:] = first * 1.0001
    monkeypatch.setattr(bench_host_step, "per_parameter_refresh", slightly_off)
    with pytest.raises(SystemExit, match="different weights or states"):
        bench_host_step.measure(client, params, server, stage, fwd_bwd, 4)
