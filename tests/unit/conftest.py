"""The unit tests run in the test's own process: one that starts a Python process (a job, the launcher, a tool
run as a command) fails here, naming the command; it belongs in tests/jobs/. Other programs (git) may run."""
import os
import subprocess
import sys

import pytest


def starts_python(args):
    """True if a Popen argv (or command string) runs a Python interpreter."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not argv:
        return False
    first = os.fsdecode(argv[0]).split()[0] if argv[0] else ""
    return first == sys.executable or os.path.basename(first).startswith("python")


@pytest.fixture(autouse=True)
def _no_python_process(monkeypatch):
    popen_init = subprocess.Popen.__init__

    def init(self, args, *more, **kwargs):
        if starts_python(args):
            raise AssertionError(f"a unit test started a Python process ({args!r}): it belongs in tests/jobs/")
        popen_init(self, args, *more, **kwargs)
    monkeypatch.setattr(subprocess.Popen, "__init__", init)
