"""MXNet's stock launcher command lines (issue 38): ours gives what MXNet's own launcher
(mxnet/tools/launch.py, dmlc_tracker, shipped in the wheel) gives for them, locally and over ssh on the
virtual cluster: the exit code, each role's environment and working directory, and the files the roles
write. Where stock is cheap to run (no MXNet in the roles) it runs side by side here; the MXNet cases and
their 10-of-10 repetitions under both launchers are scripts/stock_compat.py (results/stock_compat/;
MXNet's own nightly test files with --mxnet-tests: results/stock_compat_nightly*/).

Deliberate differences, asserted as such: a role that fails fails the job (stock exits 0 unless the
scheduler fails: its local tracker waits for the scheduler only), and the scheduler runs the command as
the other roles do (stock's scheduler skips the ./script rule, so `runme.sh` fails there with "command
not found" while the rest runs).
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.jobs import ROOT, end_group, processes_with
from jobs import test_cluster

LAUNCH = os.path.join(ROOT, "launch", "launch.py")
SCRIPTS = os.path.join(ROOT, "tests", "stock_scripts")
STOCK = os.path.join(SCRIPTS, "stock_launch.py")


def _env():
    """The launching environment: the interpreter's folder first on PATH (stock's scheduler runs `python`
    from PATH), OMP_NUM_THREADS set (so neither launcher adds anything)."""
    return dict(os.environ, OMP_NUM_THREADS="1",
                PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


def _launch(launcher, args, cwd, timeout=120):
    proc = subprocess.run([sys.executable, launcher, *args], cwd=str(cwd), env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, start_new_session=True)
    return proc.returncode, proc.stdout


def _launch_stock(args, cwd, roles, attempts=3):
    """(exit code, output, _roles_seen) of stock's local launcher once `roles` records are there (at most 20 s
    a launch). Stock's tracker waits for its scheduler only and starts the other roles from daemon threads, so
    when the scheduler ends first it can exit before a thread has started its role, which then never runs:
    launched again (up to `attempts` times) until every role ran, the run stock meant."""
    for _ in range(attempts):
        rc, out = _launch(STOCK, ["--launcher", "local", *args], cwd)
        deadline = time.time() + 20
        while len(glob.glob(os.path.join(str(cwd), "role.*.json"))) < roles and time.time() < deadline:
            time.sleep(0.1)
        seen = _roles_seen(cwd)
        if len(seen) >= roles:
            break
    return rc, out, seen


def _roles_seen(cwd):
    """[(DMLC_ROLE, FOO, cwd)] of every role that ran role_env.py in cwd, sorted; the files removed."""
    seen = []
    for path in glob.glob(os.path.join(str(cwd), "role.*.json")):
        with open(path) as f:
            env = json.load(f)
        seen.append(env)
        os.remove(path)
    return sorted(seen, key=lambda e: (e["DMLC_ROLE"], e.get("DMLC_TASK_ID", "")))


def _summary(seen):
    return sorted((e["DMLC_ROLE"], e.get("FOO"), e["cwd"]) for e in seen)


@pytest.fixture
def work(tmp_path):
    """A working directory holding the stock scripts (runme.sh is run from it, as `runme.sh`)."""
    for name in ("role_env.py", "runme.sh"):
        shutil.copy2(os.path.join(SCRIPTS, name), tmp_path / name)
    yield tmp_path
    assert processes_with(str(tmp_path)) == []


@pytest.mark.timeout(120)
def test_inline_assignment_runs_through_the_shell_as_stock(work):
    """`launch.py -n 1 -s 1 FOO=inline python role_env.py`: every role sees FOO=inline in the launcher's
    working directory, with stock's DMLC_* variables (ours a superset: DMLC_TASK_ID for the scheduler too)."""
    args = ["-n", "1", "-s", "1", "FOO=inline", "python", "role_env.py"]
    rc, out, stock = _launch_stock(args, work, 3)
    assert rc == 0, out
    rc, out = _launch(LAUNCH, args, work)
    ours = _roles_seen(work)
    assert rc == 0, out
    expected = [("scheduler", "inline", str(work)), ("server", "inline", str(work)), ("worker", "inline", str(work))]
    assert _summary(stock) == _summary(ours) == expected
    for s, o in zip(stock, ours):
        assert set(s) <= set(o), (s, o)
        for key in ("DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_JOB_CLUSTER"):
            assert s.get(key) == o.get(key) or (key == "DMLC_JOB_CLUSTER" and s["DMLC_ROLE"] == "scheduler"), key


@pytest.mark.timeout(120)
def test_p3_sets_what_stock_sets(work):
    """`--p3`: ps-lite's P3 van for every role (the wheel's ps-lite has it), the same variables as stock."""
    args = ["-n", "1", "-s", "1", "--p3", "python", "role_env.py"]
    rc, out, stock = _launch_stock(args, work, 3)
    assert rc == 0, out
    rc, out = _launch(LAUNCH, args, work)
    assert rc == 0, out
    ours = _roles_seen(work)
    for seen in (stock, ours):
        assert sorted((e["DMLC_ROLE"], e["DMLC_PS_VAN_TYPE"], e["DMLC_PS_WATER_MARK"]) for e in seen) == [
            ("scheduler", "p3", "10"), ("server", "p3", "10"), ("worker", "p3", "10")]


@pytest.mark.timeout(120)
def test_script_in_the_working_directory_runs_as_stock(work):
    """`launch.py -n 1 -s 1 runme.sh`: the worker and the server run ./runme.sh under both; stock's scheduler
    fails with "command not found" (exit 0 all the same), ours runs it too."""
    rc, out, stock = _launch_stock(["-n", "1", "-s", "1", "runme.sh"], work, 2)   # its scheduler fails at once
    assert rc == 0, out
    assert "runme.sh: command not found" in out
    assert _summary(stock) == [("server", None, str(work)), ("worker", None, str(work))]
    rc, out = _launch(LAUNCH, ["-n", "1", "-s", "1", "runme.sh"], work)
    assert rc == 0, out
    assert _summary(_roles_seen(work)) == [("scheduler", None, str(work)), ("server", None, str(work)),
                                            ("worker", None, str(work))]


def test_parentheses_in_a_word_run_through_bash_stay_literal(tmp_path):
    """Before: `echo 'f(x)' '>' out` ran as `bash -c 'echo f(x) > out'`, a syntax error. A word with
    parentheses and no shell operator is quoted now; `$(...)` is still the shell's."""
    from ssdsgd.launch.command_line import role_argv
    argv = role_argv(["echo", "f(x)", "$((1+2))", ">", "out"], sys.executable, str(tmp_path))
    assert argv == ["bash", "-c", "echo 'f(x)' $((1+2)) > out"]
    subprocess.run(argv, cwd=tmp_path, check=True, timeout=10)
    assert (tmp_path / "out").read_text() == "f(x) 3\n"


@pytest.mark.timeout(180)
def test_profiles_are_written_as_under_stock(tmp_path):
    """MXNet's profiler on servers and workers: after the job, the same files as under stock (MXNet writes a
    profile when its process exits). Checking them inside the run (as MXNet's nightly profiling test does)
    fails under both launchers, since rank 0's own file is not written yet; stock still exits 0, ours 1."""
    script = os.path.join(SCRIPTS, "profile_roles.py")
    rc, out = _launch(LAUNCH, ["-n", "2", "-s", "1", "python", script], tmp_path, timeout=150)
    assert rc == 0, out
    files = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*.json")))
    assert files == ["rank0_server_profile.json", "rank0_worker_profile.json", "rank1_worker_profile.json"]
    for name in files:
        with open(tmp_path / name) as f:
            assert json.load(f)["traceEvents"], name
        os.remove(tmp_path / name)
    rc, out = _launch(LAUNCH, ["-n", "2", "-s", "1", "python", script, "--check-in-run"], tmp_path, timeout=150)
    assert rc == 1, out
    assert re.search(r"^launch: worker \d exited with code 1", out, re.M), out
    assert "No such file or directory: 'rank0_worker_profile.json'" in out
    assert processes_with(str(tmp_path)) == []


# MXNet's own server aborting on one of its row_sparse checks: seen in whole-suite runs on 2 busy cores (CI
# once, over ssh once), and with 6 busy loops alongside in 1 of 15 runs under our launcher against 0 of 15
# under MXNet's (0 of 20 each, idle or with 2 busy loops: results/stock_compat*). The abort is inside MXNet's
# server; whether our launcher makes it likelier is not settled by these counts.
UPSTREAM_SPARSE_CHECKS = ("Check failed: (lvalue.shape_.Size()) == (rvalue.shape_.Size())",
                          "Check failed: size == to->Size()")


def _sparse_step(launch):
    """Run the sparse step (launch() -> (rc, output)); once more if, and only if, MXNet's server aborted
    on one of its row_sparse checks. Returns the last (rc, output)."""
    rc, out = launch()
    if rc != 0 and any(check in out for check in UPSTREAM_SPARSE_CHECKS):
        print("MXNet's server aborted on its row_sparse check; running the sparse step again:\n" + out[-2000:])
        rc, out = launch()
    return rc, out


@pytest.mark.timeout(300)
def test_sparse_step(tmp_path):
    """MXNet's nightly gluon sparse-step check, our own script: every worker holds the servers' update."""
    rc, out = _sparse_step(lambda: _launch(LAUNCH, ["-n", "2", "python", os.path.join(SCRIPTS, "sparse_step.py")],
                                           tmp_path, timeout=140))
    assert rc == 0, out
    assert sorted(re.findall(r"rank (\d) sparse step passed", out)) == ["0", "1"], out


def _stock_compat(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "stock_compat.py"), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)


def test_nightly_cases_need_the_users_copy_of_mxnets_tests(tmp_path):
    """scripts/stock_compat.py's nightly_* cases run MXNet's own test files, which this repository does not
    hold: without --mxnet-tests they are skipped, naming them and the option; a folder lacking a file the
    case needs is one line naming the folder, the file and the case. Neither runs anything."""
    proc = _stock_compat("--cases", "nightly_async,nightly_invalid", "--out", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert "skipping nightly_async, nightly_invalid" in proc.stdout and "--mxnet-tests DIR" in proc.stdout
    assert "no case left to run" in proc.stdout and "Traceback" not in proc.stdout
    (tmp_path / "dist_sync_kvstore.py").write_text("")    # without test_kvstore.py, which it imports
    proc = _stock_compat("--mxnet-tests", str(tmp_path), "--cases", "nightly_invalid", "--out", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert proc.stdout.strip() == (f"stock_compat.py: --mxnet-tests {tmp_path}: no test_kvstore.py there "
                                   "(case nightly_invalid)")
    assert not (tmp_path / "out").exists()


def test_a_launcher_that_hangs_after_a_role_failed_is_recorded_as_hung(monkeypatch):
    """MXNet's launcher waits for ever when a worker dies (the other roles sit in ps-lite's barrier):
    stock_compat stops waiting for such a run HUNG_GRACE seconds after the failure and records "hung"; a
    launcher that exits on its own within the grace keeps its exit code."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import stock_compat
    monkeypatch.setattr(stock_compat, "HUNG_GRACE", 1.0)

    def run(code):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        lines = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        try:
            return stock_compat.wait_for_launcher(proc, lines, timeout=30), time.monotonic()
        finally:
            end_group(proc)
    t0 = time.monotonic()
    code, t1 = run("print('Traceback (most recent call last)', flush=True); import time; time.sleep(60)")
    assert code == "hung" and t1 - t0 < 15
    code, _ = run("import sys, time; print('Check failed: x', flush=True); time.sleep(0.2); sys.exit(3)")
    assert code == 3
    code, _ = run("import time; time.sleep(0.5)")
    assert code == 0


# --- over ssh, on the virtual cluster (test_cluster's: h0 launches, the host files name h1-h3) ----------------

cluster, vc = test_cluster.cluster, test_cluster.vc   # the virtual cluster; vc checks every host is left empty


def _ssh_launch(vc, work, hostfile_text, args, timeout=150):
    hostfile = work / "hosts"
    hostfile.write_text(hostfile_text)
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "--launcher", "ssh", "-H", str(hostfile), "--ssh-config",
                            vc.ssh_config, "--interface", "eth0", *args])
    proc = subprocess.run(argv, cwd=str(work), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, start_new_session=True)
    return proc.returncode, proc.stdout


@pytest.mark.timeout(120)
def test_stock_host_file_forms_and_command_lines_over_ssh(vc, work):
    """`host`, `host:port` and MPI's `host slots=N` in one host file; an inline assignment and a script in
    the working directory, as over the local launcher. Placement: servers then workers, round robin, h3
    taking 2 in a row: server 0 on h1, server 1 on h2, worker 0 and 1 on h3."""
    forms = "h1\nh2:22\nh3 slots=2\n"
    rc, out = _ssh_launch(vc, work, forms, ["-n", "2", "FOO=inline", "python", "role_env.py"])
    assert rc == 0, out
    seen = _roles_seen(work)
    assert _summary(seen) == [("scheduler", "inline", str(work))] + [("server", "inline", str(work))] * 2 + \
        [("worker", "inline", str(work))] * 2
    hosts = {(e["DMLC_ROLE"], e["DMLC_TASK_ID"]): e["DMLC_NODE_HOST"] for e in seen}
    assert hosts == {("scheduler", "0"): vc.addresses[0], ("server", "0"): vc.addresses[1],
                     ("server", "1"): vc.addresses[2], ("worker", "0"): vc.addresses[3],
                     ("worker", "1"): vc.addresses[3]}
    rc, out = _ssh_launch(vc, work, forms, ["-n", "1", "-s", "1", "runme.sh"])
    assert rc == 0, out
    assert _summary(_roles_seen(work)) == [("scheduler", None, str(work)), ("server", None, str(work)),
                                            ("worker", None, str(work))]


@pytest.mark.timeout(360)
def test_mxnet_scripts_over_ssh(vc, work):
    """The profiles and the sparse step with roles on three hosts (the working directory is shared)."""
    rc, out = _ssh_launch(vc, work, "h1\nh2\nh3\n", ["-n", "2", "-s", "1", "python",
                                                    os.path.join(SCRIPTS, "profile_roles.py")])
    assert rc == 0, out
    assert sorted(os.path.basename(p) for p in glob.glob(str(work / "*_profile.json"))) == [
        "rank0_server_profile.json", "rank0_worker_profile.json", "rank1_worker_profile.json"]
    rc, out = _sparse_step(lambda: _ssh_launch(vc, work, "h1\nh2\nh3\n", ["-n", "2", "-s", "1", "python",
                                                                       os.path.join(SCRIPTS, "sparse_step.py")]))
    assert rc == 0, out
    assert sorted(re.findall(r"rank (\d) sparse step passed", out)) == ["0", "1"], out


def _wrapper_pid(vc, role):
    """PID of remote.py, the parent of the role's own process on its host."""
    pid = test_cluster._role_pid(vc, role)
    if pid is None:
        return None
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(120)
def test_sigkilled_remote_wrapper_is_named(vc, work):
    """Issue 34: SIGKILL of worker 1's wrapper (remote.py on h3), not of the role. The role dies with it
    (PR_SET_PDEATHSIG) and the launcher says so, naming the role and the host, instead of a generic
    "connection lost"; the job ends at once and nothing is left."""
    hostfile = work / "hosts"
    hostfile.write_text("h1\nh2\nh3\n")
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "-s", "1", "--launcher", "ssh", "-H", str(hostfile),
                            "--ssh-config", vc.ssh_config, "--interface", "eth0", "sleep", "600"])
    proc = subprocess.Popen(argv, cwd=str(work), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while (pid := _wrapper_pid(vc, "worker 1")) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid, "worker 1's wrapper on h3 did not start"
        time.sleep(1.0)   # past start-up: the wrapper has reported the role's process group
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=40)
        elapsed = time.monotonic() - t0
    finally:
        end_group(proc)
    print(f"worker 1's wrapper SIGKILLed: launcher exit {proc.returncode} after {elapsed:.1f} s")
    assert proc.returncode == 1, out
    assert ("launch: worker 1 lost its supervisor on h3: the wrapper that runs it there (remote.py) killed by "
            "SIGKILL before the role ended, and the role was killed with it") in out, out
    assert "connection" not in out, out
    assert elapsed < 20
    assert "every process on every host has ended" in out


# MXNet 1.9.1's own programs (issue 61), from the user's copy of MXNet's source: SSDSGD_MXNET_SOURCE=DIR (its
# example/image-classification and tests/nightly are used; nothing of them is in this repository).
MXNET_SOURCE = os.environ.get("SSDSGD_MXNET_SOURCE")


def _mxnet_copy(work, folder, names):
    """Copy `names` (files or folders) of MXNet's source `folder` into `work`; skip the test without the source."""
    if not MXNET_SOURCE:
        pytest.skip("MXNet's own programs: set SSDSGD_MXNET_SOURCE to a copy of MXNet 1.9.1's source tree")
    for name in names:
        src = os.path.join(MXNET_SOURCE, folder, name)
        if not os.path.exists(src):
            pytest.fail(f"SSDSGD_MXNET_SOURCE={MXNET_SOURCE}: no {folder}/{name} there")
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, work / name)


def _tiny_mnist(folder, train=1024, test=256):
    """MNIST's four files (idx format, gzipped) with random images: train_mnist.py reads data/ and downloads
    nothing when they are there."""
    import gzip

    import numpy as np
    folder.mkdir()
    rng = np.random.default_rng(0)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(np.array([2049, count], ">u4").tobytes() + labels.tobytes())
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(np.array([2051, count, 28, 28], ">u4").tobytes() + images.tobytes())


@pytest.fixture
def users_h0(vc):
    """h0 (the launching machine) set up as an MXNet user's machine is, so that MXNet's command line needs
    nothing added: a default route (MXNet's launcher finds the scheduler's address through it when the host
    name resolves to loopback, as `hostname` does here) and the cluster's ssh configuration as the system's
    (/etc/ssh/ssh_config, which ssh reads by itself: `ip netns exec` puts /etc/netns/<namespace>/ssh there,
    for h0's processes only)."""
    ns = vc.namespaces[0]
    etc = os.path.join("/etc/netns", ns)
    os.makedirs(os.path.join(etc, "ssh"))
    try:
        shutil.copy(vc.ssh_config, os.path.join(etc, "ssh", "ssh_config"))
        subprocess.run(["ip", "-n", ns, "route", "add", "default", "dev", "eth0"], check=True, timeout=10)
        yield vc
    finally:
        subprocess.run(["ip", "-n", ns, "route", "del", "default", "dev", "eth0"], timeout=10)
        shutil.rmtree(etc)


def _stock_ssh_line(vc, cwd, args, timeout):
    """MXNet's command line as its users type it (`python launch.py ARGS`), run on h0 in `cwd`."""
    proc = subprocess.run(vc.exec_argv(0, [sys.executable, LAUNCH, *args]), cwd=str(cwd), env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          start_new_session=True)
    return proc.returncode, proc.stdout


@pytest.mark.timeout(400)
def test_mxnets_own_programs_over_ssh_with_their_own_command_lines(users_h0, work):
    """Issue 61: MXNet 1.9.1's example/image-classification/train_mnist.py (dist_sync) and its nightly
    dist_sync_kvstore.py, each with MXNet's ssh command line unchanged: no --interface (found as MXNet's
    launcher finds it, said in one line), and the second without --launcher (ssh, MXNet's default with -H).
    Before: both refused, exit 2. Every role on the hosts, nothing left anywhere (the vc and work fixtures)."""
    vc = users_h0
    example = work / "image-classification"
    example.mkdir()
    _mxnet_copy(example, "example/image-classification", ["train_mnist.py", "common", "symbols"])
    _tiny_mnist(example / "data")
    (example / "hosts").write_text("h1\nh2\nh3\n")
    rc, out = _stock_ssh_line(vc, example, ["-n", "2", "-s", "1", "--launcher", "ssh", "-H", "hosts", "python",
                                            "train_mnist.py", "--kv-store", "dist_sync", "--num-epochs", "1",
                                            "--num-examples", "1024"], timeout=300)
    assert rc == 0, out
    chose = [line for line in out.splitlines() if "interface" in line]
    assert len(chose) == 1, out
    assert chose[0].startswith(f"launch: no --interface given: using eth0 ({vc.addresses[0]}), as MXNet's launcher "
                               "finds it ("), out
    assert chose[0].endswith(" resolves to 127.0.0.1 (loopback): the route out)"), out
    assert len(re.findall(r"^\[worker \d\] .*Epoch\[0\] Validation-accuracy=", out, re.M)) == 2, out
    assert "every process on every host has ended" in out

    nightly = work / "nightly"
    nightly.mkdir()
    _mxnet_copy(nightly, "tests/nightly", ["dist_sync_kvstore.py", "test_kvstore.py"])
    (nightly / "hosts").write_text("h1\nh2\nh3\n")
    rc, out = _stock_ssh_line(vc, nightly, ["-n", "2", "-H", "hosts", "python", "dist_sync_kvstore.py",
                                            "--type=gluon_type_cpu"], timeout=300)
    assert rc == 0, out
    assert sorted(re.findall(r"worker (\d) passed test_gluon_trainer_type", out)) == ["0", "1"], out
    assert "every process on every host has ended" in out
    assert not any(sign in out for sign in ("Traceback (most recent call last)", "Check failed")), out
