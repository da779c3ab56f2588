"""The launcher's job folder: heartbeat and liveness files, and who made it.

A launcher that is SIGKILLed runs no cleanup and leaves its folder; the next launcher on the same host
removes the folders whose owner process is gone.
"""
import os
import shutil
import socket
import sys
import tempfile
import time

JOB_DIR_PREFIX = 'ssdsgd-launch-'    # the launcher's job folder (heartbeat and liveness files)
OWNER_FILE = 'launcher'              # in it: host, PID and start time of the launcher that made it
REMOVE_ATTEMPTS = 5                  # removals of the job folder before giving up with a warning


def start_time(pid):
    """The kernel's start time of process pid (clock ticks since boot), or None if there is none."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _write_owner(job_path):
    with open(os.path.join(job_path, OWNER_FILE), 'w') as f:
        f.write(f'{socket.gethostname()} {os.getpid()} {start_time(os.getpid())}\n')


def owner_ended(path):
    """True if the job folder `path` was made by a launcher on this host whose process has ended; False
    for a live owner, a folder without an owner file (or still being written) and one made on another
    host (ssh job folders live on a shared file system)."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            host, pid, started = f.read().split()
    except (OSError, ValueError):
        return False
    return host == socket.gethostname() and start_time(int(pid)) != started


def remove_stale_job_dirs(parent, prefix):
    """Remove the job folders that launchers on this host left when they were SIGKILLed (no cleanup
    ran): those whose owner process is gone (owner_ended). Returns the removed paths."""
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if owner_ended(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class JobDir:
    """The job folder as a context manager: its path; removed at the end (remove_job_dir)."""

    def __init__(self, path):
        self.name = path

    def __enter__(self):
        return self.name

    def __exit__(self, *exc_info):
        remove_job_dir(self.name)


def remove_job_dir(path, attempts=REMOVE_ATTEMPTS):
    """Remove the job folder; True if it is gone. A role the cleanup could not reach may still touch its
    heartbeat or liveness file in it (ssh jobs: the folder is on the shared file system), so that the
    removal fails (ENOTEMPTY): try again, then say so in one line."""
    for attempt in range(attempts):
        try:
            shutil.rmtree(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            error = e
            if attempt + 1 < attempts:
                time.sleep(0.1 * (attempt + 1))
    print(f'launch: cannot remove the job folder {path} ({error.strerror}): a role on a host the cleanup could '
          f'not reach may still write in it; such a role ends once the folder is gone, so remove it',
          file=sys.stderr, flush=True)
    return False


def job_dir_parent(shared):
    """Where the job folder goes: the working directory, which every host of an ssh job shares (`shared`:
    their workers write heartbeats there), or else the temporary directory."""
    return os.getcwd() if shared else tempfile.gettempdir()


def make_job_dir(shared):
    """A new job folder (a JobDir), after removing stale ones; in job_dir_parent(shared), hidden there if
    shared. Raises OSError."""
    prefix, parent = ('.' + JOB_DIR_PREFIX if shared else JOB_DIR_PREFIX), job_dir_parent(shared)
    remove_stale_job_dirs(parent, prefix)
    job_dir = JobDir(tempfile.mkdtemp(prefix=prefix, dir=parent))
    _write_owner(job_dir.name)
    return job_dir
