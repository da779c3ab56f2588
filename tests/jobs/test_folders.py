"""One job per folder: locks on the run folder and checkpoint.dir, no silent overwrite of checkpoints,
no temporary files left by failed saves, private folders."""
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from support.jobs import ROOT, processes_with, run_job, start_job, wait_for_progress

from ssdsgd import provenance
from ssdsgd.checkpoint_dir import checkpoint_folders
from unit.test_folders import _files

SSGD = "configs/demo_digits_ssgd.yaml"
SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


# ---- in-process: the lock itself ---------------------------------------------------------------------


def test_final_params_on_a_full_disk(small_disk):
    """The real thing: MXNet's save_parameters into a full tmpfs."""
    import mxnet as mx

    from ssdsgd.metrics import WriteError, write_atomic
    with open(os.path.join(small_disk, "filler"), "wb") as f:
        f.write(b"\0" * 1_000_000)
    net = mx.gluon.nn.Dense(1000, in_units=1000)           # 4 MB of weights
    net.initialize()
    path = os.path.join(small_disk, "final.params")
    with pytest.raises(WriteError, match=f"^cannot write {path}: No space left on device "
                                         f"\\(the file system of {small_disk}, .* free\\)$"):
        write_atomic(path, net.save_parameters)
    assert os.listdir(small_disk) == ["filler"]


# ---- real jobs ---------------------------------------------------------------------------------------
# A job that only has to hold its folders: worker 1 sleeps 0.2 s a step, and synchronous SGD makes
# worker 0 wait for it, so the holder leaves the cores to the job under test.
IDLE_HOLDER = {"SSDSGD_TEST_FAULT": "slow:1:0.2"}


@pytest.mark.timeout(240)
def test_second_job_gets_its_own_run_folder_and_a_held_checkpoint_dir_is_refused(tmp_path):
    """A second job of the same name runs in a run folder of its own (the first one's files untouched);
    one on the same checkpoint.dir fails at once naming the holder, having started nothing."""
    ck = os.path.join(str(tmp_path), "ck")
    proc, job = start_job(tmp_path, SSGD, "train.epochs=500", "log.every_steps=1", f"checkpoint.dir={ck}",
                          name="first", env=IDLE_HOLDER)
    try:
        wait_for_progress(job, proc, timeout=90)
        first_dir = os.path.realpath(job.run_dir)
        t0 = time.time()
        same_ck = run_job(tmp_path, SSGD, "train.epochs=1", f"checkpoint.dir={ck}", name="other", timeout=60)
        elapsed = time.time() - t0
        second = run_job(tmp_path, SSGD, "train.epochs=1", "train.max_steps=3", name="first", timeout=120)
        assert proc.poll() is None                      # the first job was not disturbed
    finally:
        _stop(proc)
    assert same_ck.rc == 2, same_ck.output
    assert f"checkpoint.dir: {ck} is in use by another job: PID {proc.pid} on host" in same_ck.output
    assert "python -m ssdsgd" in same_ck.output   # what the holder is
    assert "[worker" not in same_ck.output and "[scheduler" not in same_ck.output   # nothing was started
    assert elapsed < 30
    assert not os.path.exists(os.path.join(tmp_path, "runs", "other"))   # refused before creating it
    assert second.rc == 0, second.output
    assert os.path.dirname(second.run_dir) == os.path.dirname(first_dir) and second.run_dir != first_dir
    assert os.path.realpath(os.path.join(tmp_path, "runs", "first", "latest")) == second.run_dir
    # The run folder records how it was made, every --set included.
    with open(os.path.join(second.run_dir, "manifest.json")) as f:
        made = json.load(f)
    # The user's command, which can be run again as it stands; each role's beside it.
    assert made["command"][:3] == [sys.executable, "-m", "ssdsgd"] and "train.max_steps=3" in made["command"], made
    assert made["role_command"][1:3] == ["-m", "ssdsgd.train"] and "train.max_steps=3" in made["role_command"]
    assert made["config"] == "config.yaml" and made["resumed_from"] is None
    assert made["commit"] == provenance.git("rev-parse", "HEAD")
    assert made["machine"]["cores"] == os.cpu_count() and made["date"].startswith(time.strftime("%Y-"))
    # The first job's files stayed its own: every line of its metrics parses.
    with open(os.path.join(first_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert records and all(r["rank"] == 0 for r in records)
    assert not os.path.exists(os.path.join(first_dir, "summary.json"))
    assert processes_with(job.marker) == []


@pytest.mark.timeout(240)
def test_under_launch_py_rank_0_takes_the_locks(tmp_path):
    """A job started with launch.py (no ssdsgd.launch.run front end) on a checkpoint.dir a running job holds
    fails, with the holder named by rank 0, and leaves the holder's files alone."""
    ck = os.path.join(str(tmp_path), "ck")
    proc, job = start_job(tmp_path, SSGD, "train.epochs=500", "log.every_steps=1", f"checkpoint.dir={ck}",
                          name="held", env=IDLE_HOLDER)
    try:
        wait_for_progress(job, proc, timeout=90)
        cmd = [sys.executable, os.path.join(ROOT, "launch", "launch.py"), "-n", "2", "-s", "1", "--timeout", "120",
               sys.executable, "-m", "ssdsgd.train", "--config", os.path.join(ROOT, SSGD),
               "--set", f"log.dir={job.marker}", "--set", "name=held", "--set", "train.epochs=1",
               "--set", f"checkpoint.dir={ck}"]
        second = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180,
                                start_new_session=True)
        assert proc.poll() is None
    finally:
        _stop(proc)
    assert second.returncode == 1, second.stdout[-3000:]
    assert f"is in use by another job: PID {proc.pid}" in second.stdout, second.stdout[-3000:]
    assert "Traceback" not in second.stdout            # a one-line message, not a traceback
    for rank, name in ((0, "metrics.jsonl"), (1, "metrics.rank1.jsonl")):
        with open(os.path.join(job.run_dir, name)) as f:
            lines = [json.loads(line) for line in f]
        assert lines and all(r["rank"] == rank for r in lines)
    assert processes_with(job.marker) == []


def _assert_private(*tops):
    """Every folder 0700 and every file 0600 under tops (and tops themselves)."""
    seen = 0
    for top in tops:
        assert stat.S_IMODE(os.stat(top).st_mode) == 0o700, top
        for dirpath, dirnames, filenames in os.walk(top):
            for d in dirnames:
                assert stat.S_IMODE(os.stat(os.path.join(dirpath, d)).st_mode) == 0o700, d
            for name in filenames:
                mode = stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode)
                assert mode == 0o600, (os.path.join(dirpath, name), oct(mode))
                seen += 1
    return seen


@pytest.mark.timeout(300)
def test_fresh_run_into_a_checkpoint_folder_needs_resume_or_overwrite(tmp_path):
    """Also: run and checkpoint folders are private (0700/0600) even under a umask of 022."""
    ck = os.path.join(str(tmp_path), "ck")
    sets = ["train.epochs=2", f"checkpoint.dir={ck}", "checkpoint.every_epochs=1", "train.max_steps=22"]
    old_umask = os.umask(0o022)          # what a user's shell usually has: would give 0755/0644
    try:
        a = run_job(tmp_path, SSD_TOPK, *sets, name="A")
    finally:
        os.umask(old_umask)
    assert a.rc == 0, a.output
    # config, metrics (2), worker parts (2), summary, final.params, locks (2), checkpoint files
    assert _assert_private(a.run_dir, ck) >= 12
    assert stat.S_IMODE(os.stat(os.path.join(tmp_path, "runs")).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(tmp_path, "runs", "A")).st_mode) == 0o700
    # --dry-run says what these starts would refuse, and changes nothing.
    fresh = run_job(tmp_path, SSD_TOPK, *sets, name="B", args=["--dry-run"])
    assert fresh.rc == 2 and f"\n# error: a run would stop here: checkpoint.dir {ck} already holds checkpoints " \
                             f"(epoch-0001)" in fresh.output, fresh.output[-2000:]
    changed = run_job(tmp_path, SSD_TOPK, *sets, "train.lr=0.2", name="A", args=["--resume", "--dry-run"])
    assert changed.rc == 2 and "refusing to resume" in changed.output and "train.lr" in changed.output, \
        changed.output[-2000:]
    same = run_job(tmp_path, SSD_TOPK, *sets, name="A", args=["--resume", "--dry-run"])
    assert same.rc == 0 and "# error" not in same.output, same.output[-2000:]
    assert sorted(os.listdir(os.path.join(tmp_path, "runs"))) == ["A"] and checkpoint_folders(ck) == ["epoch-0001"]
    # What a killed earlier run might have left: a file the new run does not write.
    stale = os.path.join(ck, "epoch-0001", "server-buffer9.npz")
    with open(stale, "wb") as f:
        f.write(b"old")
    again = run_job(tmp_path, SSD_TOPK, *sets, name="B")
    assert again.rc == 2, again.output
    assert f"checkpoint.dir {ck} already holds checkpoints (epoch-0001)" in again.output
    assert "--resume" in again.output and "--overwrite" in again.output
    assert os.path.exists(stale)                        # nothing was touched
    both = run_job(tmp_path, SSD_TOPK, *sets, name="B", args=["--resume", "--overwrite"])
    assert both.rc == 2 and "contradict" in both.output
    over = run_job(tmp_path, SSD_TOPK, *sets, name="B", args=["--overwrite"])
    assert over.rc == 0, over.output
    assert "--overwrite: removed the old checkpoints" in over.output
    assert not os.path.exists(stale)
    with open(os.path.join(ck, "epoch-0001", "manifest.json")) as f:
        files = json.load(f)["files"]
    assert "server-buffer9.npz" not in files and "worker0.npz" in files
    assert processes_with(over.marker) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 1.4 MB tmpfs: room for one digits checkpoint (~1 MB), not two. Needs root (mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400k,mode=0700", "tmpfs", str(disk)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stdout.strip()}")
    try:
        yield str(disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def _tmp_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp" in f]


@pytest.mark.timeout(300)
def test_checkpoint_save_on_a_full_disk(tmp_path, small_disk):
    """The epoch-2 save fills the disk: the job fails naming it, the epoch-1 checkpoint stays intact, and
    the next start removes what the failed save left, so the disk is not kept full."""
    ck = os.path.join(small_disk, "ck")
    sets = ["train.epochs=3", "algorithm.strict=true", f"checkpoint.dir={ck}"]
    job = run_job(tmp_path, SSD_TOPK, *sets, "checkpoint.every_epochs=1", name="full")
    assert job.rc == 1, job.output[-3000:]
    assert "No space left on device" in job.output
    assert os.path.exists(os.path.join(ck, "epoch-0001", "manifest.json"))
    assert not os.path.exists(os.path.join(ck, "epoch-0002", "manifest.json"))
    assert processes_with(job.marker) == []
    # Continue from epoch 1 without saving again (every_epochs is not part of the fingerprint).
    again = run_job(tmp_path, SSD_TOPK, *sets, "checkpoint.every_epochs=0", "train.max_steps=30", name="full",
                    args=["--resume"])
    assert again.rc == 0, again.output[-3000:]
    assert "resuming from" in again.output and "epoch-0001" in again.output
    assert "removed what interrupted saves left: epoch-0002/" in again.output
    assert _tmp_files(ck) == [] and sorted(os.listdir(ck)) == [".ssdsgd.lock", "epoch-0001"]
    free = os.statvfs(small_disk)
    assert free.f_bavail * free.f_frsize > 300_000


@pytest.mark.timeout(120)
def test_full_disk_before_the_job_starts_is_one_line(tmp_path, small_disk):
    filler = os.path.join(small_disk, "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC
    job = run_job(tmp_path, SSGD, "train.epochs=1", f"log.dir={small_disk}/runs", timeout=60)
    assert job.rc == 2, job.output
    assert "No space left on device" in job.output and job.output.startswith("error: "), job.output
    assert "Traceback" not in job.output and "[worker" not in job.output
    assert len(job.output.strip().splitlines()) == 1


def _fill(disk, leave_pages=0):
    """Fill the tmpfs `disk` to the last byte, then free `leave_pages` pages of 4 KiB."""
    filler = os.path.join(disk, "filler")
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    if leave_pages:
        os.truncate(filler, os.path.getsize(filler) - 4096 * leave_pages)


FULL = "No space left on device \\(the file system of {}, [0-9.]+ [KM]?B free\\)"


@pytest.mark.timeout(120)
def test_a_log_dir_with_room_for_the_locks_only_is_one_line_and_leaves_nothing(tmp_path, small_disk):
    """Room for the run folder's lock and run id, none for launcher.log: one line naming launcher.log and the
    free space, exit 2, no traceback, and the half-made run folder and its `latest` link are gone."""
    import re
    _fill(small_disk, leave_pages=2)
    runs = os.path.join(small_disk, "runs")
    job = run_job(tmp_path, SSGD, "train.epochs=1", f"log.dir={runs}", name="j", timeout=60)
    assert job.rc == 2, job.output
    lines = job.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in job.output, job.output
    assert re.fullmatch(f"error: cannot write {runs}/j/[0-9-]+/launcher.log: "
                        + FULL.format(f"{runs}/j/[0-9-]+"), lines[0]), lines[0]
    assert os.listdir(os.path.join(runs, "j")) == []
    assert processes_with(job.marker) == []


def test_a_metrics_line_that_does_not_fit_leaves_the_file_as_it_was(small_disk):
    """The whole line or nothing: a full disk is a WriteError naming the file and the free space, and the
    lines before it stay as they were, without a cut-off line after them (the page holds part of it)."""
    from ssdsgd.metrics import MetricsLog, WriteError
    log = MetricsLog(small_disk, 0)
    log.write(step=1, loss=0.5)
    before = open(log.path).read()
    _fill(small_disk)
    with pytest.raises(WriteError, match=f"^cannot write {log.path}: {FULL.format(small_disk)}$"):
        log.write(step=2, note="x" * 8000)
    log.close()
    assert open(log.path).read() == before


def test_a_config_that_does_not_fit_leaves_no_file(small_disk):
    """config.yaml (or a resume's config.resume-step<N>.yaml) is written whole or not at all."""
    from ssdsgd.config import dump_config, load_config
    from ssdsgd.metrics import WriteError
    cfg = load_config(os.path.join(ROOT, SSGD))
    _fill(small_disk)
    path = os.path.join(small_disk, "config.resume-step22.yaml")
    with pytest.raises(WriteError, match=f"^cannot write {path}: {FULL.format(small_disk)}$"):
        dump_config(cfg, path)
    assert os.listdir(small_disk) == ["filler"]


def test_launcher_log_keeps_whole_lines_on_a_full_disk(small_disk, capsys):
    """ssdsgd-run's copy of its messages in launcher.log: a line that does not fit is left out whole (the
    terminal still gets it), said once; the lines before it stay."""
    import sys as _sys

    from ssdsgd.launch.launcher_log import messages_also_in, open_launcher_log
    log = open_launcher_log(small_disk, ["ssdsgd-run", "--config", "x.yaml"])
    with messages_also_in(log):
        print("first line", file=_sys.stderr)
        _fill(small_disk)
        print("y" * 8000, file=_sys.stderr)
        print("last line", file=_sys.stderr)
    err = capsys.readouterr().err
    assert "first line" in err and "y" * 8000 in err and "last line" in err
    assert err.count("cannot write") == 1 and f"cannot write {small_disk}/launcher.log: No space" in err
    text = open(os.path.join(small_disk, "launcher.log")).read()
    assert text.endswith("first line\n") and text.startswith("20") and text.count("\n") == 2


def test_a_resume_may_change_what_the_config_leaves_idle_and_nothing_else(tmp_path):
    """An SSGD run's algorithm.delay and compression.density change no step: a resume may change them
    (and is told they do nothing); a change of train.lr is still refused."""
    ck = os.path.join(str(tmp_path), "ck")
    sets = ["train.epochs=2", f"checkpoint.dir={ck}", "checkpoint.every_epochs=1"]
    first = run_job(tmp_path, SSGD, *sets, "train.max_steps=22", name="s")
    assert first.rc == 0 and checkpoint_folders(ck) == ["epoch-0001"], first.output[-2000:]
    lr = run_job(tmp_path, SSGD, *sets, "train.lr=0.2", name="s", args=["--resume"])
    assert lr.rc == 2 and "refusing to resume" in lr.output and "train.lr (" in lr.output, lr.output[-2000:]
    # A key the plan's checks would also fail on is named, not the file it lacks (worker2.npz missing).
    more = run_job(tmp_path, SSGD, *sets, "cluster.workers=3", name="s", args=["--resume"])
    assert more.rc == 2 and "cluster.workers (2 in the checkpoint, 3 now)" in more.output, more.output[-2000:]
    idle = run_job(tmp_path, SSGD, *sets, "algorithm.delay=3", "compression.density=0.2", name="s", args=["--resume"])
    assert idle.rc == 0, idle.output[-2000:]
    assert "resuming from" in idle.output and "note: algorithm.delay = 3 has no effect" in idle.output
    assert idle.summary()["steps"] == 44 and processes_with(idle.marker) == []


def test_a_resume_of_compressed_ssgd_may_change_its_idle_local_optimizer(tmp_path):
    """SSGD on the round server never takes a local step: a resume from a checkpoint made with
    algorithm.local.optimizer sgd (no local state) to glu (one state a weight) reads no local state."""
    ck = os.path.join(str(tmp_path), "ck")
    sets = ["algorithm.type=ssgd", "train.epochs=2", f"checkpoint.dir={ck}", "checkpoint.every_epochs=1"]
    first = run_job(tmp_path, SSD_TOPK, *sets, "train.max_steps=22", "algorithm.local.optimizer=sgd", name="c")
    assert first.rc == 0 and checkpoint_folders(ck) == ["epoch-0001"], first.output[-2000:]
    glu = run_job(tmp_path, SSD_TOPK, *sets, "algorithm.local.optimizer=glu", name="c", args=["--resume"])
    assert glu.rc == 0, glu.output[-2000:]
    assert "note: algorithm.local.optimizer = 'glu' has no effect" in glu.output
    assert glu.summary()["steps"] == 44 and processes_with(glu.marker) == []


# ---- a resume writes only into the folder of the run its checkpoint belongs to ------------------------


@pytest.mark.timeout(240)
def test_a_copy_of_a_checkpoint_dir_resumed_elsewhere_leaves_the_original_run_alone(tmp_path):
    """The report's reproduction with real jobs: stop at step 44, copy checkpoint.dir, take the original to
    step 55, resume the copy with another log.dir: the copy's run gets its own folder there, and the
    original's step-55 metrics, config.resume-step44.yaml and summary stay as they were."""
    import shutil
    ck, ck2 = str(tmp_path / "ck"), str(tmp_path / "ck2")
    sets = ["checkpoint.every_epochs=1", "log.every_steps=1", "log.tensorboard=false"]
    a = run_job(tmp_path, SSGD, *sets, f"checkpoint.dir={ck}", "train.max_steps=44", name="r")
    assert a.rc == 0, a.output[-3000:]
    shutil.copytree(ck, ck2)
    b = run_job(tmp_path, SSGD, *sets, f"checkpoint.dir={ck}", "train.max_steps=55", name="r", args=["--resume"])
    assert b.rc == 0 and b.run_dir == a.run_dir, b.output[-3000:]
    with open(os.path.join(ck, "epoch-0003", "manifest.json")) as f:       # each checkpoint names its run
        assert json.load(f)["run_id"] == json.load(open(os.path.join(a.run_dir, "run-id.json")))["run_id"]
    before = _files(a.run_dir)
    assert b.summary()["steps"] == 55 and any(r["step"] == 55 for r in b.metrics())
    log2 = str(tmp_path / "runs2")
    c = run_job(tmp_path, SSGD, *sets, f"checkpoint.dir={ck2}", "train.max_steps=66", f"log.dir={log2}",
                name="r", args=["--resume"])
    assert c.rc == 0, c.output[-3000:]
    assert os.path.dirname(c.run_dir) == os.path.join(log2, "r"), c.output[-3000:]
    assert _files(a.run_dir) == before
    assert c.summary()["steps"] == 66 and processes_with(c.marker) == []
