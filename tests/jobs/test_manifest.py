"""Checkpoint manifests validated field by field, before any process starts; plans never re-made on resume."""
import json
import os
import re
import shutil

import numpy as np
import pytest
from support.jobs import processes_with, run_job

SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"


# ---- real jobs: every bad manifest is refused by the front end, nothing starts ---------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A finished 2-epoch SSD-SGD + top-k run (cost-model plan) with checkpoints at epochs 1 and 2."""
    tmp = tmp_path_factory.mktemp("ck")
    ck = os.path.join(str(tmp), "ck")
    a = run_job(tmp, SSD_TOPK, "train.epochs=4", "algorithm.strict=true", "checkpoint.every_epochs=1",
                f"checkpoint.dir={ck}", "train.max_steps=44", name="A")
    assert a.rc == 0, a.output
    return ck, a


def _resume_with(tmp_path, ck_src, edit, *sets):
    ck = os.path.join(str(tmp_path), "ck")
    shutil.copytree(ck_src, ck)
    path = os.path.join(ck, "epoch-0002", "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edited = edit(m)                              # a dict, or raw text
    with open(path, "w") as f:
        f.write(edited if isinstance(edited, str) else json.dumps(edited))
    return run_job(tmp_path, SSD_TOPK, "train.epochs=4", "algorithm.strict=true", "checkpoint.every_epochs=1",
                   f"checkpoint.dir={ck}", *sets, name="B", args=["--resume"], timeout=120)


EDITS = [
    ("not_an_object", lambda m: [m], "not a JSON object"),
    ("no_files", lambda m: {k: v for k, v in m.items() if k != "files"}, "has no 'files'"),
    ("absurd_epoch_and_step", lambda m: dict(m, epochs_done=999, step=-5), "epochs_done: 999 is more than"),
    ("server_file_omitted", lambda m: dict(m, files={k: v for k, v in m["files"].items()
                                                     if k != "server-buffer0.npz"}),
     "files: server-buffer0.npz missing"),
    ("plan_of_more_buffers", lambda m: dict(m, plan=dict(m["plan"], buffer_sizes=m["plan"]["buffer_sizes"] + [7])),
     "missing (the plan needs them)"),
    ("step_of_another_run", lambda m: dict(m, step=10**12), "step 1000000000000, but worker0.npz says step 44"),
    ("nested_too_deep", lambda m: "[" * 100000 + "]" * 100000, "cannot be read: nested too deep"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("label,edit,text", EDITS, ids=[e[0] for e in EDITS])
def test_bad_manifest_is_refused_before_anything_starts(tmp_path, checkpoint, label, edit, text):
    ck_src, _ = checkpoint
    job = _resume_with(tmp_path, ck_src, edit)
    assert job.rc == 2, job.output[-3000:]
    assert text in job.output and "epoch-0002/manifest.json" in job.output, job.output[-3000:]
    assert "Traceback" not in job.output
    assert "[worker" not in job.output and "[server" not in job.output   # refused before any process
    assert processes_with(job.marker) == []


@pytest.mark.timeout(300)
def test_more_servers_than_the_checkpoint_was_taken_with_is_refused(tmp_path, checkpoint):
    ck_src, _ = checkpoint
    job = _resume_with(tmp_path, ck_src, lambda m: m, "cluster.servers=2")
    assert job.rc == 2, job.output[-3000:]
    assert "cluster.servers (1 in the checkpoint, 2 now)); refusing to resume from it" in job.output   # the key first
    assert "[worker" not in job.output


@pytest.mark.timeout(300)
def test_plan_the_servers_cannot_serve_is_refused_before_anything_starts(tmp_path, checkpoint):
    """Same number of buffers, other sizes (a planner that changed, a hand-edited manifest): the front end
    makes the plan again from worker0.npz's parameter shapes and recorded costs and refuses."""
    ck_src, _ = checkpoint

    def edit(m):
        sizes = m["plan"]["buffer_sizes"]
        return dict(m, plan=dict(m["plan"], buffer_sizes=[sizes[0] + 1] + sizes[1:]))
    job = _resume_with(tmp_path, ck_src, edit)
    assert job.rc == 2, job.output[-3000:]
    assert "the manifest's buffer plan" in job.output and "cannot be served; resume refused" in job.output
    assert "[worker" not in job.output and "[server" not in job.output
    assert processes_with(job.marker) == []


@pytest.mark.timeout(300)
def test_server_file_of_another_plan_is_refused_before_anything_starts(tmp_path, checkpoint):
    """A server buffer file whose weights do not fit the plan (its hash made to match): the server would
    have died with `operands could not be broadcast`; the front end reads the array headers and refuses."""
    from ssdsgd.checkpoint import file_sha256, load_npz, save_npz
    ck_src, _ = checkpoint
    ck = os.path.join(str(tmp_path), "ck")
    shutil.copytree(ck_src, ck)
    folder = os.path.join(ck, "epoch-0002")
    path = os.path.join(folder, "server-buffer0.npz")
    arrays, meta = load_npz(path)
    arrays = {k: (np.concatenate([v, v[:3]]) if k in ("weights", "mom") else v) for k, v in arrays.items()}
    save_npz(path, arrays, meta)
    with open(os.path.join(folder, "manifest.json")) as f:
        m = json.load(f)
    m["files"]["server-buffer0.npz"] = file_sha256(path)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(m, f)
    job = run_job(tmp_path, SSD_TOPK, "train.epochs=4", "algorithm.strict=true", "checkpoint.every_epochs=1",
                  f"checkpoint.dir={ck}", name="B", args=["--resume"], timeout=120)
    assert job.rc == 2, job.output[-3000:]
    assert "server-buffer0.npz holds weights of shape" in job.output and "resume refused" in job.output
    assert "[worker" not in job.output
    assert processes_with(job.marker) == []


@pytest.mark.timeout(400)
def test_resumed_cost_model_run_keeps_its_plan_whatever_the_link_measures(tmp_path, checkpoint):
    """The resumed job measures other costs (SSDSGD_TEST_COST_SCALE makes a message look a million times
    cheaper, which plans one buffer per tensor) and still gets the checkpoint's plan, and finishes."""
    ck_src, a = checkpoint
    fresh = run_job(tmp_path, SSD_TOPK, "train.epochs=1", "train.max_steps=2", name="probe",
                    env={"SSDSGD_TEST_COST_SCALE": "alpha=1e-6"})
    assert fresh.rc == 0, fresh.output[-3000:]
    plan_line = re.compile(r"buffer plan \(cost_model\): (.*?) elements")
    assert plan_line.search(fresh.output).group(1) != plan_line.search(a.output).group(1)   # would differ
    ck = os.path.join(str(tmp_path), "ck")
    shutil.copytree(ck_src, ck)
    b = run_job(tmp_path, SSD_TOPK, "train.epochs=4", "algorithm.strict=true", "checkpoint.every_epochs=1",
                f"checkpoint.dir={ck}", name="B", args=["--resume"], env={"SSDSGD_TEST_COST_SCALE": "alpha=1e-6"})
    assert b.rc == 0, b.output[-3000:]
    assert plan_line.search(b.output).group(1) == plan_line.search(a.output).group(1)
    assert b.summary()["steps"] == 88
    with open(os.path.join(ck, "epoch-0004", "manifest.json")) as f:
        m4 = json.load(f)
    with open(os.path.join(ck_src, "epoch-0002", "manifest.json")) as f:
        m2 = json.load(f)
    assert m4["plan"] == m2["plan"]
    assert processes_with(b.marker) == []
