"""The README's "Extending" examples, run: a compressor added by one registration, and an
algorithm variant added by one registration, each used through the factory the worker uses."""
import os

import mxnet as mx
import numpy as np
import pytest

from jobs import ROOT
from ssdsgd.compression.codec import MailboxFormat
from ssdsgd.compression.encoders import make_encoders
from ssdsgd.compression.registry import SPARSIFIERS, is_sparsifier, make_compressor, register
from ssdsgd.config import load_config


@pytest.fixture
def maxk():
    """The README's example compressor, registered for one test and removed again."""
    @register("maxk")
    class MaxK:
        """The k largest values (signed, not magnitudes): a toy."""

        def __init__(self, seed=0):
            self.seed = seed

        def select(self, x, k, key, step):
            return mx.nd.topk(x, k=k, ret_typ="indices", is_ascend=False)
    yield MaxK
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
    rnd, rank, got = MailboxFormat("sparse", buf.size, buf.k).parse(msg.asnumpy())
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
