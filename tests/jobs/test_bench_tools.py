"""Fast tests of the benchmark tools: CSV -> table aggregation (both topologies), plots, a rate-limited
namespace, the per-host-link helpers, and one tiny smoke run of the hosts topology on a virtual cluster."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from bench import bench_network as bn
from testbed import netns
from unit.test_bench_tools import _write_csv, synthetic_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_pngs_from_csv_and_metrics(tmp_path):
    csv_path = tmp_path / "runs.csv"
    _write_csv(csv_path, synthetic_rows())
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    t = 1000.0
    with open(run / "metrics.jsonl", "w") as f:
        for epoch in range(3):
            for step in (10, 20):
                s = epoch * 20 + step
                f.write(json.dumps({"epoch": epoch, "step": s, "loss": 2.0 / s, "images_per_sec": 64.0,
                                    "time": t + s}) + "\n")
            f.write(json.dumps({"epoch": epoch, "step": epoch * 20 + 20, "test_acc": 0.3 + 0.2 * epoch,
                                "time": t + epoch * 20 + 21}) + "\n")
    (run / "config.yaml").write_text("train:\n  batch_size: 32\n")
    (run / "summary.json").write_text(json.dumps({"algorithm": "ssd", "compression": "topk"}))
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot.py"), "--csv", str(csv_path),
                           "--runs", str(run), "--out", str(out)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    names = ["throughput.png", "bytes_per_step.png", "worker_rss.png", "accuracy_vs_time.png",
             "accuracy_vs_epoch.png", "loss_vs_time.png"]
    for name in names:
        path = out / name
        assert path.exists(), name
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


RECEIVER = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while n < int(sys.argv[1]):
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
c.sendall(b"k"); c.close(); print(n, flush=True)
"""

SENDER = """
import socket, sys, time
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
t0 = time.perf_counter(); c.sendall(b"x" * int(sys.argv[2])); ack = c.recv(1)
print(time.perf_counter() - t0, ack.decode(), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="needs root and iproute2 (ip, tc)")
@pytest.mark.timeout(60)
def test_namespace_rate_limit_counts_bytes_and_is_deleted():
    size = 1 << 20
    with netns.Namespace(rate_mbit=8) as ns:
        assert ns.exists() and "tbf" in ns.qdisc() and "8Mbit" in ns.qdisc()
        before = ns.counters()["tx_bytes"]
        recv = subprocess.Popen(ns.argv([sys.executable, "-c", RECEIVER, str(size)]),
                                stdout=subprocess.PIPE, text=True)
        try:
            port = recv.stdout.readline().strip()
            send = subprocess.run(ns.argv([sys.executable, "-c", SENDER, port, str(size)]),
                                  stdout=subprocess.PIPE, text=True, timeout=30)
            received = int(recv.stdout.readline())
        finally:
            recv.kill()
            recv.wait()
        assert send.returncode == 0
        seconds, ack = send.stdout.split()
        after = ns.counters()["tx_bytes"]
    assert ack == "k" and received == size
    assert after - before >= size
    # 8 Mbit/s = 1 MB/s; the 256 KB bucket passes at once, so (1 MiB - 256 KiB) / 1 MB/s = 0.79 s at least.
    assert float(seconds) >= 0.7, seconds
    assert not ns.exists()
    assert ns.name not in subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip")
def test_namespace_is_deleted_after_an_exception_and_its_processes_killed():
    with pytest.raises(RuntimeError):
        with netns.Namespace() as ns:
            sleeper = subprocess.Popen(ns.argv(["sleep", "60"]))
            deadline = time.monotonic() + 5
            while sleeper.pid not in ns.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sleeper.pid in ns.pids()
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=5) is not None
    assert not ns.exists()


def test_time_to_accuracy_reads_both_clocks_and_tables_them(tmp_path, monkeypatch):
    """run(): training seconds are the wall seconds minus every evaluation so far (rank 0's
    eval_seconds); table(): time to SSGD's final accuracy and the ratio on both clocks, against
    hand-computed figures. A folder written before train_seconds existed reads as None, and its
    training-clock time is unknown rather than the wall time."""
    import json

    from scripts import time_to_accuracy as tta
    from scripts.results_io import write_csv

    def metrics(run_dir, evals):          # (wall seconds after launch, eval seconds, accuracy) per epoch
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch": 0, "step": 1, "loss": 1.0, "rank": 0, "time": 1000.0}) + "\n")
            for epoch, (t, ev, acc) in enumerate(evals):
                f.write(json.dumps({"epoch": epoch, "step": epoch + 1, "epoch_seconds": 1.0, "eval_seconds": ev,
                                    "test_acc": acc, "rank": 0, "time": 1000.0 + t}) + "\n")

    class FakeNamespace:               # no link limit: the commands run as they are
        def __init__(self, rate_mbit):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def argv(self, cmd):
            return cmd

        def counters(self):
            return {"tx_bytes": 0}

    runs = {"SSGD": [(100.0, 10.0, 0.80), (200.0, 10.0, 0.90), (300.0, 10.0, 0.90)],
            "topk": [(40.0, 9.0, 0.85), (80.0, 9.0, 0.91)]}
    monkeypatch.setattr(tta, "Namespace", FakeNamespace)
    monkeypatch.setattr(tta.time, "time", lambda: 1000.0)
    monkeypatch.setattr(tta, "run_captured", lambda argv: type("P", (), {"returncode": 0, "stdout": ""})())
    jobs, evals = [], []
    for label, ev in runs.items():
        run_dir = str(tmp_path / "runs" / tta.job_name(label, 0) / "latest")
        metrics(run_dir, ev)
        monkeypatch.setattr(tta, "job_summary", lambda proc, d, ev=ev: {"final_test_acc": ev[-1][2]})
        job, got = tta.run(label, "c.yaml", 0, 20.0, str(tmp_path), 60)
        jobs.append(job)
        evals += got
    assert [(e["seconds"], e["train_seconds"]) for e in evals] == [
        (100.0, 90.0), (200.0, 180.0), (300.0, 270.0), (40.0, 31.0), (80.0, 62.0)]
    text = tta.table(jobs, evals, 20.0, "T", ["SSGD", "topk"])
    # SSGD's final 0.90 is first reached at epoch 2: 200 s wall, 180 s training; top-k at its epoch 2.
    assert "| SSGD | 0.9000 | 0.0 | 0.0 | 200.0 (1/1 reached) | 1.00x | 180.0 (1/1 reached) | 1.00x |" in text
    assert "| topk | 0.9100 | 0.0 | 0.0 | 80.0 (1/1 reached) | 0.40x | 62.0 (1/1 reached) | 0.34x |" in text
    assert tta.time_to([e for e in evals if e["variant"] == "topk"], 0.95) is None     # never reached
    # A run whose metrics lack eval_seconds (older code) has no training clock: "n/a", not "not reached".
    late = str(tmp_path / "late")
    metrics(os.path.join(late, "runs", tta.job_name("topk", 0), "latest"), runs["topk"])
    path = os.path.join(late, "runs", tta.job_name("topk", 0), "latest", "metrics.jsonl")
    lines = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        f.writelines(json.dumps({k: v for k, v in m.items() if k != "eval_seconds"}) + "\n" for m in lines)
    job, got = tta.run("topk", "c.yaml", 0, 20.0, late, 60)
    assert [(e["seconds"], e["train_seconds"]) for e in got] == [(40.0, None), (80.0, None)]
    with pytest.raises(tta.UnknownClock):
        tta.time_to(got, 0.9, "train_seconds")
    assert tta.time_to(got, 0.9) == 80.0
    text = tta.table(jobs[:1] + [job], evals[:3] + got, 20.0, "T", ["SSGD", "topk"])
    assert "| topk | 0.9100 | 0.0 | 0.0 | 80.0 (1/1 reached) | 0.40x | n/a (no eval_seconds) | – |" in text
    # The same through the CSV files --reuse reads (empty cells for the missing clock).
    write_csv(str(tmp_path / "jobs.csv"), jobs)
    write_csv(str(tmp_path / "evals.csv"), [dict(e, train_seconds=None) for e in evals])
    assert [e["train_seconds"] for e in tta.read_earlier(str(tmp_path))[1]] == [None, None, None]


# ------------------------------------------------------------------ hosts topology (per-host links)


def _cluster_or_skip():
    from testbed import vcluster
    try:
        vcluster.check_tools()
    except vcluster.ClusterError as e:
        pytest.skip(f"no virtual cluster here: {e}")
    return vcluster


@pytest.mark.timeout(200)
def test_hosts_topology_smoke(tmp_path):
    """A tiny job on the per-host topology: a CSV row with link bytes both ways, nothing left behind.

    ~30 s on an idle 2-core machine (cluster set-up and 5 processes starting MXNet; 6 training steps);
    95 s was seen with the machine's both cores busy with other jobs."""
    from support.jobs import processes_with
    vcluster = _cluster_or_skip()
    out = tmp_path / "bench"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_network.py"), "--topology", "hosts",
           "--algorithms", "ssd_topk", "--rates", "100", "--steps", "6", "--repeats", "1", "--no-compute-bound",
           "--job-timeout", "100", "--config", os.path.join(ROOT, "configs", "demo_digits_ssd.yaml"),
           "--set", "log.every_steps=2", "--set", "algorithm.warmup_iters=2", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)        # SIGTERM: the bench deletes its cluster
            proc.wait(timeout=30)
    assert proc.returncode == 0, text
    (row,) = bn.read_rows(out / "runs.csv")
    assert (row["status"], row["topology"], row["num_workers"]) == ("ok", "hosts", "2"), row
    for role in ("server", "worker"):
        for d in ("tx", "rx"):
            assert float(row[f"{role}_{d}_bytes"]) > 0, (role, d, row)
            assert float(row[f"steady_{role}_{d}_bytes_per_step"]) > 0, (role, d, row)
            assert 0 < float(row[f"{role}_{d}_util"]) < 1, (role, d, row)
    assert row["host_links"].count(" worker ") == 2 and float(row["steady_server_cpu_seconds_per_step"]) >= 0
    assert float(row["steady_worker_cpu_seconds_per_step"]) > 0       # a worker always computes
    (server,) = json.loads(row["steady_per_server"])                  # the one server host, on its own
    assert server["host"] == "h1" and server["tx"] > 0 and server["rx"] > 0 and server["cpu"] >= 0, server
    assert float(row["server_tx_max_dev"]) == 0
    assert "— per-host links" in (out / "table.md").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert [manifest[k] for k in ("finished", "jobs", "exit_status", "appended")] == [True, 1, 0, False]
    assert list(manifest["configs"]) == ["configs/demo_digits_ssd.yaml"]
    # nothing left: no namespace or key folder of the bench's clusters, no process of the job
    mine = f"{vcluster.PREFIX}{proc.pid}-"
    assert mine not in subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    assert not [d for d in os.listdir(vcluster.TMP) if d.startswith(mine)]
    assert processes_with(str(tmp_path)) == []


def test_time_to_accuracy_refuses_set_for_a_variant_it_does_not_run(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "time_to_accuracy.py"), "--suite", "fmnist",
                           "--variants", "SSGD", "--set-for", "SSD-SGD", "train.epochs=3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--set-for 'SSD-SGD': not a variant this run runs (SSGD)" in proc.stderr


def test_a_results_folder_made_again_is_not_its_own_uncommitted_change(tmp_path):
    """write_manifest's uncommitted_changes asks git about the checkout without the folder being written
    (its committed files change when it is made again); a folder outside the checkout leaves out nothing.
    The arguments are checked against git itself, in a repository of the same shape."""
    from ssdsgd import provenance
    root = provenance.ROOT
    args = provenance.status_command(os.path.join(root, "results", "x"))
    assert args[-2:] == [".", ":(exclude)results/x"]
    assert provenance.status_command("/tmp/elsewhere")[-1] == "."
    assert provenance.status_command()[-1] == "."
    repo = tmp_path / "repo"
    (repo / "results" / "x").mkdir(parents=True)
    (repo / "results" / "x" / "table.md").write_text("old\n")
    (repo / "README.md").write_text("readme\n")

    def git(*a):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo,
                              stdout=subprocess.PIPE, text=True, check=True).stdout
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    (repo / "results" / "x" / "table.md").write_text("new\n")
    assert git(*args) == ""                                   # the folder's own change is left out
    (repo / "README.md").write_text("changed\n")
    assert git(*args).strip() == "M README.md"                # any other change is seen
