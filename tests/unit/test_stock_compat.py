"""MXNet's stock launcher command lines (issue 38): ours gives what MXNet's own launcher
(mxnet/tools/launch.py, dmlc_tracker, shipped in the wheel) gives for them, locally and over ssh on the
virtual cluster: the exit code, each role's environment and working directory, and the files the roles
write. Where stock is cheap to run (no MXNet in the roles) it runs side by side here; the MXNet cases and
their 10-of-10 repetitions under both launchers are scripts/stock_compat.py (results/stock_compat/;
MXNet's own nightly test files with --mxnet-tests: results/stock_compat_nightly*/).

Deliberate differences, asserted as such: a role that fails fails the job (stock exits 0 unless the
scheduler fails: its local tracker waits for the scheduler only), and the scheduler runs the command as
the other roles do (stock's scheduler skips the ./script rule, so `runme.sh` fails there with "command
not found" while the rest runs).
"""
import os

from support.jobs import ROOT
from jobs import test_cluster

SCRIPTS = os.path.join(ROOT, "tests", "stock_scripts")


def test_how_command_lines_run():
    """The argv each role executes: as given when no shell is needed, else bash as stock runs it."""
    from ssdsgd.launch.command_line import role_argv
    py = "/venv/bin/python"
    assert role_argv(["python", "x.py", "a b"], py, "/") == [py, "x.py", "a b"]
    assert role_argv(["FOO=inline", "python", "x.py"], py, "/") == ["bash", "-c", "FOO=inline python x.py"]
    assert role_argv(["FOO=1 python x.py > out"], py, "/") == ["bash", "-c", "FOO=1 python x.py > out"]
    assert role_argv(["python", "x.py", ">", "log", "a b"], py, "/") == ["bash", "-c", f"{py} x.py > log 'a b'"]
    assert role_argv(["python", "-c", "import os; print(1)"], py, "/") == [py, "-c", "import os; print(1)"]
    assert role_argv(["runme.sh", "--x"], py, SCRIPTS) == ["./runme.sh", "--x"]
    assert role_argv(["nosuch.sh"], py, SCRIPTS) == ["nosuch.sh"]


# --- over ssh, on the virtual cluster (test_cluster's: h0 launches, the host files name h1-h3) ----------------

cluster, vc = test_cluster.cluster, test_cluster.vc   # the virtual cluster; vc checks every host is left empty
