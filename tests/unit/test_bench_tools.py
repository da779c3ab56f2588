"""Fast tests of the benchmark tools: CSV -> table aggregation (both topologies), plots, a rate-limited
namespace, the per-host-link helpers, and one tiny smoke run of the hosts topology on a virtual cluster."""
import csv
import json
import os

import pytest

from bench import bench_network as bn
from testbed import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _row(alg, rate, rep, ips, kbytes, rss, status="ok", steady=None, steady_bytes=None, workers=2):
    row = {k: "" for k in bn.FIELDS}
    label = bn.COMPUTE_BOUND_LABEL if alg == bn.COMPUTE_BOUND else bn.ALGORITHMS[alg][0]
    row.update(algorithm=alg, label=label, rate_mbit=rate, repeat=rep, status=status,
               exit_code=0 if status == "ok" else 1, num_workers=workers, steps=20)
    if status == "ok":
        row.update(images_per_sec=ips, kernel_bytes_per_step=kbytes, peak_rss_worker_mb=rss,
                   steady_images_per_sec="" if steady is None else steady,
                   steady_kernel_bytes_per_step="" if steady_bytes is None else steady_bytes,
                   push_bytes_per_step=1000, pull_bytes_per_step=1000, final_loss=2.3, wall_seconds=10)
    if alg == bn.COMPUTE_BOUND:
        row["bound_workers"] = 2
    return row


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bn.FIELDS)
        w.writeheader()
        w.writerows(rows)


def synthetic_rows():
    # SSGD ips 10/20/40 and SSD 30/60/50 at 20 Mbit/s: per-repeat ratios 3, 3, 1.25 -> median 3.0,
    # while the ratio of the medians would be 50/20 = 2.5. A 4th SSD repeat failed.
    rows = [_row(bn.COMPUTE_BOUND, 0, 1, 60, 1000, 400), _row(bn.COMPUTE_BOUND, 0, 2, 50, 1000, 400)]
    for rep, (a, b) in enumerate([(10, 30), (20, 60), (40, 50)], 1):
        rows.append(_row("ssgd", 20, rep, a, 4_000_000, 400, steady=a, steady_bytes=4_000_000))
        rows.append(_row("ssd_topk", 20, rep, b, 400_000 * rep, 440 + rep, steady=b, steady_bytes=400_000))
    rows.append(_row("ssgd", 20, 4, 25, 4_000_000, 400))
    rows.append(_row("ssd_topk", 20, 4, None, None, None, status="failed"))
    rows.append(_row("ssgd", 0, 1, 100, 4_000_000, 400))
    return rows


def test_aggregate_medians_and_per_repeat_ratios(tmp_path):
    path = tmp_path / "runs.csv"
    _write_csv(path, synthetic_rows())
    agg = bn.aggregate(bn.read_rows(path))
    by = {(g["algorithm"], g["rate_mbit"]): g for g in agg["groups"]}
    assert set(by) == {("ssgd", 20.0), ("ssd_topk", 20.0), ("ssgd", 0.0)}
    ssgd, ssd = by[("ssgd", 20.0)], by[("ssd_topk", 20.0)]
    assert (ssgd["ok"], ssgd["runs"]) == (4, 4) and (ssd["ok"], ssd["runs"]) == (3, 4)
    assert ssgd["images_per_sec"] == pytest.approx(22.5)            # median of 10, 20, 25, 40
    assert ssd["images_per_sec"] == pytest.approx(50.0)
    assert ssd["speedup"] == pytest.approx(3.0)                     # median of per-repeat ratios
    assert ssd["steady_speedup"] == pytest.approx(3.0)
    assert ssgd["speedup"] == pytest.approx(1.0)
    assert ssd["bytes_ratio"] == pytest.approx(0.2)                 # 0.1, 0.2, 0.3
    assert ssd["steady_bytes_ratio"] == pytest.approx(0.1)
    assert ssd["rss_ratio"] == pytest.approx(442 / 400)
    assert ssd["failed"] == ["rep 4: failed (exit 1)"]
    assert by[("ssgd", 0.0)]["speedup"] == pytest.approx(1.0)
    cb = agg["compute_bound"]
    assert cb["single_images_per_sec"] == pytest.approx(55.0) and cb["images_per_sec"] == pytest.approx(110.0)

    table = bn.markdown_table(agg)
    assert "| SSD-SGD+top-k 1% | 20 Mbit/s | 3/4 | 50.0 | 3.00× |" in table
    assert "| SSGD | unlimited | 1/1 | 100.0 | 1.00× |" in table
    assert "Compute bound: 110.0 img/s" in table
    assert "rep 4: failed (exit 1)" in table
    # 1 - 22.5/110 -> SSGD spends ~80% of its time communicating at 20 Mbit/s: speed-up target applies.
    assert "SSD-SGD+top-k 1% ≥ 2.5× SSGD img/s at 20 Mbit/s" in table and "→ met" in table
    assert "kernel bytes/step ≤ 15% of SSGD's at 20 Mbit/s: steady 10.0%" in table
    # table-only mode writes table.md from the CSV
    assert bn.main(["--table-only", "--out", str(tmp_path)]) == 0
    assert "3.00×" in (tmp_path / "table.md").read_text()


def test_aggregate_without_baseline_has_no_ratios():
    rows = [_row("ssd", 20, 1, 30, 100, 400)]
    g = bn.aggregate(rows)["groups"][0]
    assert g["speedup"] is None and g["bytes_ratio"] is None
    assert "–" in bn.markdown_table(bn.aggregate(rows))


def test_steady_state_window_and_counter_interpolation():
    records = [{"step": 10, "loss": 1, "time": 100.0}, {"step": 20, "loss": 1, "time": 102.0},
               {"step": 30, "loss": 1, "time": 104.0}, {"step": 30, "test_acc": 0.5, "time": 110.0}]
    counter = [(99.0, 0), (101.0, 2000), (105.0, 6000)]              # 1000 B/s
    ips, bps = bn.steady_state(records, 20, 64, counter)
    assert ips == pytest.approx(10 * 64 / 2.0)
    assert bps == pytest.approx((5000 - 3000) / 10)


def test_parse_net_dev():
    text = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|"
            "bytes    packets errs drop fifo colls carrier compressed\n"
            "    lo:  123456     789    0    0    0     0          0         0"
            "   123456     789    0    0    0     0       0          0\n")
    c = netns.parse_net_dev(text)
    assert c["rx_bytes"] == c["tx_bytes"] == 123456 and c["tx_packets"] == 789


def test_table_warns_about_runs_on_a_busy_machine():
    rows = [_row("ssgd", 20, 1, 30, 100, 400), _row("ssd", 20, 1, 60, 100, 400)]
    rows[1]["other_cpu_share"] = 0.5
    agg = bn.aggregate(rows)
    assert agg["busy_runs"] == 1
    assert "in 1 of 2 successful runs other processes used more than 10%" in bn.markdown_table(agg)


def test_paired_ahead_behind_counts_wins_ties_losses():
    from scripts import accuracy as ad
    ahead, behind = "top-k 1% ahead, one buffer", "top-k 1% behind, one buffer"
    accs = {ahead: [0.98, 0.97, 0.96, 0.95], behind: [0.97, 0.97, 0.97, 0.94]}
    rows = [{"variant": v, "seed": s, "rc": 0, "final_acc": a}
            for v, values in accs.items() for s, a in enumerate(values)]
    rows.append({"variant": behind, "seed": 9, "rc": 0, "final_acc": 0.5})   # no ahead twin: unpaired
    (line,) = ad.paired_ahead_behind(rows).splitlines()
    # differences in points: +1, 0, -1, +1 -> mean 0.25, sd 0.957
    assert line == (f"- {ahead} vs behind, 4 seeds: ahead wins 2, ties 1, loses 1; "
                    "difference +0.25 ± 0.96 points (mean ± sd)")


def test_accuracy_keep_done_records_the_invocations_whose_jobs_it_keeps(tmp_path):
    """--keep-done replaces the folder's manifest: the kept jobs' invocations travel in `earlier`."""
    from scripts import accuracy as ad
    assert ad.earlier_runs(str(tmp_path)) == []
    first = {"command": ["scripts/accuracy.py", "--seeds", "0"], "commit": "c0", "date": "d0", "machine": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(first))
    assert ad.earlier_runs(str(tmp_path)) == [{"command": first["command"], "commit": "c0", "date": "d0"}]
    second = {"command": ["scripts/accuracy.py", "--keep-done"], "commit": "c1", "date": "d1",
              "earlier": ad.earlier_runs(str(tmp_path))}
    (tmp_path / "manifest.json").write_text(json.dumps(second))
    assert [e["commit"] for e in ad.earlier_runs(str(tmp_path))] == ["c0", "c1"]


def test_time_to_accuracy_reuses_only_the_ssgd_baseline(tmp_path):
    """--reuse DIR reads the SSGD jobs and evaluations of an earlier run (typed), never another variant's."""
    from scripts import time_to_accuracy as tta
    from scripts.results_io import write_csv
    jobs = [{"variant": v, "seed": 0, "rc": 0, "seconds": s, "kernel_bytes": 1e6, "final_test_acc": a,
             "rate_mbit": 20, "run_dir": "x"} for v, s, a in (("SSGD", 100.0, 0.9), ("SSD-SGD", 50.0, 0.8))]
    evals = [{"variant": v, "seed": 0, "epoch": e, "seconds": 10.0 * e, "test_acc": 0.1 * e}
             for v in ("SSGD", "SSD-SGD") for e in (1, 9)]
    write_csv(str(tmp_path / "jobs.csv"), jobs)
    write_csv(str(tmp_path / "evals.csv"), evals)
    got_jobs, got_evals = tta.read_earlier(str(tmp_path))
    assert [j["variant"] for j in got_jobs] == ["SSGD"] and got_jobs[0]["final_test_acc"] == 0.9
    assert [(e["epoch"], e["seconds"]) for e in got_evals] == [(1, 10.0), (9, 90.0)]
    assert tta.time_to(got_evals, 0.85) == 90.0


def test_time_to_accuracy_reuses_baselines_from_several_folders(tmp_path):
    """--reuse A B: each seed's SSGD job from the one folder that has it; a seed in two folders or in
    none is an error that names it."""
    from scripts import time_to_accuracy as tta
    from scripts.results_io import write_csv

    def folder(name, seeds):
        d = tmp_path / name
        d.mkdir()
        write_csv(str(d / "jobs.csv"), [{"variant": "SSGD", "seed": s, "rc": 0, "seconds": 100.0 + s,
                                         "kernel_bytes": 1e6, "final_test_acc": 0.9, "rate_mbit": 20,
                                         "run_dir": "x"} for s in seeds])
        write_csv(str(d / "evals.csv"), [{"variant": "SSGD", "seed": s, "epoch": 1, "seconds": 10.0 + s,
                                          "test_acc": 0.9} for s in seeds])
        return str(d)

    a, b, c = folder("a", [0]), folder("b", [1, 2]), folder("c", [2])
    jobs, evals = tta.read_baselines([a, b], [0, 2])
    assert sorted((j["seed"], j["seconds"]) for j in jobs) == [(0, 100.0), (2, 102.0)]
    assert sorted(e["seed"] for e in evals) == [0, 2]
    with pytest.raises(tta.ReuseError, match=r"seed 2 has an SSGD job in both .*b and .*c"):
        tta.read_baselines([a, b, c], [0])
    with pytest.raises(tta.ReuseError, match=r"no SSGD job for seed\(s\) \[1\]"):
        tta.read_baselines([a], [0, 1])


# ------------------------------------------------------------------ hosts topology (per-host links)

NET_DEV = ("Inter-|   Receive                                                |  Transmit\n"
           " face |bytes    packets errs drop fifo frame compressed multicast|"
           "bytes    packets errs drop fifo colls carrier compressed\n"
           "    lo:     100       2    0    0    0     0          0         0"
           "      100       2    0    0    0     0       0          0\n"
           "  eth0: 5000000    4000    0    1    0     0          0         0"
           "   250000    3000    0    0    0     0       0          0\n")


def test_parse_net_dev_per_interface():
    every = netns.parse_net_dev_all(NET_DEV)
    assert set(every) == {"lo", "eth0"}
    eth0 = netns.parse_net_dev(NET_DEV, "eth0")
    assert (eth0["rx_bytes"], eth0["rx_packets"], eth0["rx_dropped"]) == (5_000_000, 4000, 1)
    assert (eth0["tx_bytes"], eth0["tx_packets"]) == (250_000, 3000)
    assert netns.parse_net_dev(NET_DEV)["tx_bytes"] == 100          # lo stays the default
    with pytest.raises(netns.NetnsError):
        netns.parse_net_dev(NET_DEV, "eth1")


def test_host_roles_per_role_links_and_utilisation():
    assert bn.host_roles(1, 2) == ["launcher", "server", "worker", "worker"]
    assert bn.host_roles(2, 1) == ["launcher", "server", "server", "worker"]
    roles = bn.host_roles(1, 2)
    per_host = {0: {"tx": 5, "rx": 5}, 1: {"tx": 900, "rx": 100}, 2: {"tx": 40, "rx": 400},
                3: {"tx": 60, "rx": None}}                         # h3's rx unknown: left out of the mean
    links = bn.per_role_links(roles, per_host)
    assert links["server"] == {"tx": 900, "rx": 100}
    assert links["worker"] == {"tx": 50, "rx": 400}
    assert bn.per_role_links(roles, {})["worker"] == {"tx": None, "rx": None}
    # 2.5 MB in 2 s on a 20 Mbit/s link: 20 Mbit of 40 Mbit -> 50%
    assert bn.utilisation(2_500_000, 20, 2.0) == pytest.approx(0.5)
    assert bn.utilisation(2_500_000, 0, 2.0) is None                 # unlimited: no utilisation
    assert bn.utilisation(None, 20, 2.0) is None and bn.utilisation(1, 20, 0) is None


def test_link_columns_whole_job_and_steady_window():
    roles = bn.host_roles(1, 2)
    # per host and direction a counter growing at a constant rate (bytes/s) from t = 100 to 110
    rates = {0: (10, 10), 1: (1_000_000, 100_000), 2: (40_000, 400_000), 3: (60_000, 600_000)}
    samples = {i: {d: [(100.0 + t, v * t) for t in range(11)] for d, v in zip(("tx", "rx"), r)}
               for i, r in rates.items()}
    before = {i: {"tx_bytes": 0, "rx_bytes": 0} for i in rates}
    after = {i: {"tx_bytes": 10 * r[0], "rx_bytes": 10 * r[1]} for i, r in rates.items()}
    row = bn.link_columns(roles, before, after, samples, (20, 102.5, 106.5), 20)   # 20 steps in 4 s
    assert row["server_tx_bytes"] == 10_000_000 and row["server_rx_bytes"] == 1_000_000
    assert row["worker_tx_bytes"] == 500_000 and row["worker_rx_bytes"] == 5_000_000
    assert row["steady_server_tx_bytes_per_step"] == 200_000          # 4 MB / 20 steps
    assert row["steady_server_rx_bytes_per_step"] == 20_000
    assert row["steady_worker_rx_bytes_per_step"] == 100_000          # mean of 80 and 120 KB
    assert row["server_tx_util"] == pytest.approx(0.4)                # 8 Mbit/s of 20
    assert row["worker_rx_util"] == pytest.approx(0.2)
    assert row["host_links"].startswith("h0 launcher tx 100 rx 100; h1 server tx 10000000 rx 1000000")
    unlimited = bn.link_columns(roles, before, after, samples, (20, 102.5, 106.5), 0)
    assert unlimited["server_tx_util"] == "" and unlimited["steady_server_tx_bytes_per_step"] == 200_000
    no_window = bn.link_columns(roles, before, after, samples, None, 20)
    assert "steady_server_tx_bytes_per_step" not in no_window and no_window["server_tx_bytes"] == 10_000_000


def test_per_server_columns_and_balance_table(tmp_path):
    """Each server host's CPU and link bytes per step in the steady window, the largest deviation from
    the servers' mean, and bench_server_balance's table of them."""
    from bench import bench_server_balance as sb
    assert bn.max_deviation([90, 110, 100, 100]) == pytest.approx(0.1)
    assert bn.max_deviation([1, None]) is None and bn.max_deviation([0, 0]) is None
    roles = bn.host_roles(2, 1)                       # h0 launcher, h1 h2 servers, h3 worker
    # counters growing at a constant rate (per second) from t = 100 to 110; 20 steps in 4 s
    line = lambda rate: [(100.0 + t, rate * t) for t in range(11)]  # noqa: E731
    links = {1: {"tx": line(1000), "rx": line(500)}, 2: {"tx": line(1500), "rx": line(500)}, 3: {"tx": line(9)}}
    cpu = {1: line(0.5), 2: line(0.3), 3: line(1.0)}
    row = bn.per_server_columns(roles, links, cpu, (20, 102.0, 106.0))
    per = json.loads(row["steady_per_server"])
    assert per == [{"cpu": 0.1, "tx": 200, "rx": 100, "host": "h1"}, {"cpu": 0.06, "tx": 300, "rx": 100, "host": "h2"}]
    assert row["server_cpu_max_dev"] == pytest.approx(0.25) and row["server_tx_max_dev"] == pytest.approx(0.2)
    assert row["server_rx_max_dev"] == 0
    assert bn.per_server_columns(roles, links, cpu, None) == {}
    base = {k: "" for k in bn.FIELDS}
    rows = [dict(base, algorithm="ssgd", label="SSGD", rate_mbit=0, status="ok", **row),
            dict(base, algorithm="ssgd", label="SSGD", rate_mbit=0, status="failed", log="logs/x_ssgd_unl_rep1_s2.log")]
    (g,) = sb.balance_groups(rows)
    assert (g["servers"], g["runs"], len(g["ok"]), g["tx"], g["tx_dev"]) == (2, 2, 1, [200, 300], 0.2)
    text = sb.markdown_table([g], "t")
    assert "| 2 | SSGD | unlimited | 1/2 | 100.00 / 60.00 | 25% | 0.2 / 0.3 | 20% | 0.1 / 0.1 | 0% | NO |" in text


def _hosts_row(alg, rate, rep, steady, push=20_000, pull=40_000, server_tx=500_000):
    row = _row(alg, rate, rep, steady, 1_000_000, 400, steady=steady)
    row.update(topology="hosts", push_bytes_per_step_after_warmup=push, pull_bytes_per_step_after_warmup=pull,
               steady_server_tx_bytes_per_step=server_tx, steady_server_rx_bytes_per_step=50_000,
               steady_worker_tx_bytes_per_step=25_000, steady_worker_rx_bytes_per_step=250_000,
               server_tx_util=0.8 if rate else "", server_rx_util=0.1 if rate else "",
               worker_tx_util=0.05 if rate else "", worker_rx_util=0.4 if rate else "",
               steady_server_cpu_seconds_per_step=0.004, steady_worker_cpu_seconds_per_step=0.25)
    return row


def test_hosts_table_columns_and_issue_12_targets(tmp_path):
    rows = [_hosts_row(bn.COMPUTE_BOUND, 0, 1, 50), _hosts_row("ssgd", 20, 1, 30, pull=1_100_000),
            _hosts_row("ssd_topk_sparse", 20, 1, 90), _hosts_row("ssd", 20, 1, 60)]
    agg = bn.aggregate(rows)
    assert agg["topology"] == "hosts"
    g = {x["algorithm"]: x for x in agg["groups"]}["ssd_topk_sparse"]
    assert g["pull_push_ratio"] == pytest.approx(2.0) and g["server_tx_util"] == pytest.approx(0.8)
    table = bn.markdown_table(agg, "T")
    assert table.startswith("## T — per-host links") and "Topology: `hosts`" in table
    assert "server tx KB/step (util)" in table and "kernel MB/step |" in table
    # steady 90 img/s = 90% of the 2 × 50 bound, 3× SSGD; pulls 2× pushes
    assert ("| SSD-SGD+top-k 1%, sparse downlink (shipped) | 20 Mbit/s | 1/1 | 90.0 | 3.00× | 90.0 | 3.00× | 90% | "
            "500.0 (80%) | 50.0 (10%) | 25.0 (5%) | 250.0 (40%) | 4.0 | – | 250.0 | 20.0 | 40.0 | 2.00× |") in table
    assert "≥ 85% of the compute bound at 20 Mbit/s per host link: 90% (steady) → met" in table
    assert "≥ 3× SSGD img/s at 20 Mbit/s per host link: 3.00× (steady)" in table
    assert "pulled bytes/step after warm-up ≤ 2.2× pushed at 20 Mbit/s: 2.00×" in table
    assert "on a 3-host cluster (launcher, server, worker); its worker used 250.0 ms of CPU per step." in table
    assert "15% of SSGD" not in table                                 # the loopback targets are not checked
    slow = bn.aggregate([_hosts_row(bn.COMPUTE_BOUND, 0, 1, 50), _hosts_row("ssgd", 20, 1, 30),
                         _hosts_row("ssd_topk_sparse", 20, 1, 80, pull=50_000)])
    verdicts = bn.check_targets(slow)
    assert [v.rsplit("→ ", 1)[1] for v in verdicts[:3]] == ["NOT met"] * 3      # 80%, 2.67×, 2.5×
    # the RSS check runs in both topologies
    assert verdicts[3].startswith("SSD-SGD+top-k 1%, sparse downlink (shipped) worker peak RSS ≤ 1.3× SSGD's")
    assert bn.check_targets(bn.aggregate([_hosts_row("ssgd", 100, 1, 30)])) == [
        "SSD-SGD+top-k 1%, sparse downlink (shipped) not measured at 20 Mbit/s per host link: "
        "speed-up targets not assessable"]

    # One CSV with both topologies: one table each; a CSV written before the column existed is loopback.
    _write_csv(tmp_path / "runs.csv", rows + synthetic_rows())
    text = bn.write_table(str(tmp_path / "runs.csv"), str(tmp_path), "T")
    assert "## T — per-host links" in text and "## T — loopback (all roles share one link)" in text
    assert "| SSD-SGD+top-k 1% | 20 Mbit/s | 3/4 | 50.0 | 3.00× |" in text        # the loopback rows
    old = tmp_path / "old"
    old.mkdir()
    fields = [f for f in bn.FIELDS if f != "topology"]
    with open(old / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(synthetic_rows())
    assert bn.main(["--table-only", "--out", str(old)]) == 0
    assert "— loopback (all roles share one link)" in (old / "table.md").read_text()


def test_shipped_top_k_settings_are_the_configs():
    """The benchmark's `ssd_topk_auto` job runs the shipped top-k config's SSD-SGD and compression
    settings (read from the file), on the benchmark's model and data; `ssd_topk_sparse` the same at 1%."""
    from ssdsgd.config import load_config
    bench = load_config(os.path.join(bn.ROOT, bn.DEFAULT_CONFIG), bn.ALGORITHMS["ssd_topk_auto"][1])
    shipped = load_config(os.path.join(bn.ROOT, bn.SHIPPED_TOPK_CONFIG))
    assert bench.compression.to_dict() == shipped.compression.to_dict() and shipped.compression.density == "auto"
    one = load_config(os.path.join(bn.ROOT, bn.DEFAULT_CONFIG), bn.ALGORITHMS["ssd_topk_sparse"][1])
    assert one.compression.to_dict() == load_config(os.path.join(bn.ROOT, bn.SHIPPED_TOPK_CONFIG),
                                                    ["compression.density=0.01"]).compression.to_dict()
    for key in ("type", "delay", "momentum", "max_staleness", "local"):
        assert bench.algorithm.to_dict()[key] == shipped.algorithm.to_dict()[key], key
    assert bench.compression.downlink == "sparse"
    assert bench.algorithm.warmup_iters == load_config(os.path.join(bn.ROOT, bn.DEFAULT_CONFIG)).algorithm.warmup_iters


def test_topology_option():
    assert bn.parse_args([]).topology == "hosts"
    assert bn.parse_args(["--topology", "loopback", "--delay-ms", "5"]).delay_ms == 5
    with pytest.raises(SystemExit):
        bn.parse_args(["--delay-ms", "5"])                           # no netem on the virtual cluster


def test_time_to_accuracy_labels_the_density_it_ran_at():
    """A compression.density override shows in the top-k variant's label; other labels and runs
    without the override keep theirs."""
    from scripts import time_to_accuracy as tta
    assert tta.relabel("SSD-SGD + top-k 1%", ["compression.density=0.05", "seed=1"]) == "SSD-SGD + top-k 5%"
    assert tta.relabel("SSD-SGD + top-k 1%", ["compression.density=0.025"]) == "SSD-SGD + top-k 2.5%"
    assert tta.relabel("SSD-SGD + top-k 1%", ["train.epochs=18"]) == "SSD-SGD + top-k 1%"
    assert tta.relabel("SSD-SGD + top-k 1%", ["compression.density=0.05", "compression.density=0.1"]) \
        == "SSD-SGD + top-k 10%"
    assert tta.relabel("SSGD", ["compression.density=0.05"]) == "SSGD"
    assert tta.relabel("SSD-SGD + top-k auto", ["compression.density=0.02"]) == "SSD-SGD + top-k 2%"
    assert tta.relabel("SSD-SGD + top-k 1%", ["compression.density=auto"]) == "SSD-SGD + top-k auto"


def test_wire_bytes_compares_each_variant_with_its_own_reference():
    """Each row's differences are against the variant VARIANTS names for it (hand-computed here);
    a reference that failed leaves the differences empty rather than comparing with another row."""
    from bench import wire_bytes as wb
    variants = {"a": ([], None), "b": ([], "a"), "c": ([], None), "d": ([], "c"), "e": ([], "x")}

    def row(v, push, pull, kernel, rc=0):
        return {"variant": v, "rc": rc, "final_test_acc": 0.5, "push_bytes_all_workers": push,
                "pull_bytes_all_workers": pull, "kernel_bytes": kernel}
    rows = [row("a", 1e6, 2e6, 10e6), row("b", 0.5e6, 2e6, 9.4e6), row("c", 3e6, 6e6, 20e6),
            row("d", 2e6, 4e6, 17e6), row("x", 0, 0, 0, rc=1), row("e", 1e6, 1e6, 1e6)]
    lines = wb.table(rows, dict(variants, x=([], None))).splitlines()
    assert lines[3] == "| b | 0.5000 | 0.500 | 2.000 | 9.400 | a | -0.500 | -0.600 |"
    assert lines[5] == "| d | 0.5000 | 2.000 | 4.000 | 17.000 | c | -3.000 | -3.000 |"
    assert lines[6] == "| x | failed | | | | | | |"
    assert lines[7] == "| e | 0.5000 | 1.000 | 1.000 | 1.000 | – | – | – |"
    assert lines[2].endswith("| – | – | – |")


def test_time_to_accuracy_plans_per_variant_overrides_interleaved_by_seed():
    """--set for every job, --set-for only for its variant (after --set, so it wins); jobs by seed,
    then in the suite's order; each job's label shows the density it runs at."""
    from scripts import time_to_accuracy as tta
    _, variants = tta.SUITES["fmnist"]
    topk = "SSD-SGD + top-k auto"
    plan = tta.plan_jobs([0, 1], variants, ["SSGD", topk], ["model.hybridize=false", "compression.density=0.05"],
                         {topk: ["train.epochs=18", "compression.density=0.1"]})
    assert [(seed, label) for seed, label, _, _ in plan] == [
        (0, "SSGD"), (0, "SSD-SGD + top-k 10%"), (1, "SSGD"), (1, "SSD-SGD + top-k 10%")]
    assert plan[0][2:] == (variants["SSGD"], ["model.hybridize=false", "compression.density=0.05"])
    assert plan[1][2:] == (variants[topk], ["model.hybridize=false", "compression.density=0.05",
                                            "train.epochs=18", "compression.density=0.1"])
    assert tta.plan_jobs([3], variants, [topk], [], {}) == [(3, topk, variants[topk], [])]


def test_every_accuracy_variant_loads_as_a_valid_config():
    from scripts import accuracy as ad
    from ssdsgd.config import load_config
    for suite, variants in ad.SUITES.items():
        for label, (config, sets) in variants.items():
            load_config(os.path.join(ROOT, config), sets)     # raises ConfigError naming the key
    # how users scale: per-worker batch kept, lr by the linear rule, SSD-SGD's warm-up one epoch
    config, sets = ad.SCALE_FIXED_BATCH["N=8 SSD-SGD + top-k 1%, linear rule"]
    cfg = load_config(os.path.join(ROOT, config), sets)
    assert (cfg.cluster.workers, cfg.train.batch_size, cfg.train.lr) == (8, 128, 0.4)
    assert cfg.train.lr_schedule.warmup_epochs == 1 and cfg.algorithm.warmup_iters is None
    assert cfg.algorithm.local.lr_scale == 8.0
    config, sets = ad.SCALE_FIXED_BATCH["N=4 SSGD, linear rule"]
    cfg = load_config(os.path.join(ROOT, config), sets)
    assert (cfg.cluster.workers, cfg.train.batch_size, cfg.train.lr) == (4, 128, 0.2)


def test_a_remade_table_keeps_the_runs_title_and_shows_how_evenly_servers_share(tmp_path):
    rows = [_row("ssgd", 20, 1, 30, 100, 400), _row("ssd", 20, 1, 60, 100, 400)]
    for r in rows:
        r.update(topology="hosts", num_servers=2, server_cpu_max_dev=0.05, server_tx_max_dev=0.12,
                 server_rx_max_dev=0.0)
    csv_path = tmp_path / "runs.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    (tmp_path / "table.md").write_text("## Bandwidth-limited benchmark (40 steps, 1 repeat(s)) — old\n")
    assert bn.remake_table(str(csv_path), str(tmp_path)) == 0
    text = (tmp_path / "table.md").read_text()
    assert text.startswith("## Bandwidth-limited benchmark (40 steps, 1 repeat(s)) — per-host links")
    assert "| servers off mean CPU/tx/rx |" in text and "| 5% / 12% / 0% |" in text
