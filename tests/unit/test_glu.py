"""Tests for the GLU local optimizer (ssdsgd.algorithms.glu) against a numpy reference of its update rule."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.algorithms.glu import GLU, GlobalMomentum, LocalSGD
from ssdsgd.compression.flatviews import FlatViews
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
                GLU.refresh(states[i], weights[i])
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
    GLU.refresh(sa, mx.nd.array([0.0, 0.0]))       # only parameter 0's snapshot moves
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


# ------------------------------------------------------------------ GlobalMomentum and LocalSGD


MU = 0.9


def np_gm_update(w, v, g, lr, mu=MU, wd=WD, rescale=RESCALE):
    """MXNet's sgd_mom_update, in float64."""
    v = mu * v - lr * (rescale * g + wd * w)
    return w + v, v


def test_global_momentum_registered_and_state_layout():
    opt = mx.optimizer.create("globalmomentum", momentum=0.7, learning_rate=0.1)
    assert isinstance(opt, GlobalMomentum) and opt.momentum == 0.7
    assert GlobalMomentum().momentum == 0.9
    w = mx.nd.array([[1.0, -2.0], [3.0, 4.5]])
    s = opt.create_state(0, w)
    assert s.shape == (2, 2, 2) and s.dtype == np.float32
    np.testing.assert_array_equal(s[0].asnumpy(), w.asnumpy())   # w_prev: the initial weights
    np.testing.assert_array_equal(s[1].asnumpy(), 0)             # v: zero
    w[:] = 9.0
    np.testing.assert_array_equal(s[0].asnumpy(), [[1.0, -2.0], [3.0, 4.5]])   # a copy, not a view


def test_global_momentum_matches_numpy_with_refreshes_schedule_and_wd():
    rng = np.random.RandomState(5)
    shapes = [(3, 4), (5,)]
    opt = GlobalMomentum(momentum=MU, learning_rate=BASE_LR, wd=WD, rescale_grad=RESCALE,
                         lr_scheduler=make_schedule())
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    weights = [mx.nd.array(w) for w in w0]
    states = [opt.create_state(i, w) for i, w in enumerate(weights)]
    ref_w = [w.astype(np.float64) for w in w0]
    ref_prev = [w.astype(np.float64) for w in w0]
    ref_v = [np.zeros(s) for s in shapes]
    # updates interleaved with refreshes; per parameter rounds (they sit in different buffers)
    events = ["u", "u", ("r", (1, 3)), "u", "u", ("r", (0, 2)), "u", ("r", (4, 0)), "u", "u"]
    t = 0
    checked = {"kept_v": False, "set_v": False}
    for ev in events:
        if ev == "u":
            t += 1
            lr = cosine(t)
            for i, shape in enumerate(shapes):
                g = (rng.standard_normal(shape) * 4).astype(np.float32)
                opt.update(i, weights[i], mx.nd.array(g), states[i])
                ref_w[i], ref_v[i] = np_gm_update(ref_w[i], ref_v[i], g.astype(np.float64), lr)
            assert opt._index_update_count == {0: t, 1: t}
        else:
            for i, (shape, rounds) in enumerate(zip(shapes, ev[1])):
                new = (ref_w[i] + rng.standard_normal(shape)).astype(np.float32)
                weights[i][:] = new
                v_before = states[i][1].asnumpy().copy()
                GlobalMomentum.refresh(states[i], weights[i], rounds)
                if rounds > 0:
                    ref_v[i] = (new.astype(np.float64) - ref_prev[i]) / rounds
                    checked["set_v"] = True
                else:
                    np.testing.assert_array_equal(states[i][1].asnumpy(), v_before)   # v kept
                    assert np.abs(v_before).max() > 0
                    checked["kept_v"] = True
                ref_prev[i] = new.astype(np.float64)
                ref_w[i] = new.astype(np.float64)
                np.testing.assert_array_equal(states[i][0].asnumpy(), new)           # w_prev = w_new
                np.testing.assert_array_equal(weights[i].asnumpy(), new)             # refresh leaves w
        for i in range(len(shapes)):
            np.testing.assert_allclose(weights[i].asnumpy(), ref_w[i], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(states[i][1].asnumpy(), ref_v[i], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(states[i][0].asnumpy(), ref_prev[i], rtol=1e-6, atol=1e-6)
    assert checked == {"kept_v": True, "set_v": True}
    # the re-estimated velocity really drives the next step: with a zero gradient and wd the
    # weights move by mu * v
    w_before, v_before = weights[0].asnumpy().copy(), states[0][1].asnumpy().copy()
    GlobalMomentum(momentum=MU, learning_rate=0.3, wd=0.0).update(0, weights[0], mx.nd.zeros((3, 4)),
                                                                  states[0])
    np.testing.assert_allclose(weights[0].asnumpy(), w_before + MU * v_before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_schedule", [False, True])
def test_global_momentum_without_refresh_equals_mxnet_sgd_momentum(with_schedule):
    rng = np.random.RandomState(2)
    shapes = [(4, 3), (6,)]
    kw = dict(learning_rate=BASE_LR, wd=WD, rescale_grad=RESCALE)
    gm = GlobalMomentum(momentum=MU, lr_scheduler=make_schedule() if with_schedule else None, **kw)
    sgd = mx.optimizer.SGD(momentum=MU, lr_scheduler=make_schedule() if with_schedule else None, **kw)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    wg = [mx.nd.array(w) for w in w0]
    ws = [mx.nd.array(w) for w in w0]
    sg = [gm.create_state(i, w) for i, w in enumerate(wg)]
    ss = [sgd.create_state(i, w) for i, w in enumerate(ws)]
    for t in range(1, 7):
        for i, shape in enumerate(shapes):
            g = (rng.standard_normal(shape) * 3).astype(np.float32)
            gm.update(i, wg[i], mx.nd.array(g), sg[i])
            sgd.update(i, ws[i], mx.nd.array(g), ss[i])
            np.testing.assert_allclose(wg[i].asnumpy(), ws[i].asnumpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(sg[i][1].asnumpy(), ss[i].asnumpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(sg[i][0].asnumpy(), w0[i])     # w_prev moves only at refresh
    assert not np.allclose(wg[0].asnumpy(), w0[0])
    # momentum really accumulated (differs from plain SGD after several steps)
    assert np.abs(sg[0][1].asnumpy()).max() > 0


def test_global_momentum_state_survives_numpy_round_trip():
    """As RoundClient.state()/load_state store it: state{i} = s.asnumpy(), then s[:] = arrays[...]."""
    rng = np.random.RandomState(9)
    shapes = [(2, 3), (4,)]
    kw = dict(momentum=MU, learning_rate=BASE_LR, wd=WD, rescale_grad=RESCALE)
    a = GlobalMomentum(lr_scheduler=make_schedule(), **kw)
    wa = [mx.nd.array(rng.standard_normal(s)) for s in shapes]
    sa = [a.create_state(i, w) for i, w in enumerate(wa)]
    for t in range(3):
        for i, s in enumerate(shapes):
            a.update(i, wa[i], mx.nd.array(rng.standard_normal(s)), sa[i])
            if t == 1:
                wa[i][:] = wa[i] + 0.5
                GlobalMomentum.refresh(sa[i], wa[i], 2)
    arrays = {f"state{i}": s.asnumpy() for i, s in enumerate(sa)}
    weights = [w.asnumpy() for w in wa]
    counts, num_update = dict(a._index_update_count), a.num_update
    # a fresh optimizer on other weights, restored from the saved arrays
    b = GlobalMomentum(lr_scheduler=make_schedule(), **kw)
    wb = [mx.nd.array(w) for w in weights]
    sb = [b.create_state(i, mx.nd.zeros(s)) for i, s in enumerate(shapes)]
    for i, s in enumerate(sb):
        s[:] = arrays[f"state{i}"]
    b._index_update_count, b.num_update = dict(counts), num_update
    for i in range(len(shapes)):
        np.testing.assert_array_equal(sb[i].asnumpy(), sa[i].asnumpy())
    for t in range(3):
        for i, s in enumerate(shapes):
            g = rng.standard_normal(s)
            a.update(i, wa[i], mx.nd.array(g), sa[i])
            b.update(i, wb[i], mx.nd.array(g), sb[i])
            if t == 1:
                for w, st in ((wa[i], sa[i]), (wb[i], sb[i])):
                    w[:] = w - 0.25
                    GlobalMomentum.refresh(st, w, 3)
    for i in range(len(shapes)):
        np.testing.assert_array_equal(wb[i].asnumpy(), wa[i].asnumpy())
        np.testing.assert_array_equal(sb[i].asnumpy(), sa[i].asnumpy())


def test_local_sgd_is_mxnet_sgd_with_noop_refresh():
    rng = np.random.RandomState(4)
    kw = dict(momentum=0.0, learning_rate=0.3, wd=WD, rescale_grad=RESCALE, lr_scheduler=make_schedule())
    loc, sgd = LocalSGD(**kw), mx.optimizer.SGD(**kw)
    w0 = rng.standard_normal((3, 2)).astype(np.float32)
    wl, ws = mx.nd.array(w0), mx.nd.array(w0)
    assert loc.create_state(0, wl) is None          # no momentum: no state (the client skips it)
    state = mx.nd.array(w0)
    LocalSGD.refresh(state, mx.nd.zeros((3, 2)), 5)
    np.testing.assert_array_equal(state.asnumpy(), w0)
    for _ in range(4):
        g = mx.nd.array(rng.standard_normal((3, 2)))
        loc.update(0, wl, g, None)
        sgd.update(0, ws, g, None)
    np.testing.assert_allclose(wl.asnumpy(), ws.asnumpy(), rtol=1e-6, atol=1e-7)
    assert not np.allclose(wl.asnumpy(), w0)


# ------------------------------------------------------------------ RoundClient picks the local optimizer

class _StubKV:
    num_workers = 2
    rank = 0


class _StubParam:
    def __init__(self, arr):
        self._arr = arr
        self.shape = arr.shape

    def data(self):
        return self._arr


def _round_client(optimizer, *overrides):
    import os

    from ssdsgd.algorithms.ssd import RoundClient
    from ssdsgd.config import load_config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs", "demo_digits_ssd.yaml"),
                      [f"algorithm.local.optimizer={optimizer}"] + list(overrides))
    sched = LRSchedule("cosine", base_lr=cfg.train.lr, total_updates=100, final_lr=0.001)
    rng = np.random.RandomState(0)
    params = [_StubParam(mx.nd.array(rng.standard_normal(s))) for s in [(3, 2), (4,)]]
    return RoundClient(_StubKV(), params, cfg, sched, log=None, total_steps=100), params, cfg


def _no_buffers():
    """A transport and downlink of a plan without buffers: what state()/load_state read of them."""
    from types import SimpleNamespace

    from ssdsgd.algorithms.downlink import Downlink
    transport = SimpleNamespace(pull_bufs=[], buffers=[], stages=[])
    return transport, Downlink(transport, {}, 1, None)


@pytest.mark.parametrize("name, cls", [("global_momentum", GlobalMomentum), ("glu", GLU), ("sgd", LocalSGD)])
def test_round_client_picks_local_optimizer(name, cls):
    client, params, cfg = _round_client(name)
    opt = client.local_opt
    assert type(opt) is cls
    scale = cfg.algorithm.local.lr_scale
    assert scale == 4.0
    assert opt.lr_scheduler.base_lr == pytest.approx(scale * cfg.train.lr)
    # No local update happens in the warm-up: the first one is global update warmup + 1.
    assert opt.num_update == min(cfg.algorithm.warmup_iters, 100) > 0
    for t in (1, 50, 99):        # the local schedule follows the global one, scaled
        assert opt.lr_scheduler(t) == pytest.approx(scale * client.schedule(t), rel=1e-12)
    assert opt.rescale_grad == pytest.approx(1.0 / (2 * cfg.train.batch_size))
    assert opt.wd == cfg.train.wd
    if name == "global_momentum":
        assert opt.momentum == cfg.train.momentum == 0.9
        for p, s in zip(params, client.local_states):
            assert s.shape == (2,) + p.shape
            np.testing.assert_array_equal(s[0].asnumpy(), p.data().asnumpy())
            np.testing.assert_array_equal(s[1].asnumpy(), 0)
    elif name == "sgd":
        assert opt.momentum == 0.0 and client.local_states == [None, None]


def test_round_client_global_momentum_state_and_load_state_round_trip():
    """RoundClient.state()/load_state carry GlobalMomentum's [w_prev, v] and its update counts."""
    client, params, _ = _round_client("global_momentum")
    # only the pieces state()/load_state read besides the local optimizer (no plan, no kvstore)
    client.encoders, client.stages, client.versions = [None], [], [3]
    client.transport, client.downlink = _no_buffers()
    rng = np.random.RandomState(1)
    for i, p in enumerate(params):
        client.local_opt.update(i, p.data(), mx.nd.array(rng.standard_normal(p.shape)), client.local_states[i])
        p.data()[:] = p.data() + 1.0
        client.local_opt.refresh(client.local_states[i], p.data(), 2)
        client.local_opt.update(i, p.data(), mx.nd.array(rng.standard_normal(p.shape)), client.local_states[i])
    arrays, meta = client.state()
    assert sorted(arrays) == ["state0", "state1"]
    other, _, _ = _round_client("global_momentum")
    other.encoders, other.stages = [None], []
    other.transport, other.downlink = _no_buffers()
    other.load_state(arrays, meta)
    for s_new, s_old in zip(other.local_states, client.local_states):
        assert np.abs(s_old[1].asnumpy()).max() > 0
        np.testing.assert_array_equal(s_new.asnumpy(), s_old.asnumpy())
    w = client.cfg.algorithm.warmup_iters         # local counts start there (see the test above)
    assert other.local_opt._index_update_count == {0: w + 2, 1: w + 2}
    assert other.local_opt.num_update == client.local_opt.num_update == w + 2
    assert other.versions == [3]


@pytest.mark.parametrize("mc", [False, True])
def test_round_client_delay_stage_momentum(mc):
    """algorithm.momentum reaches the local optimizer and the servers' delay-stage rule; under momentum
    correction the servers run plain SGD in both stages."""
    client, _, cfg = _round_client("global_momentum", "algorithm.momentum=0.7",
                                   f"compression.momentum_correction={str(mc).lower()}")
    assert client.local_opt.momentum == 0.7 and client.delay_momentum == 0.7
    assert (client.server_momentum, client.server_delay_momentum) == ((0.0, 0.0) if mc else (0.9, 0.7))
    default, _, _ = _round_client("global_momentum")
    assert default.delay_momentum == default.local_opt.momentum == cfg.train.momentum


@pytest.mark.parametrize("train_momentum", [0.0, 0.9])
def test_delay_stage_momentum_correction_uses_the_stage_momentum(train_momentum):
    """With momentum correction the workers' memory runs at algorithm.momentum once the delay stage
    begins, even when the warm-up had no momentum at all (train.momentum 0)."""
    from ssdsgd.compression.memory import Memory
    client, _, _ = _round_client("global_momentum", f"train.momentum={train_momentum}", "algorithm.momentum=0.7",
                                 "compression.type=topk", "compression.momentum_correction=true")
    client.memory = Memory(True, train_momentum)
    client._delay_stage_correction()
    assert client.memory.momentum == 0.7
    plain, _, _ = _round_client("global_momentum", "algorithm.momentum=0.7", "compression.type=topk",
                                "compression.momentum_correction=false")
    plain.memory = Memory(True, 0.0)
    plain._delay_stage_correction()
    assert plain.memory.momentum == 0.0          # no correction: the memory holds no momentum


class _SlowClockKV(_StubKV):
    """The clock key reads `version - 1` until `after` seconds have passed, then `version`."""

    def __init__(self, version, after):
        import time
        self.version, self.ready_at = version, time.monotonic() + after

    def pull(self, key, out, priority=0):
        import time
        out[:] = self.version if time.monotonic() >= self.ready_at else self.version - 1


@pytest.mark.parametrize("server_timeout, notes", [(60, 1), (0, 0)])
def test_a_long_wait_for_a_round_names_the_buffers_server_once(capsys, server_timeout, notes):
    from types import SimpleNamespace
    client, _, _ = _round_client("sgd", f"cluster.server_timeout={server_timeout}")
    assert client.wait_note == (server_timeout or None)
    if client.wait_note:
        client.wait_note = 0.05           # the config's minimum is 3 s; the test stays short
    from ssdsgd.algorithms.transport import RoundTransport
    transport = RoundTransport(_SlowClockKV(3, after=0.3), [([SimpleNamespace(clock_key=7, server=1, size=1)], [])],
                               None, client.wait_note)
    transport.poll_clock(0, 3)
    out = capsys.readouterr().out
    assert out.count("rank 0: waited 0.05 s for round 2 of buffer 0, held by server rank 1: another worker is "
                     "behind, or the connection to that server is lost\n") == notes
    assert out.count("waited") == notes


# ------------------------------------------------------------------ whole-buffer forms, bit for bit

MANY_SHAPES = [(4, 3, 3, 3), (4,), (1,), (10, 8)] * 17          # 68 parameters of a buffer


def _optimizers():
    common = dict(learning_rate=0.3, wd=WD, rescale_grad=RESCALE, lr_scheduler=make_schedule())
    return [("global_momentum", lambda: GlobalMomentum(momentum=0.9, **common)),
            ("glu", lambda: GLU(c=0.5, **common)),
            ("sgd", lambda: LocalSGD(momentum=0.0, **common))]


def _bits(a):
    """An array's float32 bit patterns (so -0.0 differs from +0.0, and a NaN is compared by its bits)."""
    return np.ascontiguousarray(a.asnumpy(), np.float32).view(np.uint32)


@pytest.mark.parametrize("name, make", _optimizers())
@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_refresh_buffer_is_the_per_parameter_rule_bit_for_bit(name, make, rounds):
    """refresh_buffer over a buffer's pieces leaves the very bits the per-parameter rule (the
    optimizer's refresh(state, weight, rounds)) leaves, and both are the rule in numpy."""
    rng = np.random.default_rng(6)
    opt = make()
    weights = [mx.nd.array(rng.standard_normal(s)) for s in MANY_SHAPES]
    states_ref = [opt.create_state(i, w) for i, w in enumerate(weights)]
    for s in states_ref:                                   # a state that is not the initial one
        if s is not None:
            s[:] = mx.nd.array(rng.standard_normal(s.shape))
    states_buf = [None if s is None else s.copy() for s in states_ref]
    params = FlatViews(weights)
    new = params.buffer()
    flat_new = rng.standard_normal(params.size).astype(np.float32)
    flat_new[:4] = [0.0, -0.0, 0.0, -0.0]                  # signed zeros must come through as they are
    new.array[:] = flat_new
    params.copy_from(new)                                   # the client loads the weights first
    before = [None if s is None else s.asnumpy() for s in states_ref]
    for i, w in enumerate(weights):
        type(opt).refresh(states_ref[i], w, rounds)
    views = opt.state_views(states_buf)
    assert (views is None) == (name == "sgd")
    if views is not None:
        type(opt).refresh_buffer(views, new, rounds)
    for ref, buf in zip(states_ref, states_buf):
        if ref is not None:
            np.testing.assert_array_equal(_bits(buf), _bits(ref))
    start = 0
    for old, s, shape in zip(before, states_buf, MANY_SHAPES):     # and what that is, in numpy
        piece = flat_new[start:start + int(np.prod(shape))].reshape(shape)
        start += piece.size
        if name == "glu":
            np.testing.assert_array_equal(s.asnumpy(), piece)                  # the snapshot
        elif name == "global_momentum":
            np.testing.assert_array_equal(s[0].asnumpy(), piece)               # w_prev = w_new
            velocity = (piece - old[0]) / np.float32(rounds) if rounds else old[1]
            np.testing.assert_array_equal(s[1].asnumpy(), velocity)


def test_round_client_loads_a_buffer_through_flat_views_and_follows_a_replaced_array():
    """_set_buffer (dense pull) and _refresh_from_replica (sparse downlink) load the parameters and
    refresh GlobalMomentum's states as the per-parameter rule does; a parameter whose array was
    replaced gets the next refresh in its new array, not through a stale view."""
    from types import SimpleNamespace
    client, params, _ = _round_client("global_momentum")
    rng = np.random.RandomState(7)
    size = sum(p.data().size for p in params)
    from ssdsgd.algorithms.downlink import Downlink
    from ssdsgd.algorithms.transport import RoundTransport
    client.buffers = [SimpleNamespace(params=[0, 1], size=size)]
    client.transport = RoundTransport(_StubKV(), [(client.buffers, [])], None)
    client.downlink = Downlink(client.transport, {}, 1, None)        # dense pulls only
    client.versions, client.views = [2], [None]                        # a dense pull landed
    client.staging = [mx.nd.zeros(size)]
    new = rng.standard_normal(size).astype(np.float32)
    client.transport.pull_bufs = [mx.nd.array(np.append(new, np.float32(5)))]
    reference = [s.copy() for s in client.local_states]
    assert client._apply_pull(0) == 5 and client.versions == [5]
    start = 0
    for p, ref in zip(params, reference):
        piece = new[start:start + p.data().size].reshape(p.shape)
        start += piece.size
        np.testing.assert_array_equal(p.data().asnumpy(), piece)
        GlobalMomentum.refresh(ref, mx.nd.array(piece), 3)          # 3 rounds: version 2 -> 5
    for s, ref in zip(client.local_states, reference):
        np.testing.assert_array_equal(_bits(s), _bits(ref))
    np.testing.assert_array_equal(client.transport.pull_bufs[0].asnumpy()[-1], 5)   # the version slot is left

    replaced = mx.nd.zeros(params[0].shape)
    params[0]._arr = replaced                                        # e.g. a re-initialised parameter
    again = rng.standard_normal(size).astype(np.float32)
    client.downlink.replicas = [SimpleNamespace(weights=again, version=6)]
    assert client._refresh_from_replica(0) == 6 and client.versions == [6]
    np.testing.assert_array_equal(replaced.asnumpy().ravel(), again[:replaced.size])
    np.testing.assert_array_equal(params[1].data().asnumpy(), again[replaced.size:])
    client.staging = [mx.nd.zeros(size)]                             # a replaced staging buffer too
    client.downlink.replicas = [SimpleNamespace(weights=-again, version=7)]
    assert client._refresh_from_replica(0) == 7
    np.testing.assert_array_equal(replaced.asnumpy().ravel(), -again[:replaced.size])
