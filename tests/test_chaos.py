"""scripts/chaos.py, short: one SIGKILL of a random role into a strict job with cluster.max_restarts; it
must end with the uninterrupted run's weights bit for bit, every step once in the metrics, nothing left.
(The full run, 10 faults of every kind, is results/chaos.)"""
import json
import os
import subprocess
import sys

import pytest
from jobs import ROOT, processes_with


@pytest.mark.timeout(400)
def test_chaos_short(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--faults", "1",
                           "--kinds", "kill", "--epochs", "4", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=380, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = (out / "summary.md").read_text()
    assert "- result: PASSED" in summary and "1 SIGKILL" in summary
    assert summary.count("| kill |") == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passed"] is True and manifest["faults"] == 1
    assert processes_with(str(tmp_path)) == []
