"""ssdsgd/compression/kernels.py (issue 62, item 5): the fused numba kernels give what the numpy
formulation they replaced gives, bit for bit: the memory's accumulate (error feedback, momentum
correction, rescaling), the candidates and magnitudes of the sampled search, the values taken and the
memory's forgetting of them, the per-tensor top-k among candidates; and whole encoders with the fused
pass send the messages, and keep the memory, of encoders running the numpy formulation."""
import os

import mxnet as mx
import numpy as np
import pytest

import ssdsgd.compression.encoders as encoders_module
from support.jobs import ROOT
from ssdsgd.compression import kernels
from ssdsgd.compression.compressor import top_magnitudes
from ssdsgd.compression.encoders import SparseEncoder, make_encoders
from ssdsgd.compression.memory import Memory
from ssdsgd.compression.quotas import kth_largest, kth_smallest, quotas_from_candidates
from ssdsgd.config import load_config

TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"
# The "extremes" data overflows to inf, and inf - inf makes NaN, on purpose: numpy warns, the kernels do not.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SIZES = [1, 2, 3, 63, 64, 65, kernels.CHUNK - 1, kernels.CHUNK, kernels.CHUNK + 1, 3 * kernels.CHUNK + 17, 50_000]


class NumpyMemory(Memory):
    """The memory as it was before the kernels: numpy passes, chunk by chunk (the oracle)."""

    def accumulate(self, key, g, magnitude=None):
        u = r = None
        if self.momentum:
            u = self.velocity.get(key)
            if u is None:
                u = self.velocity[key] = g.copy()
                g = None
        if self.error_feedback:
            r = self.residual.get(key)
            if r is None:
                r = self.residual[key] = np.zeros(g.shape[0] if g is not None else u.shape[0], np.float32)
        add = u if u is not None else g
        out = r if r is not None else add
        carry = np.float32(self.carry)
        mu = np.float32(self.momentum) * carry
        for lo in range(0, out.shape[0], 1 << 18):
            part = slice(lo, lo + (1 << 18))
            if u is not None and g is not None:
                np.multiply(u[part], mu, out=u[part])
                np.add(u[part], g[part], out=u[part])
            if r is not None:
                if carry != 1:
                    np.multiply(r[part], carry, out=r[part])
                np.add(r[part], add[part], out=r[part])
            if magnitude is not None:
                np.abs(out[part], out=magnitude[part])
        return out

    def take(self, key, acc, idx, whole=False):
        val = acc[idx]
        self.update(key, acc, idx, None, whole)
        return val


def numpy_top_among(found, values, bounds, counts, fits, kths, out):
    """kernels.top_among as the encoders did it with numpy: top_magnitudes per tensor."""
    pos = 0
    for j in np.flatnonzero(fits):
        mine = slice(bounds[j], bounds[j + 1])
        taken = found[mine][top_magnitudes(values[mine], int(counts[j]))]
        out[pos:pos + taken.size] = taken
        pos += taken.size
    return pos


def gradient(rng, n, kind):
    """float32 test data: normal, ties (few distinct levels, both signs), zeros and -0.0, or huge and
    tiny magnitudes (overflow to inf in a sum, subnormals)."""
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "ties":
        return (rng.integers(-3, 4, n) * 0.25).astype(np.float32)
    if kind == "zeros":
        return np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    return (rng.choice([3e38, -3e38, 1e-45, -1e-40, 1.0], n)).astype(np.float32)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


MEMORIES = [dict(error_feedback=True, momentum=0.9), dict(error_feedback=True, momentum=0.0),
            dict(error_feedback=False, momentum=0.9), dict(error_feedback=False, momentum=0.0),
            dict(error_feedback=True, momentum=0.9, masking=False, rescale=True),
            dict(error_feedback=True, momentum=0.0, rescale=True)]


def _both(settings):
    return Memory(**settings), NumpyMemory(**settings)


def _same_state(fused, reference):
    a, b = fused.state_dict(), reference.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        same_bits(a[name], b[name])


@pytest.mark.parametrize("settings", MEMORIES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "extremes"])
def test_accumulate_and_take_are_the_numpy_formulation_bit_for_bit(settings, kind):
    rng = np.random.default_rng(len(kind))
    fused, reference = _both(settings)
    for step in range(4):
        carry = [1.0, 0.5, 1.0, 3.0][step]
        for m in (fused, reference):
            m.set_carry(carry)
        for key, n in enumerate(SIZES):
            g = gradient(rng, n, kind)
            if step % 2:
                g.flags.writeable = False                 # as a view of MXNet's memory
            mags = [np.full(n, np.nan, np.float32) for _ in range(2)]
            outs = [m.accumulate(key, g, mag) for m, mag in zip((fused, reference), mags)]
            same_bits(outs[0], outs[1])
            same_bits(mags[0], mags[1])
            idx = np.sort(rng.choice(n, max(1, n // 7), replace=False))
            whole = idx.size == n
            same_bits(fused.take(key, outs[0], idx, whole), reference.take(key, outs[1], idx, whole))
        _same_state(fused, reference)


@pytest.mark.parametrize("settings", [s for s in MEMORIES if s["error_feedback"]],
                         ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "extremes"])
def test_candidates_peek_and_the_largest_are_the_numpy_formulation(settings, kind):
    """accumulate_candidates: the same accumulate, the entries not below the threshold with their
    magnitudes (in order, from `count`, offset added, counted beyond the room), the first position of
    the largest magnitude (np.argmax); peek, before it: the magnitudes it will give."""
    rng = np.random.default_rng(7 + len(kind))
    fused, reference = _both(settings)
    for step in range(3):
        for m in (fused, reference):
            m.set_carry([1.0, 2.0, 1.0][step])
        for key, n in enumerate(SIZES):
            g = gradient(rng, n, kind)
            at = rng.integers(0, n, 2 * n + 1) + 5
            peeked = np.full(at.size, np.nan, np.float32)
            fused.peek(key, g, at, 5, peeked)
            acc = reference.accumulate(key, g)
            mag = np.abs(acc)
            same_bits(peeked, mag[at - 5])
            threshold = np.float32(np.quantile(mag, [0.0, 0.5, 0.99, 1.0][step + (key % 2)]))
            want = np.flatnonzero(~(mag < threshold))
            for room in (n + 3, want.size // 2):
                trial, oracle = Memory(**settings), NumpyMemory(**settings)   # the state before this step
                trial.load_state_dict(fused.state_dict())
                trial.set_carry(fused.carry)
                idx, val = np.full(room + 3, -7, np.int64), np.full(room + 3, -7.0, np.float32)
                got, count, top = trial.accumulate_candidates(key, g, threshold, idx[3:], val[3:], 0, 100)
                same_bits(got, acc)
                assert count == want.size and top == np.argmax(mag)
                written = min(count, room)
                np.testing.assert_array_equal(idx[3:3 + written], want[:written] + 100)
                same_bits(val[3:3 + written], mag[want[:written]])
                assert (idx[:3] == -7).all() and (idx[3 + written:] == -7).all()
                del oracle
            fused.accumulate(key, g)
        _same_state(fused, reference)


def test_candidates_and_the_largest_count_a_nan_above_every_number():
    rng = np.random.default_rng(3)
    g = rng.standard_normal(10_000).astype(np.float32)
    g[[17, 4000, 9000]] = [np.nan, -np.nan, np.inf]
    memory = Memory(error_feedback=True)
    idx, val = np.empty(10_000, np.int64), np.empty(10_000, np.float32)
    acc, count, top = memory.accumulate_candidates(0, g, np.float32(2.0), idx, val, 0, 0)
    np.testing.assert_array_equal(idx[:count], np.flatnonzero(~(np.abs(acc) < 2.0)))
    assert top == 17 == np.argmax(np.abs(acc))


@pytest.mark.parametrize("seed", range(6))
def test_top_among_takes_what_top_magnitudes_takes(seed):
    """The k largest of each tensor's candidates, ties at the k-th going to the first, with the
    thresholds of quotas.kth_largest: by partitions, or the quotas' threshold (tau) where it gives the
    same; quotas of the whole tensor, of one, NaN among the values (the partitions then)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 3000, 9)
    values = np.abs(gradient(rng, int(sizes.sum()), ["normal", "ties", "zeros"][seed % 3]))
    if seed == 5:
        values[rng.choice(values.size, 40, replace=False)] = np.nan
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    found = np.sort(rng.choice(10 * values.size, values.size, replace=False)).astype(np.int64)
    counts = np.array([max(1, n // 3) for n in sizes], np.int64)
    counts[2] = sizes[2]                                  # the whole tensor
    quotas, *around = quotas_from_candidates(values, bounds, [int(c) for c in counts], set())
    above, ties = around[1:]
    for j in range(len(sizes)):
        v = values[bounds[j]:bounds[j + 1]]
        assert (above[j], ties[j]) == ((v > around[0]).sum(), (v == around[0]).sum())
    for counts, around in ((counts, None), (np.array(quotas, np.int64), around)):
        fits = counts <= sizes
        fits[4] = False                                   # left to a search of its own
        want = np.empty(int(counts[fits].sum()), np.int64)
        numpy_top_among(found, values, bounds, counts, fits, None, want)
        got = np.full(want.size, -1, np.int64)
        kths = kth_largest(values, bounds, counts, fits, around)
        assert kernels.top_among(found, values, bounds, counts, fits, kths, got) == want.size
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "extremes"])
def test_kth_smallest_is_the_partitions(kind):
    """quotas.kth_smallest (kernels.kth_smallest for magnitudes: NaN and inf among them) gives what
    np.partition gives at k, bit for bit; with a negative value (a whole tensor's -1) numpy's own."""
    rng = np.random.default_rng(len(kind))
    for n in (1, 2, 7, 5000, 20_000):
        values = np.abs(gradient(rng, n, kind))
        if n > 2:
            values[rng.choice(n, 2, replace=False)] = [np.nan, np.inf]
        for k in sorted({0, n // 3, n - 2, n - 1} & set(range(n))):
            same_bits(np.float32(kth_smallest(values, k)), np.partition(values, k)[k])
            done, kth = kernels.kth_smallest(values, k)
            assert done
            same_bits(np.float32(kth), np.partition(values, k)[k])
    values = np.array([3.0, -1.0, 2.0, 0.0] * 2000, np.float32)
    assert not kernels.kth_smallest(values, 2001)[0] and kth_smallest(values, 2001) == 0.0


def test_sort_positions_sorts():
    rng = np.random.default_rng(0)
    for n, top in ((0, 1), (1, 1), (1000, 5), (25_600, 1 << 24), (3000, 1 << 30)):
        at = rng.integers(0, top, n)
        np.testing.assert_array_equal(kernels.sort_positions(at), np.sort(at))


def _shapes():
    # The demo model's parameters plus larger tensors, so that the buffer-wide search samples.
    return [(64, 64), (64,), (10, 64), (10,), (300, 400), (400,), (200, 300), (5, 3, 3, 3), (7000,)]


def _encoder_sets(overrides):
    sets = []
    for _ in range(2):
        cfg = load_config(os.path.join(ROOT, TOPK_CONFIG), ["compression.buffers=one", "compression.density=0.05",
                                                            "compression.selection=sampled",
                                                            "compression.allocation=gradient", *overrides])
        sets.append(make_encoders(_shapes(), 1, cfg.compression, 0, momentum=0.9, seed=3))
    reference = sets[1][1]
    numpy_memory = NumpyMemory(reference[0].memory.error_feedback, reference[0].memory.momentum,
                               reference[0].memory.masking, reference[0].memory.rescale)
    for e in reference:
        e.memory = numpy_memory
    return sets


def _messages(buffers, encs, grads, step):
    return [e.message([grads[i] for i in b.params], step, 0).asnumpy() for b, e in zip(buffers, encs)]


@pytest.mark.parametrize("overrides", [
    [], ["compression.rescale_held=true"], ["compression.momentum_correction=false"],
    ["compression.min_dense_bytes=1024"], ["compression.fp16_values=true"], ["compression.density=0.3"],
    ["compression.density=1.0"], ["compression.momentum_masking=false"], ["compression.index_coding=list"],
], ids=["shipped", "rescale", "no_momentum", "whole", "fp16", "dense30", "all", "no_masking", "list"])
@pytest.mark.parametrize("forced", ["none", "overflow", "too_few", "no_narrowing"])
def test_fused_encoders_send_what_numpy_encoders_send(overrides, forced, monkeypatch):
    """The same gradients into encoders with the fused pass and encoders running the numpy
    formulation (NumpyMemory, the unfused search, numpy_top_among): the same messages and memory, step
    after step; also where the fused search falls back: its candidates overflow their room, are fewer
    than the budget (a threshold estimated too high), or its threshold lets every entry pass."""
    (buffers, fused), (_, reference) = _encoder_sets(overrides)
    used = []
    original = SparseEncoder._fused_ahead

    def counting(self, pieces, rng):
        result = original(self, pieces, rng)
        used.append(result is not None)
        return result
    monkeypatch.setattr(SparseEncoder, "_fused_ahead", counting)
    if forced == "overflow":
        for e in fused:
            e.room = (np.empty(10, np.int64), np.empty(10, np.float32))
    elif forced in ("too_few", "no_narrowing"):
        value = np.float32(1e30 if forced == "too_few" else np.nan)
        monkeypatch.setattr(encoders_module, "sample_threshold", lambda drawn, n, k: value)
    rng = np.random.default_rng(5)
    for step in range(5):
        grads = [mx.nd.array(gradient(rng, int(np.prod(s)), ["normal", "ties"][step % 2]).reshape(s)
                             * np.float32(10 ** rng.uniform(-2, 0))) for s in _shapes()]
        for m in (fused[0].memory, reference[0].memory):
            m.set_carry([1.0, 0.8, 1.0, 1.25, 1.0][step])
        got = _messages(buffers, fused, grads, step)
        with monkeypatch.context() as m:
            m.setattr(SparseEncoder, "_fused_ahead", lambda self, pieces, rng: None)
            m.setattr(kernels, "top_among", numpy_top_among)
            want = _messages(buffers, reference, grads, step)
        for a, b in zip(got, want):
            same_bits(a, b)
    _same_state(fused[0].memory, reference[0].memory)
    # above a quarter of the buffer the sampled search leaves it to a partition (compressor.sample_size)
    narrows = not {"compression.density=0.3", "compression.density=1.0"} & set(overrides)
    assert any(used) == (narrows and forced != "no_narrowing")
