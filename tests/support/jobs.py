"""Helpers for tests that run real multi-process jobs (scheduler + servers + workers) on loopback."""
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

import pytest
from testbed import vcluster
from testbed.procs import processes_with, role_of  # noqa: F401  (the tests import them from here)
from scripts.results_io import job_command, run_folder

from ssdsgd.metrics import metrics_file, read_metrics, read_summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def virtual_cluster(hosts):
    """A testbed.vcluster.VCluster of `hosts` hosts, deleted afterwards; the test is skipped, with the reason,
    where none can be made (not root, no iproute2 or openssh)."""
    try:
        vc = vcluster.VCluster(hosts=hosts).create()
    except vcluster.ClusterError as e:
        pytest.skip(f"no virtual cluster here: {e}")
    try:
        yield vc
    finally:
        vc.delete()


def end_group(proc):
    """A test's cleanup of a Popen started with start_new_session: SIGKILL its process group if the
    leader still runs, then reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class Job:
    rc: int
    output: str
    run_dir: str
    marker: str

    def summary(self):
        return read_summary(self.run_dir)

    def metrics(self, rank=0):
        return read_metrics(self.run_dir, rank)


def _command(tmp_path, config, sets, name, args):
    log_dir = os.path.join(str(tmp_path), "runs")
    return job_command(os.path.join(ROOT, config), name, log_dir, sets) + list(args), log_dir


def _env(env):
    full_env = dict(os.environ, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return full_env


def run_job(tmp_path, config, *sets, name="job", env=None, timeout=240, args=()):
    """Run `python -m ssdsgd` with the given overrides; the run folder lives under tmp_path."""
    cmd, log_dir = _command(tmp_path, config, sets, name, args)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, start_new_session=True)
    return Job(proc.returncode, proc.stdout, run_folder(proc.stdout, log_dir, name), log_dir)


def start_job(tmp_path, config, *sets, name="job", env=None, args=()):
    """Start a job in the background; returns (Popen with merged text output, Job without rc)."""
    cmd, log_dir = _command(tmp_path, config, sets, name, args)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return proc, Job(None, "", run_folder("", log_dir, name), log_dir)


def wait_for_progress(job, proc, timeout=60):
    """Until rank 0 has logged a step (the job is past start-up), or fail the test."""
    import pytest
    path = os.path.join(job.run_dir, metrics_file(0))
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"job ended early: {proc.stdout.read()}")
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return
        time.sleep(0.2)
    pytest.fail("job made no progress")


def hit_role(job, proc, role, task, hit, progress_timeout=90, end_timeout=90):
    """Once the job is past start-up, call hit(pid) on the one process of (role, task), then wait for
    the job to end. Returns (output, seconds from the hit to the end); the job is killed if it
    outlives the wait (the caller checks that nothing is left)."""
    import signal
    try:
        wait_for_progress(job, proc, timeout=progress_timeout)
        victims = [p for p in processes_with(job.marker) if role_of(p) == (role, task)]
        assert len(victims) == 1, victims
        hit(victims[0])
        t0 = time.time()
        out, _ = proc.communicate(timeout=end_timeout)
        return out, time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stopped_resumed_and_uninterrupted(tmp_path, config, *sets, stop_steps, uninterrupted=None):
    """Three jobs with a checkpoint every epoch: A stops after `stop_steps` steps, B resumes A's
    checkpoint to the end, C runs to the end without stopping (or is `uninterrupted`, a finished
    job of the same config and sets). Returns (a, b, c), each checked to have succeeded, and B
    checked to have resumed. `sets` must include checkpoint.every_epochs."""
    ck = os.path.join(str(tmp_path), "ck")
    a = run_job(tmp_path, config, *sets, f"checkpoint.dir={ck}", f"train.max_steps={stop_steps}", name="A")
    assert a.rc == 0, a.output
    b = run_job(tmp_path, config, *sets, f"checkpoint.dir={ck}", name="B", args=["--resume"])
    assert b.rc == 0, b.output
    assert "resuming from" in b.output
    c = uninterrupted or run_job(tmp_path, config, *sets, f"checkpoint.dir={tmp_path}/ck_c", name="C")
    assert c.rc == 0, c.output
    return a, b, c


def ssh_roles(command, hosts, num_workers, num_servers, env, cwd, ssh_options=()):
    """The servers and workers of an ssh job as the launcher plans them (plan._ssh_specs, which plan() calls):
    [(name, ssh argv, the role script for its stdin)], for `hosts` ([Host]) and the job variables `env`."""
    from ssdsgd.launch.plan import _ssh_specs
    return [(s.name, s.argv, s.stdin)
            for s in _ssh_specs(command, hosts, num_workers, num_servers, env, cwd, ssh_options)]
