"""Horovod SSGD against ssdsgd's SSGD and SSD-SGD + top-k 1% at the same settings and seeds: the final test
accuracy of each, so that the speed comparison (bench/bench_horovod.py) is between equals.

    python bench/horovod_accuracy.py [--workers 2 4] [--seeds 0 1 2] [--steps 1000]
        [--set KEY=VALUE ...] [--out results/horovod_accuracy]

The settings are scripts/accuracy_scale.py's proxy (MLP, 28x28 Fashion-MNIST, 5,000 images a class,
per-worker batch 128, the linear rule lr 0.1 x N/2 with a one-epoch lr warm-up, cosine, momentum 0.9,
wd 1e-4) for about --steps steps (linear_rule), on the untuned subset data.train_offset=1000 by default
(as results/accuracy_scale_test_1000/), evaluated on the test set. Horovod runs
bench/horovod_accuracy_worker.py under `horovodrun --gloo -np N -H localhost:N` (loopback) on the SSGD
config with the same overrides; ssdsgd runs through its launcher as scripts/accuracy.py does. One job at a
time, seeds outermost; every job has a hard timeout and is ended by its process group, and any rank still
alive afterwards is named in the log, killed by pid and its row marked.

Writes runs.csv (one row per job, after every job), table.md (mean ± sd and per seed per N and system,
and Horovod minus ssdsgd SSGD paired by seed) and manifest.json.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: bench.*, scripts.* and ssdsgd from this checkout
from scripts.accuracy_scale import SSGD, TOPK, linear_rule
from scripts.results_io import (job_command, job_name, job_summary, results_folder, run_captured, run_folder,
                                stop_group, summary_row, write_csv, write_manifest, write_text)
from testbed.procs import processes_with

WORKER = os.path.join(ROOT, "bench", "horovod_accuracy_worker.py")
HOROVOD = "Horovod SSGD"
SYSTEMS = {HOROVOD: SSGD, "ssdsgd SSGD": SSGD, "ssdsgd SSD-SGD + top-k 1%": TOPK}
DEFAULT_SETS = ["data.train_offset=1000", "log.every_steps=480"]


def horovod_command(n, sets, out_dir):
    cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "--gloo", "-np", str(n),
           "-H", f"localhost:{n}", sys.executable, WORKER, "--config", os.path.join(ROOT, SSGD)]
    for s in sets:
        cmd += ["--set", s]
    return cmd + ["--out", out_dir]


def leftovers(marker):
    """Processes still alive whose command line names this job's folder: killed by pid, and returned."""
    left = processes_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def run_horovod(n, seed, sets, out, timeout):
    """One Horovod job: its row (final accuracy from rank 0's result.json, or rc and why not)."""
    job_dir = os.path.join(out, "horovod", job_name(f"n{n}", seed))
    os.makedirs(job_dir, exist_ok=True)
    row = {"system": HOROVOD, "workers": n, "seed": seed}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with open(os.path.join(job_dir, "output.log"), "w") as log:
        proc = subprocess.Popen(horovod_command(n, sets, job_dir), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, grace=15)
            rc = "timeout"
    left = leftovers(job_dir)
    if left:
        row["left_behind"] = " ".join(map(str, left))
        print(f"  killed processes left behind: {left}", flush=True)
    result = os.path.join(job_dir, "result.json")
    if rc != 0 or not os.path.exists(result):
        return {**row, "rc": rc}
    with open(result) as f:
        r = json.load(f)
    return {**row, "rc": 0, "eval_set": r["eval_set"], "final_acc": r["final_acc"], "steps": r["steps"],
            "wall_seconds": r["wall_seconds"], "final_loss": r["losses"][-1]}


def run_ssdsgd(system, n, seed, sets, out, timeout):
    """One ssdsgd job through its launcher (scripts/accuracy.py's way): its row."""
    name = job_name(f"{system} n{n}", seed)
    row = {"system": system, "workers": n, "seed": seed}
    log_dir = os.path.join(out, "runs")
    try:
        proc = run_captured(job_command(SYSTEMS[system], name, log_dir, sets), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "rc": "timeout", "left_behind": " ".join(map(str, leftovers(os.path.join(log_dir, name))))}
    s = job_summary(proc, run_folder(proc.stdout, log_dir, name))
    if s is None:
        return {**row, "rc": proc.returncode}
    keep = ("eval_set", "final_acc", "steps", "wall_seconds", "push_bytes_per_step", "max_staleness")
    return {**row, "rc": 0, **{k: v for k, v in summary_row(s).items() if k in keep}}


def _mean_sd(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(rows, workers):
    """Markdown: mean ± sd and per seed per (N, system), then Horovod minus ssdsgd SSGD paired by seed."""
    lines = ["| N | system | final test acc (mean ± sd over seeds) | per seed (seed: acc) | steps |",
             "|---|---|---|---|---|"]
    ok = [r for r in rows if r["rc"] == 0]
    for n in workers:
        for system in SYSTEMS:
            rs = sorted((r for r in ok if r["workers"] == n and r["system"] == system), key=lambda r: r["seed"])
            failed = sum(1 for r in rows if r["workers"] == n and r["system"] == system and r["rc"] != 0)
            if not rs:
                lines.append(f"| {n} | {system} | failed ({failed}) | | |" if failed else f"| {n} | {system} | | | |")
                continue
            mean, sd = _mean_sd([r["final_acc"] for r in rs])
            seeds = " ".join(f"{r['seed']}: {r['final_acc']:.4f}" for r in rs)
            more = f" ({failed} failed)" if failed else ""
            lines.append(f"| {n} | {system} | {mean:.4f} ± {sd:.4f}{more} | {seeds} | {rs[0]['steps']} |")
    lines.append("")
    for n in workers:
        for other in [s for s in SYSTEMS if s != HOROVOD]:
            acc = {s: {r["seed"]: r["final_acc"] for r in ok if r["workers"] == n and r["system"] == s}
                   for s in (HOROVOD, other)}
            seeds = sorted(set(acc[HOROVOD]) & set(acc[other]))
            if seeds:
                mean, sd = _mean_sd([100 * (acc[HOROVOD][s] - acc[other][s]) for s in seeds])
                lines.append(f"- N={n}: Horovod SSGD minus {other}, paired over {len(seeds)} seeds: "
                             f"{mean:+.2f} ± {sd:.2f} points")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=1000, help="about this many steps (linear_rule)")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    ap.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                    help=f"override for every job (repeatable; default {' '.join(DEFAULT_SETS)})")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a job may take")
    ap.add_argument("--out", default="results/horovod_accuracy")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    extra = DEFAULT_SETS if args.set is None else args.set
    out = results_folder(args.out)
    if os.path.exists(os.path.join(out, "runs.csv")):
        sys.exit(f"horovod_accuracy.py: {out}/runs.csv exists; choose another --out")
    configs = sorted({os.path.join(ROOT, SYSTEMS[s]) for s in args.systems})
    write_manifest(out, configs, finished=False, settings=extra, steps=args.steps, workers=args.workers)
    jobs = [(seed, n, system) for seed in args.seeds for n in args.workers for system in args.systems]
    rows, started = [], time.monotonic()
    for i, (seed, n, system) in enumerate(jobs):
        sets = [*linear_rule(n, args.steps), *extra, f"seed={seed}"]
        print(f"[{i + 1}/{len(jobs)}] N={n} seed {seed}: {system}", flush=True)
        if system == HOROVOD:
            rows.append(run_horovod(n, seed, sets, out, args.timeout))
        else:
            rows.append(run_ssdsgd(system, n, seed, sets, out, args.timeout))
        r = rows[-1]
        print(f"  final {r.get('eval_set')} accuracy {r['final_acc']:.4f}" if r["rc"] == 0 else f"  failed: {r}",
              flush=True)
        write_csv(os.path.join(out, "runs.csv"), rows)
        elapsed = time.monotonic() - started
        print(f"  {elapsed / 60:.0f} min so far, about {elapsed / (i + 1) * (len(jobs) - i - 1) / 60:.0f} to go",
              flush=True)
    text = table(rows, args.workers)
    write_text(os.path.join(out, "table.md"), text)
    write_manifest(out, configs, finished=True, settings=extra, steps=args.steps, workers=args.workers,
                   jobs=len(rows), failed=sum(r["rc"] != 0 for r in rows))
    print(text)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
