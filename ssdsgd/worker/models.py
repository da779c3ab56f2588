"""Networks: small ones for the embedded demo and tests, and the gluoncv model zoo (never pretrained);
the model a worker trains (build_net) and what evaluates it (build_eval_net). The names model.name may
take are model_names.py's (the launcher front end checks them without importing MXNet)."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, sym
from mxnet.gluon import nn

from ssdsgd.worker.model_names import check_model_name


def _mlp(num_classes):
    net = nn.HybridSequential()
    net.add(nn.Flatten(), nn.Dense(128, activation="relu"), nn.Dense(64, activation="relu"),
            nn.Dense(num_classes))
    return net


def _small_cnn(num_classes):
    # Two conv blocks and a classifier: enough for digits (8x8) and small enough for 2 CPU cores.
    net = nn.HybridSequential()
    net.add(nn.Conv2D(32, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"),
            nn.Conv2D(64, 3, padding=1, strides=2), nn.BatchNorm(), nn.Activation("relu"),
            nn.GlobalAvgPool2D(), nn.Dense(num_classes))
    return net


def build_model(name, num_classes):
    if name == "linear":
        # Softmax regression: its gradient has a closed form, so tests can simulate a whole job in numpy.
        net = nn.HybridSequential()
        net.add(nn.Flatten(), nn.Dense(num_classes))
        return net
    if name == "mlp":
        return _mlp(num_classes)
    if name == "small_cnn":
        return _small_cnn(num_classes)
    check_model_name(name)
    from gluoncv.model_zoo import get_model   # only for a zoo model: a worker of ours need not import gluoncv
    # pretrained weights cannot be downloaded here, and the experiments train from scratch anyway.
    return get_model(name, classes=num_classes, pretrained=False)


def parameter_shapes(name, num_classes, sample_shape):
    """Shapes of a model's trained parameters in the worker's order (collect_params), fixed by one forward
    pass of a (C, H, W) sample: what plans and benchmarks need without training it."""
    net = build_model(name, num_classes)
    net.initialize(mx.init.Normal(0.01))
    net(mx.nd.zeros((1, *sample_shape)))
    return [p.shape for p in net.collect_params().values() if p.grad_req != "null"]


def inference_graph(net):
    """net as a static graph for inference, sharing net's Parameter objects: it always sees net's
    current weights and BatchNorm statistics, however they were changed (in place, set_data, a
    checkpoint load), and holds no copy of them.

    The evaluation of an imperative model (model.hybridize: false) runs through it: the static graph
    runs the same kernels, so gives the same outputs, and infers faster (measured: docs/design.md,
    "Outputs")."""
    data = sym.var("data", dtype="float32")     # typed, or SymbolBlock warns that it cannot infer it
    graph = gluon.SymbolBlock(net(data), data, params=net.collect_params())
    graph.hybridize(static_alloc=True, static_shape=True)
    return graph


def build_net(cfg, num_classes, image_shape, contexts=None):
    """The model with its seeded initial weights on `contexts` (default: cpu(0); see
    ssdsgd/worker/devices.py), and its trainable parameters in a fixed order.

    Every worker builds the same weights from cfg.seed (only rank 0's reach the servers anyway)."""
    contexts = contexts or [mx.cpu(0)]
    mx.random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    net = build_model(cfg.model.name, num_classes)
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2), ctx=contexts)
    # Materialise parameter shapes with a recorded forward (an inference-mode forward leaves oneDNN
    # layouts that kv.init cannot read); deferred initialisation then fills every context alike.
    with autograd.record():
        net(mx.nd.zeros((2,) + tuple(image_shape), ctx=contexts[0]))
    if cfg.model.hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    return net, params


def build_eval_net(cfg, net):
    """What evaluates: the hybridized net itself, or a static-graph twin of the imperative one."""
    return net if cfg.model.hybridize else inference_graph(net)


def aux_params(net):
    """The parameters no gradient updates: BatchNorm's running statistics."""
    return [p for p in net.collect_params().values() if p.grad_req == "null"]


def with_weights(params, weights, fn, publish=None):
    """Run fn with the given weights loaded into params (host arrays, see devices.py), then restore the
    local weights. publish: called after each change (DeviceReplicas.scatter, which copies them to the
    devices)."""
    if weights is None:
        return fn()
    publish = publish or (lambda: None)
    saved = [p.data().copy() for p in params]
    for p, w in zip(params, weights):
        w.copyto(p.data())
    publish()
    try:
        return fn()
    finally:
        for p, s in zip(params, saved):
            s.copyto(p.data())
        publish()
