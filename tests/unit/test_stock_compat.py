"""How our launcher turns a stock MXNet command line into each role's argv (the jobs that run those command
lines beside MXNet's own launcher: tests/jobs/test_stock_compat.py)."""
import os

from support.jobs import ROOT

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
