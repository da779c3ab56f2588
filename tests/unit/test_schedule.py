"""Tests for ssdsgd.schedule: LRSchedule shapes against independent formulas, config conversion, pickling."""
import math
import os
import pickle

import numpy as np
import pytest

from ssdsgd.config import load_config
from ssdsgd.schedule import LRSchedule, schedule_from_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SSGD = os.path.join(REPO, "configs", "demo_digits_ssgd.yaml")


def ref_lr(t, kind, base, total=1, warmup=0, milestones=(), factor=0.1, power=2.0, final=0.0):
    """Independent reference, float64 numpy."""
    t = np.float64(t)
    if warmup > 0 and t < warmup:
        return base * t / warmup
    if kind == "constant":
        return base
    if kind == "step":
        n = int(np.sum(t > np.asarray(milestones, dtype=np.float64))) if len(milestones) else 0
        return base * np.power(factor, n)
    frac = np.clip((t - warmup) / max(1, total - warmup), 0.0, 1.0)
    if kind == "cosine":
        return final + 0.5 * (base - final) * (1.0 + np.cos(np.pi * frac))
    return final + (base - final) * np.power(1.0 - frac, power)


def test_constant():
    s = LRSchedule("constant", base_lr=0.3, total_updates=100)
    for t in [0, 1, 2, 50, 100, 1000]:
        assert s(t) == pytest.approx(0.3, rel=1e-12)


def test_step_decays_after_milestones():
    s = LRSchedule("step", base_lr=0.4, total_updates=100, milestones=[30, 10], factor=0.5)
    # milestones are sorted; the decay applies when num_update > milestone
    expected = {1: 0.4, 9: 0.4, 10: 0.4, 11: 0.2, 29: 0.2, 30: 0.2, 31: 0.1, 100: 0.1, 500: 0.1}
    for t, lr in expected.items():
        assert s(t) == pytest.approx(lr, rel=1e-12), t
        assert s(t) == pytest.approx(ref_lr(t, "step", 0.4, milestones=[10, 30], factor=0.5), rel=1e-12)


def test_step_repeated_milestone_applies_twice():
    s = LRSchedule("step", base_lr=1.0, milestones=[5, 5], factor=0.1)
    assert s(5) == pytest.approx(1.0)
    assert s(6) == pytest.approx(0.01)


@pytest.mark.parametrize("final", [0.0, 0.01])
def test_cosine(final):
    s = LRSchedule("cosine", base_lr=0.2, total_updates=40, final_lr=final)
    assert s(0) == pytest.approx(0.2, rel=1e-12)
    assert s(20) == pytest.approx((0.2 + final) / 2, rel=1e-12)      # half way
    assert s(40) == pytest.approx(final, abs=1e-15)                   # end
    assert s(41) == pytest.approx(final, abs=1e-15)                   # clamped after the end
    assert s(10) == pytest.approx(final + (0.2 - final) * (1 + math.sqrt(0.5)) / 2, rel=1e-12)
    for t in [1, 7, 13, 33, 39, 100]:
        assert s(t) == pytest.approx(ref_lr(t, "cosine", 0.2, total=40, final=final), rel=1e-12)


@pytest.mark.parametrize("power", [1.0, 2.0, 0.5])
def test_poly(power):
    s = LRSchedule("poly", base_lr=0.5, total_updates=50, power=power, final_lr=0.05)
    assert s(0) == pytest.approx(0.5, rel=1e-12)
    assert s(50) == pytest.approx(0.05, rel=1e-12)
    assert s(75) == pytest.approx(0.05, rel=1e-12)
    assert s(25) == pytest.approx(0.05 + 0.45 * 0.5 ** power, rel=1e-12)
    for t in [1, 10, 33, 49]:
        assert s(t) == pytest.approx(ref_lr(t, "poly", 0.5, total=50, power=power, final=0.05), rel=1e-12)


def test_poly_linear_is_linear():
    s = LRSchedule("poly", base_lr=1.0, total_updates=10, power=1.0)
    assert [round(s(t), 12) for t in range(11)] == [round(1 - t / 10, 12) for t in range(11)]


@pytest.mark.parametrize("kind", ["constant", "step", "cosine", "poly"])
def test_linear_warmup(kind):
    s = LRSchedule(kind, base_lr=0.8, total_updates=60, warmup_updates=8, milestones=[30],
                   factor=0.1, power=2.0, final_lr=0.02)
    # linear ramp from 0 over the warm-up updates
    assert s(0) == pytest.approx(0.0, abs=1e-15)
    assert s(1) == pytest.approx(0.1, rel=1e-12)
    assert s(4) == pytest.approx(0.4, rel=1e-12)
    assert s(7) == pytest.approx(0.7, rel=1e-12)
    assert s(8) == pytest.approx(0.8, rel=1e-12)     # end of warm-up: the schedule starts at base
    for t in [2, 5, 8, 9, 20, 30, 31, 34, 59, 60, 61]:
        want = ref_lr(t, kind, 0.8, total=60, warmup=8, milestones=[30], factor=0.1, power=2.0, final=0.02)
        assert s(t) == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, t)


def test_cosine_after_warmup_spans_the_rest():
    s = LRSchedule("cosine", base_lr=1.0, total_updates=110, warmup_updates=10)
    assert s(60) == pytest.approx(0.5, rel=1e-12)       # midpoint of [10, 110]
    assert s(110) == pytest.approx(0.0, abs=1e-15)


def test_unknown_kind():
    with pytest.raises(ValueError):
        LRSchedule("exp")


def test_schedule_from_config_converts_epochs_to_updates():
    cfg = load_config(SSGD, ["train.epochs=5", "train.lr=0.2", "train.lr_schedule.type=step",
                             "train.lr_schedule.milestones=[2,4]", "train.lr_schedule.factor=0.5",
                             "train.lr_schedule.warmup_epochs=0.5"])
    s = schedule_from_config(cfg.train, steps_per_epoch=10)
    assert s.kind == "step"
    assert s.total_updates == 50
    assert s.warmup_updates == 5
    assert s.milestones == [20, 40]
    assert s.base_lr == pytest.approx(0.2)
    for t in [1, 3, 5, 6, 20, 21, 40, 41, 50]:
        want = ref_lr(t, "step", 0.2, total=50, warmup=5, milestones=[20, 40], factor=0.5)
        assert s(t) == pytest.approx(want, rel=1e-12), t
    assert s(21) == pytest.approx(0.1)
    assert s(41) == pytest.approx(0.05)


def test_schedule_from_config_cosine_and_poly():
    cfg = load_config(SSGD, ["train.epochs=4", "train.lr=0.1", "train.lr_schedule.final_lr=0.001"])
    s = schedule_from_config(cfg.train, steps_per_epoch=25)
    assert (s.kind, s.total_updates, s.warmup_updates) == ("cosine", 100, 0)
    assert s(100) == pytest.approx(0.001)
    assert s(50) == pytest.approx(ref_lr(50, "cosine", 0.1, total=100, final=0.001))
    cfg = load_config(SSGD, ["train.epochs=2", "train.lr_schedule.type=poly",
                             "train.lr_schedule.power=3", "train.lr_schedule.warmup_epochs=1"])
    s = schedule_from_config(cfg.train, steps_per_epoch=7)
    assert (s.kind, s.total_updates, s.warmup_updates, s.power) == ("poly", 14, 7, 3.0)
    for t in [3, 7, 10, 14]:
        assert s(t) == pytest.approx(ref_lr(t, "poly", 0.1, total=14, warmup=7, power=3.0))


def test_schedule_from_config_ignores_max_steps():
    cfg = load_config(SSGD, ["train.epochs=3", "train.max_steps=5"])
    assert schedule_from_config(cfg.train, steps_per_epoch=10).total_updates == 30


def test_scaled():
    s = LRSchedule("cosine", base_lr=0.1, total_updates=30, warmup_updates=3, final_lr=0.01)
    s4 = s.scaled(4)
    assert s4.base_lr == pytest.approx(0.4)
    assert s4.final_lr == pytest.approx(0.04)
    assert (s4.kind, s4.total_updates, s4.warmup_updates) == ("cosine", 30, 3)
    assert s.base_lr == pytest.approx(0.1) and s.final_lr == pytest.approx(0.01)   # original unchanged
    for t in [1, 2, 3, 10, 29, 30, 40]:
        want = ref_lr(t, "cosine", 0.4, total=30, warmup=3, final=0.04)
        assert s4(t) == pytest.approx(want, rel=1e-12)
        assert s4(t) == pytest.approx(4 * s(t), rel=1e-12)


def test_scaled_step_keeps_milestones():
    s = LRSchedule("step", base_lr=0.1, milestones=[5], factor=0.3).scaled(2)
    assert s.milestones == [5] and s.factor == pytest.approx(0.3)
    assert s(5) == pytest.approx(0.2) and s(6) == pytest.approx(0.06)


def test_to_dict_round_trip():
    s = LRSchedule("poly", base_lr=0.3, total_updates=20, warmup_updates=2, milestones=[4, 1],
                   factor=0.2, power=1.5, final_lr=0.03)
    d = s.to_dict()
    assert d == dict(kind="poly", base_lr=0.3, total_updates=20, warmup_updates=2, milestones=[1, 4],
                     factor=0.2, power=1.5, final_lr=0.03)
    s2 = LRSchedule(**d)
    assert [s2(t) for t in range(25)] == [s(t) for t in range(25)]


def test_pickle_round_trip():
    s = LRSchedule("cosine", base_lr=0.25, total_updates=40, warmup_updates=4, final_lr=0.005)
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.to_dict() == s.to_dict()
    assert [s2(t) for t in range(45)] == [s(t) for t in range(45)]


def test_pickled_inside_stock_optimizer():
    import mxnet as mx
    sched = LRSchedule("step", base_lr=0.5, total_updates=20, milestones=[2], factor=0.1)
    opt = mx.optimizer.SGD(learning_rate=0.5, momentum=0.9, lr_scheduler=sched)
    opt2 = pickle.loads(pickle.dumps(opt))
    assert isinstance(opt2.lr_scheduler, LRSchedule)
    assert opt2.lr_scheduler.base_lr == pytest.approx(0.5)
    w, g = mx.nd.ones(3), mx.nd.ones(3)
    lrs = []
    for o in (opt, opt2):
        st = o.create_state(0, w)
        seq = []
        for _ in range(3):
            o.update(0, w.copy(), g, st)
            seq.append(o._get_lr(0))
        lrs.append(seq)
    assert lrs[0] == pytest.approx([0.5, 0.5, 0.05])
    assert lrs[1] == lrs[0]
