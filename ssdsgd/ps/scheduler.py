"""The scheduler role, run from MXNet's C library without MXNet's Python package.

ps-lite's scheduler is C++ code inside libmxnet; the scheduler never touches an NDArray, an operator
or a command. `import mxnet` would spend about 3.5 s of CPU generating the Python functions of some
2,500 operators (and importing SciPy and scikit-learn) that it never calls; loading the library
alone takes about 0.3 s. On a 2-core machine that start-up is a noticeable part of a short job.

The calls are the ones `import mxnet` makes for a scheduler (mxnet/kvstore/kvstore_server.py):
MXKVStoreCreate("dist") then MXKVStoreRunServer, which returns when the job's workers finish.
"""
import ctypes
import importlib.util
import os

from ssdsgd.lean_mxnet import package_folder

# MXKVStoreServerController(int head, const char *body, void *handle): the scheduler gets no commands.
CONTROLLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def mxnet_library_path():
    """The libmxnet.so that `import mxnet` would load (MXNet's own lookup in mxnet/libinfo.py, which
    also honours MXNET_LIBRARY_PATH), found without importing the mxnet package."""
    folder = package_folder("mxnet")
    if folder is None:
        raise RuntimeError("the mxnet package is not installed in this interpreter")
    info_spec = importlib.util.spec_from_file_location("_mxnet_libinfo", os.path.join(folder, "libinfo.py"))
    libinfo = importlib.util.module_from_spec(info_spec)
    info_spec.loader.exec_module(libinfo)
    return libinfo.find_lib_path()[0]


def _check(lib, status, call):
    if status != 0:
        lib.MXGetLastError.restype = ctypes.c_char_p
        raise RuntimeError(f"{call} failed: {lib.MXGetLastError().decode(errors='replace')}")


def run_scheduler():
    """Serve as the job's ps-lite scheduler (DMLC_ROLE=scheduler) until the workers finish."""
    lib = ctypes.CDLL(mxnet_library_path(), ctypes.RTLD_LOCAL)
    handle = ctypes.c_void_p()
    _check(lib, lib.MXKVStoreCreate(ctypes.c_char_p(b"dist"), ctypes.byref(handle)), "MXKVStoreCreate")
    controller = CONTROLLER(lambda head, body, _: None)
    _check(lib, lib.MXKVStoreRunServer(handle, controller, None), "MXKVStoreRunServer")
