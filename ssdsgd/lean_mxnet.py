"""`import mxnet` without the packages it imports for APIs no role of ours calls.

MXNet 1.9.1 imports SciPy, scikit-learn and (through them) pandas at import time, each inside
`try: ... except ImportError`: mxnet.model for the legacy FeedForward estimator, mxnet.test_utils for
its own test helpers, mxnet.ndarray.sparse and .utils to accept SciPy sparse matrices, mxnet.contrib
for quantization statistics: a large part of the CPU `import mxnet` takes, which every server and
worker of every job pays (docs/design.md, "The code, folder by folder"). With those packages hidden
during the import, MXNet takes its fallbacks (no SciPy-matrix input, which we never give it); they are
importable again right after, for whoever needs them (scripts and tests that use scikit-learn).
numba does the same with SciPy when it first compiles or loads a kernel (compression/kernels.py). And where
a process needs only a package's files (the scheduler MXNet's library, the front end gluoncv's model names, a
digits worker scikit-learn's digits file), package_folder finds them without importing the package.
"""
import importlib.util
import sys
from contextlib import contextmanager

NOT_FOR_MXNET = ("sklearn", "scipy", "pandas")


@contextmanager
def hidden(names):
    """Within the block, `import name` raises ImportError for each of `names` not imported yet; after it,
    they are importable again."""
    missing = [name for name in names if name not in sys.modules]
    for name in missing:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in missing:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


def package_folder(name):
    """The folder of the installed package `name`, found without importing it; None if it is not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def import_mxnet():
    """The mxnet module, imported now with NOT_FOR_MXNET hidden unless it already was imported (then as is)."""
    if "mxnet" in sys.modules:
        return sys.modules["mxnet"]
    with hidden(NOT_FOR_MXNET):
        import mxnet
    return mxnet
