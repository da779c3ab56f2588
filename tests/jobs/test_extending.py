"""docs/design.md's "Extending" examples, run as they stand there: a sparsifier and an algorithm, each a
plug-in module named in the config's `plugins`, registered by importing it (no patching of the package),
used through the factories the worker uses, and trained in a real 2-worker job."""
import os

import pytest
from support.jobs import ROOT, run_job

from unit.test_extending import design_example

SSD_TOPK = os.path.join(ROOT, "configs", "demo_digits_ssd_topk.yaml")
SSGD = os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml")


@pytest.fixture
def plugins(tmp_path):
    """The design's plug-in modules written to a folder the job's roles get on PYTHONPATH (this process
    imports neither)."""
    for name in ("my_sparsifiers", "local_sgd"):
        (tmp_path / f"{name}.py").write_text(design_example(f"# {name}.py"))
    return tmp_path


def _job_env(folder):
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), ROOT, os.environ.get("PYTHONPATH")]))}


# ------------------------------------------------------------------------------------------ a sparsifier


@pytest.mark.timeout(300)
def test_a_plugin_sparsifier_trains_in_a_two_worker_job(plugins):
    job = run_job(plugins, SSD_TOPK, "plugins=[my_sparsifiers]", "compression.type=maxk", "train.epochs=2",
                  name="maxk", env=_job_env(plugins))
    assert job.rc == 0, job.output
    s = job.summary()
    assert s["num_workers"] == 2 and s["compression"] == "maxk" and s["steps"] == 2 * 22
    assert 0 < s["bytes_per_step"]["push"] < 0.1 * s["bytes_per_step"]["pull"] * 22


# ------------------------------------------------------------------------------------------ an algorithm


@pytest.mark.timeout(300)
def test_a_plugin_algorithm_trains_in_a_two_worker_job(plugins):
    job = run_job(plugins, SSGD, "plugins=[local_sgd]", "algorithm.type=local_sgd", "algorithm.delay=2",
                  "train.epochs=3", "train.lr=0.5", name="local_sgd", env=_job_env(plugins))
    assert job.rc == 0, job.output
    s = job.summary()
    assert s["algorithm"] == "local_sgd" and s["num_workers"] == 2 and s["steps"] == 3 * 22
    assert s["final_test_acc"] >= 0.5                          # chance: 0.1
    n = s["bytes_per_step"]["push"]
    assert n == s["bytes_per_step"]["pull"] > 0                # every other step: the model, once each way
