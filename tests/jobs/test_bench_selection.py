"""bench/bench_selection.py: the table's figures and a tiny real run writing its results folder."""
import csv
import json
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "bench_selection.py")


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
