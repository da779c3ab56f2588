"""Shape rules of the package: layers without upward imports, short functions, each fact in one home."""
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
    for rel, names in (("ssdsgd/launch/remote.py", [env.HOST_INTERFACE_ENV, env.WRAPPER_ENV, env.JOB_DIR_ENV,
                                                   env.MARK]),
                       ("ssdsgd/launch/pyhooks/sitecustomize.py", [env.ROLE_NAME_ENV, env.ROLE_ENV, env.LIVENESS_ENV,
                                                            env.WRAPPER_ENV])):
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        for name in names:
            assert f"'{name}'" in text or f'"{name}"' in text, (rel, name)


def test_liveness_interval_is_the_hooks():
    from ssdsgd.launch import launcher
    with open(os.path.join(ROOT, "ssdsgd/launch/pyhooks/sitecustomize.py")) as f:
        assert f"LIVENESS_INTERVAL = {launcher.LIVENESS_INTERVAL!r}" in f.read()


# The package's layers, lowest first: a module imports only from its own layer or lower ones, so each
# layer can be read (and tested) knowing only what lies below it. A package is one layer.
LAYERS = [
    {"env", "errors"},                                          # names and errors shared by everything
    {"faults", "schedule", "metrics", "compression"},           # leaf helpers
    {"config"},
    {"checkpoint"},
    {"folders"},                                                # run folders: what a run leaves behind
    {"ps"},                                                     # the parameter-server side
    {"algorithms"},                                             # the worker's clients of the servers
    {"worker"},                                                 # the training loop, data, models
    {"train"},                                                  # the role entry point
    {"launch", "__main__"},                                     # the launcher and the ssdsgd-run front end
]


def _layer_of(module):
    """The layer of `ssdsgd.<part>[...]` or None for anything outside the package."""
    parts = module.split(".")
    if parts[0] != "ssdsgd" or len(parts) < 2:
        return None
    for n, names in enumerate(LAYERS):
        if parts[1] in names:
            return n
    raise AssertionError(f"{module}: not in any layer of test_code_shape.LAYERS")


def _imports(path, package):
    """Every ssdsgd module the file imports, at the top or inside a function (`from ssdsgd.x import y`
    may name a module y: counted as ssdsgd.x.y)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = node.module if node.level == 0 else package
            yield from (f"{module}.{alias.name}" for alias in node.names)


def test_no_module_of_the_package_imports_from_a_higher_layer():
    upward = []
    for folder, _, files in os.walk(os.path.join(ROOT, "ssdsgd")):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            own = _layer_of(module) if module != "ssdsgd" else -1
            for target in _imports(path, module.rpartition(".")[0]):
                layer = _layer_of(target)
                if layer is not None and layer > own:
                    upward.append(f"{module} imports {target}")
    assert not upward, "upward imports: " + "; ".join(upward)


def test_the_layer_test_sees_an_upward_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from ssdsgd.launch.launcher import run_job\n")
    assert [_layer_of(t) for t in _imports(str(path), "ssdsgd.config")] == [9]
