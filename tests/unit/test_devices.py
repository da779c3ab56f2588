"""Several devices per worker (ssdsgd/worker/devices.py, train.devices, cluster.device), on CPU contexts.

The replicas are cpu(1) and cpu(2), never cpu(0): a Gluon parameter read without its context resolves to
cpu(0) and fails there, as it would on a GPU. So every job here also proves that the clients and the
compressor only touch host arrays.
"""

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from ssdsgd.launch.gpus import assign, parse_ids
from ssdsgd.launch.hosts import read_hostfile
from ssdsgd.launch.usage import UsageError
from ssdsgd.worker.devices import HOST, DeviceReplicas, worker_contexts
from ssdsgd.worker.models import build_model

TWO = [mx.cpu(1), mx.cpu(2)]


def _net(name, contexts, seed=0):
    mx.random.seed(seed)
    net = build_model(name, 10)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    with mx.autograd.record():
        net(mx.nd.zeros((2, 1, 8, 8), ctx=contexts[0]))
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    return net, params


def _batch(n=10, seed=1):
    rng = np.random.RandomState(seed)
    return mx.nd.array(rng.rand(n, 1, 8, 8)), mx.nd.array(rng.randint(0, 10, n))


def test_cpu_replicas_leave_cpu0_out_so_a_contextless_read_fails():
    assert worker_contexts("cpu", 1) == [HOST]
    assert worker_contexts("cpu", 3) == [mx.cpu(1), mx.cpu(2), mx.cpu(3)]
    _, params = _net("mlp", TWO)
    with pytest.raises(RuntimeError, match="not initialized on context cpu\\(0\\)"):
        params[0].data()


def test_summed_gradients_of_two_replicas_equal_one_device_on_the_whole_batch():
    """An uneven split (5 + 4 of 9 images): the host gradient is the sum over the replicas, equal to one
    device's gradient of the whole batch; the loss covers every image, in order."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    data, label = _batch(9)
    one_net, one_params = _net("mlp", [HOST])
    one = DeviceReplicas.of_net(one_net, one_params, [HOST])
    two_net, two_params = _net("mlp", TWO)
    two = DeviceReplicas.of_net(two_net, two_params, TWO)
    loss1 = one.forward_backward(one_net, loss_fn, data, label)
    loss2 = two.forward_backward(two_net, loss_fn, data, label)
    assert loss2.context == HOST and loss2.shape == (9,)
    np.testing.assert_allclose(loss2.asnumpy(), loss1.asnumpy(), rtol=1e-5)
    for h1, h2 in zip(one.host, two.host):
        assert h2.grad().context == HOST and h2.data().context == HOST
        np.testing.assert_allclose(h2.grad().asnumpy(), h1.grad().asnumpy(), rtol=1e-4, atol=1e-6)


def test_buckets_cut_the_parameters_in_order_and_each_bucket_sums_its_own_gradients():
    from ssdsgd.worker.devices import _bucket_bounds
    assert _bucket_bounds([3, 3, 3, 10, 1], 6, 100) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert _bucket_bounds([5], 1, 100) == [(0, 1)]
    assert _bucket_bounds([1, 1, 50, 1, 1], 100, 50) == [(0, 2), (2, 3), (3, 5)]      # a large one alone
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    data, label = _batch(9)
    nets = [_net("mlp", TWO) for _ in range(2)]
    whole, cut = (DeviceReplicas.of_net(net, params, TWO, **kw) for (net, params), kw in
                  zip(nets, ({}, {"bucket_values": 2000, "alone_values": 5000})))
    assert len(whole.buckets) == 1 and len(cut.buckets) > 3
    assert {type(b).__name__ for b in cut.buckets} == {"_Alone", "_Bucket"}
    for r, (net, _) in zip((whole, cut), nets):
        r.forward_backward(net, loss_fn, data, label)
    for a, b in zip(whole.host, cut.host):
        np.testing.assert_array_equal(a.grad().asnumpy(), b.grad().asnumpy())


def test_one_replica_on_the_host_is_the_parameters_own_arrays():
    """train.devices: 1 on CPU is the single-device path: the clients get the parameters' own arrays."""
    net, params = _net("mlp", [HOST])
    r = DeviceReplicas.of_net(net, params, [HOST])
    for h, p in zip(r.host, params):
        assert h.data() is p.data() and h.grad() is p.grad()


def test_scatter_writes_every_replica_and_state_round_trips_each_replicas_batchnorm():
    net, params = _net("small_cnn", TWO)
    r = DeviceReplicas.of_net(net, params, TWO)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    r.forward_backward(net, loss_fn, *_batch(8))           # each replica's statistics of its own half
    for h in r.host:
        h.data()[:] = h.data() + 1.0
    r.scatter()
    for p, h in zip(params, r.host):
        for c in TWO:
            np.testing.assert_array_equal(p.data(c).asnumpy(), h.data().asnumpy())
    state = r.state()
    means = [k for k in state if k.startswith("aux") and k.endswith(".replica1")]
    assert means and any(not np.array_equal(state[k], state[k.split(".")[0]]) for k in means)
    net2, params2 = _net("small_cnn", TWO, seed=5)
    r2 = DeviceReplicas.of_net(net2, params2, TWO)
    r2.load_state(state)
    for key, value in r2.state().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    for p, h in zip(params2, r2.host):
        np.testing.assert_array_equal(p.data(mx.cpu(2)).asnumpy(), h.data().asnumpy())
    del state[means[0]]
    with pytest.raises(Exception, match="train.devices must match"):
        r2.load_state(state)


def test_save_global_writes_the_host_weights_as_gluon_names_them(tmp_path):
    net, params = _net("small_cnn", TWO)
    r = DeviceReplicas.of_net(net, params, TWO)
    for h in r.host:
        h.data()[:] = 0.25
    r.save_global(net, str(tmp_path / "final.params"))
    fresh = build_model("small_cnn", 10)
    fresh.load_parameters(str(tmp_path / "final.params"), ctx=HOST)     # Gluon's own names and shapes
    for p in fresh.collect_params().values():
        if p.grad_req != "null":
            assert (p.data().asnumpy() == 0.25).all()


# ---- the launcher's GPUs --------------------------------------------------------------------------------
def test_workers_that_share_a_host_get_disjoint_gpus_and_a_host_that_runs_out_is_named():
    hosts = [("a", [0, 1, 2, 3]), ("b", None), ("a", [0, 1, 2, 3]), ("b", None)]
    assert assign(hosts, 2) == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert assign([("a", None)] * 3, 1, default_ids=[5, 6, 7]) == [[5], [6], [7]]
    with pytest.raises(UsageError, match=r"host a: 2 workers x 3 GPUs each do not fit its 4 GPUs \(0,1,2,3\)"):
        assign([("a", [0, 1, 2, 3])] * 2, 3)
    assert parse_ids("4", "x") == [0, 1, 2, 3] and parse_ids("1,3", "x") == [1, 3]
    for bad in ("0", "1,1", "a,b", ""):
        with pytest.raises(UsageError):
            parse_ids(bad, "x")


def test_host_file_gpus_option(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("h1 slots=2 gpus=0,1,2,3\nh2 gpus=2\nh3\n")
    assert [h.gpus for h in read_hostfile(str(f))] == [[0, 1, 2, 3], [0, 1], None]
    f.write_text("h1 gpus=0,0\n")
    with pytest.raises(UsageError, match="GPU ids must be distinct"):
        read_hostfile(str(f))


def test_gpu_check_sum_fails_when_a_replicas_gradient_is_lost(monkeypatch):
    """The sum check can fail: with the second replica's gradient left out of the host sum it does."""
    from scripts import gpu_check
    gather = DeviceReplicas.gather

    def first_only(self):
        gather(self)
        if not self.on_host:
            for b in self.buckets:
                b.staged_grads[0].array.copyto(b.grads)
    monkeypatch.setattr(DeviceReplicas, "gather", first_only)
    ok, detail = gpu_check.check_sum(TWO)
    assert not ok, detail
