"""Sparse downlink (compression.downlink: sparse): the servers publish each applied round's aggregated
sparse update in a ring (ssdsgd.ps.ring.DownlinkRing); a worker's replica of the buffer's server state
applies them with the same numpy update and must stay bit for bit equal to the server's state."""
import pytest

from unit.test_downlink import bits_equal


# ---- real jobs on loopback ------------------------------------------------------------------------
TOPK = "configs/demo_digits_ssd_topk.yaml"
# Fixed buffers (no link probe, so both runs get the same plan): 3 buffers of the demo's small_cnn.
STRICT = ["train.epochs=3", "algorithm.strict=true", "compression.buffers=fixed", "compression.buffer_bytes=32768"]


def _params(path):
    import mxnet as mx
    return {k: v.asnumpy() for k, v in mx.nd.load(path).items()}


@pytest.mark.timeout(400)
def test_strict_sparse_downlink_ends_with_the_dense_downlink_weights(tmp_path):
    """Strict SSD-SGD + top-k with a density warm-up (2% in epoch 0, the synchronous warm-up, then
    1%): refreshing from the replica gives exactly (bit for bit) the global weights of the run that
    pulls dense weights, the warm-up's rounds come through their own ring (no rebuild from the dense
    state at the stage change), and the guard, run at every refresh, finds every replica equal to
    the servers' weights. The traffic: after the warm-up at most 2.2x the pushed bytes are pulled
    (the union of 2 workers' indices); the guard's checksum rides in the ring slots' fixed headers, so
    checking every round costs no bytes."""
    from support.jobs import processes_with, run_job
    strict = STRICT + ["compression.warmup=[0.02]"]
    dense = run_job(tmp_path, TOPK, *strict, name="dense")
    assert dense.rc == 0, dense.output
    sparse = run_job(tmp_path, TOPK, *strict, "compression.downlink=sparse",
                     "compression.downlink_check_every=1", name="sparse")
    assert sparse.rc == 0, sparse.output
    sd, ss = dense.summary(), sparse.summary()
    assert sd["steps"] == ss["steps"] == 66
    wd, ws = _params(sd["checkpoint"]), _params(ss["checkpoint"])
    assert wd.keys() == ws.keys()
    for name in wd:
        assert bits_equal(ws[name], wd[name]), name
    client = ss["client"]
    decisions = [(d["stage"], d["downlink"]) for d in client["downlink"]]
    assert decisions == [(0, "sparse"), (1, "sparse")] * client["buffers"]
    # Every round a replica applied was checked (check_every = 1): 22 warm-up rounds, then 8
    # refreshes of 5 rounds each (the last 4 rounds are never pulled), per buffer.
    assert client["downlink_checks"] == client["buffers"] * (22 + 8 * 5)
    assert client["downlink_resyncs"] == client["buffers"]          # only the one at start
    assert "downlink: buffer 0, density stage 0: sparse" in sparse.output
    # The warm-up's pulls (its 22 steps, and the start's one dense pull or rebuild) shrink with the
    # stage's ring: 5 slots (S = k = 5) of 2 workers' 2% are about 0.4 of the dense weights.
    warm_dense = sd["pull_bytes"] - sd["after_warmup"]["pull_bytes"]
    warm_sparse = ss["pull_bytes"] - ss["after_warmup"]["pull_bytes"]
    ring_share = sum(d["ring_bytes"] for d in client["downlink"] if d["stage"] == 0) / \
        sum(d["dense_bytes"] for d in client["downlink"] if d["stage"] == 0)
    print(f"warm-up pulls: {warm_sparse} B sparse, {warm_dense} B dense; a stage-0 ring is {ring_share:.2f} of dense")
    assert ring_share < 0.5 and warm_sparse < 0.6 * warm_dense

    aw, awd = ss["after_warmup"], sd["after_warmup"]
    push, pull = aw["push_bytes"] / aw["steps"], aw["pull_bytes"] / aw["steps"]
    print(f"after warm-up, per step: pushed {push:.0f} B, pulled {pull:.0f} B sparse "
          f"({pull / push:.2f}x), {awd['pull_bytes'] / awd['steps']:.0f} B dense")
    assert pull <= 2.2 * push, (push, pull)
    assert pull < 0.5 * awd["pull_bytes"] / awd["steps"]
    for job in (dense, sparse):
        assert processes_with(job.marker) == []


@pytest.mark.timeout(400)
def test_resume_with_a_ring_pull_in_flight_matches_uninterrupted_run(tmp_path):
    """Strict SSD-SGD + top-k with the sparse downlink and a two-epoch density warm-up (3%, 2%, then
    1%), checkpoint every epoch; the warm-up of 24 steps puts a refresh's ring pull in flight at the
    end of epoch 2 (step 43), from the second density stage's ring. Run A stops there, B resumes it
    (replica and in-flight ring from the worker's checkpoint), C runs through: B ends bit for bit
    where C ends, and every refresh passes the guard."""
    from support.jobs import processes_with, stopped_resumed_and_uninterrupted
    common = STRICT[1:] + ["train.epochs=4", "algorithm.warmup_iters=24", "checkpoint.every_epochs=1",
                           "compression.warmup=[0.03,0.02]",
                           "compression.downlink=sparse", "compression.downlink_check_every=1"]
    a, b, c = stopped_resumed_and_uninterrupted(tmp_path, TOPK, *common, stop_steps=44)
    assert "epoch-0002" in b.output
    assert b.summary()["steps"] == c.summary()["steps"] == 88
    wb, wc = (_params(j.summary()["checkpoint"]) for j in (b, c))
    for name in wc:
        assert bits_equal(wb[name], wc[name]), name
    # B rebuilt nothing from the dense state: its replicas came from the checkpoint, and the next
    # refresh (step 48) caught up from the steady stage's ring.
    client = b.summary()["client"]
    assert client["downlink_resyncs"] == 0
    assert [d["downlink"] for d in client["downlink"]] == ["sparse"] * 3 * client["buffers"]
    for job in (a, b, c):
        assert processes_with(job.marker) == []


@pytest.mark.timeout(400)
def test_compressed_downlink_at_4_workers_resumes_exactly(tmp_path):
    """Strict SSD-SGD + top-k at 4 workers with compression.downlink compressed: every buffer's ring
    is the compressed one; after the warm-up a worker pulls at most twice what it pushes (the exact ring
    would be up to 4 pushes); the guard checks every round; and a run stopped and resumed from its
    checkpoint (the servers' residual in it) ends bit for bit where the uninterrupted one ends."""
    from support.jobs import processes_with, stopped_resumed_and_uninterrupted
    common = STRICT[1:] + ["cluster.workers=4", "train.epochs=3", "checkpoint.every_epochs=1",
                           "compression.downlink=compressed", "compression.downlink_check_every=1"]
    a, b, c = stopped_resumed_and_uninterrupted(tmp_path, TOPK, *common, stop_steps=22)
    sb, sc = b.summary(), c.summary()
    assert sb["steps"] == sc["steps"]
    wb, wc = _params(sb["checkpoint"]), _params(sc["checkpoint"])
    for name in wc:
        assert bits_equal(wb[name], wc[name]), name
    client = sc["client"]
    assert {d["downlink"] for d in client["downlink"]} == {"compressed"}
    assert client["downlink_checks"] > 0 and client["downlink_resyncs"] == client["buffers"]  # the start's
    aw = sc["after_warmup"]
    push, pull = aw["push_bytes"] / aw["steps"], aw["pull_bytes"] / aw["steps"]
    print(f"4 workers, after warm-up, per step: pushed {push:.0f} B, pulled {pull:.0f} B ({pull / push:.2f}x)")
    assert pull <= 2.1 * push, (push, pull)
    for job in (a, b, c):
        assert processes_with(job.marker) == []
