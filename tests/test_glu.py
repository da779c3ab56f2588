"""Tests for the GLU local optimizer (ssdsgd.glu) against a numpy reference of its update rule."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu import GLU
from ssdsgd.schedule import LRSchedule

RESCALE = 1.0 / 8
WD = 1e-2
BASE_LR = 0.4


def cosine(t, base=BASE_LR, total=8, final=0.02):
    frac = min(1.0, max(0.0, t / total))
    return final + (base - final) * 0.5 * (1.0 + np.cos(np.pi * frac))


def make_schedule():
    return LRSchedule("cosine", base_lr=BASE_LR, total_updates=8, final_lr=0.02)


def test_registered_and_created_by_name():
    opt = mx.optimizer.create("glu", c=0.25, learning_rate=0.1, wd=WD, rescale_grad=RESCALE)
    assert isinstance(opt, GLU)
    assert opt.c == 0.25
    assert opt.rescale_grad == RESCALE
    assert GLU().c == 0.5                       # the authors' value is the default


def test_glu_matches_numpy_with_refresh_and_schedule():
    c = 0.5
    rng = np.random.RandomState(0)
    shapes = [(3, 4), (5,)]
    opt = mx.optimizer.create("glu", c=c, learning_rate=BASE_LR, wd=WD, rescale_grad=RESCALE,
                              lr_scheduler=make_schedule())
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    weights = [mx.nd.array(w) for w in w0]
    states = [opt.create_state(i, w) for i, w in enumerate(weights)]
    for s, w in zip(states, w0):
        np.testing.assert_array_equal(s.asnumpy(), w)          # snapshot of the initial weights
    ref_w = [w.astype(np.float64) for w in w0]
    ref_s = [w.astype(np.float64) for w in w0]
    steps, refresh_at = 7, 3
    seen_lrs = []
    for t in range(1, steps + 1):
        if t == refresh_at + 1:
            # refresh from "global" weights: overwrite w, then snapshot it into the state
            for i, shape in enumerate(shapes):
                new = rng.standard_normal(shape).astype(np.float32)
                weights[i][:] = new
                GLU.snapshot(states[i], weights[i])
                ref_w[i] = new.astype(np.float64)
                ref_s[i] = new.astype(np.float64)
                np.testing.assert_array_equal(states[i].asnumpy(), new)
        lr = cosine(t)
        seen_lrs.append(lr)
        for i, shape in enumerate(shapes):
            g = rng.standard_normal(shape).astype(np.float32) * 4
            opt.update(i, weights[i], mx.nd.array(g), states[i])
            ref_w[i] = ref_w[i] - lr * (RESCALE * g + WD * ref_w[i] + c * (ref_s[i] - ref_w[i]))
            np.testing.assert_allclose(weights[i].asnumpy(), ref_w[i], rtol=1e-5, atol=1e-6)
            # the state is only the snapshot; update() must not move it
            np.testing.assert_allclose(states[i].asnumpy(), ref_s[i], rtol=0, atol=0)
        assert opt._index_update_count == {0: t, 1: t}
    # the schedule really changed the lr from step to step
    assert len(set(np.round(seen_lrs, 12))) == steps
    # after the refresh the compensation term pulls toward the new snapshot, not the old one
    assert not np.allclose(ref_s[0], w0[0])


def test_states_are_independent_per_parameter():
    c = 0.8
    opt = GLU(c=c, learning_rate=0.1, wd=0.0, rescale_grad=1.0)
    wa, wb = mx.nd.array([1.0, 2.0]), mx.nd.array([[3.0], [4.0], [5.0]])
    sa, sb = opt.create_state(0, wa), opt.create_state(1, wb)
    GLU.snapshot(sa, mx.nd.array([0.0, 0.0]))       # only parameter 0's snapshot moves
    opt.update(0, wa, mx.nd.zeros(2), sa)
    opt.update(1, wb, mx.nd.zeros((3, 1)), sb)
    # zero gradient, no wd: w <- w - lr*c*(w_s - w)
    np.testing.assert_allclose(wa.asnumpy(), np.array([1.0, 2.0]) - 0.1 * c * (0 - np.array([1.0, 2.0])),
                               rtol=1e-6)
    np.testing.assert_allclose(wb.asnumpy(), [[3.0], [4.0], [5.0]], rtol=1e-6)
    np.testing.assert_array_equal(sb.asnumpy(), [[3.0], [4.0], [5.0]])


def test_create_state_is_a_copy():
    opt = GLU(learning_rate=0.1)
    w = mx.nd.array([1.0, 2.0, 3.0])
    s = opt.create_state(0, w)
    w[:] = 7.0
    np.testing.assert_array_equal(s.asnumpy(), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("with_schedule", [False, True])
def test_c_zero_equals_plain_sgd(with_schedule):
    rng = np.random.RandomState(1)
    shapes = [(4, 3), (6,)]
    kw = dict(learning_rate=BASE_LR, wd=WD, rescale_grad=RESCALE)
    glu = GLU(c=0.0, lr_scheduler=make_schedule() if with_schedule else None, **kw)
    sgd = mx.optimizer.SGD(momentum=0.0, lr_scheduler=make_schedule() if with_schedule else None, **kw)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    wg = [mx.nd.array(w) for w in w0]
    ws = [mx.nd.array(w) for w in w0]
    sg = [glu.create_state(i, w) for i, w in enumerate(wg)]
    ss = [sgd.create_state(i, w) for i, w in enumerate(ws)]
    ref = [w.astype(np.float64) for w in w0]
    for t in range(1, 7):
        lr = cosine(t) if with_schedule else BASE_LR
        for i, shape in enumerate(shapes):
            g = rng.standard_normal(shape).astype(np.float32)
            glu.update(i, wg[i], mx.nd.array(g), sg[i])
            sgd.update(i, ws[i], mx.nd.array(g), ss[i])
            ref[i] = ref[i] - lr * (RESCALE * g + WD * ref[i])
            np.testing.assert_allclose(wg[i].asnumpy(), ws[i].asnumpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(wg[i].asnumpy(), ref[i], rtol=1e-5, atol=1e-6)
    # and the weights did move
    assert not np.allclose(wg[0].asnumpy(), w0[0])


def test_lr_mult_and_wd_mult_are_honoured():
    opt = GLU(c=0.5, learning_rate=0.1, wd=0.1, rescale_grad=1.0,
              param_idx2name={0: "fc_weight", 1: "fc_bias"})
    opt.set_lr_mult({"fc_weight": 2.0})
    opt.set_wd_mult({"fc_weight": 0.0})
    w, s = mx.nd.array([1.0, -1.0]), mx.nd.array([0.5, 0.5])
    opt.update(0, w, mx.nd.array([1.0, 1.0]), s)
    wn = np.array([1.0, -1.0])
    want = wn - 0.2 * (np.array([1.0, 1.0]) + 0.0 * wn + 0.5 * (np.array([0.5, 0.5]) - wn))
    np.testing.assert_allclose(w.asnumpy(), want, rtol=1e-6)
