"""Every shipped config trains a few steps end to end, as a user first tries it on one machine: its own
model, algorithm and compression sections, on small data generated in its dataset's published format,
with 2 local workers and 1 server (ResNet-50 on one server once failed only after every process had
started). What the configs leave for the cluster (hosts, interface, batch, data size) is overridden. Two scripts'
tests train the rest: the demo's configs a whole epoch each, as shipped (tests/jobs/test_scripts.py), and the
CIFAR-10 suite of scripts/reproduce.py a short epoch each on data in the published format (test_reproduce.py)."""
import os

import numpy as np
import pytest
from support.jobs import ROOT, processes_with, run_job
from unit.test_configs import CONFIGS as SHIPPED
from unit.test_data import IDX_NAMES, make_cifar_arrays, write_cifar, write_idx_set
from jobs.test_data import write_imagenet
from scripts.demo import CONFIGS as DEMO_CONFIGS
from scripts.reproduce import configs as reproduced

from ssdsgd.config import load_config
from ssdsgd.schema import AUTO_DENSITIES

TRAINED_BY_SCRIPT_TESTS = set(DEMO_CONFIGS) | {os.path.relpath(c, ROOT) for _, c in reproduced("cifar10")}
CONFIGS = [os.path.relpath(c, ROOT) for c in SHIPPED if os.path.relpath(c, ROOT) not in TRAINED_BY_SCRIPT_TESTS]
# The ImageNet top-k config reads 224x224 images, ImageNet's own size; the other ResNet-50 configs read
# 32x32 ones (the same network takes them), which keeps this file short.
AT_IMAGENET_SIZE = "configs/imagenet_resnet50_ssd_topk.yaml"
ONE_MACHINE = ["cluster.launcher=local", "cluster.workers=2", "cluster.servers=1", "cluster.hostfile=",
               "cluster.interface=", "cluster.timeout=200", "cluster.stall_timeout=120", "train.batch_size=4",
               "train.max_steps=2", "log.every_steps=1", "checkpoint.every_epochs=0"]


def write_fashion_mnist(root):
    rng = np.random.RandomState(0)
    labels = {"train": np.arange(100) % 10, "test": np.arange(20) % 10}
    arrays = {}
    for split, y in labels.items():
        arrays[f"{split}_images"] = rng.randint(0, 256, size=(y.size, 28, 28)).astype(np.uint8)
        arrays[f"{split}_labels"] = y.astype(np.uint8)
    assert set(arrays) == set(IDX_NAMES)
    write_idx_set(root, arrays)
    return root


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory):
    """Per dataset, the overrides that point a config at small generated data of that format."""
    base = tmp_path_factory.mktemp("data")
    write_cifar(str(base / "cifar10"), "bin", make_cifar_arrays())
    return {
        "digits": [], "synthetic": ["data.synthetic_samples=64"],
        "cifar10": [f"data.root={base / 'cifar10'}"],
        "fashion_mnist": [f"data.root={write_fashion_mnist(str(base / 'fmnist'))}", "data.train_per_class=8"],
        "imagenet": [f"data.root={write_imagenet(base / 'imagenet', 32, 16, 8)}", "data.num_classes=10",
                     "data.shape=[3,32,32]", "data.preprocess_threads=1"],
        AT_IMAGENET_SIZE: [f"data.root={write_imagenet(base / 'imagenet224', 224, 16, 4)}", "data.num_classes=10",
                           "data.preprocess_threads=1"],
    }


def test_every_shipped_config_is_trained_here_or_by_a_scripts_test():
    shipped = {os.path.relpath(c, ROOT) for c in SHIPPED}
    assert len(TRAINED_BY_SCRIPT_TESTS) == 6 and TRAINED_BY_SCRIPT_TESTS < shipped
    assert set(CONFIGS) | TRAINED_BY_SCRIPT_TESTS == shipped


@pytest.mark.timeout(150)
@pytest.mark.parametrize("config", CONFIGS)
def test_shipped_config_trains_two_steps_on_one_machine(tmp_path, data_roots, config):
    cfg = load_config(os.path.join(ROOT, config))
    data = data_roots.get(config) or data_roots[cfg.data.dataset]
    job = run_job(tmp_path, config, *ONE_MACHINE, *data, f"checkpoint.dir={tmp_path / 'ck'}", timeout=140)
    assert job.rc == 0, job.output[-3000:]
    summary = job.summary()
    assert summary["steps"] == 2 and summary["num_workers"] == 2
    if cfg.compression.density == "auto":             # the top-k configs choose their density as they start
        assert summary["client"]["density_choice"]["density"] in AUTO_DENSITIES, summary["client"]
    assert 0 <= summary["final_test_acc"] <= 1
    assert processes_with(job.marker) == []
