"""The checkpoint fingerprint covers every config key that changes the data or the arithmetic of a step:
each key of SCHEMA is classified as one a resume may change or one that must match."""
import pytest

from ssdsgd import checkpoint
from ssdsgd.config import SCHEMA, Field, load_config


def _leaves(schema, prefix=""):
    for key, value in schema.items():
        if isinstance(value, Field):
            yield prefix + key
        else:
            yield from _leaves(value, f"{prefix}{key}.")


def _covers(classes, key):
    return [c for c in classes if key == c or key.startswith(c + ".")]


def test_every_schema_key_is_classified_once():
    unclassified, twice = [], []
    for key in _leaves(SCHEMA):
        hits = _covers(checkpoint.RESUME_MAY_CHANGE, key) + _covers(checkpoint.RESUME_MUST_MATCH, key)
        if not hits:
            unclassified.append(key)
        elif len(hits) > 1:
            twice.append(key)
    assert unclassified == [], f"classify these keys in ssdsgd/checkpoint.py: {unclassified}"
    assert twice == []
    leaves = set(_leaves(SCHEMA))
    for name in checkpoint.RESUME_MAY_CHANGE + checkpoint.RESUME_MUST_MATCH:   # no stale names
        assert any(k == name or k.startswith(name + ".") for k in leaves), name


@pytest.fixture
def digits(tmp_path):
    def load(*sets):
        return load_config("configs/demo_digits_ssd_topk.yaml", list(sets))
    return load


@pytest.mark.parametrize("key", ["data.train_per_class=50", "data.train_offset=10", "data.validation=100",
                                 "train.eval_bn_batches=2", "model.hybridize=false", "compression.density=0.1",
                                 "seed=3", "train.lr_schedule.factor=0.5"])
def test_what_changes_the_run_changes_the_fingerprint(digits, key):
    assert checkpoint.fingerprint(digits(key)) != checkpoint.fingerprint(digits())


@pytest.mark.parametrize("key", ["log.every_steps=3", "train.max_steps=5", "train.eval_every_epochs=2",
                                 "cluster.timeout=99", "data.preprocess_threads=1", "name=other",
                                 "checkpoint.dir=ck", "checkpoint.keep=3", "cluster.max_restarts=2",
                                 "data.root=/data/moved"])  # docs/config.md: data.root may change
def test_what_may_change_on_resume_keeps_the_fingerprint(digits, key):
    assert checkpoint.fingerprint(digits(key)) == checkpoint.fingerprint(digits())


def test_a_resume_may_differ_only_in_keys_idle_with_either_value():
    """The checkpoint's config may differ from the resumed one only in keys idle in both: a milestone moved
    past the last epoch is idle now but was not in the checkpointed run, whose rate it divided."""
    base = ["train.epochs=10", "train.lr_schedule.type=step"]

    def manifest(*sets):
        cfg = load_config("configs/demo_digits_ssgd.yaml", base + list(sets))
        return {"fingerprint": checkpoint.fingerprint(cfg), "config": checkpoint.fingerprint_parts(cfg)}

    def may_resume(saved, *sets):
        cfg = load_config("configs/demo_digits_ssgd.yaml", base + list(sets))
        return checkpoint._only_idle_keys_differ(saved, checkpoint.fingerprint_parts(cfg), cfg)
    assert may_resume(manifest("algorithm.delay=3"), "algorithm.delay=5")
    assert may_resume(manifest("train.lr_schedule.milestones=[11]"), "train.lr_schedule.milestones=[12]")
    assert not may_resume(manifest("train.lr_schedule.milestones=[5]"), "train.lr_schedule.milestones=[12]")
    assert not may_resume(manifest("train.lr=0.2"), "train.lr=0.1")
    assert not may_resume(manifest("algorithm.delay=3"), "algorithm.delay=3")          # nothing differs
    forged = dict(manifest("algorithm.delay=3"), fingerprint="0" * 64)                # parts not the hashed ones
    assert not may_resume(forged, "algorithm.delay=5")
