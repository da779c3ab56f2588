"""Every shipped config loads, names its source and states its global batch; the schema's defaults are
the recommended settings, and the authors' settings are kept under configs/paper/."""
import glob
import os
import re

import pytest

from ssdsgd.config import ConfigError, load_config, with_density

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))


def test_configs_are_found():
    names = {os.path.relpath(c, ROOT) for c in CONFIGS}
    assert {"configs/cifar10_resnet20_ssd_topk.yaml", "configs/imagenet_resnet50_ssd_topk.yaml",
            "configs/paper/cifar10_resnet20_ssd.yaml", "configs/paper/imagenet_resnet50_ssd.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(c, ROOT) for c in CONFIGS])
def test_every_config_loads_names_its_source_and_states_its_global_batch(path):
    cfg = load_config(path)
    with open(path) as f:
        header = "".join(line for line in f if line.startswith("#"))
    assert re.search(r"^# Source: \S", header, re.M), f"{path}: no '# Source:' line"
    stated = re.search(r"^# global batch: (\d+) \((\d+) workers x (\d+)\)", header, re.M)
    assert stated, f"{path}: no '# global batch: N (W workers x B)' line"
    assert [int(g) for g in stated.groups()] == [cfg.cluster.workers * cfg.train.batch_size, cfg.cluster.workers,
                                                 cfg.train.batch_size]


# Its algorithm.delay and warmup_iters serve the SSD-SGD variants bench/bench_network.py makes of it.
BASE_FOR_VARIANTS = {"configs/bench_cifar_resnet20.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(c, ROOT) for c in CONFIGS])
def test_a_shipped_config_run_as_it_is_sets_nothing_idle(path):
    ignored = load_config(path).ignored
    if os.path.relpath(path, ROOT) in BASE_FOR_VARIANTS:
        assert ignored and all(line.startswith("algorithm.") for line in ignored)
    else:
        assert ignored == ()


def test_settings_the_rest_of_the_config_leaves_idle_are_named():
    """Noted, not refused: an SSD-SGD + top-k config run as SSGD keeps its delay-stage settings."""
    topk = os.path.join(ROOT, "configs", "fmnist_resnet20_ssd_topk.yaml")
    flipped = load_config(topk, ["algorithm.type=ssgd", "algorithm.delay=5", "checkpoint.keep=2"])
    assert flipped.ignored == (
        "algorithm.delay = 5 has no effect: algorithm.type is ssgd, which does not use it (used by ssd)",
        "checkpoint.keep = 2 has no effect: no checkpoint is written (checkpoint.dir and checkpoint.every_epochs "
        "are not both set)")
    ssd = os.path.join(ROOT, "configs", "fmnist_resnet20_ssd.yaml")
    dense = load_config(ssd, ["compression.density=0.05", "compression.allocation=size", "algorithm.local.c=0.3",
                              "compression.buffers=fixed", "compression.buffer_bytes=65536"])
    assert [line.split(" = ")[0] for line in dense.ignored] == [
        "algorithm.local.c", "compression.density", "compression.allocation"]   # buffers: SSD-SGD's rounds use them
    stock = load_config(ssd, ["algorithm.type=asgd", "compression.type=2bit", "compression.buffers=fixed"])
    assert "compression.buffers = 'fixed' has no effect: MXNet's stock KVStore runs algorithm.type asgd with " \
           "compression.type 2bit; only the round-based server plans buffers" in stock.ignored
    assert not [line for line in stock.ignored if line.startswith("compression.threshold")]
    digits = load_config(os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml"), [
        "data.root=/nowhere", "data.preprocess_threads=4", "train.lr_schedule.type=step",
        "train.lr_schedule.milestones=[500]", "train.lr_schedule.power=3"])
    assert [line.split(" = ")[0] for line in digits.ignored] == [
        "data.root", "data.preprocess_threads", "train.lr_schedule.milestones", "train.lr_schedule.power"]
    assert "train.lr_schedule.milestones = [500] has no effect: no milestone falls before the end of the run " \
           f"(train.epochs {digits.train.epochs})" in digits.ignored
    assert "train.lr_schedule.factor" in digits.idle                  # idle too, though left at its default
    dense_downlink = load_config(topk, ["compression.downlink=dense", "compression.downlink_check_every=5"])
    assert dense_downlink.ignored == ("compression.downlink_check_every = 5 has no effect: only the sparse and "
                                      "compressed downlinks are checked, and compression.downlink is dense",)


def _effective(cfg):
    """The algorithm and compression sections as they run (a null momentum is train.momentum)."""
    d = cfg.to_dict()
    alg = dict(d["algorithm"], momentum=d["algorithm"]["momentum"] or d["train"]["momentum"])
    return alg, d["compression"]


def test_a_short_config_runs_the_recommended_settings(tmp_path):
    """Only the data, the model, `type: ssd` / `type: topk` and `density: auto`: the same algorithm and compression as
    fmnist_resnet20_ssd_topk.yaml, which writes the recommended settings out, the warm-up and local
    rate as null (one epoch, the number of workers) so that they follow the workers and the data."""
    full = load_config(os.path.join(ROOT, "configs", "fmnist_resnet20_ssd_topk.yaml"))
    short = tmp_path / "short.yaml"
    short.write_text("data:\n  dataset: fashion_mnist\n  root: /usr/share/datasets/fashion-mnist\n"
                     "model:\n  name: cifar_resnet20_v1\nalgorithm:\n  type: ssd\ncompression:\n  type: topk\n"
                     "  density: auto\n")
    got = load_config(str(short))
    assert _effective(got) == _effective(full)
    assert got.algorithm.warmup_iters is None                            # one epoch, resolved by the worker
    four = load_config(os.path.join(ROOT, "configs", "fmnist_resnet20_ssd_topk.yaml"), ["cluster.workers=4"])
    assert four.algorithm.local.lr_scale == 4.0                          # follows the workers


def test_defaults_follow_the_other_keys(tmp_path):
    plain = tmp_path / "p.yaml"
    plain.write_text("algorithm:\n  type: ssd\n")
    cfg = load_config(str(plain))
    assert (cfg.compression.momentum_correction, cfg.compression.allocation, cfg.compression.downlink) == \
        (False, "size", "dense")                                   # no sparsifier: nothing to correct or rebuild
    assert cfg.algorithm.local.lr_scale == 2.0                     # = cluster.workers
    assert load_config(str(plain), ["cluster.workers=4"]).algorithm.local.lr_scale == 4.0
    assert load_config(str(plain), ["algorithm.local.optimizer=glu"]).algorithm.local.lr_scale == 4.0
    behind = load_config(str(plain), ["compression.type=topk", "compression.fusion=behind"])
    assert behind.compression.allocation == "size" and behind.compression.downlink == "sparse"


def test_delay_stage_rate_above_the_cap_moves_into_momentum(tmp_path):
    """Above algorithm.lr_cap the steps-delay stage runs at the cap with more momentum, keeping SSGD's
    lr / (1 - momentum); at or below it, at SSGD's rate and momentum exactly."""
    plain = tmp_path / "p.yaml"
    plain.write_text("algorithm:\n  type: ssd\n")
    scaled = load_config(str(plain), ["cluster.workers=8", "train.lr=0.4", "train.momentum=0.9"]).algorithm
    assert scaled.lr == 0.1 and scaled.momentum == pytest.approx(0.975, abs=1e-12)
    assert 0.4 / (1 - 0.9) == pytest.approx(scaled.lr / (1 - scaled.momentum))
    at_cap = load_config(str(plain), ["train.lr=0.1", "train.momentum=0.9"]).algorithm
    assert (at_cap.lr, at_cap.momentum) == (0.1, 0.9)
    uncapped = load_config(str(plain), ["train.lr=0.4", "algorithm.lr_cap=null"]).algorithm
    assert (uncapped.lr, uncapped.momentum) == (0.4, 0.9)
    own = load_config(str(plain), ["train.lr=0.4", "algorithm.momentum=0.95"]).algorithm
    assert (own.lr, own.momentum) == (0.1, 0.95)                 # a momentum given is kept
    assert load_config(str(plain), ["algorithm.type=ssgd", "train.lr=0.4"]).algorithm.lr is None
    with pytest.raises(ConfigError, match=r"^algorithm\.lr: .* above train\.lr"):
        load_config(str(plain), ["train.lr=0.1", "algorithm.lr=0.2"])


def test_density_warmup_follows_the_lr_warmup(tmp_path):
    """compression.warmup null: DGC's ramp held through the lr warm-up, within half the run; none without
    an lr warm-up or a sparsifier; a list given is kept."""
    plain = tmp_path / "p.yaml"
    plain.write_text("algorithm:\n  type: ssd\ncompression:\n  type: topk\n  density: 0.01\ntrain:\n  epochs: 20\n")

    def warmup(*sets):
        return load_config(str(plain), list(sets)).compression.warmup

    assert warmup("train.lr_schedule.warmup_epochs=1") == [0.25, 0.0625, 0.015625]
    assert warmup("train.lr_schedule.warmup_epochs=2.5") == [0.25, 0.25, 0.25, 0.0625, 0.015625]
    assert warmup("train.lr_schedule.warmup_epochs=1", "compression.density=0.001") == \
        [0.25, 0.0625, 0.015625, 0.00390625]
    assert warmup("train.lr_schedule.warmup_epochs=1", "train.epochs=5") == [0.25, 0.0625]   # (5 - 1) // 2
    assert warmup("train.lr_schedule.warmup_epochs=1", "train.epochs=2") == []
    assert warmup("train.lr_schedule.warmup_epochs=1", "compression.density=0.3") == []
    assert warmup() == []                                                   # no lr warm-up
    assert warmup("train.lr_schedule.warmup_epochs=1", "compression.warmup=[]") == []
    assert warmup("train.lr_schedule.warmup_epochs=1", "compression.type=none", "algorithm.type=ssgd") == []
    shipped = load_config(os.path.join(ROOT, "configs", "imagenet_resnet50_ssd_topk.yaml"))
    assert shipped.compression.density == "auto" and shipped.compression.warmup is None   # follows the choice
    imagenet = with_density(shipped, 0.01).compression
    assert imagenet.warmup[:5] == [0.25] * 5 and imagenet.warmup[-1] > imagenet.density


@pytest.mark.parametrize("name", ["cifar10_resnet20_ssd", "imagenet_resnet50_ssd"])
def test_paper_configs_hold_the_authors_setting(name):
    cfg = load_config(os.path.join(ROOT, "configs", "paper", name + ".yaml"))
    alg = cfg.algorithm
    assert (alg.warmup_iters, alg.delay, alg.local.optimizer, alg.local.lr_scale) == (500, 5, "glu", 4.0)
