"""MXNet's stock command lines through our launcher: a stock dist_sync KVStore script (MXNet's own server
loop, no ssdsgd code in the roles), default -s, a one-string shell command, a worker that raises."""
import os
import re
import subprocess
import sys
import time

import pytest
from support.jobs import ROOT, processes_with

LAUNCH = os.path.join(ROOT, "launch", "launch.py")

# What a stock user script does: every role runs it; `import mxnet` puts servers and the scheduler into
# MXNet's own server loop. Workers push rank+1 into one key and pull the sum.
STOCK = '''
import os, sys
import mxnet as mx
kv = mx.kv.create("dist_sync")
kv.init(3, mx.nd.zeros((2, 3)))
if os.environ.get("STOCK_RAISE") and kv.rank == 1:
    raise ValueError("stock worker fails")
kv.push(3, mx.nd.ones((2, 3)) * (kv.rank + 1))
out = mx.nd.zeros((2, 3))
kv.pull(3, out=out)
print("rank %d of %d sum %g servers %s marker %s omp %s" % (kv.rank, kv.num_workers, out.asnumpy()[0, 0],
      os.environ["DMLC_NUM_SERVER"], os.environ.get("STOCK_MARK"), os.environ.get("OMP_NUM_THREADS")), flush=True)
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "stock_dist_sync.py"
    path.write_text(STOCK)
    return str(path)


def _launch(args, tmp_path, env=None, timeout=90):
    full_env = dict(os.environ, **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, LAUNCH] + args, cwd=str(tmp_path), env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, start_new_session=True)
    assert processes_with(str(tmp_path)) == []
    return proc.returncode, proc.stdout, time.monotonic() - t0


def _sums(out):
    return sorted(re.findall(r"rank (\d) of 2 sum (\S+) servers (\d) marker (\S+) omp (\S+)", out))


@pytest.mark.timeout(120)
def test_stock_command_line_defaults_servers_to_workers(script, tmp_path):
    """`launch.py -n 2 --launcher local python script.py`, as MXNet's CI writes it; OMP_NUM_THREADS kept."""
    rc, out, _ = _launch(["-n", "2", "--launcher", "local", "python", script], tmp_path,
                         env={"OMP_NUM_THREADS": "1"})
    assert rc == 0, out
    assert _sums(out) == [("0", "3", "2", "None", "1"), ("1", "3", "2", "None", "1")]
    assert "OMP_NUM_THREADS is not set" not in out


@pytest.mark.timeout(120)
def test_one_string_command_runs_through_the_shell(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, LAUNCH, "-n", "2", "-s", "1", f"STOCK_MARK=shell python {script}"],
                          cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=90, start_new_session=True)
    assert proc.returncode == 0, proc.stdout
    assert _sums(proc.stdout) == [("0", "3", "1", "shell", "1"), ("1", "3", "1", "shell", "1")]
    assert "launch: OMP_NUM_THREADS is not set; using 1 per process" in proc.stdout
    assert processes_with(str(tmp_path)) == []


@pytest.mark.timeout(120)
def test_raising_stock_worker_fails_the_job_fast(script, tmp_path):
    """Without the hook the raising worker waits in ps-lite's finalize and the job hangs until --timeout."""
    rc, out, seconds = _launch(["-n", "2", "-s", "1", "--timeout", "80", "--env", "STOCK_RAISE",
                                "python", script], tmp_path, env={"STOCK_RAISE": "1", "OMP_NUM_THREADS": "1"})
    assert rc == 1, out
    assert seconds < 30
    assert "ValueError: stock worker fails" in out
    assert re.search(r"launch: worker \d( \(rank 1\))? exited with code 1", out), out


def test_env_forms_and_refusals(tmp_path):
    from ssdsgd.launch.launcher import _parser
    args = _parser().parse_args(["-n", "1", "--env", "A=1", "--env", "B:2", "--env", "PATH",
                                 "--env-server", "S:3", "--env-worker", "W=4", "true"])
    assert args.env == [("A", "1"), ("B", "2"), ("PATH", os.environ["PATH"])]
    assert args.env_server == [("S", "3")] and args.env_worker == [("W", "4")]
    rc, out, _ = _launch(["-n", "1", "--env", "SSDSGD_SURELY_UNSET_VAR", "true"], tmp_path,
                         env={"OMP_NUM_THREADS": "1"}, timeout=30)
    assert rc == 2 and "SSDSGD_SURELY_UNSET_VAR is not set" in out
    # MXNet's local launcher ignores --sync-dst-dir; ours too, saying so. Over ssh it is refused, with why.
    rc, out, _ = _launch(["-n", "1", "--sync-dst-dir", "/tmp/x", "true"], tmp_path, timeout=30)
    assert rc == 0 and "--sync-dst-dir only applies to the ssh launcher; ignored" in out
    rc, out, _ = _launch(["-n", "1", "--launcher", "ssh", "-H", "h1", "--sync-dst-dir", "/tmp/x", "true"], tmp_path,
                         timeout=30)
    assert rc == 2 and "--sync-dst-dir is not supported by the ssh launcher: the roles run in this working" in out


def test_train_without_secret_says_so(tmp_path):
    """Under a foreign launcher (no job secret) every role stops at once with a message: no hang."""
    env = dict(os.environ, DMLC_ROLE="scheduler")
    env.pop("SSDSGD_JOB_SECRET", None)
    proc = subprocess.run([sys.executable, "-m", "ssdsgd.train", "--config",
                           os.path.join(ROOT, "configs", "demo_digits_ssd.yaml")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "SSDSGD_JOB_SECRET is not set" in proc.stderr
