"""Every node proves it belongs to the job (ssdsgd.ps.membership): a stranger that joins is named at once."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support.jobs import processes_with, role_of, start_job

from unit.test_membership import _wait

SSGD = "configs/demo_digits_ssgd.yaml"
SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"

# A plain MXNet client, as anyone who can reach the scheduler's port could run: it imports mxnet first
# (so it wins the race against the job's own workers), then joins with the DMLC_* settings it reads
# on stdin, says which rank it got, and sits there.
STRANGER = """
import json, os, sys, time
import mxnet as mx
print("ready", flush=True)
os.environ.update(json.loads(sys.stdin.readline()))
kv = mx.kv.create("dist_sync")
print(f"stranger rank {kv.rank} of {kv.num_workers}", flush=True)
time.sleep(300)
"""


def _environment(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


def _connected_to(pid, port):
    """Whether process `pid` has an established TCP connection to `port` (from /proc/<pid>/net/tcp)."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:["):-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    with open(f"/proc/{pid}/net/tcp") as f:
        rows = [line.split() for line in list(f)[1:]]
    return any(cols[3] == "01" and int(cols[2].split(":")[1], 16) == port and cols[9] in inodes for cols in rows)


def _job_pids(job, proc, workers):
    """{(role, task): pid} of the job's scheduler, server 0 and workers, once every one of them runs."""
    def roles():
        pids = {role_of(pid): pid for pid in processes_with(job.marker)}
        assert proc.poll() is None, proc.stdout.read()
        wanted = [("scheduler", 0), ("server", 0)] + [("worker", w) for w in range(workers)]
        return pids if all(r in pids for r in wanted) else None
    return _wait("the job's processes", roles)


def _resume(pids):
    """SIGCONT to each held role still there: the job may already have ended (what the test provokes) and
    its cleanup killed them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _scheduler_port(pids):
    return int(_environment(pids[("scheduler", 0)])["DMLC_PS_ROOT_PORT"])


def _hand_in(stranger, pids, port):
    """Give the stranger the scheduler's DMLC_* settings as worker 0's, and wait until it has connected."""
    env = {k: v for k, v in _environment(pids[("scheduler", 0)]).items() if k.startswith("DMLC_")}
    env.update(DMLC_ROLE="worker", DMLC_TASK_ID="0")
    stranger.stdin.write(json.dumps(env) + "\n")
    stranger.stdin.flush()
    _wait("the stranger to register", lambda: _connected_to(stranger.pid, port))


def _start_stranger():
    """The STRANGER process, ready for its settings on stdin."""
    return subprocess.Popen([sys.executable, "-c", STRANGER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def let_a_stranger_in(job, proc, stranger, workers=2):
    """Hand the stranger the DMLC_* settings of the job's scheduler (read from /proc, as tests/jobs.py
    role_of reads a role's) so that it registers after server 0 and before the job's workers. ps-lite
    ranks the first W+S nodes that register, whatever their roles: a stranger before the server would
    leave it no place (the scheduler then aborts in van.cc, `there is no socket to node 8`); this way
    it takes a worker's place, as when it connects as soon as the scheduler listens and wins the race.
    The job's workers are held with SIGSTOP (from their start, before they connect) until it has.
    Returns the time every node is in (the roll call can start): the first of the job's workers
    registers, or with one worker, the stranger (the job's worker then has no place)."""
    pids = _job_pids(job, proc, workers)
    held = [pids[("worker", w)] for w in range(workers)]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        port = _scheduler_port(pids)
        assert not any(_connected_to(pid, port) for pid in held)
        _wait("server 0 to register", lambda: _connected_to(pids[("server", 0)], port))
        _hand_in(stranger, pids, port)
        if workers == 1:
            return time.time()
        time.sleep(0.5)       # its registration reaches the scheduler
    finally:
        _resume(held)
    _wait("a worker of the job to register", lambda: any(_connected_to(pid, port) for pid in held))
    return time.time()


def run_with_a_stranger(tmp_path, config, *sets, workers=2):
    """A job that a stranger joins (let_a_stranger_in): (output, the stranger's output, seconds from every
    node being in to the job's end, the job's Popen, Job)."""
    stranger = _start_stranger()
    proc = None
    try:
        assert stranger.stdout.readline().strip() == "ready"
        proc, job = start_job(tmp_path, config, "train.epochs=500", *sets, name="stranger")
        t0 = let_a_stranger_in(job, proc, stranger, workers)
        out, _ = proc.communicate(timeout=60)
        elapsed = time.time() - t0
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        joined, _ = stranger.communicate()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out, joined, elapsed, proc, job


@pytest.mark.timeout(150)
def test_a_stranger_worker_is_named_at_once(tmp_path):
    """Before: the stranger was admitted as a worker rank; the job hung (or died 13-14 s later with
    `server 0 killed by SIGABRT ... init 1048576 first`). Now the servers name its rank within seconds.
    (The round server's job, where that abort was seen; the stock server meets its stranger in the
    test below: one job per server kind.)"""
    out, joined, elapsed, proc, job = run_with_a_stranger(tmp_path, SSD_TOPK)
    # Exactly one rank is named: the stranger's (it says which, if it got out of kv.create, which waits in
    # ps-lite's start barrier, before the job ended).
    named = re.findall(r"worker ranks? ([\d, ]+) ha(?:s|ve) not proven", out)
    assert len(set(named)) == 1 and named[0].isdigit(), out[-3000:]
    rank = int(named[0])
    admitted = re.search(r"stranger rank (\d+) of 2", joined)
    assert admitted is None or int(admitted.group(1)) == rank, joined
    print(f"stranger joined as worker rank {rank}; the job ended {elapsed:.1f} s after "
          f"every node was in")
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"^launch: server 0 .*exited with code 1", out, re.M), out[-3000:]
    assert "init 1048576 first" not in out and "SIGABRT" not in out
    assert elapsed < 5 + 5       # README: named within 5 s of the start-up's end (+ the job's end)
    assert processes_with(job.marker) == []


@pytest.mark.timeout(150)
def test_a_stranger_holding_every_worker_rank_is_named_at_once(tmp_path):
    """One worker, and the stranger registers before it: ps-lite gives the stranger the only worker rank
    and the job's own worker waits inside its start-up for good. Before: no hello ever came, so the
    servers never started their clock, and the job ended at the stall timeout as "worker 0 made no
    progress". Now the server sees the start-up is over (the stranger connected to it) and names rank 0
    and the stranger's host within HELLO_TIMEOUT. (On SSGD: the stock server's roll call.)"""
    out, joined, elapsed, proc, job = run_with_a_stranger(
        tmp_path, SSGD, "cluster.workers=1", "cluster.stall_timeout=120", "cluster.server_timeout=60", workers=1)
    print(f"the job ended {elapsed:.1f} s after the stranger registered")
    assert "stranger rank 0 of 1" in joined, joined
    assert re.search(r"worker rank 0 has not proven that it belongs to the job .*connected to this server from "
                     r"127\.0\.0\.1", out), out[-3000:]
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"^launch: server 0 .*exited with code 1", out, re.M), out[-3000:]
    assert "made no progress" not in out
    assert elapsed < 5 + 10      # README: within 5 s (+ the server's start-up and the job's end)
    assert processes_with(job.marker) == []


def let_a_stranger_in_first(job, proc, stranger, workers=2):
    """As let_a_stranger_in, but the stranger registers before server 0 too (both held with the workers):
    ps-lite then ranks the stranger and the job's workers as the first W+S nodes, none a server, and the
    scheduler aborts in van.cc (`there is no socket to node 8`)."""
    pids = _job_pids(job, proc, workers)
    held = [pids[("server", 0)]] + [pids[("worker", w)] for w in range(workers)]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        port = _scheduler_port(pids)
        assert not any(_connected_to(pid, port) for pid in held)
        _hand_in(stranger, pids, port)
        time.sleep(0.5)
        for pid in held[1:]:
            os.kill(pid, signal.SIGCONT)       # the workers first: with the stranger, W + S nodes
        time.sleep(1.5)
    finally:
        _resume(held)


@pytest.mark.timeout(150)
def test_a_stranger_before_every_role_of_the_job_is_named_when_the_scheduler_aborts(tmp_path):
    """Before: ps-lite's scheduler aborted (`there is no socket to node 8`, SIGABRT) and the job failed
    naming only the scheduler. Now one line says that a process that is not one of the job's roles connected
    to the scheduler, and from where (the stranger's connection, still open, shows its process here)."""
    stranger = _start_stranger()
    proc = None
    try:
        assert stranger.stdout.readline().strip() == "ready"
        proc, job = start_job(tmp_path, SSGD, "train.epochs=500", name="first")
        let_a_stranger_in_first(job, proc, stranger)
        out, _ = proc.communicate(timeout=90)
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.communicate()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(out[-3000:])
    assert proc.returncode == 1, out[-3000:]
    said = [line for line in out.splitlines() if "not one of the job's roles" in line]
    assert len(said) == 1, out[-3000:]
    assert re.search(r"^launch: scheduler .*a process that is not one of the job's roles connected to the "
                     r"scheduler.* from 127\.0\.0\.1", said[0]), said[0]
    assert f"PID {stranger.pid}" in said[0] and said[0].endswith("(README: A private network)"), said[0]
    assert processes_with(job.marker) == []
