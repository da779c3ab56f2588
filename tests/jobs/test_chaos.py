"""scripts/chaos.py, short: faults into a strict job with cluster.max_restarts; it must end with the
uninterrupted run's weights bit for bit, every step once in the metrics, nothing left. On loopback one
SIGKILL of a random role; on the virtual cluster (--launcher ssh) one SIGKILL and one host's link taken
down until the launcher gives the job up. (The full runs, 10 faults each, are results/chaos and
results/chaos_cluster.)"""
import json
import os
import subprocess
import sys

import pytest
from testbed import vcluster
from support.jobs import ROOT, processes_with

CHAOS = os.path.join(ROOT, "scripts", "chaos.py")


def _chaos(args, timeout):
    """(exit code, output, PID) of scripts/chaos.py; killed with its process group on a timeout."""
    proc = subprocess.Popen([sys.executable, CHAOS, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)      # SIGTERM: chaos.py unwinds, ending the job and deleting its cluster
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"chaos.py did not finish within {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out, proc.pid


@pytest.mark.timeout(400)
def test_chaos_short(tmp_path):
    out = tmp_path / "chaos"
    rc, text, _ = _chaos(["--faults", "1", "--kinds", "kill", "--epochs", "4", "--out", str(out)], timeout=380)
    assert rc == 0, text[-4000:]
    summary = (out / "summary.md").read_text()
    assert "- result: PASSED" in summary and "1 SIGKILL" in summary
    assert summary.count("| kill |") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passed"] is True and manifest["faults"] == 1
    assert processes_with(str(tmp_path)) == []


@pytest.mark.timeout(200)
def test_chaos_cluster_short(tmp_path):
    try:
        vcluster.check_tools()
    except vcluster.ClusterError as e:
        pytest.skip(f"no virtual cluster here: {e}")
    out = tmp_path / "chaos_cluster"
    rc, text, pid = _chaos(["--cluster", "--faults", "2", "--kinds", "kill", "cut", "--epochs", "12",
                            "--out", str(out)], timeout=180)
    assert rc == 0, text[-4000:]
    summary = (out / "summary.md").read_text()
    assert "- result: PASSED" in summary and "1 SIGKILL, 1 link down until the job fails" in summary
    assert summary.count("| kill |") == 1 and summary.count("| cut |") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passed"] is True and manifest["faults"] == 2 and manifest["restarts"] == 2
    # Nothing of the run left: no process of the job, no namespace, sshd or key folder of its cluster.
    assert processes_with(str(tmp_path)) == []
    cluster = f"{vcluster.PREFIX}{pid}-"
    assert processes_with(cluster) == []
    namespaces = os.listdir(vcluster.netns.NETNS_DIR) if os.path.isdir(vcluster.netns.NETNS_DIR) else []
    assert not [n for n in namespaces if n.startswith(cluster)]
    assert not [d for d in os.listdir(vcluster.TMP) if d.startswith(cluster)]
