"""Horovod's ring all-reduce against ssdsgd on the same virtual cluster, per N workers and per-host link rate.

For each N (--workers) the script runs, at every rate (--rates, Mbit/s, 0 = unlimited), one job per layout:
  - ssdsgd's SSGD, SSD-SGD, SSD-SGD + top-k 1% with the exact sparse downlink and with the compressed
    downlink, plus the compute bound (1 worker, no communication): bench/bench_network.py --topology hosts
    --repeats 1 --set cluster.workers=N, into <out>/ssdsgd_n<N>/ (its runs.csv, logs and run folders);
  - Horovod's DistributedTrainer in fp32 and with hvd.Compression.fp16 (bench/horovod_worker.py), started by
    `horovodrun --gloo` on host h0 of a fresh cluster of N + 1 hosts (bench/vcluster.py: one network namespace
    per host, its eth0 shaped with tbf in both directions, one sshd each), one rank on each of h1..hN, over
    eth0. Its rows go to <out>/horovod_n<N>/runs.csv in bench_network's columns (the worker links' bytes per
    step and utilisation in the steady window from rank 0's step times; kernel bytes from every host's eth0).
Same config (configs/bench_cifar_resnet20.yaml: ResNet-20, synthetic CIFAR-shaped data, 32 images a worker),
steps and steady window (from step min(warm-up + k, steps / 2) on) for both systems.

Then <out>/table.csv (bench/horovod_table.py: one row per layout, with the compute bound N x one worker's
images/s and the machine bound min(N, cores) x that), <out>/images_per_sec_vs_rate.png (scripts/plot.py) and
<out>/manifest.json (command, config, commit, machine, date, the load average at start and end: the machine may
be shared; the command that redraws the plot).

Usage (root; iproute2, openssh; Horovod: bench/install_horovod.sh):
  python bench/bench_horovod.py --workers 2,4 --rates 20,100,1000,0 --steps 40 --out results/horovod_vs_ssdsgd
  python bench/bench_horovod.py --table-only --out results/horovod_vs_ssdsgd
"""
import argparse
import contextlib
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from bench import bench_network as bn  # noqa: E402
from bench import horovod_table  # noqa: E402
from testbed import netns, vcluster  # noqa: E402
from scripts.plot_rates import FIGURE as RATE_FIGURE  # noqa: E402
from scripts.results_io import rate_name, read_jsonl, stop_on_sigterm, write_manifest  # noqa: E402

SSDSGD_VARIANTS = ("ssgd", "ssd", "ssd_topk_sparse", "ssd_topk_compressed")   # bench_network's keys
HOROVOD_VARIANTS = {"horovod_fp32": ("Horovod fp32", "none"), "horovod_fp16": ("Horovod fp16", "fp16")}
# bench_network's columns, and the images/s over the median step time (only Horovod logs every step).
FIELDS = bn.FIELDS + ["median_step_images_per_sec"]
WORKER = os.path.join(ROOT, "bench", "horovod_worker.py")


def horovod_missing():
    """Why Horovod cannot run here (text), or None."""
    try:
        import horovod.mxnet  # noqa: F401
    except ImportError as e:
        return f"horovod.mxnet does not import ({e}); install it with bench/install_horovod.sh"
    if not shutil.which("horovodrun", path=os.path.dirname(sys.executable)):
        return f"no horovodrun beside {sys.executable}"
    return None


def ssh_wrapper(vc):
    """A folder holding `ssh` that runs the system's ssh with the cluster's config: horovodrun calls plain
    `ssh host`, and the cluster's key, user and host-key settings are in vc.ssh_config."""
    folder = os.path.join(vc.dir, "bin")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "ssh")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {vc.ssh_config} "$@"\n')
    os.chmod(path, 0o755)
    return folder


@contextlib.contextmanager
def horovod_cluster(hosts, rate_mbit, queue_ms):
    """bench_network.virtual_cluster, with the machine's host name resolving to each host's eth0 address on
    that host. Horovod 0.28 opens the Gloo device of its process sets without the interface it was given:
    Gloo then binds the address the host name resolves to, 127.0.0.1 from the shared /etc/hosts, and the ranks
    cannot reach each other. `ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts for what it
    starts (each host's sshd, so each rank), so the file must be in place before the cluster starts."""
    made = []

    def write_hosts(vc):
        for ns, addr in zip(vc.namespaces, vc.addresses):
            folder = os.path.join("/etc/netns", ns)
            os.makedirs(folder)
            made.append(folder)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
    try:
        with bn.virtual_cluster(hosts, rate_mbit, queue_ms, prepare=write_hosts) as vc:
            yield vc
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def horovod_command(vc, job, args, out_dir):
    """horovodrun on h0 with one rank on each of h1..hN. Hosts by address: horovodrun resolves the names
    itself to tell local from remote hosts, and the cluster's names exist only in its ssh config."""
    hosts = ",".join(f"{vc.addresses[i]}:1" for i in range(1, job["workers"] + 1))
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "--gloo", "-np", str(job["workers"]),
           "-H", hosts, "--network-interface", "eth0", "--start-timeout", "120",
           sys.executable, WORKER, "--config", args.config, "--steps", str(args.steps),
           "--steady-from", str(job["steady_from"]), "--compression", job["compression"], "--out", out_dir]
    for s in args.set:
        cmd += ["--set", s]
    return cmd


def run_horovod(job, args, out):
    """One Horovod job on a fresh cluster of N + 1 hosts; its row in bench_network's columns."""
    row = {k: "" for k in FIELDS}
    row.update(algorithm=job["key"], label=job["label"], topology="hosts", rate_mbit=job["rate"], repeat=1,
               num_workers=job["workers"], num_servers=0)
    out_dir = os.path.join(out, "runs", job["name"])
    log_path = os.path.join(out, "logs", job["name"] + ".log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    row.update(run_dir=os.path.relpath(out_dir, out), log=os.path.relpath(log_path, out))
    roles = ["launcher"] + ["worker"] * job["workers"]
    t0 = time.monotonic()
    with horovod_cluster(len(roles), job["rate"], args.queue_ms) as vc, open(log_path, "w") as log:
        row["namespace"] = vc.name
        cmd = horovod_command(vc, job, args, out_dir)
        log.write(f"# cluster {vc.name}: h0 horovodrun, h1..h{job['workers']} one rank each; "
                  f"{rate_name(job['rate'])} per host link\n# {' '.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   PATH=ssh_wrapper(vc) + os.pathsep + os.environ.get("PATH", ""))
        sampler, returncode, timed_out, before, after, cpu = _run_sampled(vc, cmd, env, log, len(roles), args)
        row["qdisc_drops"] = vc.qdisc_drops()
    row.update(job_seconds=round(time.monotonic() - t0, 2), exit_code=returncode)
    bn._machine_columns(row, sampler, cpu)
    hosts = range(len(roles))
    row.update(kernel_bytes=sum(after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in hosts),
               kernel_rx_bytes=sum(after[i]["rx_bytes"] - before[i]["rx_bytes"] for i in hosts))
    _result_columns(row, job, out_dir, roles, before, after, sampler, timed_out, log_path)
    return row


def _run_sampled(vc, cmd, env, log, hosts, args):
    """Start cmd on h0, poll every host link until it ends (or the job timeout); the sampler, exit code,
    whether it timed out, the hosts' counters before and after, and the machine's CPU before and after."""
    before = {i: vc.counters(i) for i in range(hosts)}
    cpu_before = bn._system_cpu()
    proc = subprocess.Popen(vc.exec_argv(0, cmd), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    sshd = {vc.host_pid(i) for i in range(hosts)}
    sampler = bn.Sampler(None, None, links={i: (vc.host_pid(i), "eth0") for i in range(hosts)},
                         hosts={i: (lambda i=i: [p for p in vc.pids(i) if p not in sshd]) for i in range(hosts)})
    timed_out = bn._wait_for_job(proc, sampler, time.monotonic() + args.job_timeout)
    cpu_after = bn._system_cpu()
    left = vc.leftovers()
    if left:                                           # VCluster.delete kills them; the log names them
        log.write(f"# left on the hosts after the job: {left}\n")
    after = {i: vc.counters(i) for i in range(hosts)}
    now = time.time()
    for i in range(hosts):
        for d in ("tx", "rx"):
            sampler.link_samples[i][d].append((now, after[i][f"{d}_bytes"]))
    return sampler, proc.returncode, timed_out, before, after, (cpu_before, cpu_after)


def _result_columns(row, job, out_dir, roles, before, after, sampler, timed_out, log_path):
    """Status, images/s and the steady window's link columns from rank 0's rank0.json."""
    path = os.path.join(out_dir, "rank0.json")
    res = None
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    row["status"] = "timeout" if timed_out else ("ok" if row["exit_code"] == 0 and res else "failed")
    if row["status"] != "ok":
        row["error"] = bn._last_error(log_path)
    if not res:
        return
    times, k = res["times"], res["steady_from"]
    steps = len(times)
    window = (steps - k, times[k - 1], times[-1]) if steps > k else None
    row.update(steps=steps, images_per_sec=round(res["images_per_sec_whole"], 3),
               final_loss=round(res["final_loss"], 5), wall_seconds=round(times[-1] - res["start"], 3),
               kernel_bytes_per_step=round(row["kernel_bytes"] / max(1, steps)))
    row.update(bn.link_columns(roles, before, after, sampler.link_samples, window, job["rate"]))
    if window is not None:
        bn._steady_columns(row, window, sampler, True, res["batch_size"] * res["workers"], res["workers"])
        row["median_step_images_per_sec"] = round(res["images_per_sec_median"], 3)


# ------------------------------------------------------------------------------------------ the suite

def steady_from(args):
    """bench_network's steady window start for the config's SSD-SGD: after its warm-up and first delay."""
    from ssdsgd.config import load_config
    a = load_config(args.config, args.set).algorithm
    return min(a.warmup_iters + a.delay, max(1, args.steps // 2))


def run_ssdsgd(n, args):
    """bench_network.py on the hosts topology for N workers; its folder <out>/ssdsgd_n<N>. The exit status."""
    out = os.path.join(args.out, f"ssdsgd_n{n}")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_network.py"), "--topology", "hosts",
           "--algorithms", ",".join(args.ssdsgd), "--rates", ",".join(f"{r:g}" for r in args.rate_list),
           "--steps", str(args.steps), "--repeats", "1", "--config", args.config, "--out", out,
           "--job-timeout", f"{args.job_timeout:g}", "--queue-ms", f"{args.queue_ms:g}",
           "--set", f"cluster.workers={n}"]
    for s in args.set:
        cmd += ["--set", s]
    print(f"bench_horovod: ssdsgd, N = {n}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        bn._stop_job(proc, grace=60.0)      # bench_network cleans up its cluster on SIGTERM
        raise


def run_horovod_all(n, args):
    """Every Horovod variant at every rate for N workers into <out>/horovod_n<N>/runs.csv."""
    out = os.path.join(args.out, f"horovod_n{n}")
    os.makedirs(out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    first = steady_from(args)
    path = os.path.join(out, "runs.csv")
    new = not os.path.exists(path)              # else appended: a layout run again keeps its earlier attempt
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for rate in args.rate_list:
            for key in args.horovod:
                label, compression = HOROVOD_VARIANTS[key]
                rate_tag = "unl" if not rate else f"{rate:g}mbit"
                job = dict(key=key, label=label, compression=compression, rate=rate, workers=n,
                           steady_from=first, name=f"{stamp}_{key}_n{n}_{rate_tag}")
                print(f"bench_horovod: {label}, N = {n}, {rate_name(rate)} ...", end=" ", flush=True)
                row = run_horovod(job, args, out)
                writer.writerow(row)
                f.flush()
                print(f"{row['status']} {row['steady_images_per_sec'] or '-'} img/s (steady), worker link "
                      f"tx/rx {row['steady_worker_tx_bytes_per_step'] or '-'}/"
                      f"{row['steady_worker_rx_bytes_per_step'] or '-'} B/step, {row['job_seconds']} s"
                      + (f" -- {row['error']}" if row["error"] else ""), flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="2,4", help="comma-separated N (default 2,4)")
    ap.add_argument("--rates", default="20,100,1000,0", help="Mbit/s per host link, 0 = unlimited")
    ap.add_argument("--steps", type=int, default=40, help="training steps per job (default 40)")
    ap.add_argument("--ssdsgd", default=",".join(SSDSGD_VARIANTS), help="bench_network algorithms ('' for none)")
    ap.add_argument("--horovod", default=",".join(HOROVOD_VARIANTS), help="Horovod variants ('' for none)")
    ap.add_argument("--config", default=os.path.join(ROOT, bn.DEFAULT_CONFIG))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every job")
    ap.add_argument("--job-timeout", type=float, default=900.0)
    ap.add_argument("--queue-ms", type=float, default=50.0, help="tbf latency (as bench_network's)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "horovod_vs_ssdsgd"))
    ap.add_argument("--table-only", action="store_true", help="only re-make table.csv and the plot from <out>")
    args = ap.parse_args(argv)
    args.worker_list = [int(x) for x in args.workers.split(",") if x.strip()]
    args.rate_list = [float(x) for x in args.rates.split(",") if x.strip()]
    args.ssdsgd = [x for x in args.ssdsgd.split(",") if x.strip()]
    args.horovod = [x for x in args.horovod.split(",") if x.strip()]
    bad = [x for x in args.ssdsgd if x not in bn.ALGORITHMS] + [x for x in args.horovod if x not in HOROVOD_VARIANTS]
    if bad or not args.worker_list or not args.rate_list or min(args.worker_list) < 1:
        ap.error(f"unknown variant(s) {', '.join(bad)}" if bad else "need N >= 1 and at least one rate")
    args.out, args.config = os.path.abspath(args.out), os.path.abspath(args.config)
    return args


INVOCATIONS = "invocations.jsonl"


def log_invocation(out, **entry):
    """One line in <out>/invocations.jsonl: a folder may be filled by several invocations (ssdsgd's layouts
    first, Horovod's once installed, a failed layout again), each with its command, date and load average."""
    entry = dict(command=[os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]], date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 load_average=os.getloadavg(), **entry)
    with open(os.path.join(out, INVOCATIONS), "a") as f:
        f.write(json.dumps(entry) + "\n")


MEASURING_KEYS = ("command", "cwd", "commit", "uncommitted_changes", "date", "finished", "exit_status")


def manifest(args, **extra):
    """<out>/manifest.json: this invocation's command, config, commit, machine and date, every invocation
    that wrote into the folder, and the bench_network commands of its ssdsgd_n<N> folders."""
    sub = {}
    for name in sorted(os.listdir(args.out)):
        path = os.path.join(args.out, name, "manifest.json")
        if os.path.isfile(path):
            with open(path) as f:
                found = json.load(f)
            sub[name] = {k: found.get(k) for k in ("command", "date", "commit")}
    return write_manifest(args.out, [args.config], cores=os.cpu_count(), invocations=read_jsonl(
        os.path.join(args.out, INVOCATIONS)), bench_network=sub,
        plots={RATE_FIGURE: horovod_table.plot_command(args.out)},
        note="one run per layout on a machine shared with other engineers' jobs: see each invocation's "
             "load_average (1, 5, 15 min) and each run's other_cpu_share in the runs.csv files", **extra)


def remade_manifest(args):
    """--table-only: the manifest again (the folder's invocations may have grown, the plots' command is
    recorded), keeping the measuring run's command, commit, date and exit status; this invocation's own go
    under table_only."""
    path = os.path.join(args.out, "manifest.json")
    try:
        with open(path) as f:
            measured = json.load(f)
    except (OSError, ValueError):
        measured = {}
    remade = manifest(args)
    table_only = {k: remade.get(k) for k in ("command", "commit", "uncommitted_changes", "date")}
    by_a_measuring_run = "--table-only" not in measured.get("command", ["--table-only"])
    kept = {k: measured[k] for k in MEASURING_KEYS if k in measured} if by_a_measuring_run else {}
    with open(path, "w") as f:
        json.dump({**remade, **kept, "table_only": table_only}, f, indent=2)


def main(argv=None):
    args = parse_args(argv)
    if args.table_only:
        remade_manifest(args)
        print(horovod_table.write_outputs(args.out))
        return 0
    problem = horovod_missing() if args.horovod else None
    try:
        vcluster.check_tools()
    except netns.NetnsError as e:
        problem = problem or str(e)
    if problem:
        print(f"bench_horovod: {problem}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    log_invocation(args.out, event="start")
    manifest(args, finished=False)
    stop_on_sigterm()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 0
    try:
        for n in args.worker_list:
            if args.ssdsgd:
                status = run_ssdsgd(n, args) or status
            if args.horovod:
                run_horovod_all(n, args)
            horovod_table.write_outputs(args.out)       # a table after every N: the suite may be cut short
    except KeyboardInterrupt:
        print("\nbench_horovod: interrupted", file=sys.stderr)
        status = 130
    log_invocation(args.out, event="end", exit_status=status)
    manifest(args, finished=status == 0, exit_status=status)
    print(horovod_table.write_outputs(args.out))
    return status


if __name__ == "__main__":
    sys.exit(main())
