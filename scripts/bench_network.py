"""Bandwidth-limited network benchmark: every job in a fresh network namespace with a rate-limited loopback.

For each repeat, rate and algorithm (interleaved: repeat 1 runs A B C ... at every rate, then repeat 2),
the benchmark creates a namespace (scripts/netns.py: lo mtu 9000, `tbf rate R mbit burst 256kb latency
50ms`, no qdisc for rate 0 = unlimited), runs `python -m ssdsgd.run` inside it for a fixed number of
steps, and records:
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
worker never pulls or waits) and dense pushes (asynchronous, so the worker never waits on them).

Usage (root; ip and tc from iproute2):
  python scripts/bench_network.py                       # full suite: 3 repeats x rates 0,100,20 x 6 algorithms
  python scripts/bench_network.py --quick --out /tmp/bench_quick
  python scripts/bench_network.py --algorithms ssgd,ssd_topk --rates 0,50 --steps 40 --repeats 1
  python scripts/bench_network.py --table-only --out bench_results   # re-make table.md from runs.csv
"""
import argparse
import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import netns
from results_io import COMPUTE_BOUND, rate_name, read_jsonl, stop_on_sigterm
from ssdsgd.metrics import SUMMARY_FILE, metrics_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

DEFAULT_CONFIG = "configs/bench_cifar_resnet20.yaml"

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
    # S = 2k lets each weight pull land up to k steps after it was issued (see algorithms/ssd.py).
    "ssd_topk_s2k": ("SSD-SGD+top-k 1%, S=2k", ["algorithm.type=ssd", "compression.type=topk",
                                               "compression.density=0.01", "algorithm.max_staleness=10"]),
}
COMPUTE_BOUND_LABEL = "compute bound (1 worker, no comm.)"
# Dense pushes, not top-k: the bound must not include the compressor's own compute. On an unlimited
# loopback the asynchronous push of a ResNet-20 gradient costs the worker a copy; the server's update
# runs on the other core.
COMPUTE_BOUND_SETS = ["cluster.workers=1", "cluster.servers=1", "algorithm.type=ssd",
                      "algorithm.delay=100000", "algorithm.warmup_iters=0", "compression.type=none"]
BASELINE = "ssgd"
COMPRESSED = ("ssgd_2bit", "ssd_topk", "ssgd_topk", "ssd_topk_s2k")
ROLES = ("worker", "server", "scheduler", "launcher")

FIELDS = ["algorithm", "label", "rate_mbit", "repeat", "status", "exit_code", "images_per_sec",
          "steady_images_per_sec", "wall_seconds", "job_seconds", "steps", "num_workers", "kernel_bytes",
          "kernel_bytes_per_step", "steady_kernel_bytes_per_step", "kernel_rx_bytes", "qdisc_drops",
          "push_bytes_per_step", "pull_bytes_per_step", "final_loss", "final_test_acc", "wait_seconds"] + \
         [f"peak_rss_{r}_mb" for r in ROLES] + ["job_cpu_seconds", "other_cpu_share", "idle_wait_seconds",
                                                "bound_workers", "run_dir", "log", "namespace", "error"]

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


def steady_state(records, start_step, images_per_step, counter_samples):
    """Images/s and kernel tx bytes/step between the first logged step >= start_step and the last one.

    Leaves out the start-up, the first (hybridize) steps and the warm-up, and the final evaluation."""
    steps = [r for r in records if "loss" in r and "step" in r and "time" in r]
    window = [r for r in steps if r["step"] >= start_step]
    if len(window) < 2:
        window = steps[-2:] if len(steps) >= 2 else []
    if len(window) < 2:
        return None, None
    a, b = window[0], window[-1]
    dsteps, dt = b["step"] - a["step"], b["time"] - a["time"]
    if dsteps <= 0 or dt <= 0:
        return None, None
    ips = dsteps * images_per_step / dt
    ca, cb = _interp(counter_samples, a["time"]), _interp(counter_samples, b["time"])
    bps = (cb - ca) / dsteps if ca is not None and cb is not None else None
    return ips, bps


class Sampler:
    """Polls, while a job runs, the namespace's lo tx counter (every `net_every` s, read from
    /proc/<pid>/net/dev of the job's first process) and every namespace process's VmHWM (every
    `rss_every` s), keeping the max per pid; the role comes from the process's DMLC_ROLE."""

    def __init__(self, ns, pid, net_every=0.1, rss_every=0.5):
        self.ns, self.pid = ns, pid
        self.net_every, self.rss_every = net_every, rss_every
        self.counter = []                    # (time.time(), tx_bytes)
        self.hwm = {}                        # pid -> (role, kB)
        self.cpu_ticks = {}                  # pid -> utime + stime (clock ticks), last seen
        self._next_rss = 0.0

    def poll(self):
        now = time.time()
        c = netns.counters_of_pid(self.pid)
        if c is not None:
            self.counter.append((now, c["tx_bytes"]))
        if time.monotonic() >= self._next_rss:
            self._next_rss = time.monotonic() + self.rss_every
            for pid in self.ns.pids():
                kb = netns.read_status_kb(pid, "VmHWM")
                if kb is None:
                    continue
                # Read the role every time: between the launcher's fork and the exec a child still has
                # the launcher's environment and memory; after the exec it is a new process image.
                role = netns.read_environ(pid).get("DMLC_ROLE") or (
                    "launcher" if "ssdsgd.run" in _cmdline(pid) else "other")
                prev_role, prev_kb = self.hwm.get(pid, (role, 0))
                self.hwm[pid] = (role, max(kb, prev_kb) if prev_role == role else kb)
                ticks = _cpu_ticks(pid)
                if ticks is not None:
                    self.cpu_ticks[pid] = max(ticks, self.cpu_ticks.get(pid, 0))

    def job_cpu_seconds(self):
        return sum(self.cpu_ticks.values()) / os.sysconf("SC_CLK_TCK")

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
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(job, args):
    """Run one job in its own namespace; return its CSV row (never raises for a failed job)."""
    row = {k: "" for k in FIELDS}
    row.update(algorithm=job["key"], label=job["label"], rate_mbit=job["rate"], repeat=job["repeat"])
    log_dir = os.path.join(args.out, "runs")
    run_dir = os.path.join(log_dir, job["name"])
    log_path = os.path.join(args.out, "logs", job["name"] + ".log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    row.update(run_dir=os.path.relpath(run_dir, args.out), log=os.path.relpath(log_path, args.out))
    command = [sys.executable, "-m", "ssdsgd.run", "--config", args.config,
               "--set", f"log.dir={log_dir}", "--set", f"name={job['name']}",
               "--set", f"train.max_steps={args.steps}", "--set", f"cluster.timeout={args.job_timeout:g}"]
    for s in args.set + job["sets"]:
        command += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    t0 = time.monotonic()
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
        hard_deadline = t0 + args.job_timeout + 30     # the launcher's own timeout fires first
        timed_out = False
        try:
            while proc.poll() is None:
                sampler.poll()
                if time.monotonic() > hard_deadline:
                    timed_out = True
                    _stop_job(proc)
                    break
                time.sleep(sampler.net_every)
        except BaseException:
            _stop_job(proc)
            raise
        finally:
            proc.wait()
        cpu_after = _system_cpu()
        ns.kill_all()                                  # nothing may outlive the job in the namespace
        after = ns.counters()
        row["qdisc_drops"] = _qdisc_drops(ns)
    row["job_seconds"] = round(time.monotonic() - t0, 2)
    row["exit_code"] = proc.returncode
    sampler.counter.append((time.time(), after["tx_bytes"]))
    tx = after["tx_bytes"] - before["tx_bytes"]
    row.update(kernel_bytes=tx, kernel_rx_bytes=after["rx_bytes"] - before["rx_bytes"])
    # CPU used on this machine by anything but the job (other users' work skews the benchmark).
    busy, total = cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]
    if total > 0:
        row["other_cpu_share"] = round(max(0.0, busy - sampler.job_cpu_seconds()) / total, 3)
        row["job_cpu_seconds"] = round(sampler.job_cpu_seconds(), 2)
    for role, mb in sampler.peak_mb().items():
        if role in ROLES:
            row[f"peak_rss_{role}_mb"] = round(mb, 1)

    summary_path = os.path.join(run_dir, SUMMARY_FILE)
    if timed_out or proc.returncode == 124:
        row["status"] = "timeout"
    elif proc.returncode != 0 or not os.path.exists(summary_path):
        row["status"] = "failed"
    else:
        row["status"] = "ok"
    if row["status"] != "ok":
        row["error"] = _last_error(log_path)
    records = read_jsonl(os.path.join(run_dir, metrics_file()))   # rank 0's
    losses = [r["loss"] for r in records if "loss" in r]
    if losses:
        row["final_loss"] = round(losses[-1], 5)
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        steps = s["steps"]
        row.update(images_per_sec=round(s["images_per_sec"], 3), wall_seconds=round(s["wall_seconds"], 3),
                   steps=steps, num_workers=s["num_workers"],
                   kernel_bytes_per_step=round(tx / max(1, steps)),
                   push_bytes_per_step=round(s["bytes_per_step"]["push"]),
                   pull_bytes_per_step=round(s["bytes_per_step"]["pull"]),
                   final_test_acc=s.get("final_test_acc"), wait_seconds=round(s.get("wait_seconds") or 0.0, 3))
        ips, bps = steady_state(records, job["steady_from"], job["batch"] * s["num_workers"], sampler.counter)
        if ips is not None:
            row["steady_images_per_sec"] = round(ips, 3)
        if bps is not None:
            row["steady_kernel_bytes_per_step"] = round(bps)
    return row


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
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def aggregate(rows):
    """Per (algorithm, rate) medians over the ok runs, and medians of per-repeat ratios vs SSGD.

    Returns {"groups": [dict per (algorithm, rate) in first-seen order], "compute_bound": {...} or None}.
    A ratio for repeat r is value(alg, rate, r) / value(ssgd, rate, r); runs without an ok SSGD partner
    of the same repeat and rate give no ratio."""
    ok = [r for r in rows if r.get("status") == "ok"]
    rate = lambda r: _num(r["rate_mbit"]) or 0.0  # noqa: E731
    base = {(rate(r), r["repeat"]): r for r in ok if r["algorithm"] == BASELINE}
    order, groups = [], {}
    for r in rows:
        if r["algorithm"] == COMPUTE_BOUND:
            continue
        key = (r["algorithm"], rate(r))
        if key not in groups:
            order.append(key)
            groups[key] = {"algorithm": r["algorithm"], "label": r.get("label") or r["algorithm"],
                           "rate_mbit": rate(r), "runs": 0, "ok": 0, "_rows": [], "_failed": []}
        groups[key]["runs"] += 1
        if r.get("status") == "ok":
            groups[key]["ok"] += 1
            groups[key]["_rows"].append(r)
        else:
            groups[key]["_failed"].append(r)

    def ratios(rs, field):
        out = []
        for r in rs:
            b = base.get((rate(r), r["repeat"]))
            v, bv = _num(r.get(field)), _num(b.get(field)) if b else None
            if v is not None and bv:
                out.append(v / bv)
        return _median(out)

    def worker_bytes(r):
        p, q = _num(r.get("push_bytes_per_step")), _num(r.get("pull_bytes_per_step"))
        return p + q if p is not None and q is not None else None

    result = []
    for key in order:
        g = groups[key]
        rs, failed = g.pop("_rows"), g.pop("_failed")
        med = lambda f: _median([_num(r.get(f)) for r in rs])  # noqa: E731
        g.update(
            images_per_sec=med("images_per_sec"), steady_images_per_sec=med("steady_images_per_sec"),
            wall_seconds=med("wall_seconds"), steps=med("steps"),
            kernel_bytes_per_step=med("kernel_bytes_per_step"),
            steady_kernel_bytes_per_step=med("steady_kernel_bytes_per_step"),
            worker_bytes_per_step=_median([worker_bytes(r) for r in rs]),
            final_loss=med("final_loss"), qdisc_drops=med("qdisc_drops"),
            other_cpu_share=med("other_cpu_share"),
            **{f"peak_rss_{role}_mb": med(f"peak_rss_{role}_mb") for role in ROLES},
            speedup=ratios(rs, "images_per_sec"), steady_speedup=ratios(rs, "steady_images_per_sec"),
            bytes_ratio=ratios(rs, "kernel_bytes_per_step"),
            steady_bytes_ratio=ratios(rs, "steady_kernel_bytes_per_step"),
            rss_ratio=ratios(rs, "peak_rss_worker_mb"),
            failed=[f"rep {r['repeat']}: {r['status']} (exit {r['exit_code']})" for r in failed])
        result.append(g)

    busy = [r for r in ok if (_num(r.get("other_cpu_share")) or 0.0) > BUSY]
    cb_rows = [r for r in ok if r["algorithm"] == COMPUTE_BOUND]
    compute_bound = None
    if cb_rows:
        n = _num(cb_rows[0].get("bound_workers")) or _infer_workers(ok)
        one = _median([_num(r["images_per_sec"]) for r in cb_rows])
        one_steady = _median([_num(r.get("steady_images_per_sec")) for r in cb_rows])
        compute_bound = {"workers": n, "single_images_per_sec": one, "single_steady_images_per_sec": one_steady,
                         "images_per_sec": n * one if one else None,
                         "steady_images_per_sec": n * one_steady if one_steady else None,
                         "runs": len(cb_rows)}
    return {"groups": result, "compute_bound": compute_bound, "busy_runs": len(busy), "ok_runs": len(ok)}


def _infer_workers(ok_rows):
    ns = [_num(r.get("num_workers")) for r in ok_rows if r["algorithm"] != COMPUTE_BOUND]
    ns = [n for n in ns if n]
    return int(max(ns)) if ns else 1


def _fmt(v, spec="{:.1f}", none="–"):
    return none if v is None else spec.format(v)


def markdown_table(agg, title="Bandwidth-limited benchmark"):
    groups, cb = agg["groups"], agg["compute_bound"]
    lines = [f"## {title}", ""]
    head = ["algorithm", "rate", "ok/runs", "img/s", "× SSGD", "steady img/s", "steady × SSGD",
            "% of bound", "kernel MB/step", "× SSGD bytes", "steady kernel MB/step", "rank-0 push+pull KB/step",
            "worker RSS MB", "× SSGD RSS", "server RSS MB", "final loss", "other CPU"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    bound = cb and (cb["steady_images_per_sec"] or cb["images_per_sec"])
    for g in groups:
        ips = g["steady_images_per_sec"] or g["images_per_sec"]
        pct = 100.0 * ips / bound if ips and bound else None
        mb = lambda v: None if v is None else v / 1e6  # noqa: E731
        lines.append("| " + " | ".join([
            g["label"], rate_name(g["rate_mbit"]), f"{g['ok']}/{g['runs']}",
            _fmt(g["images_per_sec"]), _fmt(g["speedup"], "{:.2f}×"),
            _fmt(g["steady_images_per_sec"]), _fmt(g["steady_speedup"], "{:.2f}×"), _fmt(pct, "{:.0f}%"),
            _fmt(mb(g["kernel_bytes_per_step"]), "{:.3f}"), _fmt(g["bytes_ratio"], "{:.3f}"),
            _fmt(mb(g["steady_kernel_bytes_per_step"]), "{:.3f}"),
            _fmt(None if g["worker_bytes_per_step"] is None else g["worker_bytes_per_step"] / 1e3, "{:.1f}"),
            _fmt(g["peak_rss_worker_mb"], "{:.0f}"), _fmt(g["rss_ratio"], "{:.2f}×"),
            _fmt(g["peak_rss_server_mb"], "{:.0f}"), _fmt(g["final_loss"], "{:.3f}"),
            _fmt(None if g["other_cpu_share"] is None else 100 * g["other_cpu_share"], "{:.0f}%")]) + " |")
    lines.append("")
    if cb:
        lines.append(f"Compute bound: {_fmt(cb['images_per_sec'])} img/s (steady {_fmt(cb['steady_images_per_sec'])}) "
                     f"= {cb['workers']:g} workers × the images/s of one worker with no communication "
                     f"({_fmt(cb['single_images_per_sec'])}, steady {_fmt(cb['single_steady_images_per_sec'])}; "
                     f"median of {cb['runs']} run(s)), measured as a 1-worker 1-server SSD-SGD job at unlimited "
                     "rate with no warm-up, delay 100000 (never pulls or waits) and dense asynchronous pushes.")
    else:
        lines.append("Compute bound: not measured.")
    comm = communication_share(agg)
    if comm:
        lines.append("SSGD communication share (1 − SSGD steady img/s ÷ compute bound): " +
                     ", ".join(f"{rate_name(r)} {100 * s:.0f}%" for r, s in comm.items()) + ".")
    lines += ["",
              "Medians over repeats; `× SSGD` columns are medians of per-repeat ratios to SSGD at the same rate "
              "and repeat. img/s is the job's summary (all workers, all steps incl. warm-up); steady img/s is "
              "measured between the first logged step at or after warm-up + delay and the last step (rank 0's "
              "clock). Kernel bytes: tx bytes of the namespace's loopback (each byte once; includes start-up, "
              "evaluation and TCP/IP headers) per training step; steady kernel MB/step counts only the steady "
              "window. Rank-0 push+pull: the bytes rank 0's client accounts per step (payload only). RSS: peak "
              "VmHWM per role (max over processes of that role), sampled every 0.5 s. Other CPU: share of the "
              "machine's CPU time used by processes outside the job while it ran (above ~10% the machine was "
              "busy with other work and the timings are unreliable)."]
    if agg.get("busy_runs"):
        lines += ["", f"**Warning:** in {agg['busy_runs']} of {agg['ok_runs']} successful runs other processes used "
                      f"more than {BUSY:.0%} of the machine's CPU (column `other CPU`); their timings are skewed. "
                      "Re-run on an idle machine or with `--wait-idle`."]
    failed = [(g["label"], g["rate_mbit"], f) for g in groups for f in g["failed"]]
    if failed:
        lines += ["", "Failed runs:"] + [f"- {lab} at {rate_name(rate)}: {f}" for lab, rate, f in failed]
    targets = check_targets(agg)
    if targets:
        lines += ["", "Targets:"] + [f"- {t}" for t in targets]
    return "\n".join(lines) + "\n"


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


def check_targets(agg):
    """Human-readable verdicts of the project's targets (listed, with where they stand, in the README's
    "Throughput on a bandwidth-limited link" section)."""
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
    for (alg, rate), g in by.items():
        if alg in COMPRESSED and g["rss_ratio"] is not None:
            verdict = "met" if g["rss_ratio"] <= 1.3 else "NOT met"
            out.append(f"{g['label']} worker peak RSS ≤ 1.3× SSGD's at {rate_name(rate)}: "
                       f"{g['rss_ratio']:.2f}× → {verdict}")
    return out


def write_table(csv_path, out_dir, title="Bandwidth-limited benchmark"):
    rows = read_rows(csv_path)
    text = markdown_table(aggregate(rows), title)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text)
    return text


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="algorithms: " + ", ".join(f"{k} ({v[0]})" for k, v in ALGORITHMS.items()))
    ap.add_argument("--quick", action="store_true",
                    help=f"short suite (< 10 min on 2 cores): {QUICK['steps']} steps, {QUICK['repeats']} repeat, "
                         f"rates {QUICK['rates']}, job timeout {QUICK['job_timeout']:g} s")
    ap.add_argument("--repeats", type=int, help=f"interleaved repeats (default {FULL['repeats']})")
    ap.add_argument("--steps", type=int, help=f"training steps per job (default {FULL['steps']})")
    ap.add_argument("--rates", help=f"link rates in Mbit/s, 0 = unlimited (default {FULL['rates']})")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS),
                    help="comma-separated subset of: " + ", ".join(ALGORITHMS))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results"), help="output folder")
    ap.add_argument("--config", default=os.path.join(ROOT, DEFAULT_CONFIG), help="base config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every job (repeatable)")
    ap.add_argument("--job-timeout", type=float, help=f"seconds per job (default {FULL['job_timeout']:g})")
    ap.add_argument("--queue-ms", type=float, default=50.0,
                    help="tbf latency: how long a packet may queue at the link before it is dropped "
                         "(default 50; drops on loopback cost TCP retransmission timeouts)")
    ap.add_argument("--delay-ms", type=float, default=None,
                    help="also add a netem delay on the loopback (needs the sch_netem kernel module)")
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
                "workers": cfg.cluster.workers,
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


def main(argv=None):
    args = parse_args(argv)
    csv_path = os.path.join(args.out, "runs.csv")
    if args.table_only:
        if not os.path.exists(csv_path):
            print(f"bench_network: {csv_path} not found", file=sys.stderr)
            return 2
        print(write_table(csv_path, args.out))
        return 0
    jobs = plan(args)
    if args.dry_run:
        for j in jobs:
            print(f"rep {j['repeat']}  {rate_name(j['rate']):>13}  {j['label']:<36} {' '.join(j['sets'])}")
        return 0
    try:
        netns.check_tools()
    except netns.NetnsError as e:
        print(f"bench_network: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    bound_workers = max(j["workers"] for j in jobs if j["key"] != COMPUTE_BOUND) if any(
        j["key"] != COMPUTE_BOUND for j in jobs) else 1
    fields = FIELDS
    mode = "a" if args.append and os.path.exists(csv_path) else "w"
    if mode == "a":
        with open(csv_path, newline="") as f:
            header = next(csv.reader(f), None)
        if header != fields:
            print(f"bench_network: {csv_path} has other columns; not appending", file=sys.stderr)
            return 2

    old_term = stop_on_sigterm()          # SIGTERM stops like Ctrl-C: the running job is cleaned up
    # Ctrl-C must stop the suite cleanly even when we were started with SIGINT ignored (e.g. `cmd &`).
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    t_suite = time.monotonic()
    interrupted = setup_error = False
    print(f"bench_network: {len(jobs)} jobs, {args.steps} steps each, rates "
          f"{', '.join(rate_name(r) for r in args.rate_list)}; results in {args.out}", flush=True)
    try:
        with open(csv_path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
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
                print(f"{row['status']} (exit {row['exit_code']}) {_fmt(_num(row['images_per_sec']))} img/s, "
                      f"steady {_fmt(_num(row['steady_images_per_sec']))}, kernel "
                      f"{_fmt(_num(row['kernel_bytes_per_step']), '{:,.0f}')} B/step, "
                      f"{row['job_seconds']} s" + (f" -- {row['error']}" if row["error"] else ""), flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\nbench_network: interrupted; the running job and its namespace were cleaned up", file=sys.stderr)
    except netns.NetnsError as e:           # the set-up itself is broken: every further job would fail too
        interrupted = True
        print(f"\nbench_network: stopping the suite: {e}", file=sys.stderr)
        setup_error = True
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    wall = time.monotonic() - t_suite
    title = f"Bandwidth-limited benchmark ({args.steps} steps, {args.repeats} repeat(s), suite wall time {wall:.0f} s)"
    if os.path.exists(csv_path):
        text = write_table(csv_path, args.out, title)
        print()
        print(text)
        print(f"bench_network: {csv_path}, {os.path.join(args.out, 'table.md')}")
    return (130 if interrupted else 0) if not setup_error else 1


if __name__ == "__main__":
    sys.exit(main())
