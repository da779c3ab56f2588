"""Chaos run: random faults injected into one strict SSD-SGD + top-k job that restarts itself
(cluster.max_restarts); it must end exactly where an uninterrupted run of the same settings ends.

    sudo python scripts/chaos.py [--faults 10] [--seed 0] [--epochs 40] [--kinds kill stop disk]
        [--out results/chaos]

First an uninterrupted reference job, then the chaos job with a checkpoint every epoch. After each
checkpoint the job has written since the last fault, one fault at a random moment: SIGKILL or SIGSTOP
of a random role (scheduler, server or worker), or a full disk under checkpoint.dir (a small tmpfs,
filled until the next save fails, emptied once the job restarts; root only: mount). The job must
then finish with exit 0, final weights bit for bit the reference's, its metrics recording every step
once, one restart per fault and no process of it left. Writes faults.csv (what was hit, when, and how
long until the restart and the next checkpoint), summary.md and manifest.json to --out.
"""
import argparse
import csv
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from procs import processes_with, role_of
from results_io import job_command, run_folder, write_manifest, write_text

from ssdsgd.metrics import read_metrics, read_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "demo_digits_ssd_topk.yaml")
# Strict mode (every round waits for every worker: the result does not depend on timing), one buffer
# (no link-cost plan), short failure detection.
SETTINGS = ["algorithm.strict=true", "compression.buffers=one", "checkpoint.every_epochs=1",
            "cluster.stall_timeout=30", "cluster.server_timeout=10", "log.every_steps=11"]
SLOW_WORKER = {"SSDSGD_TEST_FAULT": "slow:1:0.03"}    # a longer epoch: time to hit the job between saves
KINDS = ("kill", "stop", "disk")
ROLES = (("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1))


class ChaosError(RuntimeError):
    pass


class Job:
    """The chaos job: its process, its output (read by a thread), its checkpoint folder."""

    def __init__(self, cmd, env, log_path, ck):
        self.ck, self.lines, self.log = ck, [], open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    def output(self):
        return "".join(self.lines)

    def restarts(self):
        return self.output().count("run: restart ")

    def checkpoints(self):
        return sorted(d for d in os.listdir(self.ck) if os.path.exists(os.path.join(self.ck, d, "manifest.json"))) \
            if os.path.isdir(self.ck) else []


def wait_until(test, seconds, what, job):
    t0 = time.monotonic()
    while not test():
        if job.proc.poll() is not None:
            raise ChaosError(f"the job ended (exit {job.proc.returncode}) while waiting for {what}")
        if time.monotonic() - t0 > seconds:
            raise ChaosError(f"no {what} within {seconds:g} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def role_pid(marker, role):
    pids = [p for p in processes_with(marker) if role_of(p) == role]
    return pids[0] if len(pids) == 1 else None


def fill(folder):
    """Write zeros into folder/filler until the file system is full."""
    path = os.path.join(folder, "filler")
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    return path


def inject(kind, rng, job, marker, disk):
    """One fault; returns what was hit."""
    if kind == "disk":
        filler = fill(disk)
        restarts = job.restarts()
        wait_until(lambda: job.restarts() > restarts, 120, "a restart after the full disk", job)
        os.remove(filler)
        return "checkpoint.dir (full)"
    role = rng.choice(ROLES)
    pid = role_pid(marker, role)
    if pid is None:
        raise ChaosError(f"{role[0]} {role[1]} of the job not found")
    os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return f"{role[0]} {role[1]}"


def chaos(args, out, ck, disk, reference):
    env = dict(os.environ, OMP_NUM_THREADS="1", **SLOW_WORKER)
    marker = os.path.join(out, "runs")
    sets = SETTINGS + [f"train.epochs={args.epochs}", f"seed={args.seed}", f"checkpoint.dir={ck}",
                       f"cluster.max_restarts={args.faults + 2}"]
    job = Job(job_command(CONFIG, "chaos", marker, sets), env, os.path.join(out, "chaos.log"), ck)
    rng, kinds = random.Random(args.seed), [k for k in args.kinds if k != "disk" or disk]
    faults, t_start = [], time.monotonic()
    try:
        for i in range(args.faults):
            seen = len(job.checkpoints())
            wait_until(lambda: len(job.checkpoints()) > seen, 300, "new checkpoint", job)
            time.sleep(rng.uniform(0.0, 1.0))
            kind = rng.choice(kinds)
            restarts, t0 = job.restarts(), time.monotonic()
            target = inject(kind, rng, job, marker, disk)
            print(f"fault {i + 1}/{args.faults}: {kind} {target} at {t0 - t_start:.1f} s", flush=True)
            to_restart = wait_until(lambda: job.restarts() > restarts, 180, "restart", job)
            seen = len(job.checkpoints())
            to_save = wait_until(lambda: len(job.checkpoints()) > seen, 300, "checkpoint after the restart", job)
            faults.append({"fault": i + 1, "kind": kind, "target": target, "at_seconds": round(t0 - t_start, 2),
                           "epochs_saved": seen, "seconds_to_restart": round(to_restart, 2),
                           "seconds_to_next_checkpoint": round(to_restart + to_save, 2)})
        job.proc.wait(timeout=1800)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
        job.reader.join(timeout=10)
        job.log.close()
    return job, faults, time.monotonic() - t_start


def check(job, faults, reference, marker):
    """What the chaos job must have ended with; the list of problems (empty: passed)."""
    import mxnet as mx
    import numpy as np
    problems = []
    if job.proc.returncode != 0:
        problems.append(f"the job exited {job.proc.returncode}")
        return problems
    folder = run_folder(job.output(), marker, "chaos")
    s, r = read_summary(folder), read_summary(reference)
    if job.restarts() != len(faults):
        problems.append(f"{job.restarts()} restarts for {len(faults)} faults")
    mine, ref = ({k: v.asnumpy() for k, v in mx.nd.load(p).items()} for p in (s["checkpoint"], r["checkpoint"]))
    differ = [k for k in ref if not np.array_equal(mine[k], ref[k])]
    if differ:
        problems.append(f"final weights differ from the reference in {len(differ)} arrays, e.g. {differ[0]}")
    if s["test_acc_history"] != r["test_acc_history"]:
        problems.append("the accuracy history differs from the reference's")
    for rank in range(s["num_workers"]):
        steps = [m["step"] for m in read_metrics(folder, rank) if "loss" in m]
        want = [m["step"] for m in read_metrics(reference, rank) if "loss" in m]
        if steps != want:
            problems.append(f"rank {rank}'s metrics log steps {steps[:5]}..., the reference {want[:5]}...")
    left = processes_with(marker)
    if left:
        problems.append(f"processes left: {left}")
    return problems


def small_disk():
    """A 64 MiB tmpfs for checkpoint.dir (root only), or None."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return None
    disk = tempfile.mkdtemp(prefix="ssdsgd-chaos-disk-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", disk]).returncode != 0:
        os.rmdir(disk)
        return None
    return disk


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/chaos.py", description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="of the training and of the faults")
    ap.add_argument("--epochs", type=int, default=40, help="enough for a checkpoint between faults")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="faults to draw from")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "chaos"))
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.exists(os.path.join(out, "manifest.json")):
        ap.error(f"--out: {out} already holds results; choose another folder")
    os.makedirs(out, exist_ok=True)
    write_manifest(out, [CONFIG], finished=False, settings=SETTINGS)
    marker = os.path.join(out, "runs")
    scratch = tempfile.mkdtemp(prefix="ssdsgd-chaos-")      # checkpoints: megabytes, not results
    t0 = time.monotonic()
    sets = SETTINGS + [f"train.epochs={args.epochs}", f"seed={args.seed}",
                       f"checkpoint.dir={os.path.join(scratch, 'reference_ck')}"]
    ref = subprocess.run(job_command(CONFIG, "reference", marker, sets), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **SLOW_WORKER))
    if ref.returncode != 0:
        print(ref.stdout[-3000:], file=sys.stderr)
        shutil.rmtree(scratch, ignore_errors=True)
        return 1
    reference, ref_seconds = run_folder(ref.stdout, marker, "reference"), time.monotonic() - t0
    disk = small_disk()
    ck = os.path.join(disk, "ck") if disk else os.path.join(scratch, "chaos_ck")
    try:
        job, faults, seconds = chaos(args, out, ck, disk, reference)
        problems = check(job, faults, reference, marker)
    except ChaosError as err:
        problems, faults, seconds = [str(err)], [], 0.0
    finally:
        if disk:
            subprocess.run(["umount", "-l", disk])
            os.rmdir(disk)
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(out, "faults.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["fault", "kind", "target", "at_seconds", "epochs_saved",
                                          "seconds_to_restart", "seconds_to_next_checkpoint"])
        w.writeheader()
        w.writerows(faults)
    text = summary(args, faults, problems, seconds, ref_seconds, disk is not None)
    write_text(os.path.join(out, "summary.md"), text)
    write_manifest(out, [CONFIG], finished=True, settings=SETTINGS, passed=not problems, faults=len(faults))
    print(text)
    return 0 if not problems else 1


def summary(args, faults, problems, seconds, ref_seconds, with_disk):
    kinds = {k: sum(f["kind"] == k for f in faults) for k in KINDS}
    lines = [f"# Chaos run: {len(faults)} faults into one strict SSD-SGD + top-k job (digits, {args.epochs} epochs, "
             f"seed {args.seed})", "",
             f"- result: {'PASSED' if not problems else 'FAILED: ' + '; '.join(problems)}",
             f"- faults: {kinds['kill']} SIGKILL, {kinds['stop']} SIGSTOP, {kinds['disk']} full disk"
             + ("" if with_disk else " (not run: needs root to mount a small tmpfs)"),
             f"- restarts: {len(faults)}; wall time {seconds:.0f} s against {ref_seconds:.0f} s uninterrupted "
             f"({seconds - ref_seconds:.0f} s lost)",
             "- checked: exit 0, final weights bit for bit the uninterrupted run's, the same accuracy history, every "
             "step once in each worker's metrics, no process left", ""]
    if faults:
        lines += ["| fault | kind | hit | at s | epochs saved | s to restart | s to next checkpoint |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {f['fault']} | {f['kind']} | {f['target']} | {f['at_seconds']} | {f['epochs_saved']} | "
                  f"{f['seconds_to_restart']} | {f['seconds_to_next_checkpoint']} |" for f in faults]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
