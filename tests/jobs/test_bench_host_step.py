"""bench/bench_host_step.py: a tiny real run, its bit-for-bit check, and the refused configs."""
import csv
import json
import os
import subprocess
import sys

import pytest

from bench import bench_host_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "bench_host_step.py")
# a small model on small images, so that a run takes seconds
TINY = bench_host_step.DEFAULT_SETS + ["model.name=small_cnn", "data.shape=[3,8,8]", "train.batch_size=8"]


def test_tiny_run_times_every_piece_both_ways(tmp_path):
    out = tmp_path / "bench"
    sets = [a for s in TINY for a in ("--set", s)]
    proc = subprocess.run([sys.executable, SCRIPT, *sets, "--steps", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    for way in ("land_flat", "land_per_parameter", "local", "local_on_the_copies", "gradient_copy_flat",
                "gradient_copy_per_parameter", "encode"):
        assert all(float(r[f"{way}_ms"]) > 0 for r in rows), way
    assert [bool(r["forward_backward_ms"]) for r in rows] == [True, False, False, False]
    text = (out / "table.md").read_text()
    for piece in ("| land |", "| gradient copy (part of encode) |", "local update"):
        assert piece in text
    assert "median over 4 steps" in text and "forward and backward" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["configs"]) == ["configs/fmnist_resnet20_ssd_topk.yaml"] and manifest["sets"] == TINY


@pytest.mark.parametrize("sets, named", [(["compression.buffers=fixed"], "compression.buffers: one"),
                                         (["compression.downlink=dense"], "compression.downlink: sparse"),
                                         (["algorithm.local.optimizer=glu"], "algorithm.local.optimizer")])
def test_configs_it_cannot_measure_are_refused(sets, named):
    proc = subprocess.run([sys.executable, SCRIPT, *[a for s in sets for a in ("--set", s)], "--steps", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and named in proc.stderr
