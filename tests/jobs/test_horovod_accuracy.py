"""bench/horovod_accuracy_worker.py trains what an ssdsgd SSGD job of the same config trains: after the first
steps of 2 workers on the accuracy proxy (linear rule, lr warm-up, momentum, wd, seeded model and batch order)
the Horovod job's weights are bit for bit the ssdsgd job's, and so is its test accuracy. Skips where Horovod is
not installed (bench/install_horovod.sh)."""
import json
import os
import subprocess

import pytest
from support.jobs import ROOT, end_group, processes_with, run_job

from bench.horovod_accuracy import horovod_command
from scripts.accuracy_scale import SSGD, linear_rule
from scripts.results_io import summary_row
from ssdsgd.config import load_config
from ssdsgd.metrics import FINAL_PARAMS_FILE

STEPS = 3          # the lr warm-up's first steps, momentum from the second on


def _horovod(tmp_path, sets):
    out = str(tmp_path / "hvd")
    cmd = horovod_command(2, sets, out) + ["--save-params", os.path.join(out, "final.params")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        end_group(proc)
    assert not processes_with(out), "a Horovod rank outlived horovodrun"
    assert proc.returncode == 0, output[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f), os.path.join(out, "final.params")


def _initial(sets):
    """{name: array} of the seeded weights both jobs start from."""
    from ssdsgd.worker.models import build_net
    net, _ = build_net(load_config(os.path.join(ROOT, SSGD), sets), 10, (1, 28, 28))
    return {name: p.data() for name, p in net._collect_params_with_prefix().items()}


def test_horovod_ssgd_takes_ssdsgd_ssgd_steps_bit_for_bit(tmp_path):
    pytest.importorskip("horovod.mxnet")
    import mxnet as mx
    sets = [*linear_rule(2, 1000), "data.train_offset=1000", f"train.max_steps={STEPS}", "seed=3"]
    job = run_job(tmp_path, SSGD, *sets, timeout=300)
    assert job.rc == 0, job.output[-3000:]
    result, hvd_params = _horovod(tmp_path, sets)
    assert result["workers"] == 2 and result["steps"] == STEPS and result["seed"] == 3
    ours, theirs = mx.nd.load(os.path.join(job.run_dir, FINAL_PARAMS_FILE)), mx.nd.load(hvd_params)
    initial = _initial(sets)
    assert sorted(ours) == sorted(theirs) == sorted(initial)
    for name in ours:
        assert (ours[name] == theirs[name]).min().asscalar() == 1, f"{name}: Horovod's weights differ from ssdsgd's"
    # Equal, and not merely the shared seeded start: every array has moved in those steps.
    assert all((ours[name] != initial[name]).max().asscalar() == 1 for name in ours)
    assert result["final_acc"] == summary_row(job.summary())["final_acc"]
