"""bench/bench_selection.py: the table's figures and a tiny real run writing its results folder."""
import csv
import json
import os
import subprocess
import sys

from bench import bench_selection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "bench_selection.py")


def test_table_prints_the_clock_asked_for():
    row = {"model": "m", "values": 1234567, "buffers": 2, "selection": "sampled",
           "pass_cpu_ms": 10.0, "warm_cpu_ms": 4.0, "encode_cpu_ms": 25.0, "read_cpu_ms": 3.0,
           "memory_cpu_ms": 12.0, "select_cpu_ms": 10.0, "ratio_cpu": 2.5, "ratio_warm_cpu": 6.25,
           "ratio_select_cpu": 1.0,
           "pass_wall_ms": 20.0, "warm_wall_ms": 8.0, "encode_wall_ms": 90.0, "read_wall_ms": 6.0,
           "memory_wall_ms": 40.0, "select_wall_ms": 44.0, "ratio_wall": 4.5, "ratio_warm_wall": 11.25,
           "ratio_select_wall": 2.2}
    assert bench_selection.table([row]).splitlines()[-1] == \
        "| m | 1,234,567 | 2 | sampled | 10.0 | 4.0 | 25.0 | 3.0 | 12.0 | 10.0 | 2.50 | 6.25 | 1.00 |"
    assert bench_selection.table([row], "wall").splitlines()[-1] == \
        "| m | 1,234,567 | 2 | sampled | 20.0 | 8.0 | 90.0 | 6.0 | 40.0 | 44.0 | 4.50 | 11.25 | 2.20 |"


def test_tiny_run_writes_both_selections_with_a_manifest(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, SCRIPT, "--models", "resnet20", "--steps", "1", "--out", str(out)],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["selection"] for r in rows] == ["exact", "sampled"]
    for r in rows:
        assert r["model"] == "resnet20" and int(r["values"]) > 250_000 and r["steps"] == "1"
        # ResNet-20 at 1%, one buffer: k_i = max(1, 1% of n_i) summed over the tensors
        assert int(r["values"]) // 100 <= int(r["sent"]) < int(r["values"]) // 50
        for clock in ("cpu", "wall"):
            ratio = float(r[f"encode_{clock}_ms"]) / float(r[f"pass_{clock}_ms"])
            assert abs(float(r[f"ratio_{clock}"]) - ratio) <= 1e-6 * ratio
            # the parts were timed inside the encoder's own calls: each took some of the step
            assert float(r[f"read_{clock}_ms"]) > 0 and float(r[f"memory_{clock}_ms"]) > 0
            assert float(r[f"read_{clock}_ms"]) + float(r[f"memory_{clock}_ms"]) < float(r[f"encode_{clock}_ms"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert "configs/cifar10_resnet20_ssd_topk.yaml" in manifest["configs"]
    assert "shared" in manifest["note"] and len(manifest["load_average_before"]) == 3
    assert "np.abs" in (out / "table.md").read_text()
