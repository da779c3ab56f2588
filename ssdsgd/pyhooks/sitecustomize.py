"""Loaded by every Python process of a launcher job (the launcher puts this folder first on PYTHONPATH).

An uncaught exception in a job's Python process prints its traceback and ends the process at once
with status 1 (os._exit). A normal exit would run MXNet's atexit finalize, where ps-lite waits for
every other worker forever, so a raising worker of any script, stock ones included, would hang the
job instead of failing it. The sitecustomize this file shadows, if any, is still imported.
"""
import os
import sys


def _exit_at_once(kind, value, tb):
    import traceback
    traceback.print_exception(kind, value, tb)
    name = os.environ.get('SSDSGD_ROLE_NAME', 'process')
    print(f'{name}: uncaught {kind.__name__}, exiting with status 1 without ps-lite finalize', file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if os.environ.get('DMLC_ROLE'):
    sys.excepthook = _exit_at_once


def _chain():
    """Import the sitecustomize that this one hides further down sys.path."""
    import importlib
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop('sitecustomize', None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != here]
    try:
        importlib.import_module('sitecustomize')
    except ImportError:
        sys.modules['sitecustomize'] = me
    finally:
        sys.path[:] = saved


_chain()
