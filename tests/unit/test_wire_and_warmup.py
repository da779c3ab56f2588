"""fp16 wire format (compression.fp16_values) and the density warm-up (compression.warmup): codec
against an independent numpy decoder, error feedback that keeps what fp16 rounding and clipping lost,
the per-stage plans, the server applying rounds from every stage, and a real 2-worker job whose
push bytes match the per-stage message sizes exactly."""
import os

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT

from ssdsgd.algorithms.policy import density_stage
from ssdsgd.compression.codec import DIGIT, FP16_MAX, WireFormat
from ssdsgd.compression.compressor import TopK
from ssdsgd.compression.encoders import SparseEncoder, make_stages, tensor_counts
from ssdsgd.compression.fusion import make_plan
from ssdsgd.ps.keys import KEY_HASH, place_stages
from ssdsgd.compression.memory import Memory
from ssdsgd.config import ConfigError, load_config
from ssdsgd.ps.server import RoundService
from ssdsgd.schedule import LRSchedule

TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"
SHAPES = [(3000,), (50, 60), (7,)]          # 6007 elements: indices need the high fp16 digit


def comp_config(*overrides):
    return load_config(os.path.join(ROOT, TOPK_CONFIG), ["compression.buffers=one"] + list(overrides)).compression


def np_decode16(message, size):
    """Independent reference for the fp16 wire: header [r_hi, r_lo, rank], then k high index digits,
    k low digits, k values."""
    m = np.asarray(message)
    assert m.dtype == np.float16
    rnd = int(m[0]) * 2048 + int(m[1])
    rank = int(m[2])
    body = m[3:].astype(np.float64)
    k = body.size // 3
    assert body.size == 3 * k
    high, low = body[:k], body[k:2 * k]
    assert np.all(high == np.round(high)) and np.all(low == np.round(low)) and low.max() < 2048
    idx = (high * 2048 + low).astype(np.int64)
    dense = np.bincount(idx, weights=body[2 * k:], minlength=size)
    return rnd, rank, dense, idx


def np_topk(x, k):
    return np.argsort(-np.abs(x), kind="stable")[:k]


# ------------------------------------------------------------------------------------ codec

def test_fp16_codec_round_trip_at_the_digit_boundaries():
    size = DIGIT * DIGIT                                   # the fp16 buffer cap, 2**22
    idx = np.array([0, 1, 2047, 2048, 2049, 4095, 4096, 123456, size - 2, size - 1], np.int64)
    vals = np.array([1, -2, 0.5, 3, -0.25, 7, 8, -9, 10, 65504], np.float16)
    payload = np.concatenate([(idx // 2048).astype(np.float16), (idx % 2048).astype(np.float16), vals])
    assert payload.dtype == np.float16
    got = WireFormat("sparse", size, idx.size, fp16=True).decode(payload).to_dense()
    want = np.zeros(size, np.float32)
    want[idx] = vals.astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)

    fmt = WireFormat("sparse", size, idx.size, fp16=True)
    assert fmt.length == 3 + 3 * idx.size
    header = np.array([5000 // 2048, 5000 % 2048, 1], np.float16)
    rnd, rank, dense = fmt.parse(np.concatenate([header, payload]))
    assert (rnd, rank) == (5000, 1)
    np.testing.assert_array_equal(dense.to_dense(), want)
    with pytest.raises(ValueError, match="float32"):        # the fp32 wire refuses fp16 messages
        WireFormat("sparse", size, idx.size).parse(np.concatenate([header, payload]))
    # the server may hand the updater the fp16 push widened to float32: same numbers
    widened = fmt.parse(np.concatenate([header, payload]).astype(np.float32))
    assert widened[:2] == (5000, 1)
    np.testing.assert_array_equal(widened[2].to_dense(), want)
    with pytest.raises(ValueError, match="expected"):
        fmt.parse(np.concatenate([header, payload[:-1]]))
    with pytest.raises(ValueError):
        WireFormat("dense", 10, fp16=True)


def test_fp16_plans_cap_buffers_at_2_to_the_22():
    make_plan([(DIGIT * DIGIT,)], 1, mode="one", counts=[10], codec="sparse", fp16=True)
    with pytest.raises(ValueError, match="compression.fp16_values: false"):   # no buffer plan can help
        make_plan([(DIGIT * DIGIT + 1,)], 1, mode="fixed", counts=[10], codec="sparse", fp16=True)
    make_plan([(DIGIT * DIGIT + 1,)], 1, mode="one", counts=[10], codec="sparse")   # fp32 wire: fine
    with pytest.raises(ValueError, match=str(DIGIT * DIGIT)):                 # two tensors, one buffer
        make_plan([(DIGIT * DIGIT,), (1,)], 1, mode="consecutive", counts=[10, 1], codec="sparse", fp16=True)
    split = make_plan([(DIGIT * DIGIT,), (1,)], 1, mode="one", counts=[10, 1], codec="sparse", fp16=True)
    assert [b.params for b in split] == [[1], [0]]                              # `one` takes two instead


@pytest.mark.parametrize("step,stage", [(0, 0), (21, 0), (22, 1), (43, 1), (44, 2), (45, 2), (10 ** 6, 2)])
def test_density_stage_is_the_epoch_until_the_steady_state(step, stage):
    assert density_stage(step, 22, 3) == stage          # warm-up of two epochs, then the steady state
    assert density_stage(step, 22, 1) == 0              # no warm-up


# ------------------------------------------------------------------------------ fp16 encoder

def _fp16_encoder(density=0.01, error_feedback=True):
    comp = comp_config(f"compression.density={density}", "compression.fp16_values=true",
                       f"compression.error_feedback={str(error_feedback).lower()}")
    sizes, counts, whole = tensor_counts(SHAPES, comp)
    (buf,) = make_plan(SHAPES, 1, counts=counts, codec="sparse", fp16=True)
    memory = Memory(error_feedback=error_feedback)
    return buf, memory, SparseEncoder(buf, TopK(), memory, [whole[i] for i in buf.params])


def test_fp16_message_is_the_fp16_rounded_per_tensor_topk():
    buf, _, enc = _fp16_encoder(error_feedback=False)
    assert buf.fp16 and buf.wire.dtype == "float16"
    assert buf.wire.length == 3 + 3 * buf.topk_count and buf.wire.bytes == 2 * buf.wire.length
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(s).astype(np.float32) * 3 for s in SHAPES]
    msg = enc.message([mx.nd.array(grads[p]) for p in buf.params], 2049, 1).asnumpy()
    assert msg.dtype == np.float16 and msg.shape == (buf.wire.length,)
    rnd, rank, dense, idx = np_decode16(msg, buf.size)
    assert (rnd, rank) == (2049, 1)
    assert idx.max() >= 2048                                # the high digit was really used
    want = np.zeros(buf.size)
    for p, o, c in zip(buf.params, buf.offsets, buf.counts):
        g = grads[p].reshape(-1)
        sel = np_topk(g, c)
        want[o + sel] = g[sel].astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(dense, want)
    # what the server's decoder makes of it is the same
    got_rnd, got_rank, got = WireFormat("sparse", buf.size, buf.topk_count, fp16=True).parse(msg)
    assert (got_rnd, got_rank) == (2049, 1)
    np.testing.assert_array_equal(got.to_dense(), want.astype(np.float32))


def test_fp16_error_feedback_keeps_rounding_and_clipping_losses():
    buf, memory, enc = _fp16_encoder(density=0.01)
    o = buf.offsets[buf.params.index(0)]
    big = []                                                # what was sent of the 2e5 entry, per step
    rng = np.random.default_rng(4)
    total_g = np.zeros(buf.size)
    total_sent = np.zeros(buf.size)
    for step in range(25):
        grads = [(rng.standard_normal(s) * 0.37).astype(np.float32) for s in SHAPES]
        if step == 0:
            grads[0][17] = 2e5                              # beyond fp16's range: clipped, not inf
        fused = np.concatenate([grads[p].reshape(-1) for p in buf.params])
        total_g += fused
        msg = enc.message([mx.nd.array(grads[p]) for p in buf.params], step, 0).asnumpy()
        assert np.all(np.isfinite(msg))
        _, _, dense, _ = np_decode16(msg, buf.size)
        assert np.abs(dense).max() <= FP16_MAX
        big.append(dense[o + 17])
        total_sent += dense
    residual = np.concatenate([memory.residual[p].reshape(-1) for p in buf.params])
    # nothing lost: what was sent plus what is still held equals every gradient summed
    np.testing.assert_allclose(total_sent + residual, total_g, rtol=1e-5, atol=1e-3)
    # 2e5 goes out as three full-range fp16 chunks, then the remainder (plus later gradients)
    assert big[:3] == [FP16_MAX] * 3
    assert 0 < big[3] < 2e5 - 3 * FP16_MAX + 5
    # At the positions sent in the last step the fp32 wire leaves a zero residual; the fp16 wire leaves
    # exactly the rounding error there: nonzero, and within half an fp16 ulp of the value sent.
    sent_last = np.flatnonzero(dense)
    held = residual[sent_last]
    assert np.count_nonzero(held) > 0.5 * sent_last.size
    assert np.all(np.abs(held) <= np.abs(dense[sent_last]) * 2.0 ** -11 + 6e-8)


# ------------------------------------------------------------------------------ warm-up stages

SMALL_CNN_LIKE = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 512), (64,), (10, 64), (10,)]


@pytest.mark.parametrize("servers,fp16", [(1, False), (2, True), (3, False)])
def test_warmup_stages_share_buffers_and_get_their_own_mailboxes(servers, fp16):
    warmup = [0.25, 0.05]
    comp = comp_config(f"compression.warmup={warmup}", "compression.buffers=fixed",
                       "compression.buffer_bytes=40000", f"compression.fp16_values={str(fp16).lower()}")
    stages = make_stages(SMALL_CNN_LIKE, servers, comp, 0)
    place_stages([bufs for bufs, _ in stages], servers)
    assert len(stages) == 3
    final, _ = stages[-1]
    assert len(final) >= 2
    sizes = [int(np.prod(s)) for s in SMALL_CNN_LIKE]
    mailboxes = []
    for density, (bufs, encs) in zip(warmup + [comp.density], stages):
        assert [b.id for b in bufs] == [b.id for b in final]
        for b, f, e in zip(bufs, final, encs):
            assert (b.params, b.offsets, b.server, b.weight_key, b.clock_key, b.fp16) == \
                   (f.params, f.offsets, f.server, f.weight_key, f.clock_key, fp16)
            assert b.counts == [max(1, int(density * sizes[p])) for p in b.params]
            assert (b.mailbox_key * KEY_HASH) % servers == b.server
            assert e.buffer is b and e.memory is stages[-1][1][0].memory   # one shared memory
            mailboxes.append(b.mailbox_key)
    others = [k for b in final for k in (b.weight_key, b.clock_key)]
    assert len(set(mailboxes)) == len(mailboxes) and not set(mailboxes) & set(others)
    ks = [sum(b.topk_count for b in bufs) for bufs, _ in stages]
    assert ks[0] > ks[1] > ks[2]


def test_round_service_applies_rounds_pushed_in_every_stage():
    """Rounds 0-1 arrive on the 25% fp16 mailbox, rounds 2-3 on the 1% one: the server decodes each
    by its key and applies plain SGD on the sum, as a numpy reference does from the raw messages."""
    comp = comp_config("compression.warmup=[0.25]", "compression.fp16_values=true",
                       "compression.error_feedback=false")
    workers, batch, lr = 2, 4, 0.05
    stages = [make_stages(SHAPES, 1, comp, rank) for rank in range(workers)]
    for made in stages:
        place_stages([bufs for bufs, _ in made], 1)
    (buf,) = stages[0][-1][0]
    plan = {"num_workers": workers, "batch_size": batch, "momentum": 0.0, "wd": 0.0,
            "schedule": LRSchedule("constant", base_lr=lr, total_updates=10).to_dict(),
            "buffers": [buf.to_dict([bufs[0] for bufs, _ in stages[0]])]}
    assert [m["topk_count"] for m in plan["buffers"][0]["mailboxes"]] == [stages[0][0][0][0].topk_count,
                                                                        buf.topk_count]
    svc = RoundService(plan, mx.nd)
    w0 = np.random.default_rng(5).standard_normal(buf.size).astype(np.float32)
    stored_w = mx.nd.array(np.append(w0, 0))
    svc.push(buf.weight_key, mx.nd.zeros(buf.size + 1), stored_w)
    svc.push(buf.clock_key, mx.nd.zeros(1), mx.nd.zeros(1))
    rng = np.random.default_rng(6)
    w = w0.astype(np.float64)
    for rnd in range(4):
        stage = 0 if rnd < 2 else 1
        g_sum = np.zeros(buf.size)
        for rank in range(workers):
            (sbuf,), (enc,) = stages[rank][stage]
            grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
            msg = enc.message([mx.nd.array(grads[p]) for p in sbuf.params], rnd, rank)
            _, _, dense, idx = np_decode16(msg.asnumpy(), buf.size)
            assert idx.size == sbuf.topk_count
            g_sum += dense
            svc.push(sbuf.mailbox_key, msg, mx.nd.zeros(sbuf.wire.length, dtype="float16"))
        w -= lr * g_sum / (workers * batch)
        got = stored_w.asnumpy()
        assert got[-1] == rnd + 1
        np.testing.assert_allclose(got[:-1], w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("overrides,key", [
    (["compression.type=none", "algorithm.type=ssgd", "compression.fp16_values=true"], "compression.fp16_values"),
    (["compression.type=none", "compression.warmup=[0.5]"], "compression.warmup"),
    (["compression.warmup=[0.5, 1.5]"], "compression.warmup"),
    (["compression.warmup=[0.5, 0]"], "compression.warmup"),
    (["compression.warmup=[high]"], "compression.warmup"),
    (["compression.warmup=[0.5, 0.1]", "train.epochs=2"], "compression.warmup"),
    (["compression.warmup=[0.25, 0.005]"], "compression.warmup"),          # below density 0.01
])
def test_config_refuses_bad_fp16_and_warmup_settings(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(os.path.join(ROOT, TOPK_CONFIG), overrides)
    assert str(info.value).startswith(key)


# ---------------------------------------------------------------------------- real 2-worker job


@pytest.mark.parametrize("fp16, bitmap", [(False, False), (True, False), (False, True)])
def test_a_sparse_message_made_on_the_host_is_encode_messages(fp16, bitmap):
    """codec.sparse_message (what the sparse encoders push): encode_message of the encode_sparse payload,
    dtype and bits, header included, at fp16 rounds on both sides of a digit."""
    from ssdsgd.compression.codec import encode_message, encode_sparse, sparse_message
    rng = np.random.default_rng(1)
    idx = np.sort(rng.choice(5000, 300, replace=False))
    val = rng.standard_normal(300).astype(np.float32)
    if fp16:
        val = val.astype(np.float16).astype(np.float32)
    for step in (0, DIGIT - 1, DIGIT, 3 * DIGIT + 5):
        want = encode_message(step, 3, mx.nd.array(encode_sparse(idx, val, fp16, 5000 if bitmap else None)), fp16)
        got = sparse_message(step, 3, idx, val, fp16, 5000 if bitmap else None)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.asnumpy().view(np.uint8))
