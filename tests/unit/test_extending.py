"""The README's "Extending" examples, run as they stand there: a compressor added by one
registration, and an algorithm variant added by one CLIENTS line, each used through the factory the
worker uses."""
import os
import re
import sys
import types

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT

from ssdsgd import algorithms
from ssdsgd.algorithms.base import Client, StepRecord
from ssdsgd.compression.codec import WireFormat
from ssdsgd.compression.encoders import make_encoders
from ssdsgd.compression.registry import SPARSIFIERS, is_sparsifier, make_compressor
from ssdsgd.config import load_config


def readme_example(first_line):
    """The python block of README.md or docs/design.md that starts with `first_line`, as a module."""
    blocks = []
    for doc in ("README.md", os.path.join("docs", "design.md")):
        with open(os.path.join(ROOT, doc)) as f:
            blocks += re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (code,) = [b for b in blocks if b.startswith(first_line)]
    module = types.ModuleType("readme_" + first_line.split("/")[-1].split(".")[0])
    exec(compile(code, f"README.md ({first_line})", "exec"), module.__dict__)
    return module


@pytest.fixture
def maxk():
    """The README's example compressor, registered for one test and removed again."""
    module = readme_example("# ssdsgd/compression/maxk.py")
    yield module.MaxK
    del SPARSIFIERS["maxk"]


def test_a_registered_compressor_is_configured_built_and_sent(maxk):
    assert is_sparsifier("maxk") and isinstance(make_compressor("maxk", seed=3), maxk)
    comp = load_config(os.path.join(ROOT, "configs/demo_digits_ssd_topk.yaml"),
                       ["compression.type=maxk", "compression.buffers=one", "compression.density=0.25",
                        "compression.min_dense_bytes=0", "compression.allocation=size"]).compression
    shapes = [(4, 5), (8,)]
    (buf,), (enc,) = make_encoders(shapes, 1, comp, rank=0)
    rng = np.random.default_rng(0)
    grads = [rng.permutation(np.prod(s)).astype(np.float32).reshape(s) for s in shapes]
    msg = enc.message([mx.nd.array(grads[p]) for p in buf.params], 7, 0)
    rnd, rank, got = WireFormat("sparse", buf.size, buf.topk_count, bitmap=buf.wire.bitmap).parse(msg.asnumpy())
    assert (rnd, rank) == (7, 0)
    want = np.zeros(buf.size, np.float32)
    for p, off, count in zip(buf.params, buf.offsets, buf.counts):
        g = grads[p].reshape(-1)
        top = np.argsort(-g, kind="stable")[:count]             # the largest signed values
        want[off + top] = g[top]
    np.testing.assert_array_equal(got.to_dense(), want)


def test_unknown_compressor_is_refused():
    assert not is_sparsifier("maxk")
    with pytest.raises(ValueError, match="not a sparsifier"):
        make_compressor("maxk")


# ------------------------------------------------------------------------- an algorithm variant

@pytest.fixture
def toy(monkeypatch):
    """The README's example variant, importable as the module CLIENTS names, and chosen for every config."""
    module = readme_example("# ssdsgd/algorithms/toy.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(algorithms.CLIENTS, "toy", f"{module.__name__}:ToyClient")
    monkeypatch.setattr(algorithms, "client_kind", lambda cfg: "toy")
    return module.ToyClient


def test_a_registered_client_is_built_through_make_client(toy):
    cfg = load_config(os.path.join(ROOT, "configs/demo_digits_ssd.yaml"))
    kv = algorithms.create_kvstore(cfg)
    assert kv.type == "local"
    client = algorithms.make_client(cfg, kv, [], None, None, total_steps=10, steps_per_epoch=5)
    assert isinstance(client, toy) and isinstance(client, Client) and client.stats == {}
    client.setup()
    assert client.after_backward(0) == StepRecord(0, 0, None, None)
    assert client.plan_record() == {"kind": "toy"} and client.state() == ({}, {})
    assert client.residual_norm() is None
    client.finish()


@pytest.mark.parametrize("config, sets, kind", [
    ("demo_digits_ssgd.yaml", [], "stock"),
    ("demo_digits_ssgd.yaml", ["algorithm.type=asgd", "compression.type=2bit"], "stock"),
    ("demo_digits_ssgd.yaml", ["compression.type=topk"], "rounds"),
    ("demo_digits_ssd.yaml", [], "rounds"),
])
def test_client_kind_routes_the_built_in_configs(config, sets, kind):
    cfg = load_config(os.path.join(ROOT, "configs", config), sets)
    assert algorithms.client_kind(cfg) == kind
    assert algorithms.client_class(cfg).kind == kind
