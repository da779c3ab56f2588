"""Chaos run: random faults injected into one strict SSD-SGD + top-k job that restarts itself
(cluster.max_restarts); it must end exactly where an uninterrupted run of the same settings ends.

    sudo python scripts/chaos.py [--faults 10] [--seed 0] [--epochs 40] [--kinds kill stop disk]
        [--out results/chaos]
    sudo python scripts/chaos.py --cluster [--faults 10] [--epochs 300] [--out results/chaos_cluster]

First an uninterrupted reference job, then the chaos job with a checkpoint every epoch. After each
checkpoint the job has written since the last fault, one fault at a random moment:
  kill   SIGKILL of a random role (scheduler, server or worker)
  stop   SIGSTOP of a random role, left stopped: the launcher's server or stall timeout ends the job
         (its cleanup sends SIGCONT with SIGTERM)
  pause  SIGSTOP of a random role, SIGCONT 1-3 s later: the job rides it out, no restart
  disk   a full disk under checkpoint.dir (a small tmpfs, filled until the next save fails, emptied
         once the job restarts; root only: mount)
  blip   (--cluster) a host's link down 1-3 s, then up: the job rides it out, no restart
  cut    (--cluster) a host's link down until the launcher gives the job up (ssh's keepalive, from
         cluster.server_timeout, notices an unreachable host first), then up: a restart
Every kind asked for is drawn at least once when there are as many faults as kinds. The job must
then finish with exit 0, final weights bit for bit the reference's, its metrics recording every step
once, one restart per kill, stop, disk and cut fault (none for the others) and no process of it left.

--cluster runs both jobs with `--launcher ssh` on a virtual cluster (testbed/vcluster.py, root only):
4 hosts in network namespaces on one bridge, one sshd each; h0 runs the launcher and the scheduler,
h1 server 0, h2 worker 0, h3 worker 1. Roles are found by PID inside the hosts' namespaces (their
DMLC_ROLE and DMLC_TASK_ID), a link is taken down at the switch (`ip link set v<i> down`: the host's
cable pulled). At the end no process may be left on any host; then the cluster is deleted and no
namespace or sshd of it may be left. Writes faults.csv (what was hit, when, for how long, and how long
until the restart and the next checkpoint), summary.md and manifest.json to --out.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from testbed.procs import processes_with, role_of
from scripts.results_io import job_command, run_folder, stop_on_sigterm, write_manifest, write_text
from ssdsgd.launch.watch import PAUSE_NOTE
from ssdsgd.metrics import read_metrics, read_summary

CONFIG = os.path.join(ROOT, "configs", "demo_digits_ssd_topk.yaml")
# Strict mode (every round waits for every worker: the result does not depend on timing), one buffer
# (no link-cost plan), short failure detection (each site adds its stall timeout).
SETTINGS = ["algorithm.strict=true", "compression.buffers=one", "checkpoint.every_epochs=1",
            "cluster.server_timeout=10", "log.every_steps=11"]
SLOW_WORKER = {"SSDSGD_TEST_FAULT": "slow:1:0.03"}    # a longer epoch: time to hit the job between saves
KINDS = ("kill", "stop", "pause", "disk", "blip", "cut")
LOOPBACK_KINDS = ("kill", "stop", "disk")             # the loopback run's default
LINK_KINDS = ("blip", "cut")                          # need the virtual cluster
RESTARTING = ("kill", "stop", "disk", "cut")          # faults the job must restart after
WORDS = {"kill": "SIGKILL", "stop": "SIGSTOP", "pause": "SIGSTOP + SIGCONT", "disk": "full disk",
         "blip": "link down for seconds", "cut": "link down until the job fails"}
ROLES = (("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1))
# Seconds a pause or a blip lasts. ssh's keepalive (every server_timeout / 4 s, 3 misses) gives up after
# ~8 s of silence, and TCP's retransmission back-off can stretch an outage's silence to about twice its
# length: a 4 s blip once ended the job on a busy machine.
SHORT = (1.0, 3.0)
QUIET = 12.0            # seconds from a pause's or a blip's start in which the launcher may report nothing
HOST_ROLES = ("launcher, scheduler", "server 0", "worker 0", "worker 1")   # --cluster: h0..h3
FIELDS = ["fault", "kind", "target", "at_seconds", "lasted_seconds", "epochs_saved", "restarted",
          "seconds_to_restart", "seconds_to_next_checkpoint"]


RESTART = "run: restart "      # the front end's line for each restart


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
        return self.output().count(RESTART)

    def checkpoints(self):
        return sorted(d for d in os.listdir(self.ck) if os.path.exists(os.path.join(self.ck, d, "manifest.json"))) \
            if os.path.isdir(self.ck) else []


def launcher_reported(lines):
    """Whether the launcher reported a failure among `lines`: its pause notes (`launch: 10:00:13 no worker
    has made a step for 5 s`) say only that the job waits."""
    return any(line.startswith("launch: ") and not PAUSE_NOTE.match(line) for line in lines)


def wait_until(test, seconds, what, job):
    t0 = time.monotonic()
    while not test():
        if job.proc.poll() == 0:
            raise ChaosError(f"the job finished while waiting for {what}: too few --epochs for the faults")
        if job.proc.poll() is not None:
            raise ChaosError(f"the job ended (exit {job.proc.returncode}) while waiting for {what}")
        if time.monotonic() - t0 > seconds:
            raise ChaosError(f"no {what} within {seconds:g} s")
        time.sleep(0.05)
    return time.monotonic() - t0


class Loopback:
    """Every role on this machine (the launcher's local mode)."""
    cluster = False
    settings = SETTINGS + ["cluster.stall_timeout=30"]

    def __init__(self, marker):
        self.marker = marker
        self.env = dict(os.environ, OMP_NUM_THREADS="1", **SLOW_WORKER)

    def command(self, name, sets):
        return job_command(CONFIG, name, self.marker, sets)

    def role_pid(self, role):
        pids = [p for p in processes_with(self.marker) if role_of(p) == role]
        return pids[0] if len(pids) == 1 else None

    def leftovers(self):
        return [str(p) for p in processes_with(self.marker)]

    def close(self):
        return []


class Cluster:
    """The virtual cluster (see the module docstring); the jobs run from h0 with --launcher ssh."""
    cluster = True
    # A restarted worker's start (imports, connecting, the roll call, loading the checkpoint) counts
    # against the stall timeout; over ssh on a busy machine it took more than 30 s.
    settings = SETTINGS + ["cluster.stall_timeout=60"]

    def __init__(self, marker, scratch):
        from testbed import vcluster
        self.marker, self.vcluster = marker, vcluster
        self.vc = vcluster.VCluster(hosts=len(HOST_ROLES)).create()
        hostfile = self.vc.write_hostfile(os.path.join(scratch, "hosts"), range(1, len(HOST_ROLES)))
        self.sets = ["cluster.launcher=ssh", f"cluster.hostfile={hostfile}", "cluster.interface=eth0",
                     f"cluster.ssh_config={self.vc.ssh_config}"]
        # The slow worker's variable would reach only the scheduler here (ssh roles get the job's variables).
        self.env = dict(os.environ, OMP_NUM_THREADS="1")

    def command(self, name, sets):
        return self.vc.exec_argv(0, job_command(CONFIG, name, self.marker, self.sets + list(sets)))

    def role_pid(self, role):
        """The role's own process in the hosts' namespaces (not remote.py's `python -c` wrapper of it)."""
        found = []
        for i in range(self.vc.n):
            for pid in self.vc.pids(i):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        wrapper = f.read().split(b"\0")[1:2] == [b"-c"]
                except OSError:
                    continue
                if not wrapper and role_of(pid) == role:
                    found.append(pid)
        return found[0] if len(found) == 1 else None

    def link(self, host, up):
        """The host's cable at the switch: its veth's switch end down or up."""
        subprocess.run(["ip", "-n", self.vc.switch, "link", "set", f"v{host}", "up" if up else "down"], check=True)

    def leftovers(self):
        on_hosts = [f"{host}: {p}" for host, procs in self.vc.leftovers().items() for p in procs]
        return on_hosts + [str(p) for p in processes_with(self.marker)]

    def close(self):
        """Delete the cluster; what of it is left (namespaces, sshd processes)."""
        names = [self.vc.switch] + self.vc.namespaces
        sshd = [p.pid for p in self.vc._sshd]
        self.vc.delete()
        netns = self.vcluster.netns
        return ([f"namespace {n}" for n in names if os.path.exists(os.path.join(netns.NETNS_DIR, n))]
                + [f"sshd {p}" for p in sshd if netns._alive(p)])


def fill(folder):
    """Write zeros into folder/filler until the file system is full."""
    path = os.path.join(folder, "filler")
    # Unbuffered: a buffered file keeps the tail of the write that failed and raises ENOSPC again at close.
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    return path


def inject(kind, rng, job, site, disk):
    """One fault; returns (what was hit, seconds it lasted or None)."""
    if kind == "disk":
        filler = fill(disk)
        restarts = job.restarts()
        wait_until(lambda: job.restarts() > restarts, 120, "a restart after the full disk", job)
        os.remove(filler)
        return "checkpoint.dir (full)", None
    if kind in LINK_KINDS:
        host = rng.randrange(len(HOST_ROLES))
        seen, t0 = len(job.lines), time.monotonic()
        site.link(host, up=False)
        try:
            if kind == "blip":
                time.sleep(rng.uniform(*SHORT))
            else:   # until the launcher reports the job failed
                wait_until(lambda: launcher_reported(job.lines[seen:]), 120,
                           "launcher report of the cut link", job)
        finally:
            site.link(host, up=True)
        return f"h{host} link ({HOST_ROLES[host]})", round(time.monotonic() - t0, 2)
    role = rng.choice(ROLES)
    pid = None
    try:
        wait_until(lambda: site.role_pid(role) is not None, 15, f"{role[0]} {role[1]} of the job", job)
        pid = site.role_pid(role)
    except ChaosError:
        pass
    if pid is None:
        raise ChaosError(f"{role[0]} {role[1]} of the job not found")
    target = f"{role[0]} {role[1]}"
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
        return target, None
    os.kill(pid, signal.SIGSTOP)
    if kind == "stop":
        return target, None
    seconds = rng.uniform(*SHORT)
    time.sleep(seconds)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        raise ChaosError(f"{target} ended while paused") from None
    return target, round(seconds, 2)


def draw(rng, kinds, n):
    """n fault kinds: each of `kinds` once (as far as n allows), the rest at random, shuffled."""
    plan = list(kinds)[:n] + [rng.choice(kinds) for _ in range(n - len(kinds))]
    rng.shuffle(plan)
    return plan


def one_fault(i, kind, rng, job, site, disk, t_start):
    seen = len(job.checkpoints())
    wait_until(lambda: len(job.checkpoints()) > seen, 300, "new checkpoint", job)
    time.sleep(rng.uniform(0.0, 1.0))
    restarts, lines, t0 = job.restarts(), len(job.lines), time.monotonic()
    target, lasted = inject(kind, rng, job, site, disk)
    print(f"fault {i + 1}: {kind} {target} at {t0 - t_start:.1f} s"
          + (f" for {lasted:g} s" if lasted is not None else ""), flush=True)
    to_restart = None
    if kind in RESTARTING:
        to_restart = wait_until(lambda: job.restarts() > restarts, 180, "restart", job)
    else:   # ridden out: the launcher may report nothing, also once its timeouts have had their time
        time.sleep(max(0.0, QUIET - (time.monotonic() - t0)))
    seen = len(job.checkpoints())
    to_save = wait_until(lambda: len(job.checkpoints()) > seen, 300, "checkpoint after the fault", job)
    return {"fault": i + 1, "kind": kind, "target": target, "at_seconds": round(t0 - t_start, 2),
            "lasted_seconds": lasted, "epochs_saved": seen,
            "restarted": job.restarts() > restarts or launcher_reported(job.lines[lines:]),
            "seconds_to_restart": None if to_restart is None else round(to_restart, 2),
            "seconds_to_next_checkpoint": round(time.monotonic() - t0, 2) if to_restart is None
            else round(to_restart + to_save, 2)}


def chaos(args, out, ck, disk, site, kinds, faults):
    """Run the chaos job, appending each fault's record to `faults`; (job, seconds)."""
    sets = site.settings + [f"train.epochs={args.epochs}", f"seed={args.seed}", f"checkpoint.dir={ck}",
                            f"cluster.max_restarts={args.faults + 2}"]
    job = Job(site.command("chaos", sets), site.env, os.path.join(out, "chaos.log"), ck)
    rng = random.Random(args.seed)
    t_start = time.monotonic()
    try:
        for i, kind in enumerate(draw(rng, kinds, args.faults)):
            try:
                faults.append(one_fault(i, kind, rng, job, site, disk, t_start))
            except ChaosError as err:
                raise ChaosError(f"fault {i + 1} ({kind}): {err}") from None
        job.proc.wait(timeout=1800)
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
        job.reader.join(timeout=10)
        job.log.close()
    return job, time.monotonic() - t_start


def check(job, faults, reference, site):
    """What the chaos job must have ended with; the list of problems (empty: passed)."""
    import mxnet as mx
    import numpy as np
    problems = []
    if job.proc.returncode != 0:
        problems.append(f"the job exited {job.proc.returncode}")
        return problems
    folder = run_folder(job.output(), site.marker, "chaos")
    s, r = read_summary(folder), read_summary(reference)
    expected = sum(f["kind"] in RESTARTING for f in faults)
    if job.restarts() != expected:
        problems.append(f"{job.restarts()} restarts for {expected} faults that end the job")
    problems += [f"fault {f['fault']} ({f['kind']} {f['target']}) ended the job" for f in faults
                 if f["restarted"] and f["kind"] not in RESTARTING]
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
    return problems


def leftovers(site, seconds=5.0):
    """Processes of the job still there `seconds` after it ended (a wrapper may take a moment to exit)."""
    deadline = time.monotonic() + seconds
    while site.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    return site.leftovers()


def small_disk(epochs):
    """A tmpfs for checkpoint.dir (root only) holding every epoch's checkpoint (about 1 MB each) with
    room to spare, or None. Mounted before the virtual cluster is made, so the hosts' mount namespaces
    (copied from this one) hold it too."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return None
    disk = tempfile.mkdtemp(prefix="ssdsgd-chaos-disk-")
    options = f"size={2 * epochs + 64}m,mode=0700"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", disk]).returncode != 0:
        os.rmdir(disk)
        return None
    return disk


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="scripts/chaos.py", description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", action="store_true", help="run on the virtual cluster with --launcher ssh (root)")
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="of the training and of the faults")
    ap.add_argument("--epochs", type=int, default=None,
                    help="enough for the faults (default 40, with --cluster 300: a pause or a blip is followed "
                         "by 12 s without a fault, 35 epochs on an idle machine)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=None,
                    help=f"faults to draw from (default {' '.join(LOOPBACK_KINDS)}, with --cluster all)")
    ap.add_argument("--out", default=None, help="default results/chaos, with --cluster results/chaos_cluster")
    args = ap.parse_args(argv)
    args.epochs = args.epochs or (300 if args.cluster else 40)
    args.kinds = args.kinds or list(KINDS if args.cluster else LOOPBACK_KINDS)
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "results", "chaos_cluster" if args.cluster else "chaos"))
    if not args.cluster and set(args.kinds) & set(LINK_KINDS):
        ap.error(f"--kinds {' '.join(LINK_KINDS)}: a link can be taken down only with --cluster")
    if os.path.exists(os.path.join(args.out, "manifest.json")):
        ap.error(f"--out: {args.out} already holds results; choose another folder")
    if args.cluster:
        from testbed import vcluster
        try:
            vcluster.check_tools()
        except vcluster.ClusterError as err:
            ap.error(f"--cluster: no virtual cluster here: {err}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = args.out
    stop_on_sigterm()       # SIGTERM unwinds: the job is ended, the links brought up, the cluster deleted
    os.makedirs(out, exist_ok=True)
    layout = "virtual cluster, --launcher ssh" if args.cluster else "loopback"
    settings = (Cluster if args.cluster else Loopback).settings
    write_manifest(out, [CONFIG], finished=False, settings=settings, layout=layout)
    marker = os.path.join(out, "runs")
    scratch = tempfile.mkdtemp(prefix="ssdsgd-chaos-")      # checkpoints: megabytes, not results
    disk = small_disk(args.epochs)
    kinds = [k for k in args.kinds if k != "disk" or disk]
    site, faults, problems, seconds, ref_seconds = None, [], [], 0.0, 0.0
    try:
        site = Cluster(marker, scratch) if args.cluster else Loopback(marker)
        problems, faults, seconds, ref_seconds = run(args, out, scratch, disk, site, kinds)
    finally:
        if site is not None:
            problems += [f"left after the run: {x}" for x in site.close()]
        if disk:
            subprocess.run(["umount", "-l", disk])
            os.rmdir(disk)
        shutil.rmtree(scratch, ignore_errors=True)
    if problems and problems[0].startswith("reference:"):
        print(problems[0], file=sys.stderr)
        return 1
    with open(os.path.join(out, "faults.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(faults)
    log = os.path.join(out, "chaos.log")
    restarts = open(log).read().count(RESTART) if os.path.exists(log) else 0
    text = summary(args, faults, problems, seconds, ref_seconds, disk is not None, layout, restarts)
    write_text(os.path.join(out, "summary.md"), text)
    write_manifest(out, [CONFIG], finished=True, settings=settings, layout=layout, passed=not problems,
                   faults=len(faults), restarts=restarts)
    print(text)
    return 0 if not problems else 1


def run(args, out, scratch, disk, site, kinds):
    """The reference job, then the chaos job and its checks: (problems, faults, seconds, reference seconds)."""
    t0 = time.monotonic()
    sets = site.settings + [f"train.epochs={args.epochs}", f"seed={args.seed}",
                            f"checkpoint.dir={os.path.join(scratch, 'reference_ck')}"]
    ref = subprocess.run(site.command("reference", sets), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=site.env)
    if ref.returncode != 0:
        return [f"reference: the uninterrupted job failed (exit {ref.returncode}):\n{ref.stdout[-3000:]}"], [], 0, 0
    reference, ref_seconds = run_folder(ref.stdout, site.marker, "reference"), time.monotonic() - t0
    ck = os.path.join(disk, "ck") if disk else os.path.join(scratch, "chaos_ck")
    faults, t0 = [], time.monotonic()
    try:
        job, seconds = chaos(args, out, ck, disk, site, kinds, faults)
        problems = check(job, faults, reference, site)
    except ChaosError as err:     # the faults injected so far stay in the results
        problems, seconds = [str(err)], time.monotonic() - t0
    problems += [f"process left: {x}" for x in leftovers(site)]
    return problems, faults, seconds, ref_seconds


def summary(args, faults, problems, seconds, ref_seconds, with_disk, layout, restarts):
    counts = [f"{sum(f['kind'] == k for f in faults)} {WORDS[k]}" for k in KINDS if k in args.kinds]
    where = "no process on any host, the cluster's namespaces and sshd deleted" if args.cluster \
        else "no process left"
    lines = [f"# Chaos run: {len(faults)} faults into one strict SSD-SGD + top-k job (digits, {args.epochs} epochs, "
             f"seed {args.seed}; {layout})", "",
             f"- result: {'PASSED' if not problems else 'FAILED: ' + '; '.join(problems)}",
             f"- faults: {', '.join(counts)}"
             + ("" if with_disk or "disk" not in args.kinds else " (full disk not run: needs root to mount a tmpfs)"),
             f"- restarts: {restarts}; wall time {seconds:.0f} s against {ref_seconds:.0f} s uninterrupted "
             f"({seconds - ref_seconds:.0f} s lost)",
             "- checked: exit 0, final weights bit for bit the uninterrupted run's, the same accuracy history, every "
             f"step once in each worker's metrics, a restart after each kill, stop, disk and cut and none after the "
             f"others, {where}", ""]
    if faults:
        lines += ["| fault | kind | hit | at s | lasted s | epochs saved | restarted | s to restart "
                  "| s to next checkpoint |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {f['fault']} | {f['kind']} | {f['target']} | {f['at_seconds']} | "
                  f"{'' if f['lasted_seconds'] is None else f['lasted_seconds']} | {f['epochs_saved']} | "
                  f"{'yes' if f['restarted'] else 'no'} | "
                  f"{'' if f['seconds_to_restart'] is None else f['seconds_to_restart']} | "
                  f"{f['seconds_to_next_checkpoint']} |" for f in faults]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
