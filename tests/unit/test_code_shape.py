"""Shape rules of the package: layers without upward imports, short functions, each fact in one home."""
import ast
import os
import subprocess
import sys

import pytest
from support.jobs import ROOT

from ssdsgd import env

MAX_FUNCTION_LINES = 60     # in ssdsgd/, scripts/, bench/ and testbed/
MAX_MODULE_LINES = 400      # in ssdsgd/


def _functions(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def _python_files(folder):
    for here, _, files in os.walk(folder):
        yield from (os.path.join(here, name) for name in sorted(files) if name.endswith(".py"))


def _long_functions(folder, limit):
    """`path:line name (n lines)` of every function in folder's .py files (and below) over `limit` lines."""
    return [f"{os.path.relpath(path, ROOT)}:{line} {fn} ({n} lines)"
            for path in _python_files(folder) for fn, line, n in _functions(path) if n > limit]


def test_no_function_in_the_package_or_the_tools_is_longer_than_60_lines():
    long = [f for folder in ("ssdsgd", "scripts", "bench", "testbed")
            for f in _long_functions(os.path.join(ROOT, folder), MAX_FUNCTION_LINES)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(long)


def test_the_length_test_sees_a_long_function(tmp_path):
    """61 lines (the def and 60 statements) is one too many; 60 pass."""
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "long.py").write_text("def long():\n" + body + "\n\ndef short():\n" + body[:-len("    x59 = 59\n")])
    found = _long_functions(str(tmp_path), MAX_FUNCTION_LINES)
    assert len(found) == 1 and found[0].endswith(":1 long (61 lines)"), found


def test_no_module_of_the_package_is_longer_than_400_lines():
    long = []
    for path in _python_files(os.path.join(ROOT, "ssdsgd")):
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_MODULE_LINES:
            long.append(f"{os.path.relpath(path, ROOT)} ({n} lines)")
    assert not long, f"modules over {MAX_MODULE_LINES} lines: " + "; ".join(long)


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
    """The launcher's liveness interval and minimum server timeout are the hook's and the config's."""
    from ssdsgd import schema
    from ssdsgd.launch import usage
    with open(os.path.join(ROOT, "ssdsgd/launch/pyhooks/sitecustomize.py")) as f:
        assert f"LIVENESS_INTERVAL = {usage.LIVENESS_INTERVAL!r}" in f.read()
    assert usage.MIN_SERVER_TIMEOUT == schema.MIN_SERVER_TIMEOUT


# The package's layers, lowest first: a module imports only from its own layer or lower ones, so each
# layer can be read (and tested) knowing only what lies below it. A package is one layer.
LAYERS = [
    {"env", "errors"},                                          # names and errors shared by everything
    {"faults", "schedule", "metrics", "compression", "provenance", "run_id", "paths",   # leaf helpers,
     "registry",                                                # the algorithms by name,
     "lean_mxnet"},                                             # importing MXNet
    {"schema"},                                                 # the config's keys and their checks
    {"config_yaml"},                                            # reading YAML with limits
    {"idle"},                                                   # which keys the rest of a config leaves idle
    {"config_compression"},                                     # the compression section's checks and density
    {"config"},
    {"cli"},                                                    # the options a job's commands share
    {"fingerprint"},                                            # which keys a resume may change
    {"checkpoint"},
    {"folders", "checkpoint_dir"},                              # run folders: what a run leaves behind
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
    assert [_layer_of(t) for t in _imports(str(path), "ssdsgd.config")] == [len(LAYERS) - 1]



# What only ssdsgd/worker/devices.py may do: place arrays on devices and read a parameter through them.
DEVICE_WORDS = ("mx.gpu(", "mx.cpu(", "list_ctx", "list_grad", "list_data", "split_and_load", "as_in_context")


def test_the_algorithms_and_the_compressor_know_nothing_of_devices():
    """They work on the host arrays the worker's DeviceReplicas hands them (the jobs on CPU replicas in
    tests/test_devices.py show it at run time; this keeps the code from starting to name devices)."""
    found = []
    for folder in ("algorithms", "compression"):
        for path in _python_files(os.path.join(ROOT, "ssdsgd", folder)):
            with open(path) as f:
                text = f.read()
            found += [f"{os.path.relpath(path, ROOT)}: {w}" for w in DEVICE_WORDS if w in text]
    assert not found, found


# The folders around the package, each importing only the ones after it here (and ssdsgd): the tests use
# everything; the benchmarks use the tools' results helpers (scripts/results_io.py) and the test bed; the
# tools use the test bed; the test bed (namespaces, virtual cluster, a job's processes) imports none of them.
FOLDERS = ["tests", "bench", "scripts", "testbed"]


def _folder_imports(folder, root=ROOT):
    """`path imports module` for every import in folder's .py files of a top-level folder it may not import."""
    allowed = set(FOLDERS[FOLDERS.index(folder):])
    found = []
    for path in _python_files(os.path.join(root, folder)):
        rel = os.path.relpath(path, root)
        for target in _imports(path, "."):
            top = target.split(".")[0]
            if top in FOLDERS and top not in allowed:
                found.append(f"{rel} imports {target}")
    return found


def test_tests_bench_scripts_and_testbed_import_one_way():
    wrong = [f for folder in FOLDERS for f in _folder_imports(folder)]
    package = [f"{os.path.relpath(path, ROOT)} imports {target}"
               for path in _python_files(os.path.join(ROOT, "ssdsgd")) for target in _imports(path, "ssdsgd")
               if target.split(".")[0] in FOLDERS]
    assert not wrong and not package, "imports against FOLDERS' order: " + "; ".join(wrong + package)


def test_the_folder_test_sees_an_import_against_the_order(tmp_path):
    (tmp_path / "testbed").mkdir()
    (tmp_path / "testbed" / "x.py").write_text("import os\nfrom scripts.results_io import write_csv\n")
    assert _folder_imports("testbed", str(tmp_path)) == ["testbed/x.py imports scripts.results_io.write_csv"]


def test_a_unit_test_starts_no_python_process():
    """tests/unit/conftest.py: the unit tests stay in-process (a job or a tool run as a command is a test of
    tests/jobs/); other programs may run."""
    with pytest.raises(AssertionError, match="belongs in tests/jobs/"):
        subprocess.run([sys.executable, "-c", "pass"])
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
