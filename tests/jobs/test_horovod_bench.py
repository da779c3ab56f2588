"""bench/bench_horovod.py's table, its Horovod worker's timing and bench/ring_check.py, on tiny fixtures.
Only the last test runs Horovod itself, and skips where it is not installed (bench/install_horovod.sh)."""
import csv
import json
import os
import subprocess
import sys

import pytest
from support.jobs import ROOT

from bench import bench_network as bn
from bench import horovod_table
from bench.horovod_worker import steady_rates
from bench import ring_check
from scripts.results_io import read_csv


def _runs(folder, rows):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bn.FIELDS + ["median_step_images_per_sec"])
        w.writeheader()
        for r in rows:
            w.writerow({k: "" for k in w.fieldnames} | {"status": "ok", "topology": "hosts", "repeat": 1} | r)


def _fixture(tmp_path):
    """N = 2: one worker alone does 100 images/s; top-k 300 at 20 Mbit/s, Horovod fp32 100, fp16 150."""
    out = str(tmp_path)
    _runs(os.path.join(out, "ssdsgd_n2"), [
        dict(algorithm="compute_bound", label="bound", rate_mbit=0, steady_images_per_sec=100, num_workers=1,
             num_servers=1, steady_worker_cpu_seconds_per_step=0.32),
        dict(algorithm="ssd_topk_sparse", label="top-k", rate_mbit=20, status="failed"),     # then rerun:
        dict(algorithm="ssd_topk_sparse", label="top-k", rate_mbit=20, steady_images_per_sec=300, num_workers=2,
             num_servers=1, steady_worker_tx_bytes_per_step=20000)])
    _runs(os.path.join(out, "horovod_n2"), [
        dict(algorithm="horovod_fp32", label="Horovod fp32", rate_mbit=20, steady_images_per_sec=100,
             num_workers=2, num_servers=0, steady_worker_tx_bytes_per_step=1150000, other_cpu_share=0),
        dict(algorithm="horovod_fp16", label="Horovod fp16", rate_mbit=0, steady_images_per_sec=150,
             num_workers=2, num_servers=0, other_cpu_share=0.5)])
    return out


def test_steady_rates_take_the_median_step_and_the_window_after_the_warm_up():
    times = [10.0, 11.0, 11.5, 12.0, 12.5, 14.5]          # end of steps 1..6
    median, window = steady_rates(times, 64, steady_from=2)  # steps 3..6: 0.5, 0.5, 0.5, 2.0 s
    assert median == pytest.approx(128.0)
    assert window == pytest.approx(64 * 4 / 3.5)
    assert steady_rates([1.0], 64, 1) == (None, None)


def test_the_table_has_one_row_per_layout_with_its_compute_bound_and_the_ratios(tmp_path):
    out = _fixture(tmp_path)
    text = horovod_table.write_outputs(out, cores=1)
    rows = read_csv(os.path.join(out, "table.csv"))
    assert [(r["system"], r["variant"]) for r in rows] == [
        ("horovod", "horovod_fp32"), ("horovod", "horovod_fp16"), ("ssdsgd", "ssd_topk_sparse")]
    assert {"system", "variant", "workers", "servers", "rate_mbit", "images_per_sec", "compute_bound"} <= set(rows[0])
    assert all(r["compute_bound"] == "200.0" and r["machine_bound"] == "100.0" for r in rows)
    assert rows[0]["servers"] == "0" and rows[2]["servers"] == "1"
    assert rows[0]["worker_tx_bytes_per_step"] == "1150000"
    assert (rows[2]["status"], rows[2]["attempts"], rows[0]["attempts"]) == ("ok", "2", "1")
    [q] = horovod_table.ratios(horovod_table.table_rows(horovod_table.read_runs(out), 1))
    assert (q["over_horovod_fp32"], q["over_horovod_fp16"]) == (3.0, None)   # fp16 ran at another rate only
    assert "| 2 | 20 Mbit/s | 300.0 | 3.00x | – |" in text
    assert os.path.getsize(os.path.join(out, "images_per_sec_vs_rate.png")) > 0


def test_the_ring_check_predicts_each_horovod_layout_from_the_single_worker(tmp_path):
    out = _fixture(tmp_path)
    horovod_table.write_outputs(out, cores=2)
    config = os.path.join(ROOT, bn.DEFAULT_CONFIG)
    rows, measured = ring_check.check(out, config, [], cores=2)
    assert measured["t_c"] == pytest.approx(0.32)                        # 32 images at 100 images/s
    by = {r["variant"]: r for r in rows}
    # unlimited links: the compute alone; half the 2 cores taken by others: 2 workers share 1 core
    assert by["horovod_fp16"]["predicted_own_core_images_per_sec"] == pytest.approx(200.0, rel=1e-3)
    assert by["horovod_fp16"]["predicted_images_per_sec"] == pytest.approx(100.0, rel=1e-3)
    fp32 = by["horovod_fp32"]
    assert fp32["predicted_images_per_sec"] < 64 / 0.32 and fp32["limited_by"] == "links"
    assert fp32["error"] == pytest.approx(fp32["predicted_images_per_sec"] / 100.0 - 1, abs=1e-3)
    assert fp32["predicted_worker_tx_kb"] > 1000         # the whole fp32 model (~1.1 MB) once each way


def test_the_horovod_worker_trains_and_times_one_rank(tmp_path):
    pytest.importorskip("horovod.mxnet")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "horovod_worker.py"), "--config",
           os.path.join(ROOT, bn.DEFAULT_CONFIG), "--steps", "4", "--steady-from", "2", "--out", str(tmp_path),
           "--compression", "fp16"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:]
    with open(tmp_path / "rank0.json") as f:
        res = json.load(f)
    assert res["workers"] == 1 and res["steps"] == 4 and len(res["times"]) == 4 and res["images_per_sec_median"] > 0


def test_table_only_keeps_the_measuring_run_and_records_the_plot_command(tmp_path):
    from bench import bench_horovod
    out = _fixture(tmp_path)
    measured = {"command": ["bench/bench_horovod.py", "--workers", "2"], "commit": "a" * 40, "date": "then",
                "finished": True, "exit_status": 0}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(measured, f)
    assert bench_horovod.main(["--table-only", "--out", out]) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        remade = json.load(f)
    assert {k: remade[k] for k in measured} == measured
    assert remade["table_only"]["commit"] != "a" * 40       # this invocation's own, beside the measuring run's
    [(name, command)] = remade["plots"].items()
    words = command.split()
    assert name == "images_per_sec_vs_rate.png" and words[:3] == ["python", "scripts/plot.py", "--csv"]
    assert os.path.samefile(os.path.join(ROOT, words[3]), os.path.join(out, "table.csv"))   # from the checkout
    assert os.path.getsize(os.path.join(out, name)) > 0
