"""scripts/reproduce.py end to end: SSGD, SSD-SGD and SSD-SGD + top-k with the shipped CIFAR-10 configs,
one short epoch each, on a tiny CIFAR-10 set in the published binary format."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.jobs import ROOT, processes_with


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
    assert [r["variant"] for r in rows] == ["SSGD", "SSD-SGD", "SSD-SGD + top-k auto"]
    for r in rows:
        assert r["rc"] == "0" and 0.0 <= float(r["final_acc"]) <= 1.0 and int(r["steps"]) == 6
        with open(out / r["run_dir"] / "config.yaml") as f:
            assert f"root: {data}" in f.read()
    table = (out / "table.md").read_text()
    assert "| SSGD | " in table
    # One epoch is the configs' whole synchronous warm-up: both SSD-SGD variants ran as SSGD, and say so.
    for label in ("SSD-SGD", "SSD-SGD + top-k auto"):
        assert f"| {label} (never left its warm-up: ran as SSGD) | " in table
        assert f"reproduce.py: warning: {label}, seed 0 ended within its synchronous warm-up (6 steps)" in proc.stdout
    assert (out / "accuracy.png").stat().st_size > 10_000
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["finished"] and manifest["failed"] == 0 and len(manifest["commit"] or "x" * 40) == 40
    assert set(manifest["configs"]) == {f"configs/cifar10_resnet20_{v}.yaml" for v in ("ssgd", "ssd", "ssd_topk")}
    assert manifest["machine"]["cores"] and manifest["date"]
    again = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert again.returncode == 2 and "already holds results" in again.stdout      # nothing is overwritten
    assert processes_with(str(tmp_path)) == []


def _reproduce(*args, out):
    return [sys.executable, os.path.join(ROOT, "scripts", "reproduce.py"), *args, "--out", str(out)]


@pytest.mark.timeout(300)
def test_sigterm_to_the_script_ends_its_running_job_and_nothing_is_left(tmp_path):
    """What timeout or a batch scheduler sends reaches ssdsgd-run and its roles (their process group)."""
    from support.jobs import end_group
    data = write_cifar10_binary(str(tmp_path / "cifar"))
    out = tmp_path / "out"
    cmd = _reproduce("--suite", "cifar10", "--data", data, "--epochs", "50", "--set", "train.batch_size=16",
                     "--set", "log.every_steps=1", "--set", "cluster.stall_timeout=120", out=out)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        metrics = out / "runs" / "SSGD_s0" / "latest" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.stat().st_size > 0):        # past start-up: roles training
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.5)
        assert len(processes_with(str(tmp_path))) >= 4        # ssdsgd-run, scheduler, server, workers
        os.kill(proc.pid, signal.SIGTERM)                     # the script alone, as `timeout` would
        output, _ = proc.communicate(timeout=120)
    finally:
        end_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output and "--keep-done" in output and "Traceback" not in output
    assert processes_with(str(tmp_path)) == []
    with open(out / "runs.csv") as f:
        (row,) = list(csv.DictReader(f))                      # the ended job, recorded as not done
    assert row["variant"] == "SSGD" and row["rc"] != "0"
    assert not (out / "table.md").exists()
    again = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert again.returncode == 2 and "already holds results" in again.stdout and "--keep-done" in again.stdout


def _fake_summary(acc):
    return {"eval_set": "test", "final_test_acc": acc, "best_test_acc": acc, "images_per_sec": 10.0,
            "wall_seconds": 1.0, "steps": 6, "bytes_per_step": {"push": 1, "pull": 1}, "max_staleness": 0,
            "mean_staleness": 0.0, "algorithm": "ssgd", "after_warmup": {"steps": 6}}


@pytest.fixture
def fake_jobs(monkeypatch):
    """reproduce.py in-process with its jobs faked: run_job writes a run folder (finished unless its
    variant is in `fail`) and records its call; no plot, no signal handlers of pytest's replaced."""
    from scripts import reproduce
    from scripts.results_io import job_name, summary_row
    calls, fail = [], set()

    def run_job(label, config, seed, sets, out, stopper):
        calls.append((label, seed))
        name = job_name(label, seed)
        folder = os.path.join(out, "runs", name, f"attempt{len(calls)}")
        os.makedirs(folder)
        row = {"variant": label, "seed": seed, "rc": 1 if label in fail else 0,
               "run_dir": os.path.relpath(folder, out), "log": f"logs/{name}.log"}
        if label in fail:
            return row
        with open(os.path.join(folder, "summary.json"), "w") as f:
            json.dump(_fake_summary(0.5), f)
        return dict(row, **summary_row(_fake_summary(0.5)))

    monkeypatch.setattr(reproduce, "run_job", run_job)
    monkeypatch.setattr(reproduce, "plot", lambda rows, out: None)
    monkeypatch.setattr(reproduce.Stopper, "install", lambda self: None)
    return reproduce, calls, fail


def test_keep_done_reruns_only_the_jobs_not_done_and_keeps_the_finished_ones(tmp_path, fake_jobs, capsys):
    reproduce, calls, fail = fake_jobs
    out = tmp_path / "out"
    args = ["--suite", "fmnist", "--out", str(out)]
    fail.add("SSD-SGD")
    assert reproduce.main(args) == 1
    before = {r["variant"]: r for r in csv.DictReader(open(out / "runs.csv"))}
    kept = {v: (out / before[v]["run_dir"] / "summary.json").read_bytes() for v in ("SSGD", "SSD-SGD + top-k auto")}
    with pytest.raises(SystemExit) as refused:                 # without the option: refused, and told of it
        reproduce.main(args)
    assert refused.value.code == 2 and "--keep-done keeps its finished jobs" in capsys.readouterr().err
    fail.clear()
    calls.clear()
    assert reproduce.main(args + ["--keep-done"]) == 0
    assert calls == [("SSD-SGD", 0)]                           # only what was not done
    after = {r["variant"]: r for r in csv.DictReader(open(out / "runs.csv"))}
    assert set(after) == {"SSGD", "SSD-SGD", "SSD-SGD + top-k auto"} and after["SSD-SGD"]["rc"] == "0"
    for variant, text in kept.items():                         # the finished runs: the same folders, untouched
        assert after[variant]["run_dir"] == before[variant]["run_dir"]
        assert (out / after[variant]["run_dir"] / "summary.json").read_bytes() == text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["finished"] and manifest["failed"] == 0 and len(manifest["earlier"]) == 1
    assert "failed" not in (out / "table.md").read_text()


def test_a_config_typo_stops_before_any_job_and_before_writing_to_out(tmp_path, fake_jobs, capsys):
    reproduce, calls, _ = fake_jobs
    out = tmp_path / "out"
    assert reproduce.main(["--suite", "fmnist", "--seeds", "0", "1", "--set", "train.epoch=1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("reproduce.py: config error in SSGD, seed 0 ")
    assert "train.epoch: unknown key" in err
    assert calls == [] and not out.exists()


def test_a_rerun_job_resumes_its_checkpoint_and_keeps_the_earlier_log(tmp_path, monkeypatch):
    """run_job with the job command replaced by one that prints its arguments."""
    from scripts import reproduce
    monkeypatch.setattr(reproduce, "job_command",
                        lambda *a: [sys.executable, "-c", "import sys; print('job args', sys.argv[1:])"])
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "SSGD_s0.log").write_text("the first attempt\n")
    point = out / "checkpoints" / "SSGD_s0" / "epoch-0010"
    point.mkdir(parents=True)
    (point / "manifest.json").write_text("{}")
    config = os.path.join(ROOT, "configs", "fmnist_resnet20_ssgd.yaml")
    row = reproduce.run_job("SSGD", config, 0, [], str(out), reproduce.Stopper())
    assert row["log"] == os.path.join("logs", "SSGD_s0.2.log") and row["rc"] == 0
    assert "job args ['--resume']" in (out / row["log"]).read_text()
    assert (out / "logs" / "SSGD_s0.log").read_text() == "the first attempt\n"
