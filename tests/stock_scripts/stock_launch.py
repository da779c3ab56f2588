"""MXNet's own launcher (mxnet/tools/launch.py from the wheel, dmlc_tracker) for side-by-side runs:
`python stock_launch.py -n 2 --launcher local python x.py`. The tracker calls Thread.isAlive, which
Python 3.9 removed; it is put back here, nothing else is changed. The scheduler runs `python` from PATH."""
import importlib.util
import os
import runpy
import sys
import threading

threading.Thread.isAlive = threading.Thread.is_alive
mxnet_dir = importlib.util.find_spec("mxnet").submodule_search_locations[0]   # not imported: seconds saved
path = os.path.join(mxnet_dir, "tools", "launch.py")
sys.argv = [path] + sys.argv[1:]
runpy.run_path(path, run_name="__main__")
