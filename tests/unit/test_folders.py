"""One job per folder: locks on the run folder and checkpoint.dir, no silent overwrite of checkpoints,
no temporary files left by failed saves, private folders."""
import errno
import json
import os
import stat
import time

import numpy as np
import pytest
from support.jobs import ROOT

from ssdsgd import provenance

SSGD = "configs/demo_digits_ssgd.yaml"


# ---- in-process: the lock itself ---------------------------------------------------------------------

def test_lock_names_its_holder_and_is_released(tmp_path):
    from ssdsgd.folders import FolderError, lock
    folder = str(tmp_path / "run")
    held = lock(folder, "job one", "run folder")
    # flock belongs to the open file: a second open, even in this process, is a second job.
    with pytest.raises(FolderError) as info:
        lock(folder, "job two", "run folder")
    msg = str(info.value)
    assert f"{folder} is in use by another job" in msg
    assert f"PID {os.getpid()}" in msg and "job one" in msg and "started 20" in msg
    held.close()
    lock(folder, "job two", "run folder").close()      # released: free again
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(folder, ".ssdsgd.lock")).st_mode) == 0o600


def test_a_refused_start_leaves_the_previous_runs_latest_link(tmp_path, monkeypatch):
    """A full disk refuses the rerun's lock file: `latest` still names the earlier run and the half-made
    folder is gone. `latest` moves only once the new folder exists and is locked."""
    from types import SimpleNamespace

    from ssdsgd.folders import FolderError, prepare, release
    cfg = SimpleNamespace(name="job", log=SimpleNamespace(dir=str(tmp_path)), checkpoint=SimpleNamespace(dir=None))
    home = tmp_path / "job"
    held, first = prepare(cfg, False, False, "first run")
    release(held)
    assert os.readlink(home / "latest") == os.path.basename(first)

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(FolderError, match="cannot write the lock file .*No space left on device"):
        prepare(cfg, False, False, "rerun")
    assert os.readlink(home / "latest") == os.path.basename(first)
    assert sorted(os.listdir(home)) == sorted([os.path.basename(first), "latest"])
    monkeypatch.undo()
    held, second = prepare(cfg, False, False, "second run")           # the next start that can write moves it
    release(held)
    assert second != first and os.readlink(home / "latest") == os.path.basename(second)


def test_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk while saving is one line naming the file (WriteError, a JobError: no traceback), and
    the half-written temporary file is gone."""
    from ssdsgd import checkpoint, metrics
    from ssdsgd.errors import JobError

    def full_disk(path, **arrays):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "savez", full_disk)
    full = f"No space left on device \\(the file system of {tmp_path}, .* free\\)$"
    with pytest.raises(JobError, match=f"^cannot write {tmp_path}/worker0.npz: {full}"):
        checkpoint.save_npz(str(tmp_path / "worker0.npz"), {"a": np.zeros(3)})

    def full_dump(obj, f, **kw):
        f.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(json, "dump", full_dump)
    with pytest.raises(JobError, match=f"^cannot write {tmp_path}/manifest.json: {full}"):
        metrics.write_json_atomic(str(tmp_path / "manifest.json"), {"a": 1})
    assert os.listdir(tmp_path) == []


def test_final_params_write_that_fails_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    """MXNet's own writer (save_parameters) says only 'FileStream.Write incomplete': the free space
    tells a full disk from another failure."""
    import mxnet as mx

    from ssdsgd import metrics
    path = str(tmp_path / "final.params")

    def cut_off(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise mx.base.MXNetError("Traceback (most recent call last):\n  File \"local_filesys.cc\", line 38\n"
                                 "MXNetError: Check failed: std: :fwrite(ptr, 1, size, fp_) == size: "
                                 "FileStream.Write incomplete")
    with pytest.raises(metrics.WriteError) as info:
        metrics.write_atomic(path, cut_off)
    assert str(info.value) == (f"cannot write {path}: Check failed: std: :fwrite(ptr, 1, size, fp_) == size: "
                               f"FileStream.Write incomplete")
    monkeypatch.setattr(metrics, "_free_bytes", lambda path: 4096)
    with pytest.raises(metrics.WriteError) as info:
        metrics.write_atomic(path, cut_off)
    full = f"No space left on device (the file system of {tmp_path}, 4.0 KB free)"
    assert str(info.value) == f"cannot write {path}: {full}"
    assert os.listdir(tmp_path) == []
    with pytest.raises(KeyError):           # not a failed write: raised as it is
        metrics.write_atomic(path, lambda tmp: {}["bug"])


def test_a_server_whose_checkpoint_file_cannot_be_written_says_it_in_one_line(monkeypatch, capsys):
    from ssdsgd.metrics import WriteError
    from ssdsgd.ps import server

    def exit_(code):
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(SystemExit):
        try:
            raise WriteError("cannot write /ck/epoch-0002/server-buffer0.npz: No space left on device")
        except WriteError:
            server._die("command 'save' failed")
    assert capsys.readouterr().err == ("ssdsgd server: command 'save' failed: cannot write "
                                       "/ck/epoch-0002/server-buffer0.npz: No space left on device\n")


def test_leftovers_of_interrupted_saves_are_removed_at_start(tmp_path):
    from ssdsgd.checkpoint_dir import remove_leftovers
    root = tmp_path / "ck"
    done, partial = root / "epoch-0001", root / "epoch-0002"
    done.mkdir(parents=True)
    partial.mkdir()
    (done / "manifest.json").write_text("{}")
    (done / "worker0.npz").write_bytes(b"x")
    (done / "worker1.npz.tmp123.npz").write_bytes(b"x" * 100)
    (partial / "worker0.npz").write_bytes(b"x")
    lines = []
    removed = remove_leftovers(str(root), lines.append)
    assert sorted(removed) == ["epoch-0001/worker1.npz.tmp123.npz", "epoch-0002/"]
    assert sorted(os.listdir(root)) == ["epoch-0001"]
    assert sorted(os.listdir(done)) == ["manifest.json", "worker0.npz"]
    assert "removed what interrupted saves left" in lines[0]


def test_a_second_record_of_the_same_resume_gets_a_name_of_its_own(tmp_path):
    from ssdsgd.folders import unused_name as _unused_name
    assert _unused_name(str(tmp_path), "manifest.resume-step30", ".json") == "manifest.resume-step30.json"
    (tmp_path / "manifest.resume-step30.json").write_text("{}")
    assert _unused_name(str(tmp_path), "manifest.resume-step30", ".json") == "manifest.resume-step30.2.json"
    (tmp_path / "manifest.resume-step30.2.json").write_text("{}")
    assert _unused_name(str(tmp_path), "manifest.resume-step30", ".json") == "manifest.resume-step30.3.json"


def test_provenance_answers_for_this_checkout_only():
    assert provenance.commit() == provenance.git("rev-parse", "HEAD")     # the tests run from a clone
    made = provenance.record(["x"])
    assert made["commit"] == provenance.git("rev-parse", "HEAD") and made["command"] == ["x"]


def test_dry_run_counts_the_checkpoints_a_start_keeps(tmp_path):
    """An unfinished save (an epoch folder without its manifest) is removed when a run starts, so it does
    not refuse a fresh start in --dry-run either."""
    from ssdsgd.config import load_config
    from ssdsgd.folders import start_problem
    ck = tmp_path / "ck"
    (ck / "epoch-0001").mkdir(parents=True)
    cfg = load_config(os.path.join(ROOT, SSGD), [f"checkpoint.dir={ck}", "checkpoint.every_epochs=1"])
    assert start_problem(cfg, resume=False, overwrite=False) is None
    (ck / "epoch-0001" / "manifest.json").write_text("{}")
    assert "already holds checkpoints (epoch-0001)" in start_problem(cfg, resume=False, overwrite=False)


# ---- a resume writes only into the folder of the run its checkpoint belongs to ------------------------

def _prepare_cfg(tmp_path, log="runs", ck="ck"):
    from types import SimpleNamespace
    return SimpleNamespace(name="job", log=SimpleNamespace(dir=str(tmp_path / log)),
                           checkpoint=SimpleNamespace(dir=str(tmp_path / ck)))


def _checkpoint_of(monkeypatch, manifest):
    """resume_point answers with `manifest` (its files are not what these tests are about)."""
    import ssdsgd.checkpoint as ckpt
    monkeypatch.setattr(ckpt, "resume_point", lambda cfg: (os.path.join(cfg.checkpoint.dir, "epoch-0002"), manifest))


def _first_run(tmp_path):
    """A fresh run's folder (with its identity) and the manifest a checkpoint of it records."""
    from ssdsgd.folders import prepare, release
    from ssdsgd.run_id import run_identity
    held, first = prepare(_prepare_cfg(tmp_path), False, False, "first run")
    release(held)
    (tmp_path / "runs" / "job" / os.path.basename(first) / "metrics.jsonl").write_text('{"step": 55}\n')
    return first, {"run_dir": os.path.abspath(first), "run_id": run_identity(first)["run_id"]}


def test_a_run_folder_records_its_run_id_and_its_checkpoint_dir(tmp_path):
    from ssdsgd.run_id import run_identity
    first, _ = _first_run(tmp_path)
    ident = run_identity(first)
    assert len(ident["run_id"]) == 32 and ident["checkpoint_dir"] == os.path.realpath(tmp_path / "ck")
    assert run_identity(_first_run(tmp_path)[0])["run_id"] != ident["run_id"]      # one id a run


def test_a_resume_goes_on_in_its_own_runs_folder(tmp_path, monkeypatch):
    from ssdsgd.folders import prepare, release
    first, manifest = _first_run(tmp_path)
    _checkpoint_of(monkeypatch, manifest)
    held, run_dir = prepare(_prepare_cfg(tmp_path), True, False, "resume")
    release(held)
    assert run_dir == manifest["run_dir"]


@pytest.mark.parametrize("log", ["runs", "runs2"])
def test_a_copied_checkpoint_resumes_into_a_new_run_folder_under_the_given_log_dir(tmp_path, monkeypatch, log):
    """The report's case: a copy of checkpoint.dir resumed (with another log.dir, or the same) must not
    write into the original run's folder, which has gone on from the same checkpoint."""
    from ssdsgd.folders import prepare, release
    from ssdsgd.run_id import run_identity
    first, manifest = _first_run(tmp_path)
    before = _files(first)
    _checkpoint_of(monkeypatch, manifest)
    said = []
    held, run_dir = prepare(_prepare_cfg(tmp_path, log=log, ck="ck2"), True, False, "resume of a copy", said.append)
    release(held)
    assert os.path.dirname(run_dir) == str(tmp_path / log / "job") and run_dir != first
    assert _files(first) == before                                 # the original run's folder is untouched
    assert run_identity(run_dir)["checkpoint_dir"] == os.path.realpath(tmp_path / "ck2")
    assert any(f"{tmp_path / 'ck2'} is not the checkpoint.dir of the run in {first}" in s for s in said), said


def _files(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name))}


@pytest.mark.parametrize("other", ["unrelated", "another run"])
def test_a_run_dir_that_is_not_the_runs_folder_is_refused(tmp_path, monkeypatch, other):
    """A manifest's run_dir edited to a folder that is not the run's (another run's, or any folder) is
    refused, naming it, by the start and by --dry-run; nothing is written anywhere."""
    from ssdsgd.folders import FolderError, prepare, start_problem
    first, manifest = _first_run(tmp_path)
    if other == "unrelated":
        target = tmp_path / "results"
        target.mkdir()
        (target / "keep.txt").write_text("mine")
        manifest["run_dir"] = str(target)
    else:
        manifest["run_dir"] = _first_run(tmp_path)[0]
    target = manifest["run_dir"]
    before = _files(target)
    runs_before = sorted(os.listdir(tmp_path / "runs" / "job"))
    _checkpoint_of(monkeypatch, manifest)
    cfg = _prepare_cfg(tmp_path)
    with pytest.raises(FolderError) as info:
        prepare(cfg, True, False, "resume")
    msg = str(info.value)
    assert f"records run_dir {target}, which is not the folder of the run that wrote the checkpoint" in msg, msg
    assert "\n" not in msg
    assert start_problem(cfg, True, False) == msg                  # --dry-run says the same
    assert _files(target) == before
    assert sorted(os.listdir(tmp_path / "runs" / "job")) == runs_before


def test_a_checkpoint_without_a_run_id_resumes_into_a_new_run_folder(tmp_path, monkeypatch):
    """Checkpoints written before run ids: their run_dir cannot be proved to be their run's, so the resume
    writes a new run folder (nothing of the old one is replaced)."""
    from ssdsgd.folders import prepare, release
    first, manifest = _first_run(tmp_path)
    os.remove(os.path.join(first, "run-id.json"))          # an old run folder, too
    del manifest["run_id"]
    before = _files(first)
    _checkpoint_of(monkeypatch, manifest)
    said = []
    held, run_dir = prepare(_prepare_cfg(tmp_path), True, False, "resume", said.append)
    release(held)
    assert run_dir != first and _files(first) == before
    assert any("records no run id" in s for s in said), said


def test_a_resume_of_a_finished_run_changes_no_file(tmp_path, monkeypatch):
    """'nothing to resume, no file changed': not the lock files (the checkpoint.dir's was rewritten with the
    refused start's PID), nor what an interrupted save left in checkpoint.dir."""
    from types import SimpleNamespace

    from ssdsgd.folders import RunFinished, prepare
    first, manifest = _first_run(tmp_path)
    (tmp_path / "runs" / "job" / os.path.basename(first) / "summary.json").write_text(
        json.dumps({"steps": 44, "steps_per_epoch": 22}))
    ck = tmp_path / "ck"
    (ck / "epoch-0003").mkdir(parents=True)                        # a save that never completed
    (ck / ".ssdsgd.lock").write_text('{"pid": 1, "host": "h", "started": 0, "what": "the finished run"}')
    _checkpoint_of(monkeypatch, manifest)
    cfg = _prepare_cfg(tmp_path)
    cfg.train = SimpleNamespace(epochs=2, max_steps=None)

    def state():
        return {p: (open(p, "rb").read() if os.path.isfile(p) else None, os.stat(p, follow_symlinks=False).st_mtime_ns)
                for top in (ck, tmp_path / "runs") for p in map(str, [top, *top.rglob("*")])}
    before = state()
    time.sleep(0.01)
    with pytest.raises(RunFinished, match="no file changed"):
        prepare(cfg, True, False, "resume of a finished run")
    assert state() == before
