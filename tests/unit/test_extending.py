"""docs/design.md's "Extending" examples, run as they stand there: a sparsifier and an algorithm, each a
plug-in module named in the config's `plugins`, registered by importing it (no patching of the package),
used through the factories the worker uses, and trained in a real 2-worker job."""
import os
import re
import sys

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT

from ssdsgd import algorithms, registry
from ssdsgd.algorithms.base import Client
from ssdsgd.compression.codec import WireFormat
from ssdsgd.compression.compressor import Sparsifier, TopK
from ssdsgd.compression.encoders import make_encoders
from ssdsgd.compression.registry import SPARSIFIERS, is_sparsifier, make_compressor, register
from ssdsgd.config import ConfigError, load_config

SSD_TOPK = os.path.join(ROOT, "configs", "demo_digits_ssd_topk.yaml")
SSGD = os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml")


def design_example(first_line):
    """The python block of docs/design.md that starts with `first_line` ("# name.py")."""
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (code,) = [b for b in blocks if b.startswith(first_line)]
    return code


@pytest.fixture
def plugins(tmp_path):
    """The design's plug-in modules written to a folder on sys.path (the job's roles get it on PYTHONPATH);
    afterwards their registrations and modules are gone again, so no other test sees their names."""
    for name in ("my_sparsifiers", "local_sgd"):
        (tmp_path / f"{name}.py").write_text(design_example(f"# {name}.py"))
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for module, names, table in (("my_sparsifiers", ("maxk",), SPARSIFIERS), ("local_sgd", ("local_sgd",),
                                                                               registry.ALGORITHMS)):
        sys.modules.pop(module, None)
        for name in names:
            table.pop(name, None)


# ------------------------------------------------------------------------------------------ a sparsifier

def test_a_plugin_sparsifier_is_configured_built_and_sent(plugins):
    comp = load_config(SSD_TOPK, ["plugins=[my_sparsifiers]", "compression.type=maxk", "compression.buffers=one",
                                  "compression.density=0.25", "compression.min_dense_bytes=0",
                                  "compression.allocation=size"]).compression
    maxk = SPARSIFIERS["maxk"]
    assert is_sparsifier("maxk") and isinstance(make_compressor("maxk", seed=3), maxk)
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


def test_top_k_as_a_plugin_takes_the_path_top_k_takes(plugins):
    """A plug-in declaring what top-k declares (magnitudes, select_buffer from the memory's search) sends
    what top-k sends, bit for bit, with sampled selection and per-step quotas: one path for both."""
    @register("topk_plugin")
    class TopKPlugin(Sparsifier):
        magnitudes = True

        def select(self, x, k, key, step):
            raise AssertionError("select_buffer finds the indices")

        def select_buffer(self, acc):
            return acc.largest_magnitudes()
    try:
        shapes = [(64, 64), (64,), (10, 64), (10,), (300, 40)]
        sets = ["compression.buffers=one", "compression.density=0.05", "compression.selection=sampled"]
        comps = [load_config(SSD_TOPK, sets + [f"compression.type={t}"]).compression for t in ("topk", "topk_plugin")]
        (buffers, top), (_, plug) = [make_encoders(shapes, 1, comp, 0, momentum=0.9, seed=3) for comp in comps]
        assert isinstance(top[0].compressor, TopK) and isinstance(plug[0].compressor, TopKPlugin)
        rng = np.random.default_rng(5)
        for step in range(4):
            grads = [mx.nd.array(rng.standard_normal(s).astype(np.float32)) for s in shapes]
            for b, e, f in zip(buffers, top, plug):
                mine = [grads[i] for i in b.params]
                np.testing.assert_array_equal(e.message(mine, step, 0).asnumpy(), f.message(mine, step, 0).asnumpy())
    finally:
        del SPARSIFIERS["topk_plugin"]


def test_a_bad_sparsifier_is_named():
    with pytest.raises(ValueError, match=r"sparsifier 'topk' \(.*Other\): the compression type 'topk' is already"):
        register("topk")(type("Other", (Sparsifier,), {}))
    with pytest.raises(ValueError, match=r"sparsifier 'bare' \(.*Bare\): no select_buffer, magnitudes; subclass"):
        register("bare")(type("Bare", (), {"select": lambda self, x, k, key, step: x[:k]}))
    assert "bare" not in SPARSIFIERS
    with pytest.raises(ValueError, match="not a sparsifier"):
        make_compressor("maxk")


# ------------------------------------------------------------------------------------------ an algorithm

def test_a_plugin_algorithm_is_declared_and_built_through_make_client(plugins):
    cfg = load_config(SSGD, ["plugins=[local_sgd]", "algorithm.type=local_sgd", "algorithm.delay=3",
                             "algorithm.max_staleness=4"])
    entry = registry.ALGORITHMS["local_sgd"]
    assert (entry.plan, entry.uses, entry.warmup, entry.sparsifiers, entry.compression) == \
        ("stock", ("delay",), False, None, ("none",))
    cls = algorithms.client_class(cfg)
    assert cls is entry.client and issubclass(cls, Client) and cls.kvstore_type(cfg) == "dist_sync"
    # The keys it does not declare are noted as idle; those it uses are not.
    assert "algorithm.delay" not in cfg.idle and "algorithm.local.optimizer" in cfg.idle
    assert "algorithm.max_staleness = 4 has no effect: algorithm.type is local_sgd, which does not use it " \
           "(used by ssd)" in cfg.ignored
    assert "compression.buffers" in cfg.idle                   # a stock plan plans no buffers
    # What its client does not take is refused, not ignored.
    with pytest.raises(ConfigError, match=r"^compression.type: topk needs the round-based server \(algorithm.type "
                                          r"ssgd or ssd\); local_sgd supports none$"):
        load_config(SSGD, ["plugins=[local_sgd]", "algorithm.type=local_sgd", "compression.type=topk"])
    with pytest.raises(ConfigError, match=r"^compression.type: 2bit \(MXNet's native compression, on the stock "
                                          r"KVStore path\) works with algorithm.type ssgd or asgd; local_sgd "
                                          r"supports none$"):
        load_config(SSGD, ["plugins=[local_sgd]", "algorithm.type=local_sgd", "compression.type=2bit"])
    client = cls(None, [], cfg, None, None)
    client.keys = [3, 5]
    assert client.plan_record() == {"kind": "stock", "keys": [3, 5]} and client.state() == ({}, {})


def test_a_bad_plugin_is_named_in_one_line(plugins, tmp_path):
    with pytest.raises(ConfigError, match=r"^plugins: cannot import no_such_module: No module named"):
        load_config(SSGD, ["plugins=[no_such_module]"])
    # A module that loads mxnet, in a process that has not: it leaves mxnet in sys.modules, as the import does.
    (plugins / "heavy.py").write_text("import sys\nimport types\n\nsys.modules['mxnet'] = types.ModuleType('mxnet')\n")
    had = sys.modules.pop("mxnet")
    try:
        with pytest.raises(ConfigError, match=r"^plugins: heavy imports mxnet when imported"):
            load_config(SSGD, ["plugins=[heavy]"])
    finally:
        sys.modules["mxnet"] = had
        sys.modules.pop("heavy", None)
    (plugins / "clash.py").write_text("from ssdsgd.registry import register_algorithm\n"
                                      "register_algorithm('ssd')(type('Mine', (), {}))\n")
    with pytest.raises(ConfigError, match=r"^plugins: clash: algorithm 'ssd' \(clash.Mine\): the name is already "
                                          r"taken by ssdsgd.algorithms.ssd:RoundClient$"):
        load_config(SSGD, ["plugins=[clash]"])
    (plugins / "vague.py").write_text("from ssdsgd.registry import register_algorithm\n"
                                      "register_algorithm('vague', plan='mine')(type('Mine', (), {}))\n")
    with pytest.raises(ConfigError, match=r"^plugins: vague: algorithm 'vague' \(vague.Mine\): plan must be one "
                                          r"of rounds, stock, got 'mine'$"):
        load_config(SSGD, ["plugins=[vague]"])
    (plugins / "bare.py").write_text("from ssdsgd.algorithms.base import Client\n"
                                     "from ssdsgd.registry import register_algorithm\n"
                                     "register_algorithm('bare')(type('Bare', (Client,), {'setup': print}))\n")
    with pytest.raises(ConfigError, match=r"^plugins: bare: algorithm 'bare' \(bare.Bare\): no kvstore_type, "
                                          r"after_backward, global_weights; a subclass of ssdsgd"):
        load_config(SSGD, ["plugins=[bare]"])
    with pytest.raises(ConfigError, match=r"^algorithm.type: must be one of ssgd, asgd, ssd"):
        load_config(SSGD, ["algorithm.type=local_sgd"])        # not registered without its plug-in


@pytest.mark.parametrize("config, sets, plan", [
    ("demo_digits_ssgd.yaml", [], "stock"),
    ("demo_digits_ssgd.yaml", ["algorithm.type=asgd", "compression.type=2bit"], "stock"),
    ("demo_digits_ssgd.yaml", ["compression.type=topk"], "rounds"),
    ("demo_digits_ssd.yaml", [], "rounds"),
])
def test_the_registry_routes_the_built_in_configs(config, sets, plan):
    from ssdsgd.algorithms.ssd import RoundClient
    from ssdsgd.algorithms.stock import StockClient
    from ssdsgd.config import runner_of
    cfg = load_config(os.path.join(ROOT, "configs", config), sets)
    assert runner_of(cfg).plan == plan
    assert algorithms.client_class(cfg) is {"stock": StockClient, "rounds": RoundClient}[plan]
