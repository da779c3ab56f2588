"""Multi-host jobs on a virtual cluster (testbed/vcluster.py): 5 hosts in network namespaces, one sshd each.

h0 runs the launcher and the scheduler; the host file lists h1 h2 h3, so server 0 runs on h1, worker 0
on h2 and worker 1 on h3; h4 is the spare host of the tests that lose one. Every test checks that no
process is left on any host afterwards.
Skipped, with the reason, where namespaces or sshd cannot be had (not root, no iproute2/openssh).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from testbed import vcluster
from support.jobs import ROOT, processes_with, virtual_cluster

from ssdsgd.launch.job_dir import owner_ended

LAUNCH = os.path.join(ROOT, "launch", "launch.py")
SSD = os.path.join(ROOT, "configs", "demo_digits_ssd.yaml")
HOSTS = {"server 0": 1, "worker 0": 2, "worker 1": 3}   # role -> host index, from the round robin
STOP_SECONDS = 30   # a failed or stopped job must be gone from every host within this


@pytest.fixture(scope="module")
def cluster():
    with virtual_cluster(5) as vc:
        yield vc


@pytest.fixture
def vc(cluster, tmp_path):
    """The cluster, checked to be empty after the test (and emptied, so one failure does not spread)."""
    yield cluster
    left = cluster.leftovers()
    for i in range(cluster.n):
        vcluster.netns.kill_pids([p for p in cluster.pids(i) if p not in {s.pid for s in cluster._sshd}])
    assert left == {}, f"processes left on the hosts: {left}"
    assert processes_with(str(tmp_path)) == []


def _hostfile(vc, tmp_path):
    return vc.write_hostfile(tmp_path / "hosts", [1, 2, 3])


def cluster_command(vc, tmp_path, *sets, config=SSD, hostfile=None, name="job"):
    """(the argv that starts a job from h0 over ssh on h1-h3 or `hostfile`'s hosts, its run folder's `latest`)."""
    log_dir = str(tmp_path / "runs")
    return vc.exec_argv(0, [sys.executable, "-m", "ssdsgd", "--config", config, "--set", f"log.dir={log_dir}",
                            "--set", f"name={name}", "--set", "cluster.launcher=ssh",
                            "--set", f"cluster.hostfile={hostfile or _hostfile(vc, tmp_path)}",
                            "--set", "cluster.interface=eth0", "--set", f"cluster.ssh_config={vc.ssh_config}",
                            *[a for s in sets for a in ("--set", s)]]), os.path.join(log_dir, name, "latest")


def _start(argv, tmp_path, cwd=ROOT):
    out = open(tmp_path / "launcher.out", "w+")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, out


def _finish(proc, out, timeout):
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out.seek(0)
    text = out.read()
    out.close()
    return rc, text


def _role_pid(vc, role, host=None):
    """PID of the role's own process on its host (not remote.py's `python -c` that started it); host: the
    index of the host to look on, if not the role's usual one."""
    kind, task = role.split()
    for pid in vc.pids(HOSTS[role] if host is None else host):
        env = vcluster.netns.read_environ(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if env.get("DMLC_ROLE") == kind and env.get("DMLC_TASK_ID") == task and argv[1:2] != [b"-c"]:
            return pid
    return None


def _wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


TOY = r'''
import json, os, sys
env = {k: v for k, v in os.environ.items() if k.startswith(("DMLC_", "SSDSGD_ROLE", "OMP_", "TOY", "CUDA_"))}
env["python"] = sys.executable
with open(os.path.join(os.environ["TOY_DIR"], os.environ["DMLC_ROLE"] + os.environ["DMLC_TASK_ID"]), "w") as f:
    json.dump(env, f)
'''


@pytest.mark.timeout(90)
def test_ssh_launcher_environment_on_hosts(vc, tmp_path):
    """Per-host interface and address, the launching interpreter, user ssh options, stock -s default."""
    toy = tmp_path / "toy"
    toy.mkdir()
    hostfile = tmp_path / "hosts"   # h1 names its interface, h2 its interpreter, h3 neither
    hostfile.write_text(f"h1 interface=eth0\nh2 python={sys.executable}\nh3\n")
    cmd = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "--launcher", "ssh", "-H", str(hostfile),
                           "--ssh-config", vc.ssh_config, "--ssh-option", "ConnectTimeout=7",
                           "--interface", "eth0", "--env", f"TOY_DIR={toy}", "--env-worker", "TOY_W:1",
                           "python", "-c", TOY])
    t0 = time.monotonic()
    rc, out = _finish(*_start(cmd, tmp_path), timeout=60)
    assert rc == 0, out
    assert time.monotonic() - t0 < 30
    assert "every process on every host has ended" in out
    seen = {p.name: json.loads(p.read_text()) for p in toy.iterdir()}
    # -s defaults to -n, as in MXNet's launcher: 2 servers (h1, h2), 2 workers (h3, h1).
    assert sorted(seen) == ["scheduler0", "server0", "server1", "worker0", "worker1"]
    hosts = {"scheduler0": 0, "server0": 1, "server1": 2, "worker0": 3, "worker1": 1}
    for name, env in seen.items():
        assert env["DMLC_INTERFACE"] == "eth0"
        assert env["DMLC_NODE_HOST"] == vc.addresses[hosts[name]]
        assert env["DMLC_PS_ROOT_URI"] == vc.addresses[0]
        assert env["python"] == sys.executable
        assert env["OMP_NUM_THREADS"] == "1"
        assert ("TOY_W" in env) == name.startswith("worker")


@pytest.mark.timeout(90)
def test_workers_that_share_a_host_get_disjoint_gpus(vc, tmp_path):
    """--gpus-per-worker 2 with h2 holding both workers (slots=2) and 4 GPUs: each worker sees its own two
    (CUDA_VISIBLE_DEVICES on its host), the server none."""
    toy = tmp_path / "toy"
    toy.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2 slots=2 gpus=0,1,2,3\n")
    cmd = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "-s", "1", "--launcher", "ssh", "-H", str(hostfile),
                           "--ssh-config", vc.ssh_config, "--interface", "eth0", "--gpus-per-worker", "2",
                           "--env", f"TOY_DIR={toy}", "python", "-c", TOY])
    rc, out = _finish(*_start(cmd, tmp_path), timeout=60)
    assert rc == 0, out
    seen = {p.name: json.loads(p.read_text()) for p in toy.iterdir()}
    assert {name: env.get("CUDA_VISIBLE_DEVICES") for name, env in seen.items()} == {
        "scheduler0": "", "server0": "", "worker0": "0,1", "worker1": "2,3"}
    assert seen["worker0"]["DMLC_NODE_HOST"] == seen["worker1"]["DMLC_NODE_HOST"] == vc.addresses[2]


@pytest.mark.timeout(150)
def test_ssdsgd_run_on_four_hosts(vc, tmp_path):
    argv, run_dir = cluster_command(vc, tmp_path, "train.epochs=1", "log.every_steps=5", "cluster.stall_timeout=60",
                             "cluster.server_timeout=30")
    rc, out = _finish(*_start(argv, tmp_path), timeout=120)
    assert rc == 0, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["num_workers"] == 2 and summary["steps"] == 22
    assert re.search(r"^\[worker [01] \(rank 0\)\] job: ssd", out, re.M), out   # labelled with the KVStore rank
    assert "every process on every host has ended" in out


@pytest.mark.timeout(200)
def test_cifar10_recordio_trains_over_ssh_with_the_shipped_topk_config(vc, tmp_path):
    """A user's CIFAR-10 run on hosts: im2rec RecordIO (tiny), the shipped cifar10_resnet20_ssd_topk.yaml,
    one epoch, workers on two hosts; exit 0 and a test accuracy. (One form: the hosts share the file
    system, so the form does not change what ssh does; tests/test_data_jobs.py trains the same config
    on every form, the two official archives and RecordIO, with the same data and batch.)"""
    from unit.test_data import make_cifar_arrays, write_cifar_recordio
    data = tmp_path / "cifar"
    write_cifar_recordio(data, make_cifar_arrays())
    argv, run_dir = cluster_command(vc, tmp_path, "train.epochs=1", "train.batch_size=8", "log.every_steps=5",
                             "cluster.stall_timeout=90", "cluster.server_timeout=30", f"data.root={data}",
                             f"checkpoint.dir={tmp_path / 'ck'}",
                             config=os.path.join(ROOT, "configs", "cifar10_resnet20_ssd_topk.yaml"))
    rc, out = _finish(*_start(argv, tmp_path), timeout=180)
    assert rc == 0, out[-3000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["num_workers"] == 2 and 0 <= summary["final_test_acc"] <= 1
    assert summary["compression"] == "topk" and summary["steps"] == 6          # 100 // (2 x 8)
    assert "every process on every host has ended" in out


@pytest.mark.timeout(150)
def test_launch_py_ssh_job_on_four_hosts(vc, tmp_path):
    log_dir = tmp_path / "runs"
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "-s", "1", "--launcher", "ssh",
                            "-H", _hostfile(vc, tmp_path), "--ssh-config", vc.ssh_config, "--interface", "eth0",
                            "--stall-timeout", "60", "--timeout", "110",
                            "python", "-m", "ssdsgd.train", "--config", SSD, "--set", "train.epochs=1",
                            "--set", f"log.dir={log_dir}", "--set", "name=direct"])
    rc, out = _finish(*_start(argv, tmp_path), timeout=120)
    assert rc == 0, out
    assert json.load(open(log_dir / "direct" / "latest" / "summary.json"))["steps"] == 22


def _fault_during_training(vc, tmp_path, fault, *sets):
    """Start a long job, call fault(proc) once it trains; (exit code, output, seconds to exit)."""
    argv, run_dir = cluster_command(vc, tmp_path, "train.epochs=300", "log.every_steps=2", *sets)
    proc, out = _start(argv, tmp_path)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")), 60, "training to start")
        fault(proc)
        t0 = time.monotonic()
        rc, text = _finish(proc, out, timeout=STOP_SECONDS + 10)
        return rc, text, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["worker 1", "server 0"])
def test_sigkill_of_a_remote_role(vc, tmp_path, victim):
    def kill_victim(proc):
        os.kill(_wait_for(lambda: _role_pid(vc, victim), 10, f"{victim}'s process"), signal.SIGKILL)
    rc, text, elapsed = _fault_during_training(vc, tmp_path, kill_victim)
    print(f"{victim} SIGKILLed: launcher exit {rc} after {elapsed:.1f} s")
    assert rc == 1, text
    assert elapsed < STOP_SECONDS
    host = vc.hostnames[HOSTS[victim]]
    assert f"launch: {victim}" in text and f"killed by SIGKILL on {host}" in text, text
    assert "every process on every host has ended" in text


@pytest.mark.timeout(120)
def test_stopped_remote_server_is_named_with_its_host(vc, tmp_path):
    """SIGSTOP of server 0 on h1: its liveness file (in the shared working directory) goes quiet; the job
    fails naming the role and the host, and the cleanup ends the stopped process (SIGCONT after SIGTERM)."""
    def stop(proc):
        os.kill(_wait_for(lambda: _role_pid(vc, "server 0"), 10, "server 0's process"), signal.SIGSTOP)
    rc, text, elapsed = _fault_during_training(vc, tmp_path, stop, "cluster.server_timeout=5")
    print(f"server 0 SIGSTOPped on h1: launcher exit {rc} after {elapsed:.1f} s")
    assert rc == 1, text
    # Labelled with its rank if it had reported it (metrics.jsonl, the start signal, comes before the setup).
    assert re.search(r"^launch: server 0( \(rank 0\))? on h1 gave no sign of life for 5 s \(server timeout\): "
                     r"its process is stopped or hung, h1 is unreachable", text, re.M), text
    assert "made no progress" not in text
    assert elapsed < 5 + STOP_SECONDS
    assert "every process on every host has ended" in text


@pytest.mark.timeout(150)
def test_unreachable_server_host_is_named(vc, tmp_path):
    """h1 (server 0) drops off the network mid-run: ssh's own keepalive (from cluster.server_timeout) ends
    the launcher's ssh client, and the job fails naming the role, the host and the lost connection. The
    cleanup cannot reach h1 and says so; once h1 is back, the closed connection ends the role there."""
    ns = vc.namespaces[HOSTS["server 0"]]

    def cut(proc):
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
    try:
        rc, text, elapsed = _fault_during_training(vc, tmp_path, cut, "cluster.server_timeout=8")
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
    print(f"h1 cut off: launcher exit {rc} after {elapsed:.1f} s")
    assert rc == 1, text
    assert re.search(r"^launch: server 0( \(rank 0\))? lost: ssh to h1 exited with code 255 before the role "
                     r"reported its end: the connection to h1 was lost", text, re.M), text
    assert "made no progress" not in text
    assert elapsed < 8 + STOP_SECONDS
    assert re.search(r"cannot confirm that server 0( \(rank 0\))? on h1 ended", text), text
    _wait_for(lambda: vc.leftovers() == {}, 60, "server 0 on h1 to end once h1 is back")


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher(vc, tmp_path):
    # `ip netns exec` execs: the process is the launcher itself.
    rc, text, elapsed = _fault_during_training(vc, tmp_path, lambda proc: proc.send_signal(signal.SIGTERM))
    print(f"launcher SIGTERMed: exit {rc} after {elapsed:.1f} s")
    assert rc == 128 + signal.SIGTERM, text
    assert elapsed < STOP_SECONDS
    assert "received SIGTERM" in text
    assert "every process on every host has ended" in text


@pytest.mark.timeout(60)
def test_remote_roles_die_with_a_sigkilled_launcher(vc, tmp_path):
    """No cleanup code runs here: the closed ssh connections alone must end the remote roles."""
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "-s", "1", "--launcher", "ssh",
                            "-H", _hostfile(vc, tmp_path), "--ssh-config", vc.ssh_config, "--interface", "eth0",
                            "sleep", "600"])
    proc, out = _start(argv, tmp_path, cwd=tmp_path)   # a killed launcher cannot remove its job folder
    try:
        _wait_for(lambda: all(_role_pid(vc, r) for r in HOSTS), 30, "every remote role")
    finally:
        proc.kill()
        _finish(proc, out, timeout=10)
    _wait_for(lambda: vc.leftovers() == {}, 15, "the remote roles to end")


@pytest.mark.timeout(60)
def test_shaping_and_crash_leftovers(tmp_path):
    """tbf on both ends of every link; a cluster whose creator was SIGKILLed is removed by the next one."""
    script = ("import time; from testbed import vcluster\n"
              "vc = vcluster.VCluster(2, rate_mbit=50).create()\n"
              "import subprocess\n"
              "print(vc.name, subprocess.run(['tc', '-n', vc.switch, 'qdisc', 'show', 'dev', 'v1'],"
              " capture_output=True, text=True).stdout.strip(), flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # no teardown runs
        proc.wait()
    if not line:
        pytest.skip(f"no virtual cluster here: {proc.stderr.read().strip()[-300:]}")
    name, qdisc = line.split(" ", 1)
    assert "tbf" in qdisc and "50Mbit" in qdisc
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name in namespaces
    removed = vcluster.cleanup_leftovers()
    assert {n for n in removed if n.startswith(name + "-")} >= {f"{name}-sw", f"{name}-h0", f"{name}-h1"}
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [d for d in os.listdir(vcluster.TMP) if d.startswith(name)]


@pytest.mark.timeout(120)
def test_mpi_hostfile_and_stock_script(vc, tmp_path):
    """An MPI-style host file (`host slots=N`) and a stock dist_sync script, over ssh."""
    from jobs.test_stock import STOCK
    script = tmp_path / "stock.py"
    script.write_text(STOCK)
    hostfile = tmp_path / "mpi_hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=2\n")   # server 0 and worker 0 on h1, worker 1 on h2
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "-s", "1", "--launcher", "ssh", "-H", str(hostfile),
                            "--ssh-config", vc.ssh_config, "--interface", "eth0", "python", str(script)])
    rc, out = _finish(*_start(argv, tmp_path), timeout=90)
    assert rc == 0, out
    assert len(re.findall(r"rank \d of 2 sum 3 ", out)) == 2, out


def ended_launchers_folders(before):
    """The launcher job folders in ROOT, not in `before`, whose launcher process has ended: left behind.
    (A job of a test running alongside may have a folder there too, while its launcher lives.)"""
    return [name for name in set(os.listdir(ROOT)) - before
            if name.startswith(".ssdsgd-launch-") and owner_ended(os.path.join(ROOT, name))]


@pytest.mark.timeout(120)
def test_stalled_remote_worker(vc, tmp_path):
    """Heartbeat files live in the shared working directory, so stall detection works over ssh."""
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "2", "-s", "1", "--launcher", "ssh",
                            "-H", _hostfile(vc, tmp_path), "--ssh-config", vc.ssh_config, "--interface", "eth0",
                            "--env", "SSDSGD_TEST_FAULT=slow:1:60", "--stall-timeout", "8",
                            "python", "-m", "ssdsgd.train", "--config", SSD, "--set", "train.epochs=5",
                            "--set", f"log.dir={tmp_path / 'runs'}"])
    before = set(os.listdir(ROOT))
    t0 = time.monotonic()
    rc, out = _finish(*_start(argv, tmp_path), timeout=60)
    assert rc == 1, out
    assert re.search(r"launch: worker [01]( \(rank 1\))? made no progress for 8 s", out), out
    assert time.monotonic() - t0 < 8 + STOP_SECONDS
    assert "every process on every host has ended" in out
    assert ended_launchers_folders(before) == []     # the heartbeat folder removed


@pytest.mark.timeout(60)
def test_unreachable_host_is_named(vc, tmp_path):
    """A host nobody answers on (an unused address inside the cluster's subnet): the job fails, naming it and
    what ssh said (no route, or a timeout, as the neighbour lookup goes), not a lost connection."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{vcluster.SUBNET}.250\nh2\n")
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "1", "-s", "1", "--launcher", "ssh", "-H", str(hostfile),
                            "--ssh-config", vc.ssh_config, "--interface", "eth0", "sleep", "600"])
    t0 = time.monotonic()
    rc, out = _finish(*_start(argv, tmp_path), timeout=40)
    assert rc == 1, out
    assert time.monotonic() - t0 < STOP_SECONDS
    assert re.search(rf"launch: server 0 could not start on {re.escape(vcluster.SUBNET)}\.250 \(ssh exited with code "
                     r"255\): (there is no route to the host|the ssh connection timed out)", out), out


def _params(path):
    import mxnet as mx
    return {k: v.asnumpy() for k, v in mx.nd.load(path).items()}


STRICT = ["algorithm.warmup_iters=3", "algorithm.delay=2", "algorithm.strict=true"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("config, sets", [
    ("demo_digits_ssgd.yaml", []),
    ("demo_digits_ssd.yaml", STRICT),
    # fixed buffers: the same buffers whatever the server count, placed by bytes across the servers
    ("demo_digits_ssd_topk.yaml", STRICT + ["compression.buffers=fixed", "compression.buffer_bytes=16384"]),
], ids=["ssgd", "ssd", "ssd_topk"])
def test_two_servers_on_two_hosts_match_one_server(vc, tmp_path, config, sets):
    """Servers on h1 and h2, both workers on h3: the global model equals a 1-server run's."""
    hostfile = tmp_path / "own_hosts"
    hostfile.write_text("h1\nh2\nh3 slots=2\n")
    common = ["train.epochs=1", "train.max_steps=12", "log.every_steps=4", *sets]
    models = {}
    for servers in (1, 2):
        argv, run_dir = cluster_command(vc, tmp_path, *common, f"cluster.servers={servers}", config=os.path.join(
            ROOT, "configs", config), hostfile=str(hostfile), name=f"s{servers}")
        rc, out = _finish(*_start(argv, tmp_path), timeout=60)
        assert rc == 0, out
        assert f"2 workers, {servers} servers" in out
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        assert summary["steps"] == 12
        models[servers] = _params(summary["checkpoint"])
    assert models[1].keys() == models[2].keys()
    for k in models[1]:
        np.testing.assert_allclose(models[2][k], models[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.timeout(60)
def test_ssh_user_identity_and_options_without_a_config_file(vc, tmp_path):
    """What a cluster without an ssh config file needs: user, key and -o options from the command line."""
    toy = tmp_path / "toy"
    toy.mkdir()
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{vc.addresses[1]}\n{vc.addresses[2]}:22\n")
    argv = vc.exec_argv(0, [sys.executable, LAUNCH, "-n", "1", "-s", "1", "--launcher", "ssh", "-H", str(hostfile),
                            "--ssh-user", "root", "--ssh-identity", vc.key,
                            "--ssh-option", "UserKnownHostsFile=/dev/null", "--ssh-option", "LogLevel=ERROR",
                            "--interface", "eth0", "--env", f"TOY_DIR={toy}", "python", "-c", TOY])
    rc, out = _finish(*_start(argv, tmp_path), timeout=40)
    assert rc == 0, out
    seen = {p.name: json.loads(p.read_text()) for p in toy.iterdir()}
    assert seen["server0"]["DMLC_NODE_HOST"] == vc.addresses[1]
    assert seen["worker0"]["DMLC_NODE_HOST"] == vc.addresses[2]


@pytest.mark.timeout(240)
def test_a_short_outage_is_said_as_it_happens_and_in_launcher_log(vc, tmp_path):
    """h1 (server 0) off the network for 10 s mid-run, with the default timeouts: the job rides it out.
    Before: the pause left no trace in the output or in launcher.log. Now a line, with the time of day, once
    no worker has made a step for a few seconds, and one when they go on, on the terminal and in
    launcher.log; the job finishes (exit 0)."""
    ns = vc.namespaces[HOSTS["server 0"]]
    argv, run_dir = cluster_command(vc, tmp_path, "train.epochs=20", "log.every_steps=2")
    proc, out = _start(argv, tmp_path)
    try:
        _wait_for(lambda: os.path.exists(os.path.join(run_dir, "metrics.jsonl")), 60, "training to start")
        time.sleep(1.0)
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
        time.sleep(10.0)
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        rc, text = _finish(proc, out, timeout=180)
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, text[-3000:]
    paused = re.findall(r"^launch: \d\d:\d\d:\d\d no worker has made a step for \d+ s \(stall timeout 300 s\)$",
                        text, re.M)
    went_on = re.findall(r"^launch: \d\d:\d\d:\d\d the workers go on after (\d+) s without a step$", text, re.M)
    assert len(paused) == 1 and len(went_on) == 1, text[-3000:]
    assert int(went_on[0]) >= 9, text[-3000:]
    print(f"10 s outage: {paused[0]} / the workers went on after {went_on[0]} s")
    log = open(os.path.join(run_dir, "launcher.log")).read()
    assert paused[0] in log and f"the workers go on after {went_on[0]} s without a step" in log, log


SSD_TOPK = os.path.join(ROOT, "configs", "demo_digits_ssd_topk.yaml")
# Strict SSD-SGD + top-k (the result does not depend on timing), a checkpoint every epoch, a lost host named
# within the server timeout (ssh's keepalive), and long enough to cut a host off after the first checkpoint
# (the cut follows it within a poll of 0.2 s; a cut-off job makes no step, so it cannot end before the cut
# is noticed).
SPARE_EPOCHS = 5
SPARE_RUN = [f"train.epochs={SPARE_EPOCHS}", "log.every_steps=11", *STRICT, "checkpoint.every_epochs=1",
             "cluster.server_timeout=8", "cluster.stall_timeout=60"]


@pytest.fixture(scope="module")
def uninterrupted_on_hosts(cluster, tmp_path_factory):
    """SPARE_RUN on h1 h2 h3 without a fault: the weights a run that lost a host must end with."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    argv, run_dir = cluster_command(cluster, tmp, *SPARE_RUN, f"checkpoint.dir={tmp / 'ck'}", config=SSD_TOPK, name="C")
    t0 = time.monotonic()
    rc, out = _finish(*_start(argv, tmp), timeout=240)
    assert rc == 0, out[-3000:]
    print(f"uninterrupted run on h1-h3: {time.monotonic() - t0:.1f} s")
    return json.load(open(os.path.join(run_dir, "summary.json")))


def _no_role_on(vc, i):
    """True once no process of the job (a role, its remote.py) is left on host i (its sshd sessions aside)."""
    return not [p for p in vc.pids(i) if vcluster.netns.read_environ(p).get("DMLC_ROLE")]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("victim", ["worker 0", "server 0"])
def test_a_host_lost_for_good_gives_its_roles_to_the_spare_and_the_run_ends_on_the_same_weights(
        vc, tmp_path, victim, uninterrupted_on_hosts):
    """The host file lists h4 as a spare. Once the epoch-1 checkpoint exists, the victim's host drops off the
    network for the rest of the run. The job fails naming the lost role; the restart finds the host does not
    answer, gives its roles to h4 and resumes from the newest checkpoint; the run ends with the uninterrupted
    run's weights (strict mode), the whole story in launcher.log. The roles left on the cut-off host end
    while it is still cut off (the launcher removed the job folder); nothing is left on any host."""
    i = HOSTS[victim]
    host, ns = vc.hostnames[i], vc.namespaces[i]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\nh3\nh4 spare   # takes a lost host's roles\n")
    ck = tmp_path / "ck"
    argv, run_dir = cluster_command(vc, tmp_path, *SPARE_RUN, f"checkpoint.dir={ck}", "cluster.max_restarts=2",
                             config=SSD_TOPK, hostfile=str(hostfile), name="spare")
    proc, out = _start(argv, tmp_path)
    try:
        _wait_for(lambda: os.path.exists(ck / "epoch-0001" / "manifest.json"), 120, "the epoch-1 checkpoint")
        assert _no_role_on(vc, 4)   # the spare has no role before the cut
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
        t0 = time.monotonic()
        _wait_for(lambda: _no_role_on(vc, i), 120, f"the roles on the cut-off {host} to end")
        ended = time.monotonic() - t0
        _wait_for(lambda: _role_pid(vc, victim, host=4), 120, f"{victim} on the spare h4")
        moved = time.monotonic() - t0
        rc, text = _finish(proc, out, timeout=300)
        print(f"{host} ({victim}) cut off: its roles ended {ended:.1f} s after the cut, {victim} ran on h4 "
              f"{moved:.1f} s after it, launcher exit {rc} {time.monotonic() - t0:.1f} s after it")
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, text[-4000:]
    log = open(os.path.join(run_dir, "launcher.log")).read()
    story = [rf"launch: {victim}( \(rank \d\))? lost: ssh to {host} exited with code 255",
             rf"run: {host} \({victim}\) does not answer before restart 1: ",
             rf"run: spare h4 takes over {victim} from {host}; {host} is left out of this run",
             r"run: restart 1 of 2 in 1 s: the job failed \(exit 1\); resuming from .*/ck/epoch-000\d"]
    _assert_said_in_order(story, log)
    assert "restart 2" not in log, log[-4000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps"] == uninterrupted_on_hosts["steps"] == SPARE_EPOCHS * 22
    _assert_same_weights(summary["checkpoint"], uninterrupted_on_hosts["checkpoint"])
    for key in ("test_acc_history", "final_test_acc"):
        assert summary[key] == uninterrupted_on_hosts[key], key
    # Nothing in a checkpoint names a host: the resume on other hosts read the same files.
    for manifest in ck.glob("epoch-*/manifest.json"):
        assert not re.search(r"\bh[0-4]\b|10\.231\.", manifest.read_text()), manifest
    _wait_for(lambda: vc.leftovers() == {}, 60, f"the ssh sessions on {host} to end once it is back")


def _assert_said_in_order(story, text):
    """Every pattern of `story` is in `text` (a launcher.log), in that order."""
    at = [re.search(line, text, re.M) for line in story]
    assert all(at) and [m.start() for m in at] == sorted(m.start() for m in at), text[-4000:]


def _assert_same_weights(path, uninterrupted_path):
    got, want = _params(path), _params(uninterrupted_path)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("back", [True, False], ids=["host_back_in_time", "host_gone"])
def test_without_a_spare_the_restart_waits_for_the_lost_host_up_to_host_wait(vc, tmp_path, back,
                                                                             uninterrupted_on_hosts):
    """No spare: worker 0's host h2 drops off the network after the epoch-1 checkpoint. Before, each restart
    failed at once (no route to h2) and cluster.max_restarts was used up in seconds. Now the restart waits
    for h2, probing it: back within cluster.host_wait, the run resumes on it and ends with the uninterrupted
    run's weights; gone longer, ssdsgd-run gives up after host_wait with one restart unused, naming the command
    that continues."""
    host_wait = 90 if back else 8
    ns = vc.namespaces[HOSTS["worker 0"]]
    ck = tmp_path / "ck"
    argv, run_dir = cluster_command(vc, tmp_path, *SPARE_RUN, f"checkpoint.dir={ck}", "cluster.max_restarts=2",
                             f"cluster.host_wait={host_wait}", config=SSD_TOPK, name="wait")
    waiting = (f"run: no spare left for h2: waiting up to {host_wait} s for it (cluster.host_wait), probing "
               f"every 5 s")
    proc, out = _start(argv, tmp_path)
    try:
        _wait_for(lambda: os.path.exists(ck / "epoch-0001" / "manifest.json"), 120, "the epoch-1 checkpoint")
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
        t0 = time.monotonic()
        log = os.path.join(run_dir, "launcher.log")
        _wait_for(lambda: waiting in open(log).read(), 120, "the wait for h2")
        if back:
            time.sleep(7.0)        # at least one probe during the wait finds h2 still gone
            subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        rc, text = _finish(proc, out, timeout=300)
        print(f"h2 cut off{', back after the wait began' if back else ''}: launcher exit {rc} "
              f"{time.monotonic() - t0:.1f} s after the cut")
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = open(log).read()
    story = [r"launch: worker 0( \(rank \d\))? lost: ssh to h2 exited with code 255",
             r"run: h2 \(worker 0\) does not answer before restart 1: ", re.escape(waiting)]
    if back:
        story += [r"run: h2 answers again after \d+ s", r"run: restart 1 of 2 in 1 s: the job failed \(exit 1\)"]
    else:
        story += [rf"run: h2 did not answer within {host_wait} s \(cluster.host_wait\); not restarted",
                  r"run: to continue from the newest checkpoint, .*/ck/epoch-000\d \(epoch \d, step \d+\): .* --resume"]
    _assert_said_in_order(story, said)
    if not back:
        assert rc == 1 and "run: restart" not in said, said[-4000:]
        _wait_for(lambda: vc.leftovers() == {}, 60, "the ssh sessions on h2 to end once it is back")
        return
    assert rc == 0, text[-4000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps"] == uninterrupted_on_hosts["steps"]
    _assert_same_weights(summary["checkpoint"], uninterrupted_on_hosts["checkpoint"])
    _wait_for(lambda: vc.leftovers() == {}, 60, "the ssh sessions on h2 to end")


@pytest.mark.timeout(150)
def test_a_host_down_at_the_start_gives_its_roles_to_the_spare(vc, tmp_path):
    """h2 (worker 0's host) is off the network before the job starts, no restarts allowed: the host file's spare
    takes worker 0 before the first launch (before, the job failed at once: could not start on h2)."""
    ns = vc.namespaces[HOSTS["worker 0"]]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\nh3\nh4 spare\n")
    argv, run_dir = cluster_command(vc, tmp_path, "train.epochs=1", "log.every_steps=11", "cluster.server_timeout=8",
                             "cluster.stall_timeout=60", hostfile=str(hostfile), name="start")
    subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
    try:
        t0 = time.monotonic()
        rc, out = _finish(*_start(argv, tmp_path), timeout=120)
        print(f"h2 down at the start: exit {rc} after {time.monotonic() - t0:.1f} s")
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
    assert rc == 0, out[-3000:]
    log = open(os.path.join(run_dir, "launcher.log")).read()
    assert re.search(r"^run: h2 \(worker 0\) does not answer at the start: .*\n"
                     r"run: spare h4 takes over worker 0 from h2; h2 is left out of this run$", log, re.M), log
    assert json.load(open(os.path.join(run_dir, "summary.json")))["steps"] == 22
