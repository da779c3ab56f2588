"""How evenly the servers share the load: each server's CPU and link bytes per step, at 2 and 4 servers.

For each repeat, server count (--servers) and algorithm (--algorithms), one job of bench_network's hosts
topology (testbed/vcluster.py: h0 the launcher and the scheduler, the servers on h1..hS, the workers after
them, one host each; unlimited links unless --rate): the base config with --workers workers at a small
per-worker batch (--batch), so that many processes on few cores still step quickly. bench_network's
run_one runs it and measures, besides its usual columns, per server host in the steady window (the
first logged step at or after warm-up + delay to the last one): the CPU seconds of its server process
per step, and its eth0 bytes sent (tx) and received (rx) per step (headers included), and per measure
the largest deviation of a server from the servers' mean, as a share of that mean.

Writes <out>/runs.csv (bench_network's columns, one row per job as it ends), <out>/table.md (one line
per server count and algorithm: every server's figures, the largest deviations, and whether each is
within TOLERANCE of the mean) and <out>/manifest.json.

Usage (root; the tools of testbed/vcluster.py):
  python bench/bench_server_balance.py --out results/server_balance
  python bench/bench_server_balance.py --servers 2 --algorithms ssgd --steps 20 --out /tmp/balance
  python bench/bench_server_balance.py --table-only --out results/server_balance
"""
import argparse
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from bench import bench_network as bn
from testbed import vcluster
from scripts.results_io import rate_name, write_manifest

ALGORITHMS = "ssgd,ssd_topk_sparse,ssd_topk_compressed"
TOLERANCE = 0.20       # the issue's target: every server within 20% of the servers' mean


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="2,4", help="comma-separated server counts (default 2,4)")
    ap.add_argument("--workers", type=int, default=4, help="workers per job (default 4)")
    ap.add_argument("--batch", type=int, default=8, help="per-worker batch (default 8)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per job (default 40)")
    ap.add_argument("--repeats", type=int, default=1, help="repeats (default 1)")
    ap.add_argument("--rate", type=float, default=0.0, help="Mbit/s per host link, 0 = unlimited (default)")
    ap.add_argument("--algorithms", default=ALGORITHMS, help=f"bench_network algorithms (default {ALGORITHMS})")
    ap.add_argument("--config", default=os.path.join(ROOT, bn.DEFAULT_CONFIG), help="base config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every job (repeatable)")
    ap.add_argument("--job-timeout", type=float, default=600.0, help="seconds per job (default 600)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "server_balance"), help="output folder")
    ap.add_argument("--note", default="", help="a line on how the run was made (e.g. which code it measured), "
                                               "kept in the manifest")
    ap.add_argument("--table-only", action="store_true", help="only re-make table.md from <out>/runs.csv")
    args = ap.parse_args(argv)
    try:
        args.server_list = [int(s) for s in args.servers.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--servers: expected comma-separated integers, got {args.servers!r}")
    if not args.server_list or min(args.server_list) < 1 or min(args.workers, args.batch, args.steps) < 1:
        ap.error("--servers, --workers, --batch and --steps must be positive")
    args.out = os.path.abspath(args.out)
    return args


def network_args(args, servers=None):
    """bench_network's parsed arguments for the jobs (with `servers`: those of that server count)."""
    argv = ["--topology", "hosts", "--rates", f"{args.rate:g}", "--algorithms", args.algorithms,
            "--steps", str(args.steps), "--repeats", str(args.repeats), "--no-compute-bound",
            "--config", args.config, "--job-timeout", f"{args.job_timeout:g}", "--out", args.out]
    sets = args.set + [f"cluster.workers={args.workers}", f"train.batch_size={args.batch}"]
    sets += [] if servers is None else [f"cluster.servers={servers}"]
    return bn.parse_args(argv + [x for s in sets for x in ("--set", s)])


def plan(args):
    """The jobs, repeat by repeat, each server count's algorithms in turn; the server count is one of
    each job's own overrides (bench_network's run_one adds a job's overrides to the common ones)."""
    jobs = []
    for servers in args.server_list:
        for job in bn.plan(network_args(args, servers)):
            job["sets"] = [f"cluster.servers={servers}"] + job["sets"]
            job["name"] += f"_s{servers}"
            jobs.append(job)
    return sorted(jobs, key=lambda j: j["repeat"])          # stable: server counts in order within a repeat


def main(argv=None):
    args = parse_args(argv)
    csv_path = os.path.join(args.out, "runs.csv")
    if args.table_only:
        return bn.remake_table(csv_path, args.out, write_table, "bench_server_balance")
    common = network_args(args)
    jobs = plan(args)
    try:
        vcluster.check_tools()
    except vcluster.ClusterError as e:
        print(f"bench_server_balance: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    write_manifest(args.out, [args.config], finished=False, note=args.note)
    t0 = time.monotonic()
    status = bn._run_suite(jobs, common, csv_path, "w")
    write_manifest(args.out, [args.config], finished=True, note=args.note, jobs=len(jobs), exit_status=status,
                   suite_seconds=round(time.monotonic() - t0))
    if os.path.exists(csv_path):
        print(write_table(csv_path, args.out))
    return status


# ------------------------------------------------------------------------------------------ table

def _servers_of(row):
    """A row's server count: its per-server figures, else its summary's, else its job's name (plan())."""
    if row.get("steady_per_server"):
        return len(json.loads(row["steady_per_server"]))
    named = re.search(r"_s(\d+)\.log$", row.get("log") or "")
    return int(bn._num(row.get("num_servers")) or (named and named.group(1)) or 0) or None


def _median_list(lists):
    """Element-wise median of equally long lists (None where a value is missing)."""
    return [bn._median(list(vals)) for vals in zip(*lists)] if lists else []


def balance_groups(rows):
    """Per (server count, algorithm), in first-seen order: the ok rows' medians over repeats of each
    server's figures per step and of the largest deviations."""
    groups = {}
    for r in rows:
        key = (_servers_of(r), r["algorithm"])
        g = groups.setdefault(key, {"servers": key[0], "algorithm": r["algorithm"], "label": r["label"],
                                    "rate": bn._rate(r), "runs": 0, "ok": []})
        g["runs"] += 1
        if r["status"] == "ok" and r.get("steady_per_server"):
            g["ok"].append(r)
    for g in groups.values():
        per = [json.loads(r["steady_per_server"]) for r in g["ok"]]
        for m in ("cpu", "tx", "rx"):
            g[m] = _median_list([[s[m] for s in p] for p in per])
            g[f"{m}_dev"] = bn._median([bn._num(r[f"server_{m}_max_dev"]) for r in g["ok"]])
        g["other_cpu"] = bn._median([bn._num(r.get("other_cpu_share")) for r in g["ok"]])
    return list(groups.values())


def _values(values, scale, spec):
    return " / ".join(bn._fmt(None if v is None else v * scale, spec) for v in values) or "–"


def _verdict(g):
    devs = [g[f"{m}_dev"] for m in ("cpu", "tx", "rx")]
    if any(d is None for d in devs):
        return "n/a"
    return "yes" if max(devs) <= TOLERANCE else "NO"


def markdown_table(groups, title):
    head = ["servers", "algorithm", "rate", "ok/runs", "server CPU ms/step (h1 / h2 / ...)", "CPU max dev",
            "server tx KB/step", "tx max dev", "server rx KB/step", "rx max dev",
            f"all within {TOLERANCE:.0%}", "other CPU"]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        lines.append("| " + " | ".join([
            bn._fmt(g["servers"], "{:g}"), g["label"], rate_name(g["rate"]), f"{len(g['ok'])}/{g['runs']}",
            _values(g["cpu"], 1e3, "{:.2f}"), bn._fmt(g["cpu_dev"], "{:.0%}"),
            _values(g["tx"], 1e-3, "{:.1f}"), bn._fmt(g["tx_dev"], "{:.0%}"),
            _values(g["rx"], 1e-3, "{:.1f}"), bn._fmt(g["rx_dev"], "{:.0%}"), _verdict(g),
            bn._fmt(None if g["other_cpu"] is None else 100 * g["other_cpu"], "{:.0f}%")]) + " |")
    lines += ["", "Per server host, in the steady window (the first logged step at or after warm-up + delay to "
              "the last logged step): CPU = CPU seconds of its server process per training step (sampled every "
              "0.1 s from /proc); tx / rx = bytes its eth0 sent / received per step (TCP/IP and Ethernet "
              "headers included). Max dev = the largest |server - mean| / mean over the servers. Medians over "
              "repeats. Other CPU: the share of the machine's CPU that processes outside the job used meanwhile "
              "(a shared machine slows every role; CPU seconds per step are less affected than wall time)."]
    return "\n".join(lines) + "\n"


def write_table(csv_path, out_dir, title="Per-server load"):
    text = markdown_table(balance_groups(bn.read_rows(csv_path)), title)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
