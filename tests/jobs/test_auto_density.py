"""compression.density: auto in real jobs: the choice is made once, recorded (the line, config.yaml, the
summary, every checkpoint), kept by a resume, and a strict run with it is the run with the chosen number
given by hand, bit for bit; on the virtual cluster two link rates give two densities."""
import json
import os
import subprocess

import numpy as np
import pytest
import yaml
from jobs.test_cluster import cluster_command
from support.jobs import ROOT, processes_with, run_job, virtual_cluster

from ssdsgd.env import COST_SCALE_ENV

SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"
# One buffer a server: the demo's cost_model plan follows link costs measured at each start, and so the bytes do.
STRICT = ["train.epochs=3", "algorithm.strict=true", "checkpoint.every_epochs=1", "compression.downlink=sparse",
          "compression.buffers=one"]
# The probe's rates divided by a million: on loopback the workers then see a link of a few kbit/s, where
# no density is compute-bound and auto takes the lowest, which they would never choose on loopback itself.
SLOW_LINK = {COST_SCALE_ENV: "up_rate=1e-6,down_rate=1e-6"}


def load_params(path):
    import mxnet as mx
    return {k: v.asnumpy() for k, v in mx.nd.load(path).items()}


def _density_in(path):
    with open(path) as f:
        return yaml.safe_load(f)["compression"]["density"]


def _chosen(job):
    return job.summary()["client"]["density_choice"]


@pytest.mark.timeout(300)
def test_strict_auto_is_the_chosen_density_given_by_hand_and_a_resume_keeps_it(tmp_path):
    ck = tmp_path / "ck"
    auto = run_job(tmp_path, SSD_TOPK, *STRICT, "compression.density=auto", f"checkpoint.dir={tmp_path}/ck_auto",
                   name="auto", env=SLOW_LINK)
    assert auto.rc == 0, auto.output[-3000:]
    choice = _chosen(auto)
    assert choice["density"] == 0.001 and choice["verdict"] == "network-bound", choice
    assert auto.output.count("compression: auto chose density 0.001 (link 0.0 Mbit/s up") == 1, auto.output[-3000:]
    assert _density_in(os.path.join(auto.run_dir, "config.yaml")) == 0.001
    with open(tmp_path / "ck_auto" / "epoch-0003" / "manifest.json") as f:
        assert json.load(f)["config"]["compression"]["density"] == 0.001
    by_hand = run_job(tmp_path, SSD_TOPK, *STRICT, "compression.density=0.001", f"checkpoint.dir={tmp_path}/ck_h",
                      name="by_hand")
    assert by_hand.rc == 0, by_hand.output[-3000:]
    # A stopped at epoch 1 with auto on the slow-looking link, B resumed on the real one (where auto would
    # choose another density): B goes on with A's.
    a = run_job(tmp_path, SSD_TOPK, *STRICT, "compression.density=auto", f"checkpoint.dir={ck}",
                "train.max_steps=22", name="A", env=SLOW_LINK)
    assert a.rc == 0, a.output[-3000:]
    b = run_job(tmp_path, SSD_TOPK, *STRICT, "compression.density=auto", f"checkpoint.dir={ck}", name="B",
                args=["--resume"])
    assert b.rc == 0 and "resuming from" in b.output, b.output[-3000:]
    assert "auto chose" not in b.output                          # not measured again
    assert _density_in(os.path.join(b.run_dir, "config.resume-step22.yaml")) == 0.001
    fresh = run_job(tmp_path, SSD_TOPK, *STRICT, "compression.density=auto", "train.max_steps=1",
                    "checkpoint.every_epochs=0", name="fresh")
    assert fresh.rc == 0 and _chosen(fresh)["density"] > 0.001, fresh.output[-3000:]
    w = [load_params(j.summary()["checkpoint"]) for j in (auto, by_hand, b)]
    for k in w[1]:
        np.testing.assert_array_equal(w[0][k], w[1][k], err_msg=k)      # auto = the number by hand
        np.testing.assert_array_equal(w[2][k], w[1][k], err_msg=k)      # resumed with the choice
    assert auto.summary()["push_bytes"] == by_hand.summary()["push_bytes"]
    assert processes_with(str(tmp_path)) == []


@pytest.fixture
def cluster(tmp_path):
    """A 4-host cluster (h0: the launcher; h1: the server; h2, h3: the workers), checked to be empty after."""
    with virtual_cluster(4) as vc:
        yield vc
        left = vc.leftovers()
        assert left == {}, f"processes left on the hosts: {left}"
    assert processes_with(str(tmp_path)) == []


def _on_hosts(vc, tmp_path, name):
    """A 2-worker ResNet-20 job with auto over ssh from h0: its density choice."""
    # The sparse downlink: the demo's dense pulls would be most of a step's bytes at every density.
    argv, run_dir = cluster_command(vc, tmp_path, "compression.density=auto", "compression.downlink=sparse",
                                    "model.name=cifar_resnet20_v1", "data.shape=[3,32,32]", "train.max_steps=2",
                                    "cluster.timeout=150", config=os.path.join(ROOT, SSD_TOPK), name=name)
    done = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=200, start_new_session=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["client"]["density_choice"]


@pytest.mark.timeout(500)
def test_two_link_rates_on_the_virtual_cluster_give_two_densities(cluster, tmp_path):
    """ResNet-20 on per-host links: at 2 Mbit/s (each worker's share of the server's link about half of it)
    auto takes a low density, unshaped the highest."""
    cluster.shape(2)
    slow = _on_hosts(cluster, tmp_path, "slow")
    cluster.shape(None)
    fast = _on_hosts(cluster, tmp_path, "fast")
    assert slow["density"] <= 0.01 < fast["density"], (slow, fast)
    assert slow["up_mbit"] < 2.0 < fast["up_mbit"], (slow, fast)
