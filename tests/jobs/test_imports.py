"""What a process of the job imports when it starts (the front end, a role's entry point, the server): run in a
fresh Python process, so it lives with the jobs."""
import subprocess
import sys

from support.jobs import ROOT


def test_the_front_end_the_role_entry_point_and_the_server_import_no_heavy_package():
    """`import mxnet` under DMLC_ROLE=server or scheduler would enter MXNet's stock server loop inside the import
    (run_server imports it as a worker), and the front end's --help and --dry-run would pay seconds for it: these
    modules import MXNet (and gluoncv, scikit-learn, OpenCV) only inside the functions that need them."""
    code = ("import sys, ssdsgd.launch.run, ssdsgd.train, ssdsgd.ps.server, ssdsgd.ps.scheduler; "
            "print(sorted(m for m in ('mxnet', 'gluoncv', 'sklearn', 'cv2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stdout + out.stderr
