"""Tests for ssdsgd.compression.flatviews: many NDArrays copied to and from one flat vector, against numpy."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.compression.flatviews import FlatViews

# ResNet-like: 4-D kernels, vectors, one scalar-sized tensor; more than 60 arrays (MXNet's fused
# multi-tensor kernels stop at 60, amp_multicast must not)
SHAPES = [(4, 3, 3, 3), (4,), (1,), (2, 4, 1, 1), (10, 8)] * 14


def _arrays(rng, shapes=SHAPES):
    return [mx.nd.array(rng.standard_normal(s)) for s in shapes]


def test_copy_to_and_from_match_numpy_and_write_through():
    rng = np.random.default_rng(0)
    arrays = _arrays(rng)
    fv = FlatViews(arrays)
    assert fv.size == sum(int(np.prod(s)) for s in SHAPES) and len(arrays) == 70
    buf = fv.buffer()
    fv.copy_to(buf)
    expected = np.concatenate([a.asnumpy().ravel() for a in arrays])
    np.testing.assert_array_equal(buf.array.asnumpy(), expected)
    for piece, a in zip(buf.pieces, arrays):
        np.testing.assert_array_equal(piece.asnumpy(), a.asnumpy().ravel())
    new = rng.standard_normal(fv.size).astype(np.float32)
    buf.array[:] = new
    fv.copy_from(buf)
    start = 0
    for a, s in zip(arrays, SHAPES):              # the arrays themselves, in their own shapes
        n = int(np.prod(s))
        assert a.shape == s
        np.testing.assert_array_equal(a.asnumpy(), new[start:start + n].reshape(s))
        start += n


def test_buffer_over_part_of_a_larger_vector_leaves_the_rest():
    """The pull buffer carries the version after the weights: a FlatBuffer over its first
    `size` elements must never touch the last one."""
    rng = np.random.default_rng(1)
    arrays = _arrays(rng, [(3, 2), (5,)])
    fv = FlatViews(arrays)
    pulled = mx.nd.array(np.arange(fv.size + 1, dtype=np.float32))
    buf = fv.buffer(pulled[:fv.size])
    fv.copy_from(buf)
    np.testing.assert_array_equal(arrays[0].asnumpy(), np.arange(6, dtype=np.float32).reshape(3, 2))
    np.testing.assert_array_equal(arrays[1].asnumpy(), np.arange(6, 11, dtype=np.float32))
    arrays[1][:] = -1.0
    fv.copy_to(buf)
    np.testing.assert_array_equal(pulled.asnumpy(), np.r_[np.arange(6), [-1] * 5, [11]].astype(np.float32))


def test_matches_only_the_same_objects():
    arrays = _arrays(np.random.default_rng(2), [(2,), (3,)])
    fv = FlatViews(arrays)
    assert fv.matches(list(arrays))
    assert not fv.matches([arrays[0], arrays[1].copy()])
    assert not fv.matches(arrays[:1])


def test_bad_input_is_refused_with_the_reason():
    rng = np.random.default_rng(3)
    arrays = _arrays(rng, [(2,), (3,)])
    fv = FlatViews(arrays)
    with pytest.raises(ValueError, match="FlatViews of no arrays"):
        FlatViews([])
    with pytest.raises(ValueError, match="float16, float32 arrays: float32 only"):
        FlatViews([mx.nd.zeros(2), mx.nd.zeros(2, dtype="float16")])
    with pytest.raises(ValueError, match="float16 arrays: float32 only"):
        FlatViews([mx.nd.zeros(2, dtype="float16")])
    with pytest.raises(ValueError, match="shape \\(4,\\).*5 elements"):
        fv.buffer(mx.nd.zeros(4))
    with pytest.raises(ValueError, match="dtype float16"):
        fv.buffer(mx.nd.zeros(5, dtype="float16"))
    other = FlatViews(_arrays(rng, [(5,)])).buffer()       # 5 elements, but in one piece
    with pytest.raises(ValueError, match="in 1 pieces for 2 arrays"):
        fv.copy_from(other)
