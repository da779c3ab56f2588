"""Shape rules of the package: short functions, and each fact in one home."""
import ast
import os

from jobs import ROOT
from ssdsgd import env

MAX_FUNCTION_LINES = 80


def _functions(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "ssdsgd")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                long += [f"{os.path.relpath(path, ROOT)}:{line} {fn} ({n} lines)"
                         for fn, line, n in _functions(path) if n > MAX_FUNCTION_LINES]
    assert not long, "functions over 80 lines: " + "; ".join(long)


def test_standalone_files_spell_the_environment_names_of_ssdsgd_env():
    """remote.py (shipped as source to ssh hosts) and pyhooks/sitecustomize.py import nothing of
    ssdsgd, so they spell these names themselves: they must be env.py's."""
    for rel, names in (("ssdsgd/remote.py", [env.HOST_INTERFACE_ENV, env.WRAPPER_ENV, env.JOB_DIR_ENV]),
                       ("ssdsgd/pyhooks/sitecustomize.py", [env.ROLE_NAME_ENV, env.ROLE_ENV, env.LIVENESS_ENV,
                                                            env.WRAPPER_ENV])):
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        for name in names:
            assert f"'{name}'" in text or f'"{name}"' in text, (rel, name)


def test_liveness_interval_is_the_hooks():
    from ssdsgd import launcher
    with open(os.path.join(ROOT, "ssdsgd/pyhooks/sitecustomize.py")) as f:
        assert f"LIVENESS_INTERVAL = {launcher.LIVENESS_INTERVAL!r}" in f.read()
