"""bench/scaling_model.py: the byte accounting follows the plan, codec and ring layouts; the ring
all-reduce and SSGD formulas; validate mode on a tiny synthetic runs.csv; bad input named in one line."""
import csv
import json
import os

import pytest

from bench import scaling_model as sm
from ssdsgd.algorithms.downlink import COMPRESSED_PUSHES
from ssdsgd.compression.codec import WireFormat, use_bitmap
from ssdsgd.compression.fusion import tensor_counts
from ssdsgd.ps.ring import RingLayout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "configs/bench_cifar_resnet20.yaml")
TOPK = ["algorithm.type=ssd", "compression.type=topk", "compression.density=0.01", "algorithm.delay=1"]
SHAPES = [(64, 3, 3, 3), (64,), (128, 64, 3, 3), (128,), (10, 128), (10,)]


def _cfg(*sets):
    return sm.load(BENCH, list(sets))


@pytest.mark.parametrize("downlink", ["sparse", "compressed"])
def test_round_bytes_are_the_plans_messages_and_rings(downlink):
    cfg = _cfg(*TOPK, f"compression.downlink={downlink}", "compression.buffers=one")
    workers = 16
    b = sm.round_bytes(SHAPES, cfg, workers, 1)
    sizes, counts, _ = tensor_counts(SHAPES, cfg.compression)
    size, k = sum(sizes), sum(counts)
    assert b["push"] == WireFormat("sparse", size, k, bitmap=use_bitmap(size, k)).bytes == 4 * (2 + 2 * k)
    # one slot (delay 1): the exact ring carries N pushes' values (a bitmap once that is smaller); the
    # compressed one, chosen where the exact ring is larger, two pushes' worth
    cap = min(workers * k, size)
    ring = RingLayout(1, cap, size, use_bitmap(size, cap)) if downlink == "sparse" else \
        RingLayout.packed(1, size, COMPRESSED_PUSHES * (2 + 2 * k) - 4)      # two pushes' words
    assert b["pull"] == 4 * ring.length
    assert b["downlink"] == downlink
    assert (b["server_rx"], b["server_tx"]) == (workers * b["push"], workers * b["pull"])
    assert b["server_values"] == workers * k and b["squeezed"] == (size if downlink == "compressed" else 0)


def test_round_bytes_spread_over_the_servers_and_pull_every_delay_steps():
    cfg = _cfg(*TOPK[:3], "algorithm.delay=4", "compression.downlink=sparse", "compression.buffers=one")
    one, two = sm.round_bytes(SHAPES, cfg, 4, 1), sm.round_bytes(SHAPES, cfg, 4, 2)
    assert two["push"] == pytest.approx(one["push"] + 4 * 2)            # a second message header
    assert two["server_rx"] < one["server_rx"]
    sizes, counts, _ = tensor_counts(SHAPES, cfg.compression)
    ring = RingLayout(4, min(4 * sum(counts), sum(sizes)), sum(sizes), use_bitmap(sum(sizes), 4 * sum(counts)))
    assert one["pull"] == 4 * ring.length / 4                          # a ring of 4 rounds every 4 steps


def test_the_benchmark_layout_gives_the_measured_push_and_pull():
    """results/hosts_steps60_v2: rank 0 pushed 21,976 and pulled 43,961 bytes a step (the
    pulls' mean includes the odd dense resync) with the shipped top-k settings, 2 workers, 1 server."""
    cfg = _cfg(*sm.ALGORITHMS["ssd_topk_sparse"][1])
    b = sm.round_bytes(sm.model_shapes(cfg), cfg, 2, 1)
    assert b["push"] == 21976
    assert 43900 < b["pull"] <= 43961


def test_stock_keys_land_where_mxnet_puts_them():
    shapes = [(10,), (20,), (2_000_000,)]
    b = sm.dense_bytes(shapes, 3, 2)
    # key 0 -> server 0, key 1 -> server 9973 % 2 = 1, the big array split over both
    assert b["server_size"] == max(10, 20) + 1_000_000
    assert b["push"] == b["pull"] == 4 * 2_000_030 and b["server_rx"] == 3 * 4 * b["server_size"]


def test_ring_allreduce_and_ssgd_steps():
    assert sm.ring_allreduce_bytes(1000, 4) == 6000.0
    lay = dict(kind="ring", workers=4, rate=1e6, latency=1e-3, t_c=0.5, bytes=dict(values=1000))
    t, limit = sm.step(lay, 0.0)
    assert t == pytest.approx(0.5 + sm.wire(6000, 6000) / 1e6 + 6e-3) and limit == "compute"
    b = dict(push=1e6, pull=1e6, server_rx=2e6, server_tx=2e6)
    ssgd = dict(kind="ssgd", workers=2, rate=1e6, latency=0.0, t_c=0.1, cpu_w=0.1, extra=0.0, server=0.01,
                servers_used=1, cores=None, bytes=b)
    a = sm.wire(2e6, 2e6) / 1e6
    assert sm.step(ssgd, 0.0)[0] == pytest.approx(0.1 + 2 * a + 0.01)       # push, then pull
    assert sm.step(ssgd, 1.0)[0] == pytest.approx(0.1 + a + 0.01)           # fully overlapped
    ssd = dict(ssgd, kind="ssd", extra=0.02)
    assert sm.step(ssd, 0.5) == (pytest.approx(a), "server_rx")            # the max, not the sum
    assert sm.step(dict(ssd, rate=0), 0.5) == (pytest.approx(0.12), "compute")


FIELDS = ["algorithm", "topology", "rate_mbit", "repeat", "status", "num_workers", "num_servers",
          "steady_images_per_sec", "steady_worker_cpu_seconds_per_step", "steady_server_cpu_seconds_per_step",
          "other_cpu_share"]


def _runs(path, rows, fields=FIELDS):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(FIELDS, r)))
    return str(path)


def test_validate_on_a_tiny_runs_csv(tmp_path):
    runs = _runs(tmp_path / "runs.csv", [
        ("compute_bound", "hosts", 0, 1, "ok", 1, 1, 200.0, 0.16, "", 0.0),
        ("ssgd", "hosts", 20, 1, "ok", 2, 1, 50.0, 0.16, 0.03, 0.0),
        ("ssd_topk_sparse", "hosts", 0, 1, "ok", 2, 1, 300.0, 0.17, "", 0.0),    # no server CPU: no fit
        ("ssd_topk_sparse", "loopback", 20, 1, "ok", 2, 1, 99.0, 0.17, 0.005, 0.0),
    ])
    out = tmp_path / "out"
    assert sm.main(["validate", runs, "--fit-on", runs, "--out", str(out), "--cores", "64"]) == 0
    with open(out / "validation.csv") as f:
        rows = {r["algorithm"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"ssgd", "ssd_topk_sparse"}                      # the loopback run is not modelled
    ssgd, ssd = rows["ssgd"], rows["ssd_topk_sparse"]
    assert ssgd["in_sample"] == "True" and abs(float(ssgd["error"])) < 1e-3   # fitted on itself
    # unlimited links, a core per role: the step is one worker's compute plus its encode and replica update
    cfg = _cfg(*sm.ALGORITHMS["ssd_topk_sparse"][1])
    b = sm.round_bytes(sm.model_shapes(cfg), cfg, 2, 1)
    expected = 2 * 32 / (32 / 200.0 + sm.worker_extra(cfg, b))
    assert ssd["in_sample"] == "False" and ssd["limited_by"] == "compute"
    assert float(ssd["predicted_images_per_sec"]) == pytest.approx(expected, abs=0.1)
    assert float(ssd["error"]) == pytest.approx(float(ssd["predicted_images_per_sec"]) / 300.0 - 1, abs=5e-4)
    text = (out / "table.md").read_text()
    assert "ssd_topk_sparse: the loopback topology" in text and (out / "manifest.json").exists()


def _lay(workers, servers, cores=2.0):
    return dict(kind="ssd", workers=workers, servers=servers, servers_used=servers, server=0.001, cpu_w=0.05,
                extra=0.01, cores=cores)


def test_the_cpu_per_message_terms_are_fitted_and_applied():
    terms = dict(server_per_worker=0.0005, server_per_pair=0.001, worker_per_process=0.012)
    samples = []
    for n, s in ((2, 1), (4, 2), (8, 4), (8, 1)):
        lay = _lay(n, s)
        servers = lay["server"] * s + terms["server_per_worker"] * n + terms["server_per_pair"] * n * s
        worker = (lay["cpu_w"] + lay["extra"]) * (1 + terms["worker_per_process"] * (n + s))
        samples.append((lay, servers, worker))
    fitted = sm.fit_message_cpu(samples)
    assert fitted == pytest.approx(terms)
    assert sm.fit_message_cpu([]) is None
    # applied: all servers gain per worker + per pair; the workers grow on a shared machine only
    lay = sm.with_message_cpu(_lay(8, 4), fitted)
    assert lay["server"] * 4 == pytest.approx(0.004 + 0.0005 * 8 + 0.001 * 32)
    assert (lay["cpu_w"], lay["extra"]) == pytest.approx((0.05 * 1.144, 0.01 * 1.144))
    own_hosts = sm.with_message_cpu(_lay(8, 4, cores=None), fitted)
    assert (own_hosts["cpu_w"], own_hosts["extra"]) == (0.05, 0.01) and own_hosts["server"] > 0.001
    ssgd = dict(_lay(8, 4), kind="ssgd")
    assert sm.with_message_cpu(ssgd, fitted) == ssgd and sm.with_message_cpu(_lay(8, 4), None) == _lay(8, 4)


def _manifest(folder, cpu):
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(dict(command=["bench/bench_network.py"], machine=dict(cpu=cpu))))
    return folder


def test_each_runs_file_is_validated_with_the_cpu_terms_of_the_others(tmp_path):
    """Leave one file out: each file's round-based rows are predicted with terms fitted on the other files
    (out-of-sample); the compute-bound runs are pooled over the files of one machine, not across machines."""
    def runs(folder, cpu, bound, server_cpu):
        return _runs(_manifest(tmp_path / folder, cpu) / "runs.csv", [
            ("compute_bound", "hosts", 0, 1, "ok", 1, 1, bound, 0.16, "", 0.0),
            ("ssd_topk_sparse", "hosts", 0, 1, "ok", 2, 1, 300.0, 0.17, server_cpu, 0.0),
            ("ssd_topk_sparse", "hosts", 0, 1, "ok", 4, 2, 500.0, 0.18, 2 * server_cpu, 0.0)])
    a, b = runs("a", "X", 200.0, 0.004), runs("b", "X", 100.0, 0.008)
    other = runs("c", "Y", 50.0, 0.004)
    args = sm.parse_args(["validate", a, b, other])
    args.pool = sm.pool_keys([a, b, other], args)
    files = [(p, *sm.runs_of(p, args)) for p in (a, b, other)]
    # a and b share their compute-bound runs (one machine): the median of 200 and 100 img/s; c keeps its own
    assert files[0][4]["t_c"] == files[1][4]["t_c"] == pytest.approx(32 / 150.0)
    assert files[2][4]["t_c"] == pytest.approx(32 / 50.0) and files[2][4]["files"] == 1
    fits, every = sm.fit_per_file(files, 2)
    samples = {p: sm.message_samples(*rest, 2) for p, *rest in files}
    assert fits[a] == (sm.fit_message_cpu(samples[b] + samples[other]), False)
    assert fits[b][0] != fits[a][0] and every == sm.fit_message_cpu([x for v in samples.values() for x in v])
    only, _ = sm.fit_per_file(files[:1], 2)
    assert only[a] == (sm.fit_message_cpu(samples[a]), True)          # alone: fitted on itself, in-sample


def test_bad_input_is_one_line_naming_it(tmp_path, capsys):
    missing = str(tmp_path / "nope.csv")
    assert sm.main(["validate", missing, "--fit-on", missing, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"scaling_model: {missing}: file not found"
    runs = _runs(tmp_path / "runs.csv", [("ssgd", "hosts", 20, 1, "ok", 2, 1, 50.0)],
                 fields=[f for f in FIELDS if f != "steady_images_per_sec"])
    assert sm.main(["validate", runs, "--fit-on", runs, "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"scaling_model: {runs}: missing column 'steady_images_per_sec'"
    no_bound = _runs(tmp_path / "nb.csv", [("ssgd", "hosts", 20, 1, "ok", 2, 1, 50.0, 0.16, 0.03, 0.0)])
    assert sm.main(["validate", no_bound, "--fit-on", no_bound, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"scaling_model: {no_bound}: no ok compute_bound row") and "\n" not in err
    assert not os.path.exists(tmp_path / "o")
