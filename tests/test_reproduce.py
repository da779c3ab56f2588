"""scripts/reproduce.py end to end: SSGD, SSD-SGD and SSD-SGD + top-k with the shipped CIFAR-10 configs,
one short epoch each, on a tiny CIFAR-10 set in the published binary format."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jobs import ROOT, processes_with


def write_cifar10_binary(folder, per_file=40, seed=0):
    """cifar-10-batches-bin/ as the official archive unpacks: data_batch_1..5.bin and test_batch.bin,
    each record one label byte and 3072 image bytes (R, G, B planes of 32x32)."""
    rng = np.random.default_rng(seed)
    bin_dir = os.path.join(folder, "cifar-10-batches-bin")
    os.makedirs(bin_dir)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rng.integers(0, 10, per_file, dtype=np.uint8)
        images = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        images[:, :1024] //= (labels[:, None] + 1)        # a learnable signal in the red plane
        np.concatenate([labels[:, None], images], axis=1).tofile(os.path.join(bin_dir, name))
    return folder


@pytest.mark.timeout(400)
def test_reproduce_cifar10_one_short_epoch(tmp_path):
    data = write_cifar10_binary(str(tmp_path / "cifar"))
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "reproduce.py"), "--suite", "cifar10", "--data", data,
           "--epochs", "1", "--out", str(out), "--set", "train.batch_size=16", "--set", "log.every_steps=3",
           "--set", "cluster.stall_timeout=120"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=380,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "[3/3] ok" in proc.stdout and "min to go" in proc.stdout
    with open(out / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == ["SSGD", "SSD-SGD", "SSD-SGD + top-k 1%"]
    for r in rows:
        assert r["rc"] == "0" and 0.0 <= float(r["final_acc"]) <= 1.0 and int(r["steps"]) == 6
        with open(out / r["run_dir"] / "config.yaml") as f:
            assert f"root: {data}" in f.read()
    table = (out / "table.md").read_text()
    for label in ("SSGD", "SSD-SGD", "SSD-SGD + top-k 1%"):
        assert f"| {label} | " in table
    assert (out / "accuracy.png").stat().st_size > 10_000
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["finished"] and manifest["failed"] == 0 and len(manifest["commit"] or "x" * 40) == 40
    assert set(manifest["configs"]) == {f"configs/cifar10_resnet20_{v}.yaml" for v in ("ssgd", "ssd", "ssd_topk")}
    assert manifest["machine"]["cores"] and manifest["date"]
    again = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert again.returncode == 2 and "already holds results" in again.stdout      # nothing is overwritten
    assert processes_with(str(tmp_path)) == []
