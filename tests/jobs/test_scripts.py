"""The small user tools: scripts/demo.py and scripts/compare.py."""
import json
import os
import subprocess
import sys
import time

import pytest
from support.jobs import ROOT, processes_with

DEMO_NAMES = ["demo_digits_ssgd", "demo_digits_ssd", "demo_digits_ssd_topk"]


def run_script(script, *args, timeout=60):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


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


def test_compare_help_is_argparses():
    proc = run_script("compare.py", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: scripts/compare.py") and "RUN" in proc.stdout
    assert proc.stderr == ""
    assert run_script("compare.py").returncode == 2            # no run given: usage


def test_accuracy_help_describes_every_suite():
    from scripts import accuracy
    proc = run_script("accuracy.py", "--help")
    assert proc.returncode == 0
    description = proc.stdout.split("\n\n")[1]
    assert "digits demo" not in description and "suite" in description
    for suite in accuracy.SUITES:
        assert f"\n  {suite} " in proc.stdout, suite


def test_a_script_whose_stdout_is_closed_goes_on_to_its_end(tmp_path):
    """`scripts/demo.py | head`: the reader goes away after one line; the script must still finish (its
    jobs and its results with it), not die at its next print."""
    done = tmp_path / "done"
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from scripts.results_io import survive_closed_stdout\n"
            "survive_closed_stdout()\n"
            "for i in range(20000):\n"
            "    print('line', i, flush=True)\n"
            "open(%r, 'w').close()\n") % (ROOT, str(done))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"line 0")
    proc.stdout.close()                                   # what `| head -1` does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and done.exists(), err.decode()[-2000:]
    assert b"BrokenPipeError" not in err


@pytest.mark.timeout(60)
def test_a_job_dies_with_the_script_that_started_it_even_by_sigkill(tmp_path):
    """demo.py and reproduce.py start their jobs with dies_with_script: a script killed outright (SIGKILL
    cannot be handled) must not leave its job running."""
    code = ("import subprocess, sys, time; sys.path.insert(0, %r)\n"
            "from scripts.results_io import dies_with_script\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " preexec_fn=dies_with_script())\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n") % ROOT
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _state(child) not in ("gone", "Z"):
        time.sleep(0.05)
    outlived = _state(child) not in ("gone", "Z")
    if outlived:
        os.kill(child, 9)                                 # leave nothing behind, then fail
    assert not outlived, "the job outlived its script"


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
