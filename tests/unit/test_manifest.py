"""Checkpoint manifests validated field by field, before any process starts; plans never re-made on resume."""
import copy
import json
import os

import pytest
from support.jobs import ROOT

SSGD = "configs/demo_digits_ssgd.yaml"
SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"
HEX = "ab" * 32


def _cfg(config=SSD_TOPK, *sets):
    from ssdsgd.config import load_config
    return load_config(os.path.join(ROOT, config), ["train.epochs=4", *sets])


def _good(cfg):
    from ssdsgd.checkpoint import FORMAT, fingerprint, fingerprint_parts
    return {"format": FORMAT, "fingerprint": fingerprint(cfg), "config": fingerprint_parts(cfg), "name": "x",
            "epochs_done": 2, "step": 44,
            "plan": {"kind": "rounds", "servers": 1, "buffer_sizes": [19000, 658],
                     "cost_model": {"alpha": 1e-3, "beta": 1e-9, "backward": 1e-2}},
            "files": {"worker0.npz": HEX, "worker1.npz": HEX, "server-buffer0.npz": HEX,
                      "server-buffer1.npz": HEX}}


def _with(m, path, value):
    m = copy.deepcopy(m)
    node, keys = m, path.split(".", 1)
    for k in keys[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return m


class _Delete:
    """Marks a field to delete (its repr names it, so test ids are the same in every process)."""

    def __repr__(self):
        return "<deleted>"


_DELETE = _Delete()

BAD_MANIFESTS = [
    # (field, value, text the reason must contain)
    (None, [1, 2], "not a JSON object (got list)"),
    ("files", _DELETE, "has no 'files'"),
    ("files", ["worker0.npz"], "files: expected an object"),
    ("format", 7, "unknown checkpoint format 7"),
    ("format", "2", "unknown checkpoint format '2'"),
    ("fingerprint", "abc", "not a sha256"),
    ("epochs_done", 999, "epochs_done: 999 is more than train.epochs (4)"),
    ("epochs_done", 3, "epochs_done: 3, but the folder is that of epoch 2"),
    ("epochs_done", 0, "epochs_done: 0"),
    ("epochs_done", True, "epochs_done: expected int"),
    ("step", -5, "step: -5 is less than epochs_done"),
    ("step", 44.0, "step: expected int"),
    ("files.server-buffer1.npz", _DELETE, "server-buffer1.npz missing"),
    ("files.worker1.npz", _DELETE, "worker1.npz missing"),
    ("files.server-buffer2.npz", HEX, "lists server-buffer2.npz, which this plan does not have"),
    ("files.../../etc/passwd", HEX, "'../../etc/passwd' is not a checkpoint file name"),
    ("files.worker0.npz", "zz", "worker0.npz: not a sha256"),
    ("plan", _DELETE, "has no 'plan'"),
    ("plan.kind", "stock", "kind 'stock', but this config runs 'rounds'"),
    ("plan.servers", 2, "written for 2 servers, but cluster.servers is 1"),
    ("plan.buffer_sizes", [], "buffer_sizes: expected a non-empty list"),
    ("plan.buffer_sizes", [10, -1], "buffer_sizes: expected a non-empty list"),
    ("plan.cost_model", None, "cost_model: expected the measured costs"),
    ("plan.cost_model", {"alpha": 1}, "cost_model: expected the measured costs"),
]


@pytest.mark.parametrize("field,value,text", BAD_MANIFESTS, ids=[f"{b[0]}={b[1]!r}"[:40] for b in BAD_MANIFESTS])
def test_manifest_fields_are_validated(field, value, text):
    from ssdsgd.checkpoint import manifest_problem
    cfg = _cfg()
    assert manifest_problem(_good(cfg), cfg, 2) is None
    bad = value if field is None else _with(_good(cfg), field, value)
    problem = manifest_problem(bad, cfg, 2)
    assert problem is not None and text in problem, problem


def _stock_manifest():
    from ssdsgd.checkpoint import fingerprint
    cfg = _cfg(SSGD, "cluster.servers=2")
    m = _with(_good(cfg), "plan", {"kind": "stock", "servers": 2, "keys": [3, 0, 7]})
    m["fingerprint"] = fingerprint(cfg)
    m["files"] = {"worker0.npz": HEX, "worker1.npz": HEX, "server-stock0.npz": HEX, "server-stock1.npz": HEX}
    return cfg, m


def test_stock_plan_needs_every_server_file():
    from ssdsgd.checkpoint import manifest_problem
    cfg, m = _stock_manifest()
    assert manifest_problem(m, cfg, 2) is None
    del m["files"]["server-stock1.npz"]
    assert "server-stock1.npz missing" in manifest_problem(m, cfg, 2)


@pytest.mark.parametrize("keys", [_DELETE, [], [1, 1], [-1], [1 << 20], [True], "0,1", [1.0]])
def test_stock_plan_needs_its_parameter_keys(keys):
    """The servers saved their optimizer state by key: a stock plan without distinct valid keys (such as
    one written before the keys were recorded) is refused, not resumed on guessed keys."""
    from ssdsgd.checkpoint import manifest_problem
    cfg, m = _stock_manifest()
    m = _with(m, "plan.keys", keys)
    assert manifest_problem(m, cfg, 2).startswith("plan: keys: expected a list of distinct parameter keys")


def test_format_1_manifests_are_refused():
    """Format 1 (before the manifest recorded its plan and config) is no longer read (issue 37)."""
    from ssdsgd.checkpoint import manifest_problem
    cfg = _cfg()
    m = _good(cfg)
    for k in ("plan", "config"):
        del m[k]
    m["format"] = 1
    assert manifest_problem(m, cfg, 2) == "unknown checkpoint format 1 (this version reads 2)"


def test_mismatched_config_names_the_keys_that_differ(tmp_path):
    from ssdsgd.checkpoint import CheckpointError, verify
    cfg = _cfg()
    folder = tmp_path / "epoch-0002"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(_good(cfg)))
    with pytest.raises(CheckpointError, match=r"different configuration .*train\.lr \(0\.1 in the checkpoint, "
                                               r"0\.2 now\)"):
        verify(str(folder), _cfg(SSD_TOPK, "train.lr=0.2"))


def test_check_against_run():
    from ssdsgd.checkpoint import CheckpointError, check_against_run
    m = {"epochs_done": 2, "step": 44}
    check_against_run(m, "d", 22, {"step": 44})
    check_against_run(dict(m, step=30), "d", 22, None)          # train.max_steps ended epoch 2 early
    with pytest.raises(CheckpointError, match="step 45 is not within epoch 2 of this run"):
        check_against_run(dict(m, step=45), "d", 22, None)
    with pytest.raises(CheckpointError, match="worker's file step 40"):
        check_against_run(m, "d", 22, {"step": 40})


# ---- real jobs: every bad manifest is refused by the front end, nothing starts ---------------------------


def test_prune_keeps_the_newest_complete_checkpoints_and_deletes_only_older_epoch_folders(tmp_path):
    import json

    from ssdsgd.checkpoint import MANIFEST
    from ssdsgd.checkpoint_dir import prune_checkpoints as prune

    def make(e, step=None):
        (tmp_path / f"epoch-{e:04d}").mkdir()
        if step is not None:
            (tmp_path / f"epoch-{e:04d}" / MANIFEST).write_text(json.dumps({"step": step}))

    for e, complete in [(1, True), (2, False), (3, True), (4, True), (5, False)]:
        make(e, 10 * e if complete else None)                    # 10 steps an epoch
    (tmp_path / "notes").mkdir()                                 # not a checkpoint: never touched
    assert prune(str(tmp_path), 0, 10) == [] and prune(str(tmp_path), 3, 10) == []
    removed = prune(str(tmp_path), 2, 10)
    assert [os.path.basename(r) for r in removed] == ["epoch-0001", "epoch-0002"]
    # The two newest complete ones stay, and so does the newer incomplete one (a save under way).
    assert sorted(os.listdir(tmp_path)) == ["epoch-0003", "epoch-0004", "epoch-0005", "notes"]
    assert [os.path.basename(r) for r in prune(str(tmp_path), 1, 10)] == ["epoch-0003"]
    # A mid-epoch stop's checkpoint (step 53 of epoch 6) does not push out the last whole one: its
    # resume saves epoch 6 again, replacing it, and epoch 4 is what stays if that save fails.
    make(6, 53)
    assert prune(str(tmp_path), 1, 10) == [] and os.path.isdir(tmp_path / "epoch-0004")
    make(7, 70)
    assert [os.path.basename(r) for r in prune(str(tmp_path), 1, 10)] == ["epoch-0004", "epoch-0005", "epoch-0006"]
