"""Liveness of servers and the scheduler on real loopback jobs: a stopped process is named, fast.

A SIGSTOPped server or scheduler never exits; before cluster.server_timeout existed the job only ended
when the worker stall timeout (300 s by default) blamed a worker. Now the role's liveness file (touched
every second by a thread of its Python process) goes quiet and the launcher names the role and its host
within the server timeout.
"""
import os
import re
import signal

import pytest
from support.jobs import hit_role, processes_with, start_job

SSD_TOPK = "configs/demo_digits_ssd_topk.yaml"
SERVER_TIMEOUT = 5


@pytest.mark.timeout(180)
@pytest.mark.parametrize("role,name", [("server", "server 0"), ("scheduler", "scheduler")])
def test_stopped_server_or_scheduler_fails_the_job_within_the_server_timeout(tmp_path, role, name):
    proc, job = start_job(tmp_path, SSD_TOPK, "train.epochs=500", "log.every_steps=1",
                          f"cluster.server_timeout={SERVER_TIMEOUT}", name="stop")
    out, elapsed = hit_role(job, proc, role, 0, lambda pid: os.kill(pid, signal.SIGSTOP))
    print(f"{name} SIGSTOPped: job ended after {elapsed:.1f} s with exit {proc.returncode}")
    assert proc.returncode == 1, out[-3000:]
    # A server is labelled with its KVStore rank once it has reported it.
    assert re.search(rf"^launch: {name}( \(rank 0\))? on localhost gave no sign of life for {SERVER_TIMEOUT} s "
                     r"\(server timeout\): its process is stopped \(SIGSTOP or SIGTSTP\)", out, re.M), out[-3000:]
    assert "made no progress" not in out
    # The server timeout since the last touch, the supervisor's poll, and the cleanup (a stopped process gets
    # SIGCONT after its SIGTERM, so it ends at once).
    assert SERVER_TIMEOUT - 1.5 <= elapsed < SERVER_TIMEOUT + 15, out[-3000:]   # last touch: up to 1 s before
    assert processes_with(job.marker) == []      # the stopped process too
    assert not os.path.exists(os.path.join(job.run_dir, "summary.json"))
