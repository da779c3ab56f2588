"""Networks: small ones for the embedded demo and tests, and the gluoncv model zoo (never pretrained).

mxnet and gluoncv are imported inside the functions: the launcher front end checks model names
without paying for them when the model is one of ours."""

SMALL_MODELS = ("linear", "mlp", "small_cnn")


class ModelError(ValueError):
    pass


def _mlp(num_classes):
    from mxnet.gluon import nn
    net = nn.HybridSequential()
    net.add(nn.Flatten(), nn.Dense(128, activation="relu"), nn.Dense(64, activation="relu"),
            nn.Dense(num_classes))
    return net


def _small_cnn(num_classes):
    from mxnet.gluon import nn
    # Two conv blocks and a classifier: enough for digits (8x8) and small enough for 2 CPU cores.
    net = nn.HybridSequential()
    net.add(nn.Conv2D(32, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"),
            nn.Conv2D(64, 3, padding=1, strides=2), nn.BatchNorm(), nn.Activation("relu"),
            nn.GlobalAvgPool2D(), nn.Dense(num_classes))
    return net


def check_model_name(name):
    if name in SMALL_MODELS:
        return
    from gluoncv.model_zoo import get_model_list
    if name not in get_model_list():
        raise ModelError(f"model.name: unknown model {name!r}; use one of {', '.join(SMALL_MODELS)} "
                         f"or a gluoncv model zoo name such as cifar_resnet20_v1, cifar_resnet56_v1, "
                         f"resnet50_v1")


def build_model(name, num_classes):
    if name == "linear":
        from mxnet.gluon import nn
        # Softmax regression: its gradient has a closed form, so tests can simulate a whole job in numpy.
        net = nn.HybridSequential()
        net.add(nn.Flatten(), nn.Dense(num_classes))
        return net
    if name == "mlp":
        return _mlp(num_classes)
    if name == "small_cnn":
        return _small_cnn(num_classes)
    check_model_name(name)
    from gluoncv.model_zoo import get_model
    # pretrained weights cannot be downloaded here, and the experiments train from scratch anyway.
    return get_model(name, classes=num_classes, pretrained=False)


def inference_graph(net):
    """net as a static graph for inference, sharing net's Parameter objects: it always sees net's
    current weights and BatchNorm statistics, however they were changed (in place, set_data, a
    checkpoint load), and holds no copy of them.

    The evaluation of an imperative model (model.hybridize: false) runs through it: on the CPU of the
    README's measurements the imperative model trains faster, but the static graph infers in 0.72x
    the time (0.67x with 2 processes at once; ResNet-20, batch 128, one thread each,
    results/bench_step_eval), with the same kernels and so the same outputs."""
    from mxnet import gluon, sym
    data = sym.var("data", dtype="float32")     # typed, or SymbolBlock warns that it cannot infer it
    graph = gluon.SymbolBlock(net(data), data, params=net.collect_params())
    graph.hybridize(static_alloc=True, static_shape=True)
    return graph
