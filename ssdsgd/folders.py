"""One job per folder: exclusive locks on the run folder and on checkpoint.dir, taken before any
process of the job starts, and the checks of checkpoint.dir that go with them.

The lock is an flock(2) on `<folder>/.ssdsgd.lock`, held by the front end (`python -m ssdsgd`)
for the whole job; the file records who holds it (PID, host, start time, command), so a second job
on the same folder is refused at once (exit 2) with the holder named. flock is released by the
kernel when the holder dies, so a crashed or SIGKILLed front end never leaves a stale lock.

Under another launcher (launch.py or MXNet's) rank 0 takes the same locks itself when it starts,
unless SSDSGD_FOLDERS_LOCKED says the front end holds them (it is set for every role it starts).

No MXNet at import: the front end uses this module.
"""
import fcntl
import json
import os
import shutil
import socket
import time

from ssdsgd import checkpoint as ckpt
from ssdsgd.checkpoint_dir import _is_leftover, checkpoint_folders, remove_leftovers
from ssdsgd.errors import CheckpointError, JobError
from ssdsgd.metrics import FINAL_PARAMS_FILE, SUMMARY_FILE, read_summary, write_json_atomic
from ssdsgd.paths import folder_problem
from ssdsgd.run_id import RUN_ID_FILE, run_identity, write_run_identity

LOCK_FILE = ".ssdsgd.lock"
PRIVATE_UMASK = 0o077          # run and checkpoint folders: 0700 folders, 0600 files


class FolderError(JobError):
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


def _make_folder(folder, label):
    """Create `folder` (private) if needed; FolderError naming `label` (the key or role) if it cannot be."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as err:
        raise FolderError(_cannot_create(folder, label, err.strerror)) from None


def _cannot_create(folder, label, strerror=None):
    """The line for a folder that cannot be made (FolderError's, and --dry-run's): what the path is, where
    that says more than the errno (a link loop is 'File exists')."""
    return f"{label}: cannot create {folder}: {folder_problem(folder) or strerror}"


def lock(folder, what, label, record=True):
    """Create `folder` (private) if needed and take its lock; returns the open lock file, which must
    stay open as long as the job runs. FolderError naming the holder if another job has it. record: write
    who holds it now (else record_holder does, once the start is sure: a refused one changes no file)."""
    _make_folder(folder, label)
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
    held = os.fdopen(fd, "r+")
    if record:
        record_holder(held, folder, what, label)
    return held


def record_holder(held, folder, what, label):
    """Write this process into the lock file `held` of `folder` (lock's), so a second job can name it."""
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "what": what}
    try:
        os.ftruncate(held.fileno(), 0)
        os.pwrite(held.fileno(), json.dumps(info).encode(), 0)
    except OSError as err:                  # a full disk, a quota: said before any process starts
        held.close()
        raise FolderError(f"{label}: cannot write the lock file {os.path.join(folder, LOCK_FILE)}: "
                          f"{err.strerror}") from None


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


class RunFinished(FolderError):
    """--resume (or a restart) of a run that has nothing left to train: the front end says so and exits
    0, changing no file."""


LATEST = "latest"              # log.dir/<name>/latest: a link to the newest run folder of that name


def run_home(cfg):
    """log.dir/<name>: the folder that holds every run of this name, one sub-folder each."""
    return os.path.join(cfg.log.dir, cfg.name)


def new_run_folder(cfg):
    """A new, empty run folder log.dir/<name>/<YYYYmmdd-HHMMSS>[-n]; prepare points `latest` at it once
    it holds its lock, so a start refused before that (a full disk) leaves the old link as it was.

    A run never writes into another run's folder: two runs that differ only by seed (or a rerun that
    fails at start) each get their own, so nothing of an earlier run is replaced."""
    home = run_home(cfg)
    _make_folder(home, "log.dir")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        folder = os.path.join(home, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(folder, 0o700)       # exclusive: two runs started in the same second differ by -n
            break
        except FileExistsError:
            continue
        except OSError as err:
            raise FolderError(f"log.dir: cannot create the run folder {folder}: {err.strerror}") from None
    else:
        raise FolderError(f"log.dir: {home} has 999 runs started at {stamp}")
    return folder


def point_latest(run_dir):
    """Make the `latest` link beside run_dir point at it, replacing the old link in one rename (the old
    one stays as it was if this fails). FolderError if it cannot be made."""
    home, name = os.path.split(os.path.normpath(run_dir))
    tmp = os.path.join(home, f".{LATEST}.tmp{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(name, tmp)
        os.replace(tmp, os.path.join(home, LATEST))
    except OSError as err:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise FolderError(f"log.dir: cannot make the link {home}/{LATEST}: {err.strerror}") from None


def latest_run_folder(cfg):
    """The run folder log.dir/<name>/latest points at, or None."""
    link = os.path.join(run_home(cfg), LATEST)
    return os.path.realpath(link) if os.path.isdir(link) else None


def resume_run_folder(cfg, manifest):
    """(the folder a resume from the checkpoint `manifest` goes on writing in, or None for a new one; why
    a new one, or None). The recorded run_dir is used only when it holds the run that wrote the checkpoint
    (the same run id) and the checkpoint is in that run's own checkpoint.dir: a copy of checkpoint.dir
    resumed elsewhere is another run from there on, and gets its own folder. FolderError when run_dir is
    an existing folder of another run, or of none."""
    folder, run_id = manifest.get("run_dir"), manifest.get("run_id")
    if not isinstance(folder, str) or not os.path.isdir(folder):
        return None, "the run folder of the checkpoint's run is gone"
    if run_id is None:
        return None, (f"the checkpoint records no run id (written before run ids), so {folder} cannot be "
                      f"proved to be its run's folder")
    ident = run_identity(folder)
    if ident is None or ident["run_id"] != run_id:
        whose = f"it holds run {ident['run_id']}" if ident else f"it has no {RUN_ID_FILE}"
        raise FolderError(f"--resume: the checkpoint in {cfg.checkpoint.dir} records run_dir {folder}, which is "
                          f"not the folder of the run that wrote the checkpoint (run {run_id}; {whose}); "
                          f"refusing to write into it: correct run_dir in the checkpoint's manifest.json, or "
                          f"remove it to resume into a new run folder")
    if not (ident.get("checkpoint_dir") and _same(ident["checkpoint_dir"], cfg.checkpoint.dir)):
        return None, (f"checkpoint.dir {cfg.checkpoint.dir} is not the checkpoint.dir of the run in {folder} "
                      f"({ident.get('checkpoint_dir')}; a copy?), so that run's folder is left as it is")
    return folder, None


def planned_steps(cfg, steps_per_epoch):
    steps = cfg.train.epochs * steps_per_epoch
    return steps if cfg.train.max_steps is None else min(steps, cfg.train.max_steps)


def _read_summary(run_dir):
    """The run folder's summary.json: None if there is none, {} if it cannot be read as an object."""
    try:
        summary = read_summary(run_dir)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def finished_message(run_dir, cfg):
    """Why a resume of the run in run_dir has nothing left to do (its summary.json records every step
    this config trains), or None. A summary that cannot be read counts as finished: refuse rather
    than risk replacing a result."""
    summary = _read_summary(run_dir)
    if summary is None:
        return None
    steps, per_epoch = summary.get("steps"), summary.get("steps_per_epoch")
    if not all(isinstance(v, int) and v > 0 for v in (steps, per_epoch)):
        return f"run folder {run_dir} holds a finished run (summary.json); nothing to resume, no file changed"
    if steps >= planned_steps(cfg, per_epoch):
        return (f"run folder {run_dir} holds a finished run: its summary.json records all {steps} steps this "
                f"config trains; nothing to resume, no file changed")
    return None


def keep_stopped_result(run_dir, log=print):
    """A run stopped early (train.max_steps) that a resume takes further keeps its summary and final
    weights so far under names that say where it stopped (summary.step<N>.json, final.step<N>.params)."""
    summary = _read_summary(run_dir)
    if summary is None:
        return
    steps = summary["steps"]
    params = os.path.join(run_dir, FINAL_PARAMS_FILE)
    if os.path.exists(params):
        kept = os.path.join(run_dir, f"final.step{steps}.params")
        os.replace(params, kept)
        summary["checkpoint"] = kept
    write_json_atomic(os.path.join(run_dir, f"summary.step{steps}.json"), summary)
    os.remove(os.path.join(run_dir, SUMMARY_FILE))
    log(f"run folder {run_dir}: the run stopped at step {steps} goes on; its summary and weights so far are "
        f"kept as summary.step{steps}.json and final.step{steps}.params")


def prepare(cfg, resume, overwrite, what, log=print, start=None):
    """Lock checkpoint.dir and check it for this start, choose the run folder and lock it.

    Returns (the open lock files (keep them open), the run folder). A fresh run gets a new run folder
    (new_run_folder); a resume continues in the folder of the run it resumes (recorded in the
    checkpoint), or a new one if that folder is gone. A fresh run into a checkpoint.dir that already
    holds checkpoints is refused unless overwrite, which removes them first. RunFinished if a resume
    has nothing left to train, FolderError or CheckpointError if the job cannot start. start(run folder),
    if given, is the first write into the folder (ssdsgd-run's launcher.log), before `latest` moves to it.
    On refusal nothing is left behind: folders this call created are removed."""
    problem = _options_problem(cfg, resume, overwrite)
    if problem:
        raise FolderError(problem)
    root = cfg.checkpoint.dir
    held, created, run_dir = [], [], None
    try:
        if root:
            if not os.path.exists(root):
                created.append(root)
            held.append(lock(root, what, "checkpoint.dir", record=False))
        if resume:
            # CheckpointError if it cannot be resumed, FolderError if its run_dir is not its run's folder
            run_dir, why_new = resume_run_folder(cfg, ckpt.resume_point(cfg)[1])
            done = run_dir and finished_message(run_dir, cfg)
            if done:
                raise RunFinished(done)     # before any file changes: the lock file's holder, leftovers
            if why_new:
                log(f"--resume: {why_new}; the resumed run writes a new run folder")
        if root:
            record_holder(held[0], root, what, "checkpoint.dir")
            _check_checkpoints(root, resume, overwrite, log)
        if run_dir is None:
            run_dir = new_run_folder(cfg)
            created.append(run_dir)
        if not (root and _same(root, run_dir)):
            held.append(lock(run_dir, what, "run folder"))
        if resume:
            keep_stopped_result(run_dir, log)
        if run_dir in created:
            write_run_identity(run_dir, root)
        if start is not None:
            start(run_dir)
        if run_dir in created:
            point_latest(run_dir)       # last: only a run folder that exists and is locked becomes `latest`
    except BaseException:
        release(held)
        for folder in reversed(created):
            _remove_if_only_lock(folder)
        raise
    return held, run_dir


def _options_problem(cfg, resume, overwrite):
    if resume and overwrite:
        return ("--resume and --overwrite contradict each other: --resume continues the checkpoints in "
                "checkpoint.dir, --overwrite deletes them")
    root = cfg.checkpoint.dir
    if root and os.path.exists(root) and not os.path.isdir(root):
        return f"checkpoint.dir: {root} is a file, not a folder"
    return None


def _held_checkpoints_problem(root, existing):
    return (f"checkpoint.dir {root} already holds checkpoints ({', '.join(existing)}) of an earlier run; "
            f"use --resume to continue that run, or --overwrite to delete them and start afresh")


def _check_checkpoints(root, resume, overwrite, log):
    remove_leftovers(root, log)
    existing = checkpoint_folders(root)
    if existing and not resume:
        if not overwrite:
            raise FolderError(_held_checkpoints_problem(root, existing))
        for d in existing:
            shutil.rmtree(os.path.join(root, d))
        log(f"--overwrite: removed the old checkpoints in {root} ({', '.join(existing)})")


def _remove_if_only_lock(folder):
    try:
        if set(os.listdir(folder)) <= {LOCK_FILE, RUN_ID_FILE}:
            shutil.rmtree(folder)
    except OSError:
        pass


def release(held):
    for f in held:
        try:
            f.close()
        except OSError:
            pass


def unused_name(folder, stem, ext):
    """stem + ext, or stem.2 + ext, stem.3 + ext, ...: the first not in folder, so that a file of an
    earlier attempt (a resume's record, a job's log) is kept, not replaced."""
    n = 1
    while os.path.exists(os.path.join(folder, stem + (f".{n}" if n > 1 else "") + ext)):
        n += 1
    return stem + (f".{n}" if n > 1 else "") + ext


def start_problem(cfg, resume, overwrite):
    """What prepare() would refuse about checkpoint.dir and --resume, found without taking a lock or
    changing a file (for --dry-run): a message, or None. (A lock held by a running job is not checked.)"""
    problem = _options_problem(cfg, resume, overwrite)
    root = cfg.checkpoint.dir
    if not problem and root and folder_problem(root):
        problem = _cannot_create(root, "checkpoint.dir")
    if problem or not (root or resume):
        return problem or _run_home_problem(cfg)
    kept = [d for d in checkpoint_folders(root) if not _is_leftover(os.path.join(root, d))]   # as after the cleanup
    if kept and not resume and not overwrite:
        return _held_checkpoints_problem(root, kept)
    if resume:
        try:
            if resume_run_folder(cfg, ckpt.resume_point(cfg)[1])[0]:
                return None                 # goes on in the resumed run's folder: log.dir is not made
        except (CheckpointError, FolderError) as err:
            return str(err)
    return _run_home_problem(cfg)


def _run_home_problem(cfg):
    home = run_home(cfg)
    return _cannot_create(home, "log.dir") if folder_problem(home) else None
