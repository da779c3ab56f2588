"""Real multi-process jobs on loopback: 1 scheduler + servers + 2 workers, through the launcher."""
import os
import re
import subprocess
import time

import numpy as np
import pytest
from support.jobs import ROOT, end_group, processes_with, run_job
from scripts.results_io import job_command

from ssdsgd.compression.fusion import largest_deviation

SSGD = "configs/demo_digits_ssgd.yaml"
SSD = "configs/demo_digits_ssd.yaml"


def load_params(path):
    import mxnet as mx
    return {k: v.asnumpy() for k, v in mx.nd.load(path).items()}


@pytest.fixture(scope="module")
def ssgd_job(tmp_path_factory):
    """A 6-epoch SSGD digits job, shared by the tests that check it or compare against it. Its
    compression.density does nothing without a sparsifier: the job says so, and runs as without it."""
    return run_job(tmp_path_factory.mktemp("ssgd"), SSGD, "train.epochs=6", "compression.density=0.05", name="ssgd")


@pytest.mark.timeout(240)
def test_ssgd_digits_job_trains_and_leaves_no_process(ssgd_job):
    job = ssgd_job
    assert job.rc == 0, job.output
    s = job.summary()
    assert s["algorithm"] == "ssgd" and s["num_workers"] == 2 and s["steps"] == 6 * 22
    assert s["final_test_acc"] >= 0.9
    assert "note: compression.density = 0.05 has no effect: compression.type is none" in job.output
    # Stock SSGD pushes every gradient and pulls every weight each step: 4 bytes per parameter.
    assert s["bytes_per_step"]["push"] == s["bytes_per_step"]["pull"] > 0
    assert s["max_staleness"] == 0
    assert processes_with(job.marker) == []
    for name in ("config.yaml", "metrics.jsonl", "metrics.rank1.jsonl", "final.params"):
        assert os.path.exists(os.path.join(job.run_dir, name)), name


@pytest.mark.timeout(240)
def test_crashing_worker_fails_the_job_fast_and_cleanly(tmp_path):
    t0 = time.time()
    job = run_job(tmp_path, SSGD, "train.epochs=50", name="crash",
                  env={"SSDSGD_TEST_FAULT": "raise:1:5"})
    elapsed = time.time() - t0
    assert job.rc == 1, job.output[-3000:]          # design.md: a crash ... exits 1, naming the role
    assert "injected fault at step 5" in job.output
    assert re.search(r"^launch: worker \d \(rank 1\) exited with code 1", job.output, re.M), job.output[-3000:]
    assert elapsed < 60
    assert not os.path.exists(os.path.join(job.run_dir, "summary.json"))
    assert processes_with(job.marker) == []


@pytest.mark.timeout(200)
def test_closed_stdout_lets_the_job_run_to_its_end(tmp_path):
    """`ssdsgd-run ... | head -1`: the launcher's reader of a role's output died with BrokenPipeError, the
    role blocked on its full pipe, and the job ended at the stall timeout blaming a worker. Now the
    output is drained to the end and the job finishes as it would have."""
    log_dir = str(tmp_path / "runs")
    sets = ["train.epochs=1", "cluster.stall_timeout=120", "cluster.server_timeout=60"]
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(job_command(os.path.join(ROOT, SSGD), "head", log_dir, sets), cwd=ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
        try:
            t0 = time.time()
            first = proc.stdout.readline()
            proc.stdout.close()                       # what `| head -1` does after its line
            rc = proc.wait(timeout=150)
            elapsed = time.time() - t0
        finally:
            end_group(proc)
        err.seek(0)
        stderr = err.read()
    assert first.startswith("run folder: ")
    assert rc == 0, stderr
    assert elapsed < 90, stderr                       # well before the 120 s stall timeout
    assert "Traceback" not in stderr and "made no progress" not in stderr
    assert "launch: standard output was closed; the job goes on without showing its output" in stderr
    assert os.path.exists(os.path.join(first[len("run folder: "):].strip(), "summary.json"))
    assert processes_with(log_dir) == []


def _mlp_accuracy(params, images, labels):
    """numpy forward of models._mlp (Flatten, Dense 128 relu, Dense 64 relu, Dense 10)."""
    x = images.reshape(len(images), -1).astype(np.float64)
    for i, layer in enumerate((1, 2, 3)):
        x = x @ params[f"{layer}.weight"].T.astype(np.float64) + params[f"{layer}.bias"]
        if i < 2:
            x = np.maximum(x, 0)
    return float(np.mean(x.argmax(axis=1) == labels))


def _eval_shares(run_dir, rank):
    import json
    name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
    with open(os.path.join(run_dir, name)) as f:
        return [r["eval_share"] for r in map(json.loads, f) if "eval_share" in r]


@pytest.mark.timeout(300)
def test_ssd_with_full_warmup_reproduces_ssgd_weights(tmp_path):
    """SSD-SGD whose warm-up covers the whole run is synchronous SGD on our round server; it must
    give the stock dist_sync baseline's weights (same seed, same data order) to float tolerance.
    Both runs evaluate with every worker (train.eval_workers: all, through the stock dist_sync
    server and the round server's dist_async one): each worker counts every other batch of the
    360 test images, and the accuracy rank 0 reports is that of the final weights on the whole
    set, computed here in numpy (the MLP has no BatchNorm, so every worker evaluates the same model)."""
    from ssdsgd.worker.data import build_data
    common = ["train.epochs=2", "model.name=mlp", "train.eval_workers=all"]
    a = run_job(tmp_path, SSGD, *common, name="ssgd")
    b = run_job(tmp_path, SSD, *common, "algorithm.warmup_iters=100000", name="ssd_warm")
    assert a.rc == 0, a.output
    assert b.rc == 0, b.output
    wa, wb = load_params(a.summary()["checkpoint"]), load_params(b.summary()["checkpoint"])
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_allclose(wb[k], wa[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert b.summary()["max_staleness"] == 0
    test = build_data("digits", batch_size=32, rank=0, num_workers=2, seed=0).test
    images, labels = (np.concatenate([t.asnumpy() for t in col]) for col in zip(*test.batches(32)))
    for job, weights in ((a, wa), (b, wb)):
        s = job.summary()
        assert len(s["test_acc_history"]) == 2
        assert s["final_test_acc"] == pytest.approx(_mlp_accuracy(weights, images, labels), abs=1e-9)
        shares = [_eval_shares(job.run_dir, r) for r in (0, 1)]
        # 360 images in batches of 32: rank 0 gets batches 0, 2, ..., 10 (6 x 32), rank 1 the rest.
        assert [[x["images"] for x in sh] for sh in shares] == [[192, 192], [168, 168]]
        correct = shares[0][-1]["correct"] + shares[1][-1]["correct"]
        assert s["final_test_acc"] == pytest.approx(correct / 360, abs=1e-9)


def _simulate_strict_ssd(cfg, num_workers, total_steps):
    """Independent numpy simulation of strict SSD-SGD on softmax regression (model 'linear')."""
    from ssdsgd.worker.data import build_data
    from ssdsgd.worker.models import build_net

    B = cfg.train.batch_size
    sets = [build_data("digits", batch_size=B, rank=r, num_workers=num_workers, seed=cfg.seed).train
            for r in range(num_workers)]
    batches = [[(x.asnumpy().reshape(B, -1).astype(np.float64), y.asnumpy().astype(int))
                for e in range(cfg.train.epochs) for x, y in s.epoch(e)][:total_steps] for s in sets]
    _, params = build_net(cfg, 10, (1, 8, 8))
    W0, b0 = (p.data().asnumpy().astype(np.float64) for p in params)

    def grad(W, b, x, y):
        z = x @ W.T + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0          # d(sum of CE)/dz
        return p.T @ x, p.sum(axis=0)

    alg, tr = cfg.algorithm, cfg.train
    lr, mu, wd, N = tr.lr, tr.momentum, tr.wd, num_workers
    lr_loc, c, k, Tw = alg.lr * alg.local.lr_scale, alg.local.c, alg.delay, alg.warmup_iters
    glob = [np.concatenate([W0.ravel(), b0])]          # glob[v] = global weights at version v
    vel = np.zeros_like(glob[0])
    split = W0.size
    loc = [glob[0].copy() for _ in range(N)]
    snap = [glob[0].copy() for _ in range(N)]
    pending = None
    for t in range(total_steps):
        grads = []
        for r in range(N):
            gW, gb = grad(loc[r][:split].reshape(W0.shape), loc[r][split:], *batches[r][t])
            grads.append(np.concatenate([gW.ravel(), gb]))
        G = sum(grads)
        delayed = t >= Tw                                # the delay stage's own rate and momentum
        rate, m = (alg.lr, alg.momentum) if delayed else (lr, mu)
        vel = m * vel - rate * (G / (N * B) + wd * glob[-1])
        glob.append(glob[-1] + vel)                      # round t applied: version t+1
        if t < Tw:                                       # synchronous: every step is a refresh
            loc = [glob[t + 1].copy() for _ in range(N)]
            snap = [glob[t + 1].copy() for _ in range(N)]
            continue
        for r in range(N):
            if pending is not None:
                loc[r] = glob[pending + 1].copy()
                snap[r] = loc[r].copy()
            loc[r] = loc[r] - lr_loc * (grads[r] / (N * B) + wd * loc[r] + c * (snap[r] - loc[r]))
        pending = t if (t - Tw + 1) % k == 0 else None
    return glob[total_steps][:split].reshape(W0.shape), glob[total_steps][split:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lr", ["0.05", "0.3"])          # below and above algorithm.lr_cap (0.1)
def test_strict_ssd_matches_numpy_simulation(tmp_path, lr):
    from ssdsgd.config import load_config
    sets = ["model.name=linear", "model.hybridize=false", "train.epochs=2", "train.batch_size=16",
            f"train.lr={lr}", "train.lr_schedule.type=constant", "algorithm.warmup_iters=5",
            "algorithm.delay=3", "algorithm.strict=true"]
    job = run_job(tmp_path, SSD, *sets, name="strict")
    assert job.rc == 0, job.output
    s = job.summary()
    cfg = load_config(os.path.join(ROOT, SSD), sets)
    W, b = _simulate_strict_ssd(cfg, 2, s["steps"])
    got = load_params(s["checkpoint"])
    gw = next(v for v in got.values() if v.ndim == 2)
    gb = next(v for v in got.values() if v.ndim == 1)
    np.testing.assert_allclose(gw, W, rtol=1e-3, atol=2e-5)
    np.testing.assert_allclose(gb, b, rtol=1e-3, atol=2e-5)
    # The delayed schedule matters: plain synchronous SGD ends far outside that tolerance.
    sync = load_config(os.path.join(ROOT, SSD), sets + ["algorithm.warmup_iters=100000"])
    W_sync, _ = _simulate_strict_ssd(sync, 2, s["steps"])
    assert np.abs(W_sync - W).max() > 100 * 2e-5
    assert s["max_staleness"] == 3


@pytest.mark.timeout(300)
def test_slow_worker_never_exceeds_staleness_bound(tmp_path):
    """Worker 1 sleeps every step; with k=2, S=3 the fast worker must wait instead of running ahead."""
    job = run_job(tmp_path, SSD, "train.epochs=2", "algorithm.warmup_iters=4", "algorithm.delay=2",
                  "algorithm.max_staleness=3", name="slow", env={"SSDSGD_TEST_FAULT": "slow:1:0.03"})
    assert job.rc == 0, job.output
    s = job.summary()
    assert s["max_staleness"] <= 3
    for rank in (0, 1):
        steps = [m for m in job.metrics(rank) if "staleness" in m and m["staleness"] is not None]
        assert steps and max(m["staleness"] for m in steps) <= 3
    waited = sum(w["wait_seconds"] for w in s["workers"])
    assert waited > 0.5          # 88 steps x 30 ms of straggling had to be absorbed by waiting
    # Where the steps went: the waits are inside the client's share, and both shares inside the
    # epochs' training time (the straggler sleeps before its step, outside both).
    for w in s["workers"]:
        assert 0 < w["compute_seconds"] and w["wait_seconds"] <= w["client_seconds"]
        assert w["compute_seconds"] + w["client_seconds"] <= w["train_seconds"]
    for rank, w in enumerate(s["workers"]):      # the logged per-step means add up to the totals
        logged = [m for m in job.metrics(rank) if "compute_seconds" in m]
        steps = np.diff([0] + [m["step"] for m in logged])
        assert logged and steps.sum() == w["steps"]
        for what in ("compute_seconds", "client_seconds"):
            assert sum(m[what] * n for m, n in zip(logged, steps)) == pytest.approx(w[what], rel=1e-6)


@pytest.mark.timeout(300)
def test_ssd_pull_traffic_is_one_kth_of_ssgd(tmp_path, ssgd_job):
    k = 4
    a = ssgd_job
    b = run_job(tmp_path, SSD, "train.epochs=6", "algorithm.warmup_iters=0", f"algorithm.delay={k}",
                name="ssd")
    assert a.rc == 0 and b.rc == 0, a.output + b.output
    sa, sb = a.summary(), b.summary()
    assert sa["steps"] == sb["steps"]
    ratio = sb["pull_bytes"] / sa["pull_bytes"]
    assert 0.9 / k <= ratio <= 1.3 / k, ratio
    # pushes stay dense and every step: mailbox header of 2 floats on top of the gradient
    assert sb["bytes_per_step"]["push"] == pytest.approx(sa["bytes_per_step"]["push"] + 8, rel=1e-6)


@pytest.mark.timeout(120)
def test_two_servers_each_serve_a_buffer_and_apply_every_round(tmp_path):
    """A 2-server round-based job with the sparse downlink: each server says, at the end, that it held
    a buffer of its own with all five of its keys (weight, clock, mailbox, ring, momentum) and applied
    a round for every step; no server idle, no process left behind."""
    steps = 12
    job = run_job(tmp_path, SSD, "cluster.servers=2", f"train.max_steps={steps}", "algorithm.warmup_iters=4",
                  "compression.type=topk", "compression.downlink=sparse", name="servers2", timeout=90)
    assert job.rc == 0, job.output
    served = re.findall(r"^\[server \d+ \(rank (\d+)\)\] ssdsgd server: served (.*)$", job.output, re.M)
    assert sorted(rank for rank, _ in served) == ["0", "1"], job.output
    buffers = {}
    for rank, what in served:
        held = re.findall(r"(\d+) \((\d+) keys, (\d+) rounds\)", what)
        assert held, f"server rank {rank} served no buffer: {what}"
        buffers.update({int(b): (int(keys), int(rounds)) for b, keys, rounds in held})
    assert buffers == {0: (5, steps), 1: (5, steps)}
    assert processes_with(job.marker) == []


RESNET20 = "configs/bench_cifar_resnet20.yaml"


@pytest.mark.timeout(300)
def test_resnet20_on_four_servers_places_whole_tensors_and_ends_with_the_one_server_model(tmp_path):
    """compression.buffers: one on 4 servers gives ResNet-20 buffers of whole tensors placed largest
    first (its consecutive split would leave a server 15% off the mean), so each buffer holds tensors
    from all over the model. Strict SSD-SGD + top-k with per-tensor quotas by size (the messages do not
    depend on how tensors are grouped) then ends with the global model of a 1-server run."""
    common = ["algorithm.type=ssd", "algorithm.strict=true", "algorithm.warmup_iters=2", "algorithm.delay=2",
              "compression.type=topk", "compression.allocation=size", "compression.buffers=one",
              "train.max_steps=6", "train.batch_size=4", "data.synthetic_samples=64", "log.every_steps=3"]
    models = {}
    for servers in (1, 4):
        job = run_job(tmp_path, RESNET20, *common, f"cluster.servers={servers}", name=f"s{servers}", timeout=140)
        assert job.rc == 0, job.output
        assert processes_with(job.marker) == []
        summary = job.summary()
        assert summary["steps"] == 6 and summary["num_servers"] == servers
        models[servers] = load_params(summary["checkpoint"])
        sizes = summary["client"]["buffer_sizes"]
    assert len(sizes) == 4 and largest_deviation(sizes, [[b] for b in range(4)]) <= 0.1     # consecutive: 15%
    assert models[1].keys() == models[4].keys()
    for k in models[1]:
        np.testing.assert_allclose(models[4][k], models[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
