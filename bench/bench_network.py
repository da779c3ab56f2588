"""Bandwidth-limited network benchmark: every job on per-host shaped links (default) or on one shaped loopback.

Two topologies (--topology):
  hosts (default): each job gets a fresh virtual cluster (testbed/vcluster.py): one network namespace
    per host, each with its own link (eth0 on a bridge), `tbf rate R mbit burst 256kb latency 50ms` on
    both directions of every host link (no qdisc for rate 0 = unlimited), one sshd per host. Host h0
    runs the launcher and the scheduler (the ssh launcher runs the scheduler where it runs itself; its
    traffic is a few KB), each server and each worker has a host of its own: 1 server + 2 workers use
    h0..h3, servers on h1..hS, workers after them. The job is started on h0 with the ssh launcher
    (hostfile h1..h(S+W), --interface eth0). Recorded in addition, from each host's eth0 counters
    (sampled every 0.1 s from /proc/<sshd pid>/net/dev, the host's sshd living in its namespace): bytes
    sent (tx) and received (rx) by the server hosts and by the worker hosts (mean over the hosts of
    that role), per step in the steady window, and each link's utilisation in that window
    (bytes * 8 / (rate * window seconds)); the servers' CPU seconds per step (whole job and steady
    window); per server host on its own (steady window): its server's CPU seconds and its link's tx
    and rx bytes per step, and each measure's largest deviation from the servers' mean (SERVER_FIELDS;
    bench/bench_server_balance.py tabulates them); kernel bytes are the sum of every host's eth0 tx
    (each byte once, when it leaves its host).
  loopback: one namespace with a rate-limited loopback that every role shares (the behaviour before the
    per-host topology existed; the README's older figures).

For each repeat, rate and algorithm (interleaved: repeat 1 runs A B C ... at every rate, then repeat 2),
the loopback topology creates a namespace (testbed/netns.py: lo mtu 9000, `tbf rate R mbit burst 256kb
latency 50ms`, no qdisc for rate 0 = unlimited), runs `python -m ssdsgd` inside it for a fixed
number of steps, and records:
  - the job's summary.json (images/s, wall time, steps, push/pull bytes per step of rank 0),
  - the namespace's exact lo byte counters before/after (every loopback byte is counted once as tx and
    once as rx; tx is reported), and a steady-state bytes/step measured between two logged steps,
  - the peak RSS (VmHWM) per role, sampled from /proc every 0.5 s for every process in the namespace,
  - the final training loss from the run's metrics.jsonl.
One CSV row per run goes to <out>/runs.csv as soon as the run ends (a failed or timed-out job is a row
with its status and exit code; the suite continues). At the end a markdown table of per (algorithm,
rate) medians and ratios vs SSGD (median over repeats of the ratio to SSGD of the same repeat and rate)
is printed and written to <out>/table.md.

The compute bound (N x the single-worker images/s with no communication) is measured once
per repeat with 1 worker + 1 server, unlimited rate, SSD-SGD with no warm-up and delay 100000 (so the
worker never pulls or waits) and dense pushes (asynchronous, so the worker never waits on them), in
the same topology as the other jobs (hosts: a 3-host cluster, launcher, server, worker).

Usage (root; ip and tc from iproute2; hosts also sshd, ssh, ssh-keygen from openssh):
  python bench/bench_network.py                       # full suite: 3 repeats x rates 0,100,20 x 7 algorithms
  python bench/bench_network.py --topology loopback   # the same on one shared loopback
  python bench/bench_network.py --quick --out /tmp/bench_quick
  python bench/bench_network.py --algorithms ssgd,ssd_topk --rates 0,50 --steps 40 --repeats 1
  python bench/bench_network.py --table-only --out results/bench_network   # re-make table.md from runs.csv
"""
import argparse
import contextlib
import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from testbed import netns, vcluster
from scripts.results_io import (COMPUTE_BOUND, earlier_runs, rate_name, read_csv, read_jsonl, stop_group,
                                stop_on_sigterm, write_manifest)
from ssdsgd.metrics import SUMMARY_FILE, metrics_file

DEFAULT_CONFIG = "configs/bench_cifar_resnet20.yaml"

SHIPPED_TOPK_CONFIG = "configs/fmnist_resnet20_ssd_topk.yaml"


def shipped_settings(path=SHIPPED_TOPK_CONFIG):
    """Overrides that give the benchmark's job the SSD-SGD and compression settings of a shipped
    config (its `algorithm` and `compression` sections; the warm-up length stays the benchmark's),
    read from that file so the two cannot drift apart."""
    with open(os.path.join(ROOT, path)) as f:
        raw = yaml.safe_load(f)
    sets = []

    def walk(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif f"{prefix}{k}" != "algorithm.warmup_iters":
                sets.append(f"{prefix}{k}={json.dumps(v)}")
    walk("algorithm.", raw["algorithm"])
    walk("compression.", raw["compression"])
    return sets


# key -> (label, overrides). The keys are what --algorithms takes and what the CSV's `algorithm` holds.
ALGORITHMS = {
    "ssgd": ("SSGD", ["algorithm.type=ssgd", "compression.type=none"]),
    "asgd": ("ASGD", ["algorithm.type=asgd", "compression.type=none"]),
    "ssgd_2bit": ("SSGD+2bit", ["algorithm.type=ssgd", "compression.type=2bit"]),
    "ssd": ("SSD-SGD", ["algorithm.type=ssd", "compression.type=none"]),
    "ssd_topk": ("SSD-SGD+top-k 1%", ["algorithm.type=ssd", "compression.type=topk",
                                       "compression.density=0.01"]),
    "ssgd_topk": ("SSGD+top-k 1%", ["algorithm.type=ssgd", "compression.type=topk",
                                     "compression.density=0.01"]),
    # S = 2k lets each weight pull land up to k steps after it was issued (see algorithms/policy.py).
    "ssd_topk_s2k": ("SSD-SGD+top-k 1%, S=2k", ["algorithm.type=ssd", "compression.type=topk",
                                               "compression.density=0.01", "algorithm.max_staleness=10"]),
    # The product's top-k setting: the shipped top-k config's k, momentum, local update, quotas and
    # sparse downlink (issue targets of the per-host links are checked on this one).
    "ssd_topk_sparse": ("SSD-SGD+top-k 1%, sparse downlink (shipped)", shipped_settings() +
                        ["compression.density=0.01"]),
    # The same with the servers re-sparsifying each round (at N > 2: a pull of two pushes' size).
    "ssd_topk_compressed": ("SSD-SGD+top-k 1%, compressed downlink",
                            shipped_settings() + ["compression.density=0.01", "compression.downlink=compressed"]),
    # The shipped settings with the density the workers choose for the link (compression.density: auto).
    "ssd_topk_auto": ("SSD-SGD+top-k auto (shipped)", shipped_settings() + ["compression.density=auto"]),
}
COMPUTE_BOUND_LABEL = "compute bound (1 worker, no comm.)"
# Dense pushes, not top-k: the bound must not include the compressor's own compute. On an unlimited
# loopback the asynchronous push of a ResNet-20 gradient costs the worker a copy; the server's update
# runs on the other core.
COMPUTE_BOUND_SETS = ["cluster.workers=1", "cluster.servers=1", "algorithm.type=ssd",
                      "algorithm.delay=100000", "algorithm.warmup_iters=0", "compression.type=none"]
BASELINE = "ssgd"
COMPRESSED = ("ssgd_2bit", "ssd_topk", "ssgd_topk", "ssd_topk_s2k", "ssd_topk_sparse", "ssd_topk_compressed")
HOST_TARGET = "ssd_topk_sparse"     # the algorithm the per-host-link targets are checked on
ROLES = ("worker", "server", "scheduler", "launcher")
CPU_ROLES = ("server", "worker")     # whose CPU seconds per step the runs report

TOPOLOGIES = {"hosts": "per-host links (one host per role, each link shaped in both directions)",
              "loopback": "loopback (all roles share one link)"}
LINK_ROLES = ("server", "worker")     # the host links the hosts topology reports, per direction
# Columns of the hosts topology (empty in loopback rows): per role (mean over its hosts) and direction.
LINK_FIELDS = [f"{r}_{d}_bytes" for r in LINK_ROLES for d in ("tx", "rx")] + \
              [f"steady_{r}_{d}_bytes_per_step" for r in LINK_ROLES for d in ("tx", "rx")] + \
              [f"{r}_{d}_util" for r in LINK_ROLES for d in ("tx", "rx")]

# Hosts topology, each server host on its own (steady window): per step its server's CPU seconds and its
# link's tx and rx bytes (JSON list, one dict per server host), and per measure the largest deviation of
# a server from the servers' mean, as a share of that mean (how evenly the servers share the load).
SERVER_FIELDS = ["steady_per_server"] + [f"server_{m}_max_dev" for m in ("cpu", "tx", "rx")]

FIELDS = ["algorithm", "label", "topology", "rate_mbit", "repeat", "status", "exit_code", "images_per_sec",
          "steady_images_per_sec", "wall_seconds", "job_seconds", "steady_seconds", "steps", "num_workers",
          "num_servers", "kernel_bytes", "kernel_bytes_per_step", "steady_kernel_bytes_per_step",
          "kernel_rx_bytes", "qdisc_drops", "push_bytes_per_step", "pull_bytes_per_step",
          "push_bytes_per_step_after_warmup", "pull_bytes_per_step_after_warmup"] + LINK_FIELDS + SERVER_FIELDS + \
         ["server_cpu_seconds_per_step", "steady_server_cpu_seconds_per_step",
          "steady_worker_cpu_seconds_per_step", "final_loss", "final_test_acc", "density", "density_verdict",
          "wait_seconds"] + \
         [f"peak_rss_{r}_mb" for r in ROLES] + ["job_cpu_seconds", "other_cpu_share", "idle_wait_seconds",
                                                "bound_workers", "run_dir", "log", "namespace", "host_links",
                                                "error"]

FULL = dict(steps=60, repeats=3, rates="0,100,20", job_timeout=900.0)
QUICK = dict(steps=20, repeats=1, rates="0,20", job_timeout=300.0)
BUSY = 0.10     # a run during which other processes used more than this share of the CPU is flagged


# ------------------------------------------------------------------------------------------ running

def _interp(samples, t):
    """Counter value at time t, linearly interpolated between (time, value) samples."""
    if not samples:
        return None
    if t <= samples[0][0]:
        return samples[0][1]
    for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / max(1e-9, t1 - t0)
    return samples[-1][1]


def steady_window(records, start_step):
    """(steps, t0, t1) between the first logged step >= start_step and the last logged step, or None.

    Leaves out the start-up, the first (hybridize) steps and the warm-up, and the final evaluation."""
    steps = [r for r in records if "loss" in r and "step" in r and "time" in r]
    window = [r for r in steps if r["step"] >= start_step]
    if len(window) < 2:
        window = steps[-2:] if len(steps) >= 2 else []
    if len(window) < 2:
        return None
    a, b = window[0], window[-1]
    dsteps, dt = b["step"] - a["step"], b["time"] - a["time"]
    if dsteps <= 0 or dt <= 0:
        return None
    return dsteps, a["time"], b["time"]


def window_delta(samples, t0, t1):
    """How much a sampled counter ([(time, value)]) grew between t0 and t1 (interpolated), or None."""
    a, b = _interp(samples, t0), _interp(samples, t1)
    return None if a is None or b is None else b - a


def steady_state(records, start_step, images_per_step, counter_samples):
    """Images/s and kernel tx bytes/step between the first logged step >= start_step and the last one."""
    w = steady_window(records, start_step)
    if w is None:
        return None, None
    dsteps, t0, t1 = w
    d = window_delta(counter_samples, t0, t1)
    return dsteps * images_per_step / (t1 - t0), None if d is None else d / dsteps


def host_roles(servers, workers):
    """Role of each host of the hosts topology: h0 the launcher (and scheduler), then the servers, then the
    workers, one host each (the ssh launcher places servers first, round robin over the hostfile)."""
    return ["launcher"] + ["server"] * servers + ["worker"] * workers


def utilisation(nbytes, rate_mbit, seconds):
    """Share of a link's capacity used: bytes * 8 / (rate * seconds); None when unlimited or unknown."""
    if nbytes is None or not rate_mbit or not seconds or seconds <= 0:
        return None
    return nbytes * 8 / (rate_mbit * 1e6 * seconds)


def per_role_links(roles, per_host):
    """Mean over the hosts of each role of per-host {"tx": x, "rx": y} values: {role: {"tx", "rx"}}.

    roles: role of each host index; per_host: {host index: {"tx": ..., "rx": ...}} (None values and
    missing hosts are left out of the means; a role without any value gets None)."""
    out = {}
    for role in dict.fromkeys(roles):
        hosts = [i for i, r in enumerate(roles) if r == role]
        out[role] = {}
        for d in ("tx", "rx"):
            values = [per_host[i][d] for i in hosts if i in per_host and per_host[i].get(d) is not None]
            out[role][d] = sum(values) / len(values) if values else None
    return out


def link_columns(roles, before, after, samples, window, rate_mbit):
    """The hosts topology's link columns of a CSV row.

    before/after: {host: {"tx_bytes", "rx_bytes"}} exact counters around the job; samples: {host: {"tx":
    [(time, bytes)], "rx": [...]}} polled while it ran; window: (steps, t0, t1) of steady_window or None."""
    whole = {i: {d: after[i][f"{d}_bytes"] - before[i][f"{d}_bytes"] for d in ("tx", "rx")} for i in after}
    row = {}
    for role, v in per_role_links(roles, whole).items():
        if role in LINK_ROLES:
            row.update({f"{role}_{d}_bytes": None if v[d] is None else round(v[d]) for d in ("tx", "rx")})
    if window is not None:
        dsteps, t0, t1 = window
        steady = {i: {d: window_delta(samples[i][d], t0, t1) for d in ("tx", "rx")} for i in samples}
        for role, v in per_role_links(roles, steady).items():
            if role not in LINK_ROLES:
                continue
            for d in ("tx", "rx"):
                if v[d] is None:
                    continue
                row[f"steady_{role}_{d}_bytes_per_step"] = round(v[d] / dsteps)
                u = utilisation(v[d], rate_mbit, t1 - t0)
                row[f"{role}_{d}_util"] = None if u is None else round(u, 4)
    row["host_links"] = "; ".join(f"h{i} {roles[i]} tx {whole[i]['tx']} rx {whole[i]['rx']}"
                                  for i in sorted(whole))
    return {k: "" if v is None else v for k, v in row.items()}


def max_deviation(values):
    """The largest |value - mean| / mean of a list of values (None if a value is unknown or the mean is 0)."""
    if not values or any(v is None for v in values):
        return None
    mean = sum(values) / len(values)
    return max(abs(v - mean) for v in values) / mean if mean > 0 else None


def per_server_columns(roles, link_samples, host_cpu, window):
    """The SERVER_FIELDS of a hosts-topology row: each server host's CPU seconds (of its server
    process) and link tx and rx bytes per step in the steady window, and their largest deviation from
    the servers' mean. link_samples: {host: {"tx": [(time, bytes)], "rx": [...]}}; host_cpu: {host:
    [(time, CPU seconds)]}; window: steady_window's (steps, t0, t1) or None (then no columns)."""
    if window is None:
        return {}
    dsteps, t0, t1 = window
    per_server = []
    for i in [i for i, role in enumerate(roles) if role == "server"]:
        got = {"cpu": window_delta(host_cpu.get(i, []), t0, t1)}
        got.update({d: window_delta(link_samples.get(i, {}).get(d, []), t0, t1) for d in ("tx", "rx")})
        per_server.append(dict({k: None if v is None else v / dsteps for k, v in got.items()}, host=f"h{i}"))
    digits = {"cpu": 6, "tx": 0, "rx": 0}
    shown = [{k: v if v is None or k == "host" else round(v, digits[k]) for k, v in s.items()} for s in per_server]
    row = {"steady_per_server": json.dumps(shown, separators=(",", ":"))}
    for m in ("cpu", "tx", "rx"):
        dev = max_deviation([s[m] for s in per_server])
        row[f"server_{m}_max_dev"] = "" if dev is None else round(dev, 4)
    return row


class Sampler:
    """Polls, while a job runs, the namespace's lo tx counter (every `net_every` s, read from
    /proc/<pid>/net/dev of the job's first process) and every namespace process's VmHWM (every
    `rss_every` s), keeping the max per pid; the role comes from the process's DMLC_ROLE.

    Hosts topology: `links` {host: (pid living on it, iface)} adds per-host tx and rx samples (every
    `net_every` s), `hosts` {host: function listing the processes on it} adds per-host CPU samples of
    the server and worker processes (every `net_every` s); `pid` is None (no lo)."""

    def __init__(self, ns, pid, net_every=0.1, rss_every=0.5, links=None, hosts=None):
        self.ns, self.pid = ns, pid
        self.net_every, self.rss_every = net_every, rss_every
        self._hosts = dict(hosts or {None: ns.pids})
        self.links = dict(links or {})
        self.counter = []                    # (time.time(), tx_bytes)
        self.link_samples = {h: {"tx": [], "rx": []} for h in self.links}
        self.hwm = {}                        # pid -> (role, kB)
        self.cpu_ticks = {}                  # pid -> utime + stime (clock ticks), last seen
        # role -> [(time.time(), ticks of every process of that role so far)], for servers and workers
        self.role_cpu = {role: [] for role in CPU_ROLES}
        self._role_pids = {role: set() for role in CPU_ROLES}
        # host -> [(time.time(), ticks of its server and worker processes so far)] (hosts topology)
        self.host_cpu = {h: [] for h in self._hosts if h is not None}
        self._host_pids = {h: set() for h in self.host_cpu}
        self._next_rss = 0.0

    def poll(self):
        now = time.time()
        if self.pid is not None:
            c = netns.counters_of_pid(self.pid)
            if c is not None:
                self.counter.append((now, c["tx_bytes"]))
        for host, (pid, iface) in self.links.items():
            c = netns.counters_of_pid(pid, iface)
            if c is not None:
                self.link_samples[host]["tx"].append((now, c["tx_bytes"]))
                self.link_samples[host]["rx"].append((now, c["rx_bytes"]))
        for role, pids in self._role_pids.items():
            if not pids:
                continue
            for pid in pids:
                ticks = _cpu_ticks(pid)
                if ticks is not None:
                    self.cpu_ticks[pid] = max(ticks, self.cpu_ticks.get(pid, 0))
            self.role_cpu[role].append((now, sum(self.cpu_ticks.get(p, 0) for p in pids)))
        for host, pids in self._host_pids.items():     # their ticks were just read with their role's
            self.host_cpu[host].append((now, sum(self.cpu_ticks.get(p, 0) for p in pids)))
        if time.monotonic() >= self._next_rss:
            self._next_rss = time.monotonic() + self.rss_every
            self._poll_processes()

    def _poll_processes(self):
        """Peak RSS, role and CPU ticks of every process (new ones join their role's and host's sets)."""
        for host, list_pids in self._hosts.items():
            for pid in list_pids():
                kb = netns.read_status_kb(pid, "VmHWM")
                if kb is None:
                    continue
                # Read the role every time: between the launcher's fork and the exec a child still has
                # the launcher's environment and memory; after the exec it is a new process image.
                role = netns.read_environ(pid).get("DMLC_ROLE") or (
                    "launcher" if "-m ssdsgd " in _cmdline(pid) else "other")
                prev_role, prev_kb = self.hwm.get(pid, (role, 0))
                self.hwm[pid] = (role, max(kb, prev_kb) if prev_role == role else kb)
                if role in self._role_pids:
                    self._role_pids[role].add(pid)
                    if host is not None:
                        self._host_pids[host].add(pid)
                ticks = _cpu_ticks(pid)
                if ticks is not None:
                    self.cpu_ticks[pid] = max(ticks, self.cpu_ticks.get(pid, 0))

    def job_cpu_seconds(self):
        return sum(self.cpu_ticks.values()) / os.sysconf("SC_CLK_TCK")

    def cpu_seconds(self, role):
        """CPU seconds of the processes of a role (the last value seen of each)."""
        return sum(self.cpu_ticks.get(p, 0) for p in self._role_pids[role]) / os.sysconf("SC_CLK_TCK")

    def cpu_seconds_samples(self, role):
        tick = os.sysconf("SC_CLK_TCK")
        return [(t, v / tick) for t, v in self.role_cpu[role]]

    def host_cpu_seconds_samples(self):
        """{host: [(time, CPU seconds of its server and worker processes)]} (hosts topology)."""
        tick = os.sysconf("SC_CLK_TCK")
        return {h: [(t, v / tick) for t, v in samples] for h, samples in self.host_cpu.items()}

    def peak_mb(self):
        out = {}
        for role, kb in self.hwm.values():
            out[role] = max(out.get(role, 0.0), kb / 1024.0)
        return out


def _cpu_ticks(pid):
    """utime + stime of a process, in clock ticks (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _system_cpu():
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / tick, sum(v[:8]) / tick


def wait_until_idle(max_seconds, threshold=0.15, probe=2.0):
    """Wait (at most max_seconds) until the machine's CPU is less than `threshold` busy over `probe` s.

    Returns the seconds waited. On a shared machine this keeps other users' jobs out of the timings."""
    t0 = time.monotonic()
    while True:
        b0, a0 = _system_cpu()
        time.sleep(probe)
        b1, a1 = _system_cpu()
        busy = (b1 - b0) / max(1e-9, a1 - a0)
        if busy < threshold or time.monotonic() - t0 >= max_seconds:
            return round(time.monotonic() - t0, 1)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _qdisc_drops(ns):
    try:
        out = subprocess.run(["tc", "-n", ns.name, "-s", "-j", "qdisc", "show", "dev", "lo"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        return sum(q.get("drops", 0) for q in json.loads(out or "[]"))
    except (ValueError, OSError):
        return None


def _stop_job(proc, grace=15.0):
    """SIGTERM the job's process group (the launcher then stops its roles), SIGKILL after `grace`."""
    stop_group(proc, grace)


def _wait_for_job(proc, sampler, deadline):
    """Poll the sampler until the job ends; stop it at `deadline` (monotonic). Returns True if it timed out."""
    try:
        while proc.poll() is None:
            sampler.poll()
            if time.monotonic() > deadline:
                _stop_job(proc)
                return True
            time.sleep(sampler.net_every)
    except BaseException:
        _stop_job(proc)
        raise
    finally:
        proc.wait()
    return False


@contextlib.contextmanager
def virtual_cluster(hosts, rate_mbit, queue_ms, prepare=None):
    """A VCluster of `hosts` hosts, every link shaped at rate_mbit (0/None: unlimited); always deleted.
    prepare(vc), if given, runs before the cluster is created (its namespaces and addresses are known)."""
    vc = vcluster.VCluster(hosts, rate_mbit or None, latency=f"{queue_ms:g}ms")
    if prepare is not None:
        prepare(vc)
    vc.create()
    try:
        yield vc
    finally:
        with netns.signals_ignored():
            vc.delete()


def _run_on_loopback(job, args, command, env, log_path, row, t0):
    """One job in its own namespace with a shaped loopback. Returns (returncode, timed_out, sampler, cpu)."""
    with netns.Namespace(job["rate"] or None, args.delay_ms, latency=f"{args.queue_ms:g}ms") as ns, \
            open(log_path, "w") as log:
        row["namespace"] = ns.name
        log.write(f"# namespace {ns.name}: {ns.qdisc()}\n# {' '.join(command)}\n")
        log.flush()
        before = ns.counters()
        cpu_before = _system_cpu()
        proc = subprocess.Popen(ns.argv(command), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        sampler = Sampler(ns, proc.pid)
        # the launcher's own timeout fires first
        timed_out = _wait_for_job(proc, sampler, t0 + args.job_timeout + 30)
        cpu_after = _system_cpu()
        ns.kill_all()                                  # nothing may outlive the job in the namespace
        after = ns.counters()
        row["qdisc_drops"] = _qdisc_drops(ns)
    sampler.counter.append((time.time(), after["tx_bytes"]))
    row.update(kernel_bytes=after["tx_bytes"] - before["tx_bytes"],
               kernel_rx_bytes=after["rx_bytes"] - before["rx_bytes"])
    return proc.returncode, timed_out, sampler, (cpu_before, cpu_after)


def _run_on_hosts(job, args, command, env, log_path, row, t0):
    """One job on a fresh virtual cluster, one host per role (see host_roles). Returns what
    _run_on_loopback does; the per-host counters go to row["_links"] for run_one."""
    roles = host_roles(job["servers"], job["workers"])
    with virtual_cluster(len(roles), job["rate"], args.queue_ms) as vc, open(log_path, "w") as log:
        row["namespace"] = vc.name
        hostfile = vc.write_hostfile(os.path.join(vc.dir, "hostfile"), range(1, len(roles)))
        command = command + ["--set", "cluster.launcher=ssh", "--set", f"cluster.hostfile={hostfile}",
                             "--set", "cluster.interface=eth0", "--set", f"cluster.ssh_config={vc.ssh_config}"]
        shaping = f"tbf {job['rate']:g} Mbit/s each way on every host link" if job["rate"] else "unlimited links"
        log.write(f"# cluster {vc.name}: " + ", ".join(f"h{i} {r}" for i, r in enumerate(roles)) +
                  f"; {shaping}\n# {' '.join(command)}\n")
        log.flush()
        hosts = range(len(roles))
        before = {i: vc.counters(i) for i in hosts}
        cpu_before = _system_cpu()
        proc = subprocess.Popen(vc.exec_argv(0, command), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        sshd = {vc.host_pid(i) for i in hosts}
        sampler = Sampler(None, None, links={i: (vc.host_pid(i), "eth0") for i in hosts},
                          hosts={i: (lambda i=i: [p for p in vc.pids(i) if p not in sshd]) for i in hosts})
        timed_out = _wait_for_job(proc, sampler, t0 + args.job_timeout + 30)
        cpu_after = _system_cpu()
        left = vc.leftovers()
        if left:                                       # VCluster.delete kills them; the log names them
            log.write(f"# left on the hosts after the job: {left}\n")
        after = {i: vc.counters(i) for i in hosts}
        row["qdisc_drops"] = vc.qdisc_drops()
    now = time.time()
    for i in hosts:
        for d in ("tx", "rx"):
            sampler.link_samples[i][d].append((now, after[i][f"{d}_bytes"]))
    # Kernel bytes: every byte once, when it leaves its host (the sum of the hosts' eth0 tx).
    row.update(kernel_bytes=sum(after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in hosts),
               kernel_rx_bytes=sum(after[i]["rx_bytes"] - before[i]["rx_bytes"] for i in hosts))
    row["_links"] = (roles, before, after)
    return proc.returncode, timed_out, sampler, (cpu_before, cpu_after)


def _job_command(job, args, log_dir):
    """`python -m ssdsgd` of one benchmark job and the environment it runs with."""
    command = [sys.executable, "-m", "ssdsgd", "--config", args.config,
               "--set", f"log.dir={log_dir}", "--set", f"name={job['name']}",
               "--set", f"train.max_steps={args.steps}", "--set", f"cluster.timeout={args.job_timeout:g}"]
    for s in args.set + job["sets"]:
        command += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return command, env


def run_one(job, args):
    """Run one job in its own namespace(s); return its CSV row (never raises for a failed job)."""
    row = {k: "" for k in FIELDS}
    row.update(algorithm=job["key"], label=job["label"], topology=args.topology, rate_mbit=job["rate"],
               repeat=job["repeat"])
    log_dir = os.path.join(args.out, "runs")
    run_dir = os.path.join(log_dir, job["name"], "latest")      # the job's own run folder, once it starts
    log_path = os.path.join(args.out, "logs", job["name"] + ".log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    row.update(run_dir=os.path.relpath(run_dir, args.out), log=os.path.relpath(log_path, args.out))
    command, env = _job_command(job, args, log_dir)
    t0 = time.monotonic()
    runner = _run_on_hosts if args.topology == "hosts" else _run_on_loopback
    returncode, timed_out, sampler, cpu = runner(job, args, command, env, log_path, row, t0)
    links = row.pop("_links", None)
    run_dir = os.path.realpath(run_dir)
    row["run_dir"] = os.path.relpath(run_dir, args.out)
    row["job_seconds"] = round(time.monotonic() - t0, 2)
    row["exit_code"] = returncode
    _machine_columns(row, sampler, cpu)
    summary_path = os.path.join(run_dir, SUMMARY_FILE)
    if timed_out or returncode == 124:
        row["status"] = "timeout"
    elif returncode != 0 or not os.path.exists(summary_path):
        row["status"] = "failed"
    else:
        row["status"] = "ok"
    if row["status"] != "ok":
        row["error"] = _last_error(log_path)
    records = read_jsonl(os.path.join(run_dir, metrics_file()))   # rank 0's
    losses = [r["loss"] for r in records if "loss" in r]
    if losses:
        row["final_loss"] = round(losses[-1], 5)
    window = steady_window(records, job["steady_from"])
    if links is not None:
        roles, before, after = links
        row.update(link_columns(roles, before, after, sampler.link_samples, window, job["rate"]))
        row.update(per_server_columns(roles, sampler.link_samples, sampler.host_cpu_seconds_samples(), window))
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        _summary_columns(row, s, sampler)
        if window is not None:
            _steady_columns(row, window, sampler, links is not None, job["batch"] * s["num_workers"],
                            s["num_workers"])
    return row


def _machine_columns(row, sampler, cpu):
    """The job's CPU seconds, the share of the machine other processes used meanwhile (other users' work
    skews the benchmark; cpu: _system_cpu() before and after) and each role's peak RSS."""
    (busy0, total0), (busy1, total1) = cpu
    busy, total = busy1 - busy0, total1 - total0
    if total > 0:
        row["other_cpu_share"] = round(max(0.0, busy - sampler.job_cpu_seconds()) / total, 3)
        row["job_cpu_seconds"] = round(sampler.job_cpu_seconds(), 2)
    for role, mb in sampler.peak_mb().items():
        if role in ROLES:
            row[f"peak_rss_{role}_mb"] = round(mb, 1)


def _summary_columns(row, s, sampler):
    """The whole-job columns from the job's summary.json dict `s` (row["kernel_bytes"] is already set)."""
    steps = s["steps"]
    row.update(images_per_sec=round(s["images_per_sec"], 3), wall_seconds=round(s["wall_seconds"], 3),
               steps=steps, num_workers=s["num_workers"], num_servers=s.get("num_servers", ""),
               kernel_bytes_per_step=round(row["kernel_bytes"] / max(1, steps)),
               push_bytes_per_step=round(s["bytes_per_step"]["push"]),
               pull_bytes_per_step=round(s["bytes_per_step"]["pull"]),
               final_test_acc=s.get("final_test_acc"), wait_seconds=round(s.get("wait_seconds") or 0.0, 3))
    choice = (s.get("client") or {}).get("density_choice") or {}      # compression.density: auto
    row.update(density=choice.get("density", ""), density_verdict=choice.get("verdict", ""))
    aw = s.get("after_warmup") or {}
    if aw.get("steps"):
        row.update(push_bytes_per_step_after_warmup=round(aw["push_bytes"] / aw["steps"]),
                   pull_bytes_per_step_after_warmup=round(aw["pull_bytes"] / aw["steps"]))
    if sampler.role_cpu["server"]:
        row["server_cpu_seconds_per_step"] = round(sampler.cpu_seconds("server") / max(1, steps), 5)


def _steady_columns(row, window, sampler, hosts, images_per_step, workers):
    """The steady-window columns: window is steady_window's (steps, t0, t1); hosts: the kernel bytes are
    the sum of the hosts' eth0 tx samples, else the namespace's lo tx samples."""
    dsteps, w0, w1 = window
    row["steady_seconds"] = round(w1 - w0, 3)
    row["steady_images_per_sec"] = round(dsteps * images_per_step / (w1 - w0), 3)
    if not hosts:
        d = window_delta(sampler.counter, w0, w1)
    else:
        deltas = [window_delta(sampler.link_samples[i]["tx"], w0, w1) for i in sampler.link_samples]
        d = None if any(x is None for x in deltas) else sum(deltas)
    if d is not None:
        row["steady_kernel_bytes_per_step"] = round(d / dsteps)
    cpu = window_delta(sampler.cpu_seconds_samples("server"), w0, w1)
    if cpu is not None:
        row["steady_server_cpu_seconds_per_step"] = round(cpu / dsteps, 5)
    cpu = window_delta(sampler.cpu_seconds_samples("worker"), w0, w1)
    if cpu is not None:          # per worker: the job's workers share the steps
        row["steady_worker_cpu_seconds_per_step"] = round(cpu / dsteps / workers, 5)


def _last_error(log_path, lines=3):
    try:
        with open(log_path, errors="replace") as f:
            tail = [line.strip() for line in f if line.strip()][-40:]
    except OSError:
        return ""
    # Prefer the launcher's verdict and exception lines over the generic tail.
    keys = [line for line in tail if line.startswith("launch:") or "Error" in line or "error" in line]
    return " | ".join((keys or tail)[-lines:])[:500]


# ----------------------------------------------------------------------------------- aggregation

def _num(v):
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def read_rows(path):
    return read_csv(path)


def aggregate(rows):
    """Per (algorithm, rate) medians over the ok runs, and medians of per-repeat ratios vs SSGD.

    Returns {"groups": [dict per (algorithm, rate) in first-seen order], "compute_bound": {...} or None}.
    A ratio for repeat r is value(alg, rate, r) / value(ssgd, rate, r); runs without an ok SSGD partner
    of the same repeat and rate give no ratio."""
    ok = [r for r in rows if r.get("status") == "ok"]
    base = {(_rate(r), r["repeat"]): r for r in ok if r["algorithm"] == BASELINE}

    def ratios(rs, field):
        out = []
        for r in rs:
            b = base.get((_rate(r), r["repeat"]))
            v, bv = _num(r.get(field)), _num(b.get(field)) if b else None
            if v is not None and bv:
                out.append(v / bv)
        return _median(out)

    result = []
    for g in _groups(rows):
        rs, failed = g.pop("_rows"), g.pop("_failed")
        g.update(_group_figures(rs, ratios),
                 failed=[f"rep {r['repeat']}: {r['status']} (exit {r['exit_code']})" for r in failed])
        result.append(g)
    busy = [r for r in ok if (_num(r.get("other_cpu_share")) or 0.0) > BUSY]
    return {"groups": result, "compute_bound": _compute_bound(ok), "busy_runs": len(busy), "ok_runs": len(ok),
            "topology": topology_of(rows[0]) if rows else "loopback"}


def _rate(row):
    return _num(row["rate_mbit"]) or 0.0


def _groups(rows):
    """One dict per (algorithm, rate) but the compute bound, in first-seen order, counting its runs; its
    ok rows in "_rows", the others in "_failed"."""
    groups = {}
    for r in rows:
        if r["algorithm"] == COMPUTE_BOUND:
            continue
        key = (r["algorithm"], _rate(r))
        if key not in groups:
            groups[key] = {"algorithm": r["algorithm"], "label": r.get("label") or r["algorithm"],
                           "rate_mbit": _rate(r), "runs": 0, "ok": 0, "_rows": [], "_failed": []}
        groups[key]["runs"] += 1
        if r.get("status") == "ok":
            groups[key]["ok"] += 1
            groups[key]["_rows"].append(r)
        else:
            groups[key]["_failed"].append(r)
    return list(groups.values())


def _worker_bytes(r):
    p, q = _num(r.get("push_bytes_per_step")), _num(r.get("pull_bytes_per_step"))
    return p + q if p is not None and q is not None else None


def _pull_push(r):
    p, q = _num(r.get("push_bytes_per_step_after_warmup")), _num(r.get("pull_bytes_per_step_after_warmup"))
    return q / p if p and q is not None else None


def _group_figures(rs, ratios):
    """The medians of one group's ok rows rs; ratios(rs, field): the median per-repeat ratio to SSGD."""
    med = lambda f: _median([_num(r.get(f)) for r in rs])  # noqa: E731
    return dict(
        images_per_sec=med("images_per_sec"), steady_images_per_sec=med("steady_images_per_sec"),
        wall_seconds=med("wall_seconds"), steps=med("steps"),
        kernel_bytes_per_step=med("kernel_bytes_per_step"),
        steady_kernel_bytes_per_step=med("steady_kernel_bytes_per_step"),
        worker_bytes_per_step=_median([_worker_bytes(r) for r in rs]),
        final_loss=med("final_loss"), qdisc_drops=med("qdisc_drops"),
        other_cpu_share=med("other_cpu_share"),
        **{f"peak_rss_{role}_mb": med(f"peak_rss_{role}_mb") for role in ROLES},
        speedup=ratios(rs, "images_per_sec"), steady_speedup=ratios(rs, "steady_images_per_sec"),
        bytes_ratio=ratios(rs, "kernel_bytes_per_step"),
        steady_bytes_ratio=ratios(rs, "steady_kernel_bytes_per_step"),
        rss_ratio=ratios(rs, "peak_rss_worker_mb"),
        steady_seconds=med("steady_seconds"),
        push_after_warmup=med("push_bytes_per_step_after_warmup"),
        pull_after_warmup=med("pull_bytes_per_step_after_warmup"),
        pull_push_ratio=_median([_pull_push(r) for r in rs]),
        server_cpu_per_step=med("server_cpu_seconds_per_step"),
        steady_server_cpu_per_step=med("steady_server_cpu_seconds_per_step"),
        steady_worker_cpu_per_step=med("steady_worker_cpu_seconds_per_step"),
        num_servers=med("num_servers"),
        **{f: med(f) for f in LINK_FIELDS + SERVER_FIELDS[1:]})


def _compute_bound(ok):
    """The compute bound from the ok rows: N x the single worker's images/s, or None if not measured."""
    cb_rows = [r for r in ok if r["algorithm"] == COMPUTE_BOUND]
    if not cb_rows:
        return None
    n = _num(cb_rows[0].get("bound_workers")) or _infer_workers(ok)
    one = _median([_num(r["images_per_sec"]) for r in cb_rows])
    one_steady = _median([_num(r.get("steady_images_per_sec")) for r in cb_rows])
    return {"workers": n, "single_images_per_sec": one, "single_steady_images_per_sec": one_steady,
            "worker_cpu_per_step": _median([_num(r.get("steady_worker_cpu_seconds_per_step")) for r in cb_rows]),
            "images_per_sec": n * one if one else None,
            "steady_images_per_sec": n * one_steady if one_steady else None,
            "runs": len(cb_rows)}


def topology_of(row):
    """A CSV row's topology; rows written before the column existed are loopback runs."""
    return row.get("topology") or "loopback"


def split_topologies(rows):
    """{topology: its rows}, in the order the topologies first appear."""
    out = {}
    for r in rows:
        out.setdefault(topology_of(r), []).append(r)
    return out


def _infer_workers(ok_rows):
    ns = [_num(r.get("num_workers")) for r in ok_rows if r["algorithm"] != COMPUTE_BOUND]
    ns = [n for n in ns if n]
    return int(max(ns)) if ns else 1


def _fmt(v, spec="{:.1f}", none="–"):
    return none if v is None else spec.format(v)


def _balance_cell(g):
    """How evenly the servers share the load: each measure's largest deviation from the servers' mean
    (CPU / tx / rx, steady window); "–" with one server."""
    devs = [g.get(f) for f in SERVER_FIELDS[1:]]
    if (g.get("num_servers") or 1) < 2 or any(d is None for d in devs):
        return "–"
    return " / ".join(f"{100 * d:.0f}%" for d in devs)


def _link_cell(g, role, d):
    """`KB/step (utilisation)` of a role's link in one direction, steady window."""
    v, u = g[f"steady_{role}_{d}_bytes_per_step"], g[f"{role}_{d}_util"]
    return _fmt(None if v is None else v / 1e3, "{:.1f}") + ("" if u is None else f" ({100 * u:.0f}%)")


def markdown_table(agg, title="Bandwidth-limited benchmark", topology=None):
    groups, cb = agg["groups"], agg["compute_bound"]
    topology = topology or agg.get("topology") or "loopback"
    hosts = topology == "hosts"
    lines = [f"## {title} — {TOPOLOGIES[topology]}", "", f"Topology: `{topology}` — {TOPOLOGIES[topology]}"
             + (": h0 launcher + scheduler, each server and each worker on a host of its own, every host link "
                "shaped at the rate in both directions." if hosts else
                ": every role in one namespace, every byte crosses the one shaped loopback."), ""]
    head = _table_head(hosts)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    bound = cb and (cb["steady_images_per_sec"] or cb["images_per_sec"])
    lines += ["| " + " | ".join(_table_cells(g, bound, hosts)) + " |" for g in groups]
    lines.append("")
    lines.append(_compute_bound_line(cb, hosts))
    comm = communication_share(agg)
    if comm:
        lines.append("SSGD communication share (1 − SSGD steady img/s ÷ compute bound): " +
                     ", ".join(f"{rate_name(r)} {100 * s:.0f}%" for r, s in comm.items()) + ".")
    lines += ["", _table_notes(hosts)]
    if agg.get("busy_runs"):
        lines += ["", f"**Warning:** in {agg['busy_runs']} of {agg['ok_runs']} successful runs other processes used "
                      f"more than {BUSY:.0%} of the machine's CPU (column `other CPU`); their timings are skewed. "
                      "Re-run on an idle machine or with `--wait-idle`."]
    failed = [(g["label"], g["rate_mbit"], f) for g in groups for f in g["failed"]]
    if failed:
        lines += ["", "Failed runs:"] + [f"- {lab} at {rate_name(rate)}: {f}" for lab, rate, f in failed]
    targets = check_targets(agg, topology)
    if targets:
        lines += ["", "Targets:"] + [f"- {t}" for t in targets]
    return "\n".join(lines) + "\n"


def _table_head(hosts):
    head = ["algorithm", "rate", "ok/runs", "img/s", "× SSGD", "steady img/s", "steady × SSGD", "% of bound"]
    if hosts:
        return head + ["server tx KB/step (util)", "server rx KB/step (util)", "worker tx KB/step (util)",
                       "worker rx KB/step (util)", "server CPU ms/step", "servers off mean CPU/tx/rx",
                       "worker CPU ms/step", "rank-0 push KB/step",
                       "rank-0 pull KB/step",
                       "pull ÷ push", "kernel MB/step", "× SSGD bytes", "worker RSS MB", "× SSGD RSS",
                       "server RSS MB", "final loss", "other CPU"]
    return head + ["kernel MB/step", "× SSGD bytes", "steady kernel MB/step", "rank-0 push+pull KB/step",
                   "worker RSS MB", "× SSGD RSS", "server RSS MB", "final loss", "other CPU"]


def _scaled(v, unit):
    return None if v is None else v / unit


def _ms(seconds):
    return None if seconds is None else 1e3 * seconds


def _table_cells(g, bound, hosts):
    """One group's cells, in _table_head's order; bound: the compute bound's images/s (or None)."""
    ips = g["steady_images_per_sec"] or g["images_per_sec"]
    pct = 100.0 * ips / bound if ips and bound else None
    cells = [g["label"], rate_name(g["rate_mbit"]), f"{g['ok']}/{g['runs']}",
             _fmt(g["images_per_sec"]), _fmt(g["speedup"], "{:.2f}×"),
             _fmt(g["steady_images_per_sec"]), _fmt(g["steady_speedup"], "{:.2f}×"), _fmt(pct, "{:.0f}%")]
    if hosts:
        cpu = g["steady_server_cpu_per_step"]
        cpu = g["server_cpu_per_step"] if cpu is None else cpu
        cells += [_link_cell(g, r, d) for r in LINK_ROLES for d in ("tx", "rx")] + [
            _fmt(_ms(cpu)), _balance_cell(g), _fmt(_ms(g["steady_worker_cpu_per_step"])),
            _fmt(_scaled(g["push_after_warmup"], 1e3), "{:.1f}"), _fmt(_scaled(g["pull_after_warmup"], 1e3), "{:.1f}"),
            _fmt(g["pull_push_ratio"], "{:.2f}×"),
            _fmt(_scaled(g["kernel_bytes_per_step"], 1e6), "{:.3f}"), _fmt(g["bytes_ratio"], "{:.3f}")]
    else:
        cells += [_fmt(_scaled(g["kernel_bytes_per_step"], 1e6), "{:.3f}"), _fmt(g["bytes_ratio"], "{:.3f}"),
                  _fmt(_scaled(g["steady_kernel_bytes_per_step"], 1e6), "{:.3f}"),
                  _fmt(_scaled(g["worker_bytes_per_step"], 1e3), "{:.1f}")]
    return cells + [_fmt(g["peak_rss_worker_mb"], "{:.0f}"), _fmt(g["rss_ratio"], "{:.2f}×"),
                    _fmt(g["peak_rss_server_mb"], "{:.0f}"), _fmt(g["final_loss"], "{:.3f}"),
                    _fmt(None if g["other_cpu_share"] is None else 100 * g["other_cpu_share"], "{:.0f}%")]


def _compute_bound_line(cb, hosts):
    if not cb:
        return "Compute bound: not measured."
    return (f"Compute bound: {_fmt(cb['images_per_sec'])} img/s (steady {_fmt(cb['steady_images_per_sec'])}) "
            f"= {cb['workers']:g} workers × the images/s of one worker with no communication "
            f"({_fmt(cb['single_images_per_sec'])}, steady {_fmt(cb['single_steady_images_per_sec'])}; "
            f"median of {cb['runs']} run(s)), measured as a 1-worker 1-server SSD-SGD job at unlimited "
            "rate with no warm-up, delay 100000 (never pulls or waits) and dense asynchronous pushes"
            + (", on a 3-host cluster (launcher, server, worker)" if hosts else "")
            + (f"; its worker used {1e3 * cb['worker_cpu_per_step']:.1f} ms of CPU per step."
               if cb.get("worker_cpu_per_step") is not None else "."))


def _table_notes(hosts):
    """The paragraph under the table that says what its columns measure."""
    common = ("Medians over repeats; `× SSGD` columns are medians of per-repeat ratios to SSGD at the same rate "
              "and repeat. img/s is the job's summary (all workers, all steps incl. warm-up); steady img/s is "
              "measured between the first logged step at or after warm-up + delay and the last step (rank 0's "
              "clock). ")
    tail = ("RSS: peak VmHWM per role (max over processes of that role), sampled every 0.5 s. Other CPU: share of "
            "the machine's CPU time used by processes outside the job while it ran (above ~10% the machine was "
            "busy with other work and the timings are unreliable).")
    if hosts:
        return (common +
                "Link columns: bytes per training step that a server's host (server, mean over the server hosts) "
                "and a worker's host (worker, mean over the worker hosts) sent (tx) and received (rx) on its eth0 "
                "in the steady window "
                "(TCP/IP and Ethernet headers included); in brackets the link's utilisation in that window, "
                "bytes × 8 ÷ (rate × window seconds), not shown for unlimited links. Server CPU: CPU seconds "
                "of the server processes per step in the steady window (sampled every 0.1 s; all servers' "
                "sum); servers off mean: with 2 or more servers, the largest deviation of one server's CPU, tx "
                "and rx bytes per step from the servers' mean, as a share of it; worker CPU: the "
                "same for the worker processes, per worker. Rank-0 push/pull: "
                "the payload bytes rank 0's client accounts per step after the warm-up; pull ÷ push is their "
                "ratio. Kernel bytes: the sum of every host's eth0 tx (each byte once) per training step, whole "
                "job (start-up and evaluation included). " + tail)
    return (common +
            "Kernel bytes: tx bytes of the namespace's loopback (each byte once; includes start-up, "
            "evaluation and TCP/IP headers) per training step; steady kernel MB/step counts only the steady "
            "window. Rank-0 push+pull: the bytes rank 0's client accounts per step (payload only). " + tail)


def communication_share(agg):
    cb = agg["compute_bound"]
    if not cb:
        return {}
    out = {}
    for g in agg["groups"]:
        if g["algorithm"] == BASELINE:
            ips = g["steady_images_per_sec"] or g["images_per_sec"]
            bound = cb["steady_images_per_sec"] or cb["images_per_sec"]
            if ips and bound:
                out[g["rate_mbit"]] = max(0.0, 1.0 - ips / bound)
    return out


def check_targets(agg, topology=None):
    """Human-readable verdicts of the project's targets (where they stand: docs/results.md,
    "How much faster on a slow link?"): loopback, the original targets; hosts, issue
    12's acceptance at TARGET_RATE per host link."""
    topology = topology or agg.get("topology") or "loopback"
    out = _host_targets(agg) if topology == "hosts" else _loopback_targets(agg)
    by = {(g["algorithm"], g["rate_mbit"]): g for g in agg["groups"]}
    for (alg, rate), g in by.items():
        if alg in COMPRESSED and g["rss_ratio"] is not None:
            verdict = "met" if g["rss_ratio"] <= 1.3 else "NOT met"
            out.append(f"{g['label']} worker peak RSS ≤ 1.3× SSGD's at {rate_name(rate)}: "
                       f"{g['rss_ratio']:.2f}× → {verdict}")
    return out


TARGET_RATE = 20.0         # Mbit/s per host link: the rate of the hosts topology's acceptance checks
TARGET_BOUND_SHARE = 0.85  # SSD-SGD + top-k 1% img/s ≥ this share of the compute bound ...
TARGET_SPEEDUP = 3.0       # ... and ≥ this many times SSGD's
TARGET_PULL_PUSH = 2.2     # pulled bytes per step after warm-up ≤ this many times the pushed bytes


def _host_targets(agg):
    by = {(g["algorithm"], g["rate_mbit"]): g for g in agg["groups"]}
    cb = agg["compute_bound"]
    bound = cb and (cb["steady_images_per_sec"] or cb["images_per_sec"])
    out = []
    g = by.get((HOST_TARGET, TARGET_RATE))
    where = f"at {rate_name(TARGET_RATE)} per host link"
    if g is None:
        out.append(f"{ALGORITHMS[HOST_TARGET][0]} not measured {where}: speed-up targets not assessable")
    else:
        ips = g["steady_images_per_sec"] or g["images_per_sec"]
        share = ips / bound if ips and bound else None
        verdict = "n/a" if share is None else ("met" if share >= TARGET_BOUND_SHARE else "NOT met")
        out.append(f"{g['label']} ≥ {TARGET_BOUND_SHARE:.0%} of the compute bound {where}: "
                   f"{_fmt(None if share is None else 100 * share, '{:.0f}%')} (steady) → {verdict}")
        sp = g["steady_speedup"] or g["speedup"]
        verdict = "n/a" if sp is None else ("met" if sp >= TARGET_SPEEDUP else "NOT met")
        out.append(f"{g['label']} ≥ {TARGET_SPEEDUP:g}× SSGD img/s {where}: {_fmt(sp, '{:.2f}×')} (steady) / "
                   f"{_fmt(g['speedup'], '{:.2f}×')} (summary) → {verdict}")
    for (alg, rate), g in by.items():
        if alg == HOST_TARGET:
            r = g["pull_push_ratio"]
            verdict = "n/a" if r is None else ("met" if r <= TARGET_PULL_PUSH else "NOT met")
            out.append(f"{g['label']} pulled bytes/step after warm-up ≤ {TARGET_PULL_PUSH:g}× pushed at "
                       f"{rate_name(rate)}: {_fmt(r, '{:.2f}×')} (rank 0: {_fmt(g['pull_after_warmup'], '{:,.0f}')} "
                       f"/ {_fmt(g['push_after_warmup'], '{:,.0f}')} B) → {verdict}")
    return out


def _loopback_targets(agg):
    by = {(g["algorithm"], g["rate_mbit"]): g for g in agg["groups"]}
    comm = communication_share(agg)
    out = []
    heavy = [r for r, s in comm.items() if s >= 0.5]
    for alg, need in (("ssd", 1.5), ("ssd_topk", 2.5)):
        for rate in heavy:
            g = by.get((alg, rate))
            if g is None:
                continue
            sp = g["steady_speedup"] or g["speedup"]
            verdict = "n/a" if sp is None else ("met" if sp >= need else "NOT met")
            out.append(f"{g['label']} ≥ {need}× SSGD img/s at {rate_name(rate)} (SSGD comm. share "
                       f"{100 * comm[rate]:.0f}%): {_fmt(sp, '{:.2f}×')} (steady) / {_fmt(g['speedup'], '{:.2f}×')} "
                       f"(summary) → {verdict}")
    if comm and not heavy:
        out.append("no rate where SSGD spends ≥ half its time communicating: speed-up targets not assessable")
    for (alg, rate), g in by.items():
        if alg == "ssd_topk":
            r = g["steady_bytes_ratio"] if g["steady_bytes_ratio"] is not None else g["bytes_ratio"]
            verdict = "n/a" if r is None else ("met" if r <= 0.15 else "NOT met")
            out.append(f"{g['label']} kernel bytes/step ≤ 15% of SSGD's at {rate_name(rate)}: steady "
                       f"{_fmt(g['steady_bytes_ratio'], '{:.1%}')}, whole job {_fmt(g['bytes_ratio'], '{:.1%}')} "
                       f"→ {verdict}")
    return out


def write_table(csv_path, out_dir, title="Bandwidth-limited benchmark"):
    """table.md from runs.csv: one table per topology the CSV holds."""
    parts = [markdown_table(aggregate(rs), title, topology)
             for topology, rs in split_topologies(read_rows(csv_path)).items()]
    text = "\n".join(parts) if parts else f"## {title}\n\nNo runs.\n"
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text)
    return text


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="algorithms: " + ", ".join(f"{k} ({v[0]})" for k, v in ALGORITHMS.items()))
    ap.add_argument("--topology", choices=tuple(TOPOLOGIES), default="hosts",
                    help="hosts (default): one virtual host per role, each with its own shaped link; "
                         "loopback: every role in one namespace sharing one shaped loopback")
    ap.add_argument("--quick", action="store_true",
                    help=f"short suite (< 10 min on 2 cores): {QUICK['steps']} steps, {QUICK['repeats']} repeat, "
                         f"rates {QUICK['rates']}, job timeout {QUICK['job_timeout']:g} s")
    ap.add_argument("--repeats", type=int, help=f"interleaved repeats (default {FULL['repeats']})")
    ap.add_argument("--steps", type=int, help=f"training steps per job (default {FULL['steps']})")
    ap.add_argument("--rates", help=f"link rates in Mbit/s, 0 = unlimited (default {FULL['rates']})")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS),
                    help="comma-separated subset of: " + ", ".join(ALGORITHMS))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench_network"), help="output folder")
    ap.add_argument("--config", default=os.path.join(ROOT, DEFAULT_CONFIG), help="base config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every job (repeatable)")
    ap.add_argument("--job-timeout", type=float, help=f"seconds per job (default {FULL['job_timeout']:g})")
    ap.add_argument("--queue-ms", type=float, default=50.0,
                    help="tbf latency: how long a packet may queue at the link before it is dropped "
                         "(default 50; drops on loopback cost TCP retransmission timeouts)")
    ap.add_argument("--delay-ms", type=float, default=None,
                    help="loopback topology only: also add a netem delay on the loopback (needs the sch_netem "
                         "kernel module)")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each job wait, at most this long, until the machine is < 15%% busy "
                         "(for shared machines; default 0: do not wait)")
    ap.add_argument("--no-compute-bound", action="store_true", help="skip the compute-bound runs")
    ap.add_argument("--append", action="store_true", help="append to an existing runs.csv instead of replacing it")
    ap.add_argument("--table-only", action="store_true", help="only re-make table.md from <out>/runs.csv")
    ap.add_argument("--dry-run", action="store_true", help="print the planned jobs and exit")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for k in ("steps", "repeats", "rates", "job_timeout"):
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    try:
        args.rate_list = [float(r) for r in str(args.rates).split(",") if r.strip() != ""]
    except ValueError:
        ap.error(f"--rates: expected comma-separated numbers, got {args.rates!r}")
    if not args.rate_list or any(r < 0 for r in args.rate_list):
        ap.error("--rates: need at least one rate >= 0")
    args.alg_list = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in args.alg_list if a not in ALGORITHMS]
    if unknown or not args.alg_list:
        ap.error(f"--algorithms: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(ALGORITHMS)}")
    if args.steps < 1 or args.repeats < 1 or args.job_timeout <= 0:
        ap.error("--steps, --repeats and --job-timeout must be positive")
    if args.delay_ms and args.topology == "hosts":
        ap.error("--delay-ms needs --topology loopback (the virtual cluster shapes with tbf only)")
    args.out = os.path.abspath(args.out)
    args.config = os.path.abspath(args.config)
    return args


def plan(args):
    """The jobs in run order, with what each needs to know about its config."""
    from ssdsgd.config import ConfigError, load_config
    jobs = []
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def job(key, label, rate, rep, sets):
        try:
            cfg = load_config(args.config, args.set + sets + [f"train.max_steps={args.steps}"])
        except ConfigError as e:
            raise SystemExit(f"bench_network: config error for {label}: {e}")
        a = cfg.algorithm
        rate_tag = "unl" if not rate else f"{rate:g}mbit"
        return {"key": key, "label": label, "rate": rate, "repeat": rep, "sets": sets,
                "name": f"{stamp}_{key}_{rate_tag}_rep{rep}", "batch": cfg.train.batch_size,
                "workers": cfg.cluster.workers, "servers": cfg.cluster.servers,
                # the same window for every algorithm: after SSD's warm-up and first delay period
                "steady_from": min(a.warmup_iters + a.delay, max(1, args.steps // 2))}

    for rep in range(1, args.repeats + 1):
        if not args.no_compute_bound:
            jobs.append(job(COMPUTE_BOUND, COMPUTE_BOUND_LABEL, 0.0, rep, COMPUTE_BOUND_SETS))
        for rate in args.rate_list:
            for key in args.alg_list:
                label, sets = ALGORITHMS[key]
                jobs.append(job(key, label, rate, rep, sets))
    return jobs


def remake_table(csv_path, out_dir, write=None, prog="bench_network"):
    """--table-only: table.md again from runs.csv (by `write`, default write_table); the exit status."""
    if not os.path.exists(csv_path):
        print(f"{prog}: {csv_path} not found", file=sys.stderr)
        return 2
    title = table_title(os.path.join(out_dir, "table.md"))
    write = write or write_table
    print(write(csv_path, out_dir, title) if title else write(csv_path, out_dir))
    return 0


def table_title(path):
    """The title of an existing table.md (its first heading up to " — "), or None: a remade table keeps
    what the run wrote there (steps, repeats, the suite's wall time), which runs.csv does not hold."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        first = f.readline()
    return first[3:].split(" — ")[0].strip() if first.startswith("## ") else None


def main(argv=None):
    args = parse_args(argv)
    csv_path = os.path.join(args.out, "runs.csv")
    if args.table_only:
        return remake_table(csv_path, args.out)
    jobs = plan(args)
    if args.dry_run:
        for j in jobs:
            print(f"rep {j['repeat']}  {rate_name(j['rate']):>13}  {j['label']:<36} {' '.join(j['sets'])}")
        return 0
    try:
        (vcluster.check_tools if args.topology == "hosts" else netns.check_tools)()
    except netns.NetnsError as e:
        print(f"bench_network: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    mode = "a" if args.append and os.path.exists(csv_path) else "w"
    if mode == "a":
        with open(csv_path, newline="") as f:
            header = next(csv.reader(f), None)
        if header != FIELDS:
            print(f"bench_network: {csv_path} has other columns; not appending", file=sys.stderr)
            return 2
    # With --append, runs.csv also holds the rows of the earlier runs: the manifest names them under "earlier".
    earlier = earlier_runs(args.out) if mode == "a" else []
    write_manifest(args.out, [args.config], finished=False, appended=mode == "a", earlier=earlier)
    t_suite = time.monotonic()
    status = _run_suite(jobs, args, csv_path, mode)
    wall = time.monotonic() - t_suite
    write_manifest(args.out, [args.config], finished=True, appended=mode == "a", earlier=earlier, jobs=len(jobs),
                   exit_status=status)
    title = f"Bandwidth-limited benchmark ({args.steps} steps, {args.repeats} repeat(s), suite wall time {wall:.0f} s)"
    if os.path.exists(csv_path):
        text = write_table(csv_path, args.out, title)
        print()
        print(text)
        print(f"bench_network: {csv_path}, {os.path.join(args.out, 'table.md')}")
    return status


def _run_suite(jobs, args, csv_path, mode):
    """Run the jobs, one CSV row each as it ends (mode "a": appended to runs.csv). Returns the exit
    status: 0, 130 when interrupted, 1 when the namespace set-up failed."""
    bound_workers = max(j["workers"] for j in jobs if j["key"] != COMPUTE_BOUND) if any(
        j["key"] != COMPUTE_BOUND for j in jobs) else 1
    old_term = stop_on_sigterm()          # SIGTERM stops like Ctrl-C: the running job is cleaned up
    # Ctrl-C must stop the suite cleanly even when we were started with SIGINT ignored (e.g. `cmd &`).
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"bench_network: {len(jobs)} jobs, {args.steps} steps each, rates "
          f"{', '.join(rate_name(r) for r in args.rate_list)}, topology {TOPOLOGIES[args.topology]}; "
          f"results in {args.out}", flush=True)
    try:
        with open(csv_path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if mode == "w":
                writer.writeheader()
            for i, job in enumerate(jobs, 1):
                print(f"[{i}/{len(jobs)}] rep {job['repeat']} {rate_name(job['rate'])} {job['label']} ...",
                      end=" ", flush=True)
                waited = wait_until_idle(args.wait_idle) if args.wait_idle > 0 else 0.0
                row = run_one(job, args)
                row["idle_wait_seconds"] = waited
                row["bound_workers"] = bound_workers if job["key"] == COMPUTE_BOUND else ""
                writer.writerow(row)
                f.flush()
                print(_progress(row, args.topology == "hosts"), flush=True)
    except KeyboardInterrupt:
        print("\nbench_network: interrupted; the running job and its namespace were cleaned up", file=sys.stderr)
        return 130
    except netns.NetnsError as e:           # the set-up itself is broken: every further job would fail too
        print(f"\nbench_network: stopping the suite: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    return 0


def _progress(row, hosts):
    """The line printed when a job ends."""
    return (f"{row['status']} (exit {row['exit_code']}) {_fmt(_num(row['images_per_sec']))} img/s, "
            f"steady {_fmt(_num(row['steady_images_per_sec']))}, kernel "
            f"{_fmt(_num(row['kernel_bytes_per_step']), '{:,.0f}')} B/step, "
            + (f"server link steady tx/rx {_fmt(_num(row['steady_server_tx_bytes_per_step']), '{:,.0f}')}/"
               f"{_fmt(_num(row['steady_server_rx_bytes_per_step']), '{:,.0f}')} B/step, "
               if hosts else "")
            + f"{row['job_seconds']} s" + (f" -- {row['error']}" if row["error"] else ""))


if __name__ == "__main__":
    sys.exit(main())
