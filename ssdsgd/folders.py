"""One job per folder: exclusive locks on the run folder and on checkpoint.dir, taken before any
process of the job starts, and the checks of checkpoint.dir that go with them.

The lock is an flock(2) on `<folder>/.ssdsgd.lock`, held by the front end (`python -m ssdsgd.run`)
for the whole job; the file records who holds it (PID, host, start time, command), so a second job
on the same folder is refused at once (exit 2) with the holder named. flock is released by the
kernel when the holder dies, so a crashed or SIGKILLed front end never leaves a stale lock.

Under another launcher (launch.py or MXNet's) rank 0 takes the same locks itself when it starts,
unless SSDSGD_FOLDERS_LOCKED says the front end holds them (it is set for every role it starts).

Standard library only: the front end must not import mxnet.
"""
import fcntl
import json
import os
import shutil
import socket
import time

LOCK_FILE = ".ssdsgd.lock"
PRIVATE_UMASK = 0o077          # run and checkpoint folders: 0700 folders, 0600 files


class FolderError(RuntimeError):
    """A folder cannot be used by this job; the front end exits with status 2."""


def make_private():
    """Files and folders this process (and its children) creates are the user's alone."""
    os.umask(PRIVATE_UMASK)


def _holder(path):
    try:
        with open(path) as f:
            info = json.load(f)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"PID {info['pid']} on host {info['host']}, started {when} ({info.get('what', 'a job')})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def lock(folder, what, label):
    """Create `folder` (private) if needed and take its lock; returns the open lock file, which must
    stay open as long as the job runs. FolderError naming the holder if another job has it."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as err:
        raise FolderError(f"{label}: cannot create {folder}: {err.strerror}") from None
    if not os.path.isdir(folder):
        raise FolderError(f"{label}: {folder} is not a folder")
    path = os.path.join(folder, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise FolderError(f"{label}: cannot create the lock file {path}: {err.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderError(f"{label}: {folder} is in use by another job: {_holder(path)} "
                          f"(lock file {path}); wait for it to end or choose another folder") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "what": what}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return os.fdopen(fd, "r+")


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def checkpoint_folders(root):
    """Names of the epoch-* folders under root (complete or not), sorted."""
    if not root or not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("epoch-") and os.path.isdir(os.path.join(root, d)))


def remove_leftovers(root, log=print):
    """Temporary files of interrupted saves, and epoch folders without a manifest (saves that never
    completed; never used for a resume), under checkpoint.dir. Only while holding its lock."""
    from ssdsgd.checkpoint import MANIFEST
    removed = []
    for d in checkpoint_folders(root):
        folder = os.path.join(root, d)
        if not os.path.exists(os.path.join(folder, MANIFEST)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(d + "/")
            continue
        for name in os.listdir(folder):
            if ".tmp" in name:
                os.remove(os.path.join(folder, name))
                removed.append(f"{d}/{name}")
    if removed:
        log(f"checkpoint.dir {root}: removed what interrupted saves left: {', '.join(removed)}")
    return removed


def prepare(cfg, resume, overwrite, what, log=print):
    """Lock the run folder and checkpoint.dir, and check checkpoint.dir for this start.

    A fresh run (no --resume) into a checkpoint.dir that already holds checkpoints is refused unless
    overwrite, which removes them first. Returns the open lock files (keep them open). On refusal
    nothing is left behind: folders this call created are removed again."""
    from ssdsgd.metrics import run_dir
    if resume and overwrite:
        raise FolderError("--resume and --overwrite contradict each other: --resume continues the "
                          "checkpoints in checkpoint.dir, --overwrite deletes them")
    root = cfg.checkpoint.dir
    if root and os.path.exists(root) and not os.path.isdir(root):
        raise FolderError(f"checkpoint.dir: {root} is a file, not a folder")
    wanted = [(run_dir(cfg), "run folder (log.dir/name)")]
    if root and not _same(root, run_dir(cfg)):
        wanted.append((root, "checkpoint.dir"))
    held, created = [], []
    try:
        for folder, label in wanted:
            if not os.path.exists(folder):
                created.append(folder)
            held.append(lock(folder, what, label))
        if root:
            _check_checkpoints(root, resume, overwrite, log)
    except BaseException:
        release(held)
        for folder in reversed(created):
            _remove_if_only_lock(folder)
        raise
    return held


def _check_checkpoints(root, resume, overwrite, log):
    remove_leftovers(root, log)
    existing = checkpoint_folders(root)
    if existing and not resume:
        if not overwrite:
            raise FolderError(
                f"checkpoint.dir {root} already holds checkpoints ({', '.join(existing)}) of an earlier run; "
                f"use --resume to continue that run, or --overwrite to delete them and start afresh")
        for d in existing:
            shutil.rmtree(os.path.join(root, d))
        log(f"--overwrite: removed the old checkpoints in {root} ({', '.join(existing)})")


def _remove_if_only_lock(folder):
    try:
        if os.listdir(folder) in ([], [LOCK_FILE]):
            shutil.rmtree(folder)
    except OSError:
        pass


def release(held):
    for f in held:
        try:
            f.close()
        except OSError:
            pass
