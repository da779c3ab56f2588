"""scripts/chaos.py, short: two SIGKILLs of random roles into a strict job with cluster.max_restarts; it
must end with the uninterrupted run's weights bit for bit, every step once in the metrics, nothing left."""
import json
import os
import subprocess
import sys

import pytest

from jobs import ROOT, processes_with


@pytest.mark.timeout(400)
def test_chaos_short(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "chaos.py"), "--faults", "2",
                           "--kinds", "kill", "--epochs", "8", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=380, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = (out / "summary.md").read_text()
    assert "- result: PASSED" in summary and "2 SIGKILL" in summary
    assert summary.count("| kill |") == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["passed"] is True and manifest["faults"] == 2
    assert processes_with(str(tmp_path)) == []
