"""How a folder of results was made: the command, the commit of this checkout (and whether it had
uncommitted changes), the machine and the date. Every run folder (ssdsgd.worker.start) and every
results folder of the scripts (scripts/results_io.write_manifest) records them, so that a figure can
be traced to what made it and made again."""
import os
import platform
import subprocess
import time
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the checkout holding this package


def git(*args):
    """git's output in this checkout ('' when it printed nothing), or None when git could not say (no
    git, or the package is installed outside a checkout)."""
    # --no-optional-locks: `status` must not rewrite the index (under the job's umask 077 that would
    # make a shared checkout's index private) nor hold its lock while the user commits.
    try:
        proc = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit():
    """The commit checked out in this package's own checkout, or None: not in one, or installed into
    some other repository's tree (a venv in a project, say), for which git would answer instead."""
    top_and_head = (git("rev-parse", "--show-toplevel", "HEAD") or "").splitlines()
    if len(top_and_head) != 2 or os.path.realpath(top_and_head[0]) != os.path.realpath(ROOT):
        return None
    return top_and_head[1]


def status_command(out=None):
    """git's arguments for the tracked changes in the checkout, the folder `out` left out: making a
    committed results folder again changes its own files, which are not what produced them."""
    rel = os.path.relpath(os.path.abspath(out), ROOT) if out else ".."
    return ["status", "--porcelain", "--untracked-files=no", "--", ".",
            *([f":(exclude){rel}"] if not rel.startswith("..") else [])]


def machine():
    """What the figures of a folder depend on: host, CPU model, cores, memory, Python, MXNet, OS."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            mem_kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
    except (OSError, ValueError, StopIteration):
        mem_kb = None
    try:
        mxnet = version("mxnet")
    except Exception:
        mxnet = None
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(mem_kb / 2**20, 1) if mem_kb else None,
            "python": platform.python_version(), "mxnet": mxnet, "os": platform.platform()}


def record(command, out=None, **extra):
    """{command, cwd, commit, uncommitted_changes, machine, date, extra keys}; `out`: the folder the
    record goes into, left out of the uncommitted changes."""
    head = commit()
    status = git(*status_command(out)) if head else None
    return {"command": list(command), "cwd": os.getcwd(), "commit": head,
            "uncommitted_changes": bool(status) if status is not None else None,
            "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
