"""Bitmap index coding (compression.index_coding: auto): a sparse message or a sparse-downlink round
carries its indices as a selection mask of ceil(size / 24) float32 words instead of k indices, where
that is smaller. Checked against an independent pure-Python reading of the format, against the
index-list coding bit for bit, and in real jobs."""

import pytest

from unit.test_bitmap_coding import bits_equal


# ---- real jobs on loopback ------------------------------------------------------------------------
TOPK = "configs/demo_digits_ssd_topk.yaml"
# Strict SSD-SGD (k = 1) + top-k 10% with the sparse downlink over fixed buffers of at most 32 KB (the
# demo's small_cnn gives 3): every push and ring then carries more indices than its buffer's bitmap has
# words (k > size / 24), so both use the bitmap.
DENSE10 = ["train.epochs=2", "algorithm.strict=true", "algorithm.delay=1", "compression.buffers=fixed",
           "compression.buffer_bytes=32768", "compression.density=0.1", "compression.downlink=sparse",
           "compression.downlink_check_every=1"]


@pytest.mark.timeout(400)
def test_bitmap_coding_trains_bit_for_bit_as_the_index_list_with_fewer_bytes(tmp_path):
    from support.jobs import processes_with, run_job
    from jobs.test_downlink import _params
    listed = run_job(tmp_path, TOPK, *DENSE10, "compression.index_coding=list", name="list")
    assert listed.rc == 0, listed.output
    bitmap = run_job(tmp_path, TOPK, *DENSE10, name="bitmap")
    assert bitmap.rc == 0, bitmap.output
    sl, sb = listed.summary(), bitmap.summary()
    assert sl["steps"] == sb["steps"] > 0
    wl, wb = _params(sl["checkpoint"]), _params(sb["checkpoint"])
    assert wl.keys() == wb.keys()
    for name in wl:
        assert bits_equal(wb[name], wl[name]), name
    assert {d["indices"] for d in sb["client"]["downlink"]} == {"bitmap"}
    assert {d["indices"] for d in sl["client"]["downlink"]} == {"list"}
    assert "with an index bitmap" in bitmap.output
    # Every replica applied every round and checked it against the servers' checksum.
    assert sb["client"]["downlink_checks"] == sl["client"]["downlink_checks"] > 0
    al, ab = sl["after_warmup"], sb["after_warmup"]
    push_l, push_b = al["push_bytes"] / al["steps"], ab["push_bytes"] / ab["steps"]
    pull_l, pull_b = al["pull_bytes"] / al["steps"], ab["pull_bytes"] / ab["steps"]
    print(f"per step after warm-up: push {push_b:.0f} B (list {push_l:.0f}), pull {pull_b:.0f} B (list {pull_l:.0f})")
    assert push_b < 0.8 * push_l and pull_b < 0.7 * pull_l
    for job in (listed, bitmap):
        assert processes_with(job.marker) == []
