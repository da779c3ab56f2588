"""Tests for the BatchNorm statistics recomputation used when evaluating the global weights
(ssdsgd.worker.evaluate: recompute_bn_stats, bn_stats_restored, evaluate_global), against statistics
computed here in numpy from the layers' own weights (numpy convolution, numpy batch normalisation).

MXNet 1.9's BatchNorm (CPU, oneDNN build) keeps running statistics of the BIASED batch variance
(divide by N*H*W): test_mxnet_running_var_is_biased pins that down, and the references use it."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd
from mxnet.gluon import nn

from ssdsgd.worker.evaluate import batchnorm_layers, bn_stats_restored, evaluate_global, recompute_bn_stats

EPS = 1e-5
IN_C, H, W = 2, 6, 6
BATCH = 4


def make_net(hybridize, momentum=0.9, seed=0):
    """Conv2D -> BatchNorm -> relu -> Conv2D -> BatchNorm -> Dense, built like worker.build_net:
    initialised, shapes materialised with a recorded forward, then (optionally) hybridized with
    static_alloc/static_shape. gamma/beta and the running statistics are set to arbitrary values so
    that nothing passes by accident of the defaults."""
    mx.random.seed(seed)
    rng = np.random.RandomState(seed)
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 3, padding=1, in_channels=IN_C),
            nn.BatchNorm(momentum=momentum, in_channels=4),
            nn.Activation("relu"),
            nn.Conv2D(3, 3, padding=1, in_channels=4),
            nn.BatchNorm(momentum=momentum, in_channels=3),
            nn.Dense(5))
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2))
    with autograd.record():
        net(mx.nd.zeros((2, IN_C, H, W)))
    for conv in (net[0], net[3]):
        conv.bias.set_data(mx.nd.array(rng.uniform(-1, 1, conv.bias.shape)))
    for bn in (net[1], net[4]):
        c = bn.gamma.shape[0]
        bn.gamma.set_data(mx.nd.array(rng.uniform(0.5, 2.0, c)))
        bn.beta.set_data(mx.nd.array(rng.uniform(-1, 1, c)))
        bn.running_mean.set_data(mx.nd.array(rng.uniform(-3, 3, c)))
        bn.running_var.set_data(mx.nd.array(rng.uniform(2, 5, c)))
    if hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    return net


def make_batches(n=3, seed=1):
    """Batches with different offsets and scales, so that the average of the per-batch variances
    differs clearly from the variance over all batches pooled."""
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.standard_normal((BATCH, IN_C, H, W)) * (1 + b) + 2 * b - 1),
             mx.nd.array(rng.randint(0, 5, BATCH)))
            for b in range(n)]


def np_conv3x3(x, w, b):
    """Cross-correlation, 3x3 kernel, stride 1, zero padding 1 (MXNet's Conv2D)."""
    n, _, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out + b[None, :, None, None]


def batch_stats(h):
    return h.mean(axis=(0, 2, 3)), h.var(axis=(0, 2, 3))       # biased, as MXNet


def np_bn_train(h, gamma, beta):
    """Training-mode BatchNorm: normalise with the batch's own mean and biased variance."""
    m, v = batch_stats(h)
    return ((h - m[None, :, None, None]) / np.sqrt(v + EPS)[None, :, None, None]
            * gamma[None, :, None, None] + beta[None, :, None, None])


def reference_stats(weights, batches):
    """[(mean, var)] per BN layer: the average over the batches of the batch mean and biased
    variance of that layer's input, as a training-mode forward of these weights produces it."""
    per_layer = [[], []]
    for data, _ in batches:
        x = data.asnumpy().astype(np.float64)
        h1 = np_conv3x3(x, weights["w1"], weights["b1"])
        per_layer[0].append(batch_stats(h1))
        a1 = np.maximum(0.0, np_bn_train(h1, weights["g1"], weights["be1"]))
        h2 = np_conv3x3(a1, weights["w2"], weights["b2"])
        per_layer[1].append(batch_stats(h2))
    return [(np.mean([m for m, _ in stats], axis=0), np.mean([v for _, v in stats], axis=0))
            for stats in per_layer]


def net_weights(net):
    f = lambda p: p.data().asnumpy().astype(np.float64)      # noqa: E731
    return dict(w1=f(net[0].weight), b1=f(net[0].bias), g1=f(net[1].gamma), be1=f(net[1].beta),
                w2=f(net[3].weight), b2=f(net[3].bias))


def bn_stats(net):
    return [(bn.running_mean.data().asnumpy().copy(), bn.running_var.data().asnumpy().copy())
            for bn in (net[1], net[4])]


def assert_stats_equal(got, want):
    for (gm, gv), (wm, wv) in zip(got, want, strict=True):
        np.testing.assert_allclose(gm, wm, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gv, wv, rtol=1e-4, atol=1e-4)


def test_mxnet_running_var_is_biased():
    """Which variance MXNet 1.9 puts in running_var: the biased one (and in the backward pass)."""
    x = np.random.RandomState(0).standard_normal((3, 2, 2, 2)) * 3 + 1
    bn = nn.BatchNorm(momentum=0.0, in_channels=2)
    bn.initialize()
    with autograd.record():
        out = bn(mx.nd.array(x))
    out.backward()
    mx.nd.waitall()
    biased, unbiased = x.var(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)
    assert not np.allclose(biased, unbiased, rtol=1e-3)
    np.testing.assert_allclose(bn.running_var.data().asnumpy(), biased, rtol=1e-5)
    np.testing.assert_allclose(bn.running_mean.data().asnumpy(), x.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_batchnorm_layers_found_in_order():
    net = make_net(hybridize=False)
    assert batchnorm_layers(net) == [net[1], net[4]]
    outer = nn.HybridSequential()
    inner = nn.HybridSequential()
    inner.add(nn.Dense(3), nn.BatchNorm())
    outer.add(nn.BatchNorm(), inner, nn.Dense(2))
    assert batchnorm_layers(outer) == [outer[0], inner[1]]         # nested blocks too


@pytest.mark.parametrize("momentum", [0.9, 0.5])
@pytest.mark.parametrize("hybridize", [True, False])
def test_recompute_equals_numpy_average_of_batch_stats(hybridize, momentum):
    net = make_net(hybridize, momentum=momentum)
    batches = make_batches()
    weights = net_weights(net)
    want = reference_stats(weights, batches)
    before = bn_stats(net)
    recompute_bn_stats(net, iter(batches))      # a one-shot iterator, as evaluate_global gets
    got = bn_stats(net)
    assert_stats_equal(got, want)
    # a real change, and not the statistics of all data pooled (nor of the last batch only)
    for (gm, gv), (bm, bv) in zip(got, before):
        assert not np.allclose(gm, bm, atol=1e-2) and not np.allclose(gv, bv, atol=1e-2)
    h1_all = np.concatenate([np_conv3x3(d.asnumpy().astype(np.float64), weights["w1"], weights["b1"])
                             for d, _ in batches])
    assert not np.allclose(got[0][1], h1_all.var(axis=(0, 2, 3)), rtol=1e-2)
    last = reference_stats(weights, batches[-1:])
    assert not np.allclose(got[1][1], last[1][1], rtol=1e-2)
    # the weights themselves are untouched (backward ran, but no update)
    for name, value in net_weights(net).items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    # and inference uses the recomputed statistics: compare with a numpy inference forward
    x = batches[0][0]
    out = net(x).asnumpy()
    want_out = np_inference(net, x.asnumpy().astype(np.float64), got)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-4)


def np_inference(net, x, stats):
    w = net_weights(net)

    def bn(h, gamma, beta, mean, var):
        s = lambda a: a[None, :, None, None]      # noqa: E731
        return (h - s(mean)) / np.sqrt(s(var) + EPS) * s(gamma) + s(beta)
    h = np.maximum(0, bn(np_conv3x3(x, w["w1"], w["b1"]), w["g1"], w["be1"], *stats[0]))
    h = bn(np_conv3x3(h, w["w2"], w["b2"]), net[4].gamma.data().asnumpy(), net[4].beta.data().asnumpy(),
           *stats[1])
    dense = net[5]
    return h.reshape(len(x), -1) @ dense.weight.data().asnumpy().T + dense.bias.data().asnumpy()


@pytest.mark.parametrize("hybridize", [True, False])
def test_bn_stats_restored_puts_original_statistics_back(hybridize):
    net = make_net(hybridize)
    batches = make_batches()
    original = bn_stats(net)
    x = batches[1][0]
    out_before = net(x).asnumpy()
    with bn_stats_restored(net):
        recompute_bn_stats(net, batches)
        during = bn_stats(net)
        out_during = net(x).asnumpy()
    assert not np.allclose(during[1][0], original[1][0], atol=1e-2)
    assert not np.allclose(out_during, out_before, atol=1e-3)
    assert_stats_equal(bn_stats(net), original)
    for (gm, gv), (om, ov) in zip(bn_stats(net), original):
        np.testing.assert_array_equal(gm, om)
        np.testing.assert_array_equal(gv, ov)
    np.testing.assert_allclose(net(x).asnumpy(), out_before, rtol=1e-6, atol=1e-6)
    # also when the body raises
    with pytest.raises(RuntimeError, match="boom"):
        with bn_stats_restored(net):
            recompute_bn_stats(net, batches)
            raise RuntimeError("boom")
    for (gm, gv), (om, ov) in zip(bn_stats(net), original):
        np.testing.assert_array_equal(gm, om)
        np.testing.assert_array_equal(gv, ov)


def test_empty_batches_raise_and_leave_statistics():
    net = make_net(hybridize=True)
    original = bn_stats(net)
    with pytest.raises(ValueError):
        recompute_bn_stats(net, [])
    with pytest.raises(ValueError):
        recompute_bn_stats(net, iter(()))
    for (gm, gv), (om, ov) in zip(bn_stats(net), original):
        np.testing.assert_array_equal(gm, om)
        np.testing.assert_array_equal(gv, ov)


class _StubClient:
    def __init__(self, weights):
        self.weights = weights
        self.calls = []

    def global_weights(self, steps_done):
        self.calls.append(steps_done)
        return [w.copy() for w in self.weights], 123


def global_and_local_weights(net):
    """(trainable params, 'global' weights 0.3 sd away from the local ones, copies of the local ones)."""
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    rng = np.random.RandomState(3)
    global_w = [mx.nd.array(p.data().asnumpy() + 0.3 * rng.standard_normal(p.shape)) for p in params]
    local_w = [p.data().asnumpy().copy() for p in params]
    return params, global_w, local_w


class _RecordingTestSet:
    """Yields one batch; records the net's weights and BN statistics at evaluation time."""

    def __init__(self, net, data, label):
        self.net, self.data, self.label = net, data, label
        self.seen = None

    def batches(self, batch_size, part=0, parts=1):
        assert (part, parts) == (0, 1)
        self.seen = (net_weights(self.net), bn_stats(self.net))
        yield self.data, self.label


@pytest.mark.parametrize("with_bn_batches", [True, False])
def test_evaluate_global_recomputes_for_the_global_weights_then_restores(with_bn_batches):
    net = make_net(hybridize=True)
    params, global_w, local_w = global_and_local_weights(net)
    original = bn_stats(net)
    batches = make_batches()
    # the statistics the GLOBAL weights produce (not the local ones)
    for p, w in zip(params, global_w):
        w.copyto(p.data())
    want_global = reference_stats(net_weights(net), batches)
    want_weights = net_weights(net)
    x = batches[2][0]
    with bn_stats_restored(net):
        recompute_bn_stats(net, batches)
        pred = net(x).argmax(axis=1)
    for p, w in zip(params, local_w):
        p.data()[:] = w
    want_local = reference_stats(net_weights(net), batches)
    assert not np.allclose(want_local[1][0], want_global[1][0], atol=1e-2)
    pred_np = pred.asnumpy()
    label = mx.nd.array(np.where(np.arange(BATCH) % 2 == 0, pred_np, (pred_np + 1) % 5))  # half right
    test_set = _RecordingTestSet(net, x, label)
    client = _StubClient(global_w)
    bn_batches = iter(batches) if with_bn_batches else None
    (correct, images), pulled = evaluate_global(net, params, client, test_set, BATCH, 77, bn_batches)
    acc = correct / images
    assert client.calls == [77] and pulled == 123 and images == BATCH
    seen_weights, seen_stats = test_set.seen
    for name, value in seen_weights.items():
        np.testing.assert_allclose(value, want_weights[name], rtol=1e-6, atol=1e-6, err_msg=name)
    if with_bn_batches:
        assert_stats_equal(seen_stats, want_global)
        assert acc == 0.5
    else:
        for (gm, gv), (om, ov) in zip(seen_stats, original):
            np.testing.assert_array_equal(gm, om)
            np.testing.assert_array_equal(gv, ov)
    # afterwards: the local weights and the original statistics are back
    for p, w in zip(params, local_w):
        np.testing.assert_array_equal(p.data().asnumpy(), w)
    for (gm, gv), (om, ov) in zip(bn_stats(net), original):
        np.testing.assert_array_equal(gm, om)
        np.testing.assert_array_equal(gv, ov)
