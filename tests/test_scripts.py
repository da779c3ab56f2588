"""The small user tools: scripts/demo.py and scripts/compare.py."""
import json
import os
import subprocess
import sys

import pytest
from jobs import ROOT, processes_with
from scripts.results_io import printed_run_folder

DEMO_NAMES = ["demo_digits_ssgd", "demo_digits_ssd", "demo_digits_ssd_topk"]


def run_script(script, *args, timeout=60):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def test_printed_run_folder_is_the_front_ends_line_under_the_jobs_cwd():
    assert printed_run_folder("x\nrun folder: /a/b/c\n[worker 1] run folder: /d\n") == "/a/b/c"
    assert printed_run_folder("run folder: runs/n/1\n", cwd="/r") == "/r/runs/n/1"
    assert printed_run_folder("[worker 1 (rank 0)] run folder: /d\n") is None


@pytest.mark.timeout(240)
def test_demo_tables_the_runs_its_jobs_just_wrote(tmp_path):
    # A stale earlier result where the table used to look (log.dir/<name>/latest): it must not be read.
    for name in DEMO_NAMES:
        old = tmp_path / name / "20000101-000000"
        old.mkdir(parents=True)
        (old / "summary.json").write_text("not json: an earlier run's")
        (tmp_path / name / "latest").symlink_to("20000101-000000")
    proc = run_script("demo.py", "--set", "train.epochs=1", "--set", f"log.dir={tmp_path}", timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("\n\n")[-1]
    for name in DEMO_NAMES:
        runs = [d for d in os.listdir(tmp_path / name) if d not in ("latest", "20000101-000000")]
        assert len(runs) == 1, runs
        assert f"run folder: {tmp_path / name / runs[0]}" in proc.stdout
        with open(tmp_path / name / runs[0] / "summary.json") as f:
            acc = json.load(f)["final_test_acc"]
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert f"{acc:.4f}" in row.split(), (row, acc)
    assert processes_with(str(tmp_path)) == []


def test_demo_stops_at_a_failed_job_with_one_line_and_its_exit_code(tmp_path):
    proc = run_script("demo.py", "--set", "train.epoch=1", "--set", f"log.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "demo: configs/demo_digits_ssgd.yaml failed with exit code 2"
    assert "Traceback" not in proc.stderr and "run                          algorithm" not in proc.stdout
