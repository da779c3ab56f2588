"""What a process of the job imports when it starts (the front end, a role's entry point, the server): run in a
fresh Python process, so it lives with the jobs."""
import subprocess
import sys

from support.jobs import ROOT


def _python(code):
    """`code` run in a fresh interpreter from the project's root: nothing this test process imported counts."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_front_end_the_role_entry_point_and_the_server_import_no_heavy_package():
    """`import mxnet` under DMLC_ROLE=server or scheduler would enter MXNet's stock server loop inside the import
    (run_server imports it as a worker), and the front end's --help and --dry-run would pay seconds for it: these
    modules import MXNet (and gluoncv, scikit-learn, OpenCV) only inside the functions that need them."""
    code = ("import sys, ssdsgd.launch.run, ssdsgd.train, ssdsgd.ps.server, ssdsgd.ps.scheduler; "
            "print(sorted(m for m in ('mxnet', 'gluoncv', 'sklearn', 'cv2') if m in sys.modules))")
    out = _python(code)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stdout + out.stderr


def test_mxnet_imported_by_a_role_leaves_scipy_and_scikit_learn_out_and_importable():
    """ssdsgd.lean_mxnet: a server or worker imports MXNet without SciPy, scikit-learn and pandas (CPU it would
    spend on every role's start), and scikit-learn can still be imported afterwards."""
    code = ("import sys; from ssdsgd.lean_mxnet import import_mxnet; mx = import_mxnet(); "
            "print(mx.nd.ones((2,)).sum().asscalar(), "
            "sorted(m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules)); "
            "from sklearn.datasets import load_digits; print(len(load_digits().target))")
    out = _python(code)
    assert out.returncode == 0 and out.stdout == "2.0 []\n1797\n", out.stdout + out.stderr


def test_the_front_ends_data_and_model_checks_import_no_heavy_package(tmp_path):
    """preflight reads a CIFAR-10 copy (batch files) and checks an ImageNet RecordIO pair and a gluoncv model
    name as rank 0 would, without MXNet, gluoncv or scikit-learn: seconds of CPU in every job's front end."""
    from jobs.test_data import write_imagenet
    from unit.test_data import make_cifar_arrays, write_cifar
    write_cifar(str(tmp_path / "bin"), "bin", make_cifar_arrays())
    imagenet = write_imagenet(tmp_path / "imagenet", 32, 8, 4)
    small = ["train.batch_size=4", "cluster.workers=2", "cluster.launcher=local", "cluster.hostfile=",
             "cluster.interface="]
    checks = [("configs/cifar10_resnet20_ssd_topk.yaml", [*small, f"data.root={tmp_path / 'bin'}"]),
              ("configs/imagenet_resnet50_ssd_topk.yaml", [*small, f"data.root={imagenet}", "data.num_classes=10",
                                                           "data.shape=[3,32,32]"])]
    for config, sets in checks:
        code = ("import sys; from ssdsgd.config import load_config; from ssdsgd.launch.run import preflight; "
                f"print(preflight(load_config({config!r}, {sets!r})), "
                "sorted(m for m in ('mxnet', 'gluoncv', 'sklearn', 'cv2') if m in sys.modules))")
        out = _python(code)
        assert out.returncode == 0 and out.stdout == "None []\n", (config, out.stdout + out.stderr)


def test_the_kernels_load_without_scipys_linear_algebra_and_leave_it_importable():
    """numba's first compile or cache load would import scipy.linalg to look for a BLAS, which no kernel of
    compression/kernels.py calls: a top-k worker's start-up does without it, and it can still be imported."""
    code = ("import sys, numpy as np; from ssdsgd.compression import kernels; kernels.warm(); "
            "print('scipy.linalg' in sys.modules, kernels.kth_smallest(np.arange(8, dtype=np.float32), 3)); "
            "import scipy.linalg; print(scipy.linalg.norm([3.0, 4.0]))")
    out = _python(code)
    assert out.returncode == 0 and out.stdout.splitlines() == ["False (True, 3.0)", "5.0"], out.stdout + out.stderr
