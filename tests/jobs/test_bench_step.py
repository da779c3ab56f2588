"""bench/bench_step.py: the table's medians and ratios, a tiny real run, and the --shape error."""
import csv
import json
import os
import signal
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "bench_step.py")


# The eval task runs 2 copies only: the copies plumbing is the same for both tasks (the train run
# covers 1 and 2), and each copy is a process that imports mxnet.
@pytest.mark.parametrize("task, copies", [("train", ["1", "2"]), ("eval", ["2"])], ids=["train", "eval"])
def test_tiny_run_writes_every_timed_step(tmp_path, task, copies):
    out = tmp_path / "bench"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "small_cnn", "--batch", "4", "--shape", "3,8,8",
                           "--warmup", "1", "--steps", "2", "--copies", *copies, "--task", task, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    with open(out / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    # 2 modes x (1 + 2 processes, or 2) x 2 timed steps, every time positive.
    assert len(rows) == 2 * sum(int(c) for c in copies) * 2
    assert {(r["mode"], r["copies"]) for r in rows} == {(m, c) for m in ("imperative", "hybridized")
                                                        for c in copies}
    assert {r["copy"] for r in rows if r["copies"] == "2"} == {"0", "1"}
    assert all(float(r["seconds"]) > 0 for r in rows)
    text = (out / "table.md").read_text()
    assert text.count("| 2 |") == 2
    assert text.startswith("Forward + backward" if task == "train" else "Evaluation")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["command"][:2] == ["bench/bench_step.py", "--model"] and manifest["configs"] == {}


@pytest.mark.parametrize("flags, named", [(["--shape", "3,x"], "'3,x'"), (["--shape", "32,32"], "'32,32'"),
                                          (["--copies", "1", "0"], "--copies"), (["--steps", "0"], "--steps")])
def test_bad_arguments_are_refused_with_the_flag_named(flags, named):
    proc = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert named in proc.stderr


def test_a_failing_benchmark_process_is_reported(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "no_such_model", "--copies", "2",
                           "--out", str(tmp_path / "bench")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "the imperative benchmark process (copy 0) exited with 1" in proc.stderr
    assert not (tmp_path / "bench").exists()


def test_timeout_ends_every_copy(tmp_path):
    # 100000 steps of small_cnn cannot finish in 3 s; both copies must be gone when the script exits.
    proc = subprocess.Popen([sys.executable, SCRIPT, "--model", "small_cnn", "--batch", "4", "--shape", "3,8,8",
                             "--steps", "100000", "--copies", "2", "--timeout", "3", "--out", str(tmp_path / "b")],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "did not finish within --timeout 3 s" in err
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == []
