"""Sparse downlink (compression.downlink: sparse): the servers publish each applied round's aggregated
sparse update in a ring (ssdsgd.ps.ring.DownlinkRing); a worker's replica of the buffer's server state
applies them with the same numpy update and must stay bit for bit equal to the server's state."""
import numpy as np
import pytest

from ssdsgd.compression.codec import WireFormat
from ssdsgd.ps.ring import DownlinkRing, RingLayout, StagedRings, read_ring
from ssdsgd.ps.rounds import BufferState, RoundError
from ssdsgd.schedule import LRSchedule

B = 8


def schedule(rounds):
    return LRSchedule("cosine", base_lr=0.3, total_updates=rounds, warmup_updates=3)


def sparse_message(rnd, rank, idx, vals):
    return np.concatenate([np.array([rnd, rank], np.float32), idx.astype(np.float32), vals.astype(np.float32)])


def bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def make_pair(size, workers, k, rounds, momentum, delay_momentum, wd, slots, warmup=5):
    fmt = [WireFormat("sparse", size, k)]
    server = BufferState(size, workers, B, momentum, wd, schedule(rounds), fmt, delay_momentum, warmup)
    replica = BufferState(size, workers, B, momentum, wd, schedule(rounds), [], delay_momentum, warmup)
    server.ring = DownlinkRing(RingLayout(slots, workers * k, size))
    w0 = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    server.bind(w0)
    replica.bind(w0)
    return server, replica


@pytest.mark.parametrize("momentum,delay_momentum,wd", [(0.9, 0.5, 1e-4), (0.0, 0.0, 1e-4), (0.9, None, 0.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_replica_stays_bit_identical(seed, momentum, delay_momentum, wd):
    """Random sparse pushes from N workers (repeated indices inside a message and across workers,
    values that cancel exactly), arriving out of order and up to several rounds ahead; the replica
    pulls the ring at random times (every 1 to slots - 2 rounds: one message can apply 3) and must
    equal the server exactly."""
    rng = np.random.default_rng(seed)
    size, workers, k, rounds, slots = 300, 4, 12, 120, 5
    server, replica = make_pair(size, workers, k, rounds, momentum, delay_momentum, wd, slots)
    msgs = []
    for rnd in range(rounds):
        for rank in range(workers):
            idx = rng.integers(0, size if rnd % 7 else 10, k)        # some rounds: heavy overlap
            idx[: k // 4] = idx[0]                                    # repeats inside one message
            vals = rng.standard_normal(k).astype(np.float32) * np.float32(10.0 ** rng.integers(-4, 3))
            if rank == 1 and rnd % 5 == 0:
                vals[0] = -np.float32(vals[: k // 4].sum(dtype=np.float32) - vals[0])   # may cancel
            msgs.append((rnd, rank, sparse_message(rnd, rank, idx, vals)))
    # Out of order: shuffle within windows of three rounds (a fast worker runs ahead).
    order = []
    for start in range(0, len(msgs), 3 * workers):
        window = msgs[start:start + 3 * workers]
        order += [window[i] for i in rng.permutation(len(window))]
    checked = 0
    next_pull = 1
    for rnd, rank, msg in order:
        server.receive(msg)
        if server.version >= next_pull:
            ring = read_ring(server.ring.array.copy(), server.ring.layout)
            assert replica.catch_up(ring)
            assert replica.version == server.version
            assert bits_equal(replica.weights, server.weights)
            assert bits_equal(replica.mom, server.mom)
            checked += 1
            next_pull = replica.version + int(rng.integers(1, slots - 1))   # a jump of 3 still fits
    assert server.version == rounds and checked > 20


def test_missed_rounds_and_dense_slots_ask_for_a_dense_pull():
    size, workers, k, slots = 50, 2, 3, 2
    server, replica = make_pair(size, workers, k, 10, 0.9, None, 1e-4, slots)
    rng = np.random.default_rng(0)
    for rnd in range(3):
        for rank in range(workers):
            server.receive(sparse_message(rnd, rank, rng.integers(0, size, k), rng.standard_normal(k)))
    ring = read_ring(server.ring.array, server.ring.layout)
    assert sorted(ring) == [1, 2]
    assert not replica.catch_up(ring)              # round 0 has left the ring
    assert replica.version == 0
    # Resync from the dense state, then a round whose sum does not fit its slot.
    replica.bind(server.weights, server.version)
    replica.mom = server.mom.copy()
    server.ring.record(server.version, np.ones(size, np.float32))
    ring = read_ring(server.ring.array, server.ring.layout)
    assert ring[3] is None and not replica.catch_up(ring)
    assert replica.version == 3


def test_record_keeps_negative_zero_and_nan():
    ring = DownlinkRing(RingLayout(1, 4, 6))
    g = np.array([0.0, -0.0, 1.5, np.nan, 0.0, 2.0], np.float32)
    ring.record(0, g)
    (idx, vals, _), = read_ring(ring.array, ring.layout).values()
    back = np.zeros(6, np.float32)
    back[idx] = vals
    assert bits_equal(back, g)


def test_read_ring_checks_length_and_empty_slots():
    ring = DownlinkRing(RingLayout(3, 2, 10))
    assert ring.array.shape == (RingLayout(3, 2, 10).length,) == (3 * (4 + 2 + 2),)
    assert read_ring(ring.array, ring.layout) == {}
    with pytest.raises(RoundError):
        read_ring(ring.array[:-1], ring.layout)


def test_staged_rings_route_each_round_to_its_density_stage():
    """Under a density warm-up every stage has its own ring, sized for its density: rounds 0-3 (30
    values a worker) go to stage 0's ring, rounds 4-9 (3 values) to stage 1's. A replica that pulls
    the ring of each round's stage stays bit for bit the server's across the boundary; one that
    pulls stage 1's ring while it still misses stage 0's last round cannot catch up (it then
    rebuilds from the dense state). A stage without a ring publishes nothing."""
    size, workers, k0, k1, slots, first = 200, 2, 30, 3, 2, 4
    fmts = [WireFormat("sparse", size, k0), WireFormat("sparse", size, k1)]
    server = BufferState(size, workers, B, 0.9, 1e-4, schedule(10), fmts, 0.5, 2)
    replica = BufferState(size, workers, B, 0.9, 1e-4, schedule(10), [], 0.5, 2)
    rings = [DownlinkRing(RingLayout(slots, workers * k0, size)), DownlinkRing(RingLayout(slots, workers * k1, size))]
    server.ring = StagedRings(rings, [0, first])
    lagging = BufferState(size, workers, B, 0.9, 1e-4, schedule(10), [], 0.5, 2)
    w0 = np.random.default_rng(2).standard_normal(size).astype(np.float32)
    for st in (server, replica, lagging):
        st.bind(w0)
    rng = np.random.default_rng(4)
    for rnd in range(10):
        stage, k = (0, k0) if rnd < first else (1, k1)
        for rank in range(workers):
            idx = rng.choice(size, k, replace=False)
            server.receive(sparse_message(rnd, rank, idx, rng.standard_normal(k)), stage)
        ring = read_ring(rings[stage].array.copy(), rings[stage].layout)
        assert max(ring) == rnd
        if stage == 0:
            assert len(ring[rnd].indices) > workers * k1     # would not fit stage 1's slots
        assert replica.catch_up(ring) and replica.version == rnd + 1
        assert bits_equal(replica.weights, server.weights) and bits_equal(replica.mom, server.mom)
        if rnd < first - 1:
            assert lagging.catch_up(ring)                  # lagging stops pulling before round 3
    late = read_ring(rings[1].array.copy(), rings[1].layout)
    assert sorted(late) == [8, 9] and not lagging.catch_up(late) and lagging.version == first - 1
    # Stage 0's ring kept its last rounds; nothing of stage 1 was written into it.
    assert sorted(read_ring(rings[0].array, rings[0].layout)) == [2, 3]
    quiet = StagedRings([None, DownlinkRing(RingLayout(slots, 4, size))], [0, 5])
    quiet.record(3, np.ones(size, np.float32))
    assert read_ring(quiet.rings[1].array, quiet.rings[1].layout) == {}
    with pytest.raises(RoundError, match="stages starting at rounds"):
        StagedRings(rings, [0])
    with pytest.raises(RoundError, match="stages starting at rounds"):
        StagedRings(rings, [3, 1])


def test_round_service_publishes_each_stage_ring_in_its_own_key():
    """The server binds one key per stage ring (and the momentum key), refuses mailbox pushes before
    all of them are bound, and after each round the stored ring of that round's stage carries it."""
    import mxnet as mx

    from ssdsgd.ps.server import RoundService
    size, workers, ks = 64, 2, (8, 2)
    plan = {"num_workers": workers, "batch_size": B, "momentum": 0.0, "wd": 0.0,
            "schedule": LRSchedule("constant", base_lr=0.1, total_updates=10).to_dict(),
            "buffers": [{"id": 0, "size": size, "weight_key": 0, "clock_key": 1,
                         "mailboxes": [{"key": 2, "codec": "sparse", "size": size, "topk_count": ks[0]},
                                       {"key": 3, "codec": "sparse", "size": size, "topk_count": ks[1]}],
                         "downlink": {"rings": [{"key": 4, "cap": workers * ks[0], "bitmap": False},
                                                {"key": 5, "cap": workers * ks[1], "bitmap": False}],
                                      "first_rounds": [0, 2], "mom_key": 6, "slots": 1, "check_every": 0}}]}
    svc = RoundService(plan, mx.nd)
    stored = {key: mx.nd.zeros(n) for key, n in ((0, size + 1), (1, 1), (6, size + 1),
                                                  (4, RingLayout(1, workers * ks[0], size).length),
                                                  (5, RingLayout(1, workers * ks[1], size).length))}
    for key in (0, 1, 6, 4):
        svc.push(key, mx.nd.zeros(stored[key].shape), stored[key])
    msg = sparse_message(0, 0, np.arange(ks[0]), np.ones(ks[0]))
    with pytest.raises(RuntimeError, match="downlink ring and momentum keys"):
        svc.push(2, mx.nd.array(msg), mx.nd.zeros(msg.size))
    svc.push(5, mx.nd.zeros(stored[5].shape), stored[5])
    rng = np.random.default_rng(7)
    for rnd in range(4):
        stage = 0 if rnd < 2 else 1
        k, sums = ks[stage], np.zeros(size, np.float32)
        for rank in range(workers):
            idx, vals = rng.choice(size, k, replace=False), rng.standard_normal(k).astype(np.float32)
            sums[idx] += vals
            svc.push(2 + stage, mx.nd.array(sparse_message(rnd, rank, idx, vals)), mx.nd.zeros(2 + 2 * k))
        (got_rnd, (idx, vals, _)), = read_ring(stored[4 + stage].asnumpy(), RingLayout(1, workers * k, size)).items()
        back = np.zeros(size, np.float32)
        back[idx] = vals
        assert got_rnd == rnd and bits_equal(back, sums)
        assert stored[6].asnumpy()[-1] == rnd + 1
        assert svc.states[0].ring.changed == set()        # published, so nothing is left to copy
    assert sorted(read_ring(stored[4].asnumpy(), RingLayout(1, workers * ks[0], size))) == [1]


def test_compressed_rounds_stay_bit_identical_and_lose_nothing():
    """Compressed downlink at 8 workers: the servers apply and publish each round's largest values of
    (sum + residual), rounded to the packed slot's one-byte values, as many as a slot of 8 words holds
    (21 bytes: at most 10 pairs); the replica that applies the ring equals the servers' weights bit for
    bit; and nothing is lost: the residual plus every published round is the sum of all pushes (the
    servers' error feedback keeps the rest, rounding errors included)."""
    from ssdsgd.ps.ring_packing import round_values
    rng = np.random.default_rng(3)
    size, workers, k, rounds, slots = 400, 8, 10, 30, 4
    fmt = [WireFormat("sparse", size, k)]
    server = BufferState(size, workers, B, 0.9, 1e-4, schedule(rounds), fmt, 0.5, 5)
    replica = BufferState(size, workers, B, 0.9, 1e-4, schedule(rounds), [], 0.5, 5)
    server.ring = DownlinkRing(RingLayout.packed(slots, size, 8), check_every=1)
    assert server.ring.layout.cap == 10
    w0 = rng.standard_normal(size).astype(np.float32)
    server.bind(w0)
    replica.bind(w0)
    pushed, published = np.zeros(size, np.float64), np.zeros(size, np.float64)
    for rnd in range(rounds):
        for rank in range(workers):
            idx = rng.choice(size, k, replace=False)
            vals = rng.standard_normal(k).astype(np.float32)
            np.add.at(pushed, idx, vals)
            server.receive(sparse_message(rnd, rank, idx, vals))
        ring = read_ring(server.ring.array.copy(), server.ring.layout, from_round=replica.version)
        entry = ring[rnd]
        assert 0 < len(entry.indices) <= k
        assert bits_equal(round_values(entry.values)[0], entry.values)      # one-byte values, as applied
        published[entry.indices] += entry.values
        assert replica.catch_up(ring) and replica.checks == rnd + 1      # the guard: every round
        assert bits_equal(replica.weights, server.weights) and bits_equal(replica.mom, server.mom)
    assert np.allclose(published + server.residual, pushed, atol=1e-4)
    assert np.count_nonzero(server.residual) > size // 2         # most of what was pushed still waits


def test_compressed_downlink_picks_per_buffer_by_size():
    """compression.downlink compressed: the exact ring up to 2 workers (it is then no larger than the
    compressed ring of two pushes' bytes), the compressed ring beyond, dense where no ring is smaller than
    the dense weights; sparse keeps the exact ring at any N. A compressed slot is two pushes' bytes:
    a push of 100 values is 2 + 200 words, the slot 4 + 400 (1,197 payload bytes, up to 598 pairs)."""
    from types import SimpleNamespace
    from ssdsgd.algorithms.downlink import ring_choice
    comp = SimpleNamespace(downlink="compressed", index_coding="list", fp16_values=False)
    assert ring_choice(comp, 5, 10000, 100, 2)[0] == "sparse"
    assert ring_choice(comp, 5, 10000, 100, 3)[0] == "compressed"
    kind, layout = ring_choice(comp, 5, 10000, 100, 8)
    assert kind == "compressed" and layout.compressed and layout.slot_length == 2 * (2 + 200)
    assert layout.cap == 598
    assert ring_choice(comp, 5, 800, 100, 8)[0] == "dense"
    sparse = SimpleNamespace(downlink="sparse", index_coding="list")
    kind, layout = ring_choice(sparse, 5, 100000, 100, 8)
    assert kind == "sparse" and layout.cap == 800


def test_round_service_keeps_the_residual_in_its_checkpoint(tmp_path):
    """A server's compressed-downlink residual is part of its checkpoint: saved and loaded back."""
    import mxnet as mx

    from ssdsgd.ps.server import RoundService
    size, workers, k = 64, 4, 3
    plan = {"num_workers": workers, "batch_size": B, "momentum": 0.0, "wd": 0.0,
            "schedule": LRSchedule("constant", base_lr=0.1, total_updates=10).to_dict(),
            "buffers": [{"id": 0, "size": size, "weight_key": 0, "clock_key": 1,
                         "mailboxes": [{"key": 2, "codec": "sparse", "size": size, "topk_count": k}],
                         "downlink": {"rings": [{"key": 4, "cap": k, "bitmap": False, "packed_words": 3}],
                                      "first_rounds": [0], "mom_key": 6, "slots": 2, "check_every": 0}}]}

    def service():
        svc = RoundService(plan, mx.nd)
        stored = {key: mx.nd.zeros(n) for key, n in ((0, size + 1), (1, 1), (6, size + 1),
                                                      (4, RingLayout.packed(2, size, 3).length))}
        for key in stored:
            svc.push(key, mx.nd.zeros(stored[key].shape), stored[key])
        return svc

    svc = service()
    rng = np.random.default_rng(5)
    for rank in range(workers):
        # disjoint, non-zero, exact in the packed slot's one-byte values (so only what it leaves out waits)
        msg = sparse_message(0, rank, rank * k + np.arange(k), rng.integers(8, 16, k).astype(np.float32))
        svc.push(2, mx.nd.array(msg), mx.nd.zeros(msg.size))
    residual = svc.states[0].residual.copy()
    assert np.count_nonzero(residual) == workers * k - k
    svc.save(str(tmp_path))
    again = service()
    again.load(str(tmp_path))
    assert bits_equal(again.states[0].residual, residual) and again.states[0].version == 1


def test_config_downlink_needs_a_sparsifier():
    import os

    from support.jobs import ROOT

    from ssdsgd.config import ConfigError, load_config
    cfg = load_config(os.path.join(ROOT, "configs/demo_digits_ssd_topk.yaml"))
    assert cfg.compression.downlink == "dense" and cfg.compression.downlink_check_every == 50
    cfg = load_config(os.path.join(ROOT, "configs/demo_digits_ssd_topk.yaml"), ["compression.downlink=sparse"])
    assert cfg.compression.downlink == "sparse"
    with pytest.raises(ConfigError, match=r"compression\.downlink: sparse .* needs a sparsifier"):
        load_config(os.path.join(ROOT, "configs/demo_digits_ssd.yaml"), ["compression.downlink=sparse"])
    with pytest.raises(ConfigError, match=r"compression\.downlink"):
        load_config(os.path.join(ROOT, "configs/demo_digits_ssd_topk.yaml"), ["compression.downlink=lossy"])
    with pytest.raises(ConfigError, match=r"compression\.downlink_check_every"):
        load_config(os.path.join(ROOT, "configs/demo_digits_ssd_topk.yaml"), ["compression.downlink_check_every=-1"])


def test_checksum_guard_names_the_version_and_the_buffer():
    """Every check_every-th round carries the CRC-32 of the server's weights; a replica one ulp off
    is refused at the next checked round, and the worker's Downlink names the buffer and its keys."""
    from types import SimpleNamespace

    import mxnet as mx

    from ssdsgd.algorithms.downlink import Downlink
    from ssdsgd.ps.rounds import ReplicaMismatch, weights_checksum
    size, workers, k, slots = 40, 2, 3, 4
    server, replica = make_pair(size, workers, k, 20, 0.9, 0.5, 1e-4, slots)
    server.ring.check_every = 2
    rng = np.random.default_rng(3)

    def play(rounds):
        for rnd in rounds:
            for rank in range(workers):
                server.receive(sparse_message(rnd, rank, rng.integers(0, size, k), rng.standard_normal(k)))
        return read_ring(server.ring.array.copy(), server.ring.layout)

    ring = play(range(3))
    assert [ring[r].checksum is not None for r in range(3)] == [False, True, False]   # (r + 1) % 2 == 0
    assert ring[1].checksum != weights_checksum(server.weights)          # the weights after round 1 only
    assert replica.catch_up(ring) and replica.checks == 1
    replica.weights[7] = np.nextafter(replica.weights[7], np.float32(np.inf))   # one ulp off
    ring = play(range(3, 5))
    with pytest.raises(ReplicaMismatch, match=r"version 4 differs from the servers' \(CRC-32"):
        replica.catch_up(ring)

    replica.bind(server.weights, server.version)
    replica.mom = server.mom.copy()
    replica.weights[0] += np.float32(1)
    play(range(5, 7))
    ring_buf = mx.nd.array(server.ring.array)
    transport = SimpleNamespace(buffers=[SimpleNamespace(weight_key=3, size=size)], stages=[None])
    downlink = Downlink(transport, {}, slots, steps_per_epoch=None)          # no compression: no plan
    assert downlink.plans == [None] and downlink.land(0) is None
    downlink.plans = [{"rings": [{"key": 9, "cap": workers * k, "bitmap": False}], "slots": slots}]
    downlink.replicas, downlink.ring_bufs, downlink.pulled = [replica], [[ring_buf]], [0]
    with pytest.raises(RuntimeError, match=r"downlink: buffer 0 \(keys 3/9\): .* version 6 differs"):
        downlink.land(0)
