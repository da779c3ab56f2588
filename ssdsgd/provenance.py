"""How a folder of results was made: the command, the commit of this checkout (and whether it had
uncommitted changes), the machine and the date. Every run folder (ssdsgd.worker.start) and every
results folder of the scripts (scripts/results_io.write_manifest) records them, so that a figure can
be traced to what made it and made again."""
import os
import platform
import subprocess
import time

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


def in_checkout():
    """Is this package's folder the top of a git checkout? (Installed into some other repository's
    tree, a venv in a project say, git would answer for that repository.)"""
    top = git("rev-parse", "--show-toplevel")
    return bool(top) and os.path.realpath(top) == os.path.realpath(ROOT)


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
        from importlib.metadata import version
        mxnet = version("mxnet")
    except Exception:
        mxnet = None
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(mem_kb / 2**20, 1) if mem_kb else None,
            "python": platform.python_version(), "mxnet": mxnet, "os": platform.platform()}


def record(command, out=None, **extra):
    """{command, cwd, commit, uncommitted_changes, machine, date, extra keys}; `out`: the folder the
    record goes into, left out of the uncommitted changes."""
    ours = in_checkout()
    status = git(*status_command(out)) if ours else None
    commit = (git("rev-parse", "HEAD") or None) if ours else None
    return {"command": list(command), "cwd": os.getcwd(), "commit": commit,
            "uncommitted_changes": bool(status) if status is not None else None,
            "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
