"""The small user tools: scripts/demo.py and scripts/compare.py."""
import json
import os
import subprocess
import sys
import time

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


def _summary(name, acc):
    return {"name": name, "algorithm": "ssgd", "compression": "none", "eval_set": "test", "final_test_acc": acc,
            "images_per_sec": 100.0, "bytes_per_step": {"push": 10, "pull": 10}, "max_staleness": 0}


def _run(home, stamp, acc=None):
    """A run folder home/stamp: finished (summary.json) when acc is given, else only started."""
    folder = home / stamp
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    if acc is not None:
        (folder / "summary.json").write_text(json.dumps(_summary(home.name, acc)))
    return folder


def _compare(capsys, *paths):
    from scripts import compare
    rc = compare.main([str(p) for p in paths])
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_help_is_argparses():
    proc = run_script("compare.py", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: scripts/compare.py") and "RUN" in proc.stdout
    assert proc.stderr == ""
    assert run_script("compare.py").returncode == 2            # no run given: usage


def test_compare_takes_run_folders_and_a_names_folder_stands_for_its_latest_run(tmp_path, capsys):
    run = _run(tmp_path / "a", "20260101-000000", 0.5)
    linked = tmp_path / "b"
    _run(linked, "20260101-000000", 0.25)
    _run(linked, "20260102-000000", 0.75)
    (linked / "latest").symlink_to("20260101-000000")          # latest wins over the newer stamp
    stamped = tmp_path / "c"                                    # no link: the newest stamp, -10 after -9
    _run(stamped, "20260101-000000-9", 0.125)
    _run(stamped, "20260101-000000-10", 0.875)
    rc, out, err = _compare(capsys, run, linked, stamped)
    assert rc == 0 and err == ""
    accs = [line.split()[3] for line in out.splitlines()[2:]]
    assert accs == ["0.5000", "0.2500", "0.8750"]


def test_compare_never_shows_a_validation_accuracy_as_a_test_one(tmp_path, capsys):
    tested = _run(tmp_path / "tested", "20260101-000000", 0.25)
    validated = tmp_path / "validated" / "20260101-000000"
    validated.mkdir(parents=True)
    (validated / "summary.json").write_text(json.dumps(dict(_summary("validated", 0.0), eval_set="validation",
                                                            final_val_acc=0.75)))
    rc, out, _ = _compare(capsys, tested)
    assert rc == 0 and out.splitlines()[0].split()[3:5] == ["test", "acc"]
    rc, out, _ = _compare(capsys, validated)
    assert rc == 0 and out.splitlines()[0].split()[3:5] == ["val", "acc"]
    rc, out, _ = _compare(capsys, tested, validated)
    assert rc == 0 and out.splitlines()[0].split()[3:5] == ["final", "acc"]
    assert [line.split()[3:5] for line in out.splitlines()[2:]] == [["0.2500", "test"], ["0.7500", "val"]]


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("empty", "is neither a run folder (no summary.json, config.yaml or metrics.jsonl) nor a folder of runs"),
    ("unfinished", "has no summary.json: the run did not finish, or is still running"),
    ("unfinished_latest", "(latest run {tmp}/name/20260101-000000) has no summary.json"),
    ("broken_latest", "latest points to 'gone', which is not a folder"),
])
def test_compare_says_in_one_line_what_it_expected(tmp_path, capsys, case, expected):
    path = tmp_path / "name"
    if case == "empty":
        path.mkdir()
    elif case == "unfinished":
        path = _run(tmp_path / "name", "20260101-000000")
    elif case == "unfinished_latest":
        _run(path, "20260101-000000")
        (path / "latest").symlink_to("20260101-000000")
    elif case == "broken_latest":
        path.mkdir()
        (path / "latest").symlink_to("gone")
    rc, out, err = _compare(capsys, path)
    assert rc == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected.format(tmp=tmp_path) in err, err


def test_accuracy_help_describes_every_suite():
    from scripts import accuracy
    proc = run_script("accuracy.py", "--help")
    assert proc.returncode == 0
    description = proc.stdout.split("\n\n")[1]
    assert "digits demo" not in description and "suite" in description
    for suite in accuracy.SUITES:
        assert f"\n  {suite} " in proc.stdout, suite


def test_keep_done_refuses_to_mix_jobs_made_with_other_settings(tmp_path):
    from scripts.results_io import settings_problem
    assert settings_problem(str(tmp_path), ["train.epochs=2"]) is None            # nothing written yet
    (tmp_path / "manifest.json").write_text(json.dumps({"command": ["x"]}))
    assert settings_problem(str(tmp_path), ["train.epochs=2"]) is None            # an older folder: taken as it is
    (tmp_path / "manifest.json").write_text(json.dumps({"settings": ["train.epochs=2"]}))
    assert settings_problem(str(tmp_path), ["train.epochs=2"]) is None
    problem = settings_problem(str(tmp_path), ["train.epochs=3"])
    assert problem.startswith(f"--keep-done: the finished jobs in {tmp_path} were made with ['train.epochs=2']")
    assert "choose another --out" in problem


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
