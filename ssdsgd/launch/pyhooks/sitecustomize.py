"""Loaded by every Python process of a launcher job (the launcher puts this folder first on PYTHONPATH).

An uncaught exception in a job's Python process prints its traceback and ends the process at once
with status 1 (os._exit). A normal exit would run MXNet's atexit finalize, where ps-lite waits for
every other worker forever, so a raising worker of any script, stock ones included, would hang the
job instead of failing it. The sitecustomize this file shadows, if any, is still imported.

Why PYTHONPATH, now that ssdsgd is an installed package: the install makes `import ssdsgd` work in every
role, but nothing imports this hook; Python runs a `sitecustomize` at start-up only if one is on sys.path
under that top-level name. Putting this folder (which holds nothing else) first on the job's PYTHONPATH
is what makes it run in exactly the job's processes, before any user code and also in stock
scripts that never import ssdsgd or in `/bin/sh -c` command lines. Installing it into site-packages
instead would make it run in every process of the interpreter and collide with a sitecustomize already
there.

Liveness: when the launcher names a file in SSDSGD_LIVENESS_FILE (it does for servers and the scheduler),
a daemon thread touches it every LIVENESS_INTERVAL seconds for as long as the process runs. The thread
needs nothing but the interpreter, so it keeps going while the main thread sits in MXNet's server loop
(ctypes releases the GIL), also for stock scripts whose server loop runs inside `import mxnet`; it stops
with the process, and also when the process is stopped (SIGSTOP) or its host is cut off, which is what
the launcher watches for (cluster.server_timeout). The variable is taken out of the environment, so only
this process, not the processes it starts, speaks for the role. ssdsgd/launch/remote.py, which wraps the role
on an ssh host, sets SSDSGD_REMOTE_WRAPPER and leaves the file to the role it starts.
"""
import os
import sys
import threading
import time

LIVENESS_INTERVAL = 1.0


def _exit_at_once(kind, value, tb):
    import traceback   # only when a role fails: this file runs at the start of every process of a job
    traceback.print_exception(kind, value, tb)
    name = os.environ.get('SSDSGD_ROLE_NAME', 'process')
    print(f'{name}: uncaught {kind.__name__}, exiting with status 1 without ps-lite finalize', file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if os.environ.get('DMLC_ROLE'):
    sys.excepthook = _exit_at_once


def _keep_alive(path):
    while True:
        try:
            with open(path, 'a'):
                os.utime(path, None)
        except OSError:
            pass            # the launcher's folder is gone: the job is ending
        time.sleep(LIVENESS_INTERVAL)


if os.environ.get('SSDSGD_LIVENESS_FILE') and not os.environ.get('SSDSGD_REMOTE_WRAPPER'):
    threading.Thread(target=_keep_alive, args=(os.environ.pop('SSDSGD_LIVENESS_FILE'),), daemon=True,
                     name='ssdsgd-liveness').start()


def _chain():
    """Import the sitecustomize that this one hides further down sys.path."""
    import importlib   # only when another sitecustomize is there: this file runs in every process of a job
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop('sitecustomize', None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != here]
    try:
        importlib.import_module('sitecustomize')
    except ModuleNotFoundError as e:
        sys.modules['sitecustomize'] = me
        if e.name != 'sitecustomize':
            raise           # a module the other sitecustomize imports is missing: Python's site reports it
    finally:
        sys.path[:] = saved


_chain()
