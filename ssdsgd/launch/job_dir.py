"""The launcher's job folder: heartbeat and liveness files, and who made it.

A launcher that is SIGKILLed runs no cleanup and leaves its folder; the next launcher on the same host
removes the folders whose owner process is gone.
"""
import os
import shutil
import socket
import tempfile

JOB_DIR_PREFIX = 'ssdsgd-launch-'    # the launcher's job folder (heartbeat and liveness files)
OWNER_FILE = 'launcher'              # in it: host, PID and start time of the launcher that made it


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


def remove_stale_job_dirs(parent, prefix):
    """Remove the job folders that launchers on this host left when they were SIGKILLed (no cleanup
    ran): those whose owner process is gone. A folder without an owner file, or made on another host
    (ssh job folders live on a shared file system), is left alone. Returns the removed paths."""
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                host, pid, started = f.read().split()
        except (OSError, ValueError):
            continue
        if host == socket.gethostname() and start_time(int(pid)) != started:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_job_dir(shared):
    """A new job folder (a TemporaryDirectory), after removing stale ones. `shared`: in the working
    directory, which every host of an ssh job shares (their workers write heartbeats there), hidden;
    otherwise in the temporary directory. Raises OSError."""
    prefix, parent = ('.' + JOB_DIR_PREFIX, os.getcwd()) if shared else (JOB_DIR_PREFIX, None)
    remove_stale_job_dirs(parent or tempfile.gettempdir(), prefix)
    job_dir = tempfile.TemporaryDirectory(prefix=prefix, dir=parent)
    _write_owner(job_dir.name)
    return job_dir
