"""The static-graph twin that evaluates an imperative model (models.inference_graph, models.build_eval_net):
its outputs against a numpy forward of the network's current weights and statistics, however those
change, and a real job whose reported accuracy is recomputed here from its saved weights."""
import os

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT
from mxnet import autograd, gluon
from unit.test_bn_stats import (
    _RecordingTestSet,
    _StubClient,
    bn_stats,
    global_and_local_weights,
    make_batches,
    make_net,
    np_inference,
)

from ssdsgd.worker.evaluate import bn_stats_restored, evaluate_global, recompute_bn_stats
from ssdsgd.worker.models import inference_graph


def assert_graph_is_numpy_forward(graph, net, x):
    want = np_inference(net, x.asnumpy().astype(np.float64), bn_stats(net))
    np.testing.assert_allclose(graph(x).asnumpy(), want, rtol=1e-4, atol=1e-4)


def test_graph_follows_every_change_of_the_shared_parameters():
    net = make_net(hybridize=False)
    graph = inference_graph(net)
    # the very same Parameter objects (no copies of the weights)
    assert {id(p) for p in graph.collect_params().values()} == {id(p) for p in net.collect_params().values()}
    batches = make_batches()
    x = batches[0][0]
    assert_graph_is_numpy_forward(graph, net, x)
    before = graph(x).asnumpy()
    # SGD steps on the imperative net write the weights in place (and its BatchNorm statistics)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for data, label in batches:
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(len(data))
    assert_graph_is_numpy_forward(graph, net, x)
    assert not np.allclose(graph(x).asnumpy(), before, atol=1e-3)
    # set_data, as a checkpoint load does, and statistics recomputed then restored
    net[3].weight.set_data(net[3].weight.data() * -1.5)
    assert_graph_is_numpy_forward(graph, net, x)
    with bn_stats_restored(net):
        recompute_bn_stats(net, batches)
        assert_graph_is_numpy_forward(graph, net, x)
    assert_graph_is_numpy_forward(graph, net, x)
    # a batch of another size (the test set's last batch) through the static-shape graph
    assert_graph_is_numpy_forward(graph, net, mx.nd.concat(x, x[:1], dim=0))


@pytest.mark.parametrize("with_bn_batches", [True, False])
def test_evaluate_global_runs_the_batches_through_eval_net(with_bn_batches):
    """evaluate_global with an imperative net and its graph: statistics recomputed through the net
    for the global weights, predictions from the graph, local weights and statistics back after."""
    net = make_net(hybridize=False)
    graph = inference_graph(net)
    params, global_w, local_w = global_and_local_weights(net)
    original = bn_stats(net)
    batches = make_batches()
    x = batches[2][0]
    for p, w in zip(params, global_w):
        w.copyto(p.data())
    with bn_stats_restored(net):
        if with_bn_batches:
            recompute_bn_stats(net, batches)
        want_logits = np_inference(net, x.asnumpy().astype(np.float64), bn_stats(net))
    want = want_logits.argmax(axis=1)
    for p, w in zip(params, local_w):
        p.data()[:] = w
    label = mx.nd.array(np.where(np.arange(len(want)) % 2 == 0, want, (want + 1) % 5))   # half right

    class RecordingGraph:
        outputs = []

        def __call__(self, data):
            out = graph(data)
            RecordingGraph.outputs.append(out.asnumpy())
            return out
    test_set = _RecordingTestSet(net, x, label)
    (correct, images), _ = evaluate_global(net, params, _StubClient(global_w), test_set, len(want), 5,
                                            iter(batches) if with_bn_batches else None, eval_net=RecordingGraph())
    # the graph ran the batch on the global weights (and, with bn_batches, their recomputed statistics)
    assert len(RecordingGraph.outputs) == 1
    np.testing.assert_allclose(RecordingGraph.outputs[0], want_logits, rtol=1e-4, atol=1e-4)
    assert (correct, images) == (len(want) // 2, len(want))
    for p, w in zip(params, local_w):
        np.testing.assert_array_equal(p.data().asnumpy(), w)
    for (gm, gv), (om, ov) in zip(bn_stats(net), original):
        np.testing.assert_array_equal(gm, om)
        np.testing.assert_array_equal(gv, ov)


def test_end_epoch_evaluates_through_the_runs_eval_net(monkeypatch):
    """The loop's evaluation at the end of an epoch hands evaluate_global the run's eval_net (the graph),
    not its net."""
    from types import SimpleNamespace

    from ssdsgd.config import load_config
    from ssdsgd.worker import evaluate, loop
    from ssdsgd.worker.counters import Counters
    cfg = load_config(os.path.join(ROOT, "configs", "demo_digits_ssd.yaml"), ["model.hybridize=false"])
    seen = {}

    def fake_evaluate(net, params, client, test_set, batch_size, steps_done, bn_batches=None, part=0, parts=1,
                      eval_net=None, replicas=None):
        seen.update(net=net, eval_net=eval_net, steps_done=steps_done)
        return (3, 4), 0
    monkeypatch.setattr(evaluate, "evaluate_global", fake_evaluate)
    net, graph = object(), object()
    run = SimpleNamespace(cfg=cfg, kv=SimpleNamespace(rank=0, num_workers=2), tally=None, net=net, eval_net=graph,
                          replicas=None,
                          total_steps=10, steps_per_epoch=10,
                          params=[], client=None, data=SimpleNamespace(test=None, eval_set="test"),
                          log=SimpleNamespace(write=lambda **kw: None))
    counters = Counters(0, "test", 0.0)
    loop._end_epoch(run, counters, cfg.train.epochs - 1, 10, 1.0)
    assert seen == {"net": net, "eval_net": graph, "steps_done": 10}
    assert counters.final_acc == 0.75


def test_images_per_second_after_an_epoch_end_leaves_out_its_evaluation(monkeypatch):
    """The first log line after an epoch's end divides the images since the last line by the training time
    alone: 20 s of evaluation and checkpoint in between do not make the speed dip."""
    from types import SimpleNamespace

    from ssdsgd.algorithms.base import StepRecord
    from ssdsgd.worker import loop
    from ssdsgd.worker.counters import Counters, StepTimes
    written = []
    counters = Counters(0, "test", 100.0)
    for step in range(4):
        counters.add_step(step, StepRecord(8, 8), 32, StepTimes(0.5, 0.5))
    counters.leave_out_of_window(20.0)                     # the epoch end, as the loop times it
    loss = SimpleNamespace(mean=lambda: SimpleNamespace(asscalar=lambda: 1.0))
    run = SimpleNamespace(kv=SimpleNamespace(rank=1), schedule=lambda step: 0.1,
                          client=SimpleNamespace(residual_norm=lambda: None),
                          log=SimpleNamespace(write=lambda **kw: written.append(kw)))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: 124.0)   # 4 s of training, 20 s of epoch end
    loop._log_steps(run, counters, 0, 4, loss, StepRecord(8, 8))
    assert written[0]["images_per_sec"] == 128 / 4.0
    assert counters.window["t"] == 124.0 and counters.window["n"] == 0
