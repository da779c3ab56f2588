"""Several devices per worker (ssdsgd/worker/devices.py, train.devices, cluster.device), on CPU contexts.

The replicas are cpu(1) and cpu(2), never cpu(0): a Gluon parameter read without its context resolves to
cpu(0) and fails there, as it would on a GPU. So every job here also proves that the clients and the
compressor only touch host arrays.
"""
import os
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT, processes_with, run_job, stopped_resumed_and_uninterrupted


SSGD = "configs/demo_digits_ssgd.yaml"
SSD = "configs/demo_digits_ssd.yaml"
SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"


def _launch_dry_run(*args):
    out = subprocess.run([sys.executable, "launch/launch.py", *args, "--dry-run", "python", "x.py"], cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout, out.stderr


def test_dry_run_shows_each_workers_gpus_and_hides_them_from_servers():
    rc, out, err = _launch_dry_run("-n", "2", "-s", "1", "--gpus-per-worker", "2", "--gpus", "4,5,6,7")
    assert rc == 0, err
    seen = dict(re.findall(r"^(\w+(?: \d)?) on localhost:.*\n.*CUDA_VISIBLE_DEVICES=(\S+)", out, re.M))
    assert seen == {"scheduler": "''", "server 0": "''", "worker 0": "4,5", "worker 1": "6,7"}
    rc, _, err = _launch_dry_run("-n", "3", "--gpus-per-worker", "2", "--gpus", "4")
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "launch: host localhost: 3 workers x 2 GPUs each do not fit its 4 GPUs (0,1,2,3)")
    rc, _, err = _launch_dry_run("-n", "2", "--gpus", "0,1")
    assert rc == 2 and "--gpus: lists the GPUs that --gpus-per-worker shares out" in err


def test_gpu_on_the_cpu_wheel_stops_before_any_process_with_one_line(tmp_path):
    job = run_job(tmp_path, SSGD, "cluster.device=gpu", name="gpu", timeout=60)
    assert job.rc == 2
    assert job.output.strip().splitlines() == [
        f"error: cluster.device: gpu, but this MXNet ({mx.__version__}) was built without CUDA: install a GPU "
        f"build (README: GPUs), or set cluster.device: cpu"]
    assert not os.path.exists(os.path.join(str(tmp_path), "runs", "gpu"))


@pytest.mark.parametrize("sets, text", [
    (["train.devices=40"], "train.devices: 40 replicas share a worker's batch of train.batch_size 32 images"),
    (["cluster.gpus=[0,1]"], "cluster.gpus: set, but cluster.device is cpu"),
])
def test_device_settings_that_cannot_work_are_refused(tmp_path, sets, text):
    job = run_job(tmp_path, SSGD, *sets, name="bad", timeout=60)
    assert job.rc == 2 and text in job.output


# ---- jobs on two CPU replicas per worker ----------------------------------------------------------------
def _params(path):
    return {k: v.asnumpy() for k, v in mx.nd.load(path).items()}


ONE_STEP = ["model.name=mlp", "train.max_steps=3", "train.eval_every_epochs=1000", "log.every_steps=1"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config, sets", [
    (SSGD, []),                                                    # stock dist_sync
    # Local updates from the first step; one buffer plan for both (cost_model's depends on measured times).
    (SSD, ["algorithm.warmup_iters=0", "compression.buffers=one"]),
    (SSD_TOPK, ["algorithm.warmup_iters=0", "compression.buffers=one"]),         # top-k, sparse downlink
], ids=["ssgd", "ssd", "ssd_topk"])
def test_two_replicas_train_to_one_devices_weights_and_push_the_same_bytes(tmp_path, config, sets):
    """A model without BatchNorm: three steps on two replicas per worker end at the weights of one device
    on the same batches (float tolerance: the sum over replicas rounds differently), and push the same bytes."""
    jobs = [run_job(tmp_path, config, *ONE_STEP, *sets, f"train.devices={d}", name=f"d{d}") for d in (1, 2)]
    for job in jobs:
        assert job.rc == 0, job.output[-3000:]
    w1, w2 = (_params(j.summary()["checkpoint"]) for j in jobs)
    assert w1.keys() == w2.keys()
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert max(np.abs(w1[k] - _initial(tmp_path, config, k)).max() for k in w1) > 1e-4   # they did train
    s1, s2 = (j.summary() for j in jobs)
    assert s2["push_bytes"] == s1["push_bytes"]
    assert processes_with(str(tmp_path)) == []


def _initial(tmp_path, config, key):
    """The seeded initial value of parameter `key` (train.max_steps=0 is not a thing: rebuild it)."""
    from ssdsgd.config import load_config
    from ssdsgd.worker.models import build_net
    cfg = load_config(os.path.join(ROOT, config), ["model.name=mlp"])
    net, _ = build_net(cfg, 10, (1, 8, 8))
    return net._collect_params_with_prefix()[key].data().asnumpy()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("config, sets", [
    (SSGD, ["algorithm.type=asgd"]),
    (SSGD, ["compression.type=topk"]),                               # compressed SSGD on the round server
    (SSD_TOPK, ["compression.downlink=compressed"]),
    (SSD_TOPK, ["train.eval_bn_batches=2", "train.eval_workers=all"]),
], ids=["asgd", "ssgd_topk", "ssd_topk_compressed_downlink", "ssd_topk_bn_recompute"])
def test_every_algorithm_trains_on_two_replicas_per_worker(tmp_path, config, sets):
    job = run_job(tmp_path, config, "train.epochs=2", "train.devices=2", *sets, name="two")
    assert job.rc == 0, job.output[-3000:]
    s = job.summary()
    assert s["steps"] == 44 and s["final_test_acc"] > 0.3
    assert processes_with(str(tmp_path)) == []


@pytest.mark.timeout(400)
def test_resume_on_two_replicas_ends_where_the_uninterrupted_run_ends(tmp_path):
    """BatchNorm statistics per replica and the host weights come back from the checkpoint: strict SSD-SGD +
    top-k stopped after epoch 1 and resumed ends at the uninterrupted run's weights."""
    sets = ["train.epochs=2", "algorithm.strict=true", "checkpoint.every_epochs=1", "train.devices=2"]
    a, b, c = stopped_resumed_and_uninterrupted(tmp_path, SSD_TOPK, *sets, stop_steps=22)
    wb, wc = (_params(j.summary()["checkpoint"]) for j in (b, c))
    for k in wc:
        np.testing.assert_array_equal(wb[k], wc[k], err_msg=k)
    assert b.summary()["final_test_acc"] == c.summary()["final_test_acc"]
    assert processes_with(str(tmp_path)) == []


@pytest.mark.timeout(200)
def test_imagenet_recordio_batches_reach_both_replicas(tmp_path):
    """RecordIO batches come on pinned host memory: each replica gets its part on its own device, and the
    evaluation runs on the first."""
    from jobs.test_data import FAST, check_finished, write_imagenet
    root = write_imagenet(tmp_path / "data", 32, 64, 20)
    job = run_job(tmp_path, "configs/cifar10_resnet20_ssd_topk.yaml", *FAST, "data.dataset=imagenet",
                  f"data.root={root}", "data.shape=[3,32,32]", "data.num_classes=10", "train.batch_size=8",
                  "data.preprocess_threads=1", "train.epochs=2", "algorithm.warmup_iters=2", "train.devices=2")
    assert check_finished(job)["steps"] == 8


@pytest.mark.timeout(300)
def test_gpu_check_passes_on_cpu_devices(tmp_path):
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--devices", "cpu:2", "--repeats", "1",
                          "--sizes", "resnet20", "--out", str(tmp_path / "check")], cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for check in ("answers", "sum", "job ssgd", "job ssd ", "job ssd_topk"):
        assert any(line.startswith("PASS  " + check) for line in lines), (check, out.stdout)
    assert lines[-1] == "gpu_check: all checks passed on cpu:2"
    assert re.search(r"resnet20 gather +\d+\.\d ms/step", out.stdout)
    assert os.path.exists(tmp_path / "check" / "table.csv") and os.path.exists(tmp_path / "check" / "manifest.json")


@pytest.mark.timeout(200)
def test_bench_devices_writes_its_table_and_manifest(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "bench/bench_devices.py", "--repeats", "1", "--transfer-model", "resnet20",
                           "--out", str(out)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import csv
    with open(out / "table.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["part"], r["replicas"]) for r in rows] == [("transfer", "1"), ("transfer", "2"), ("transfer", "4"),
                                                         ("overlap", "2"), ("overlap", "2"), ("overlap", "2")]
    assert all(float(r["gather_ms"]) > 0 for r in rows if r["part"] == "transfer")
    assert (out / "manifest.json").exists() and "| resnet20 size |" in (out / "summary.md").read_text()
