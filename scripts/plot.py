"""PNG plots of benchmark results and training runs (matplotlib, Agg backend: no display needed).

  python scripts/plot.py --csv bench_results/runs.csv --out bench_results/
      throughput.png      images/s per algorithm, grouped by link rate (median, min-max bars), with the
                          compute bound (N x one worker without communication) as a dashed line
      bytes_per_step.png  kernel (loopback tx) bytes per training step per algorithm and rate
      worker_rss.png      peak resident memory of a worker per algorithm and rate
  python scripts/plot.py --runs runs/a runs/b --out plots/
      accuracy_vs_time.png   test accuracy vs wall time since training start, one line per run
      accuracy_vs_epoch.png  test accuracy vs epochs completed
      loss_vs_time.png       training loss (rank 0) vs wall time
Both can be given at once. A run folder is what `python -m ssdsgd.run` writes: metrics.jsonl, and
optionally summary.json and config.yaml (for labels and the start time).
"""
import argparse
import csv
import json
import os
import statistics
import sys

import matplotlib

from results_io import COMPUTE_BOUND, rate_name, read_jsonl
from ssdsgd.metrics import CONFIG_FILE, SUMMARY_FILE, metrics_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402


def _num(v):
    try:
        return float(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _grouped(rows, field, fallback=None):
    """{(algorithm, rate): [values]} over ok rows, plus the algorithm and rate orders and labels."""
    algs, rates, labels, values = [], [], {}, {}
    for r in rows:
        if r.get("status") != "ok" or r["algorithm"] == COMPUTE_BOUND:
            continue
        rate = _num(r["rate_mbit"]) or 0.0
        if r["algorithm"] not in algs:
            algs.append(r["algorithm"])
        if rate not in rates:
            rates.append(rate)
        labels[r["algorithm"]] = r.get("label") or r["algorithm"]
        v = _num(r.get(field))
        if v is None and fallback:
            v = _num(r.get(fallback))
        if v is not None:
            values.setdefault((r["algorithm"], rate), []).append(v)
    return algs, rates, labels, values


def _bars(ax, algs, rates, labels, values, scale=1.0, value_fmt="%.0f"):
    width = 0.8 / max(1, len(algs))
    for i, alg in enumerate(algs):
        xs, ys, lo, hi = [], [], [], []
        for j, rate in enumerate(rates):
            vals = [v * scale for v in values.get((alg, rate), [])]
            if not vals:
                continue
            m = statistics.median(vals)
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(m)
            lo.append(m - min(vals))
            hi.append(max(vals) - m)
        if xs:
            bars = ax.bar(xs, ys, width, label=labels[alg], yerr=[lo, hi], capsize=3)
            ax.bar_label(bars, fmt=value_fmt, fontsize=7, padding=2)
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([rate_name(r) for r in rates])
    ax.set_xlabel("link rate (loopback tbf)")
    ax.grid(axis="y", alpha=0.3)


def plot_csv(csv_path, out_dir):
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    written = []

    # images/s, with the compute bound
    field = "steady_images_per_sec" if any(_num(r.get("steady_images_per_sec")) for r in rows) else "images_per_sec"
    algs, rates, labels, values = _grouped(rows, field, fallback="images_per_sec")
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rates) * max(1, len(algs)) / 2), 4.8))
    _bars(ax, algs, rates, labels, values)
    cb = [r for r in rows if r["algorithm"] == COMPUTE_BOUND and r.get("status") == "ok"]
    if cb:
        single = [_num(r.get(field)) or _num(r.get("images_per_sec")) for r in cb]
        single = [v for v in single if v]
        n = _num(cb[0].get("bound_workers")) or max(
            [_num(r.get("num_workers")) or 1 for r in rows if r["algorithm"] != COMPUTE_BOUND] or [1])
        if single:
            bound = n * statistics.median(single)
            ax.axhline(bound, color="k", linestyle="--", linewidth=1.2,
                       label=f"compute bound ({n:g} × 1 worker, no comm.): {bound:.0f}")
    kind = "steady-state " if field.startswith("steady") else ""
    ax.set_ylabel(f"{kind}throughput (images/s, all workers)")
    ax.set_title("Training throughput by link rate (median, bars: min-max over repeats)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the bars, not over them
    fig.tight_layout()
    written.append(_save(fig, out_dir, "throughput.png"))

    # bytes per step
    field = "steady_kernel_bytes_per_step" if any(_num(r.get("steady_kernel_bytes_per_step")) for r in rows) \
        else "kernel_bytes_per_step"
    algs, rates, labels, values = _grouped(rows, field, fallback="kernel_bytes_per_step")
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rates) * max(1, len(algs)) / 2), 4.8))
    _bars(ax, algs, rates, labels, values, scale=1e-6, value_fmt="%.2f")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    which = "steady-state window" if field.startswith("steady") else "whole job incl. start-up"
    ax.set_ylabel("kernel bytes per step (MB, log scale)")
    ax.set_title(f"Loopback tx bytes per training step, all workers ({which})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out_dir, "bytes_per_step.png"))

    # worker memory
    algs, rates, labels, values = _grouped(rows, "peak_rss_worker_mb")
    if values:
        fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rates) * max(1, len(algs)) / 2), 4.8))
        _bars(ax, algs, rates, labels, values)
        ax.set_ylabel("peak RSS of a worker (MB)")
        ax.set_title("Worker peak resident memory (VmHWM, max over workers)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir, "worker_rss.png"))
    return written


def _save(fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_run(run_dir):
    """(label, test points [(seconds, epochs, acc)], loss points [(seconds, loss)]) of a run folder."""
    records = read_jsonl(os.path.join(run_dir, metrics_file()))
    label = os.path.basename(os.path.normpath(run_dir))
    summary_path = os.path.join(run_dir, SUMMARY_FILE)
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            s = json.load(f)
        alg = s.get("algorithm", "?") + ("" if s.get("compression") in (None, "none") else f"+{s['compression']}")
        label = f"{label} ({alg})"
    t0 = _start_time(run_dir, records)
    tests = [(r["time"] - t0, r["epoch"] + 1, r["test_acc"]) for r in records
             if "test_acc" in r and "time" in r and "epoch" in r]
    losses = [(r["time"] - t0, r["loss"]) for r in records if "loss" in r and "time" in r]
    return label, tests, losses


def _start_time(run_dir, records):
    """Training start: the first step record's time minus the time its window took (from its images/s)."""
    steps = [r for r in records if "loss" in r and "time" in r]
    first = records[0]["time"] if records else 0.0
    if not steps:
        return first
    r = steps[0]
    batch = None
    cfg = os.path.join(run_dir, CONFIG_FILE)
    if os.path.exists(cfg):
        try:
            import yaml
            with open(cfg) as f:
                batch = (yaml.safe_load(f) or {}).get("train", {}).get("batch_size")
        except Exception:  # a damaged config only costs the start-time correction
            batch = None
    if batch and r.get("images_per_sec") and r.get("step"):
        return r["time"] - r["step"] * batch / r["images_per_sec"]
    return first


def plot_runs(run_dirs, out_dir):
    runs = [load_run(d) for d in run_dirs]
    written = []
    specs = [("accuracy_vs_time.png", 0, 2, "wall time since training start (s)", "test accuracy (fraction)",
              "Test accuracy vs wall time", "tests"),
             ("accuracy_vs_epoch.png", 1, 2, "epochs completed", "test accuracy (fraction)",
              "Test accuracy vs epoch", "tests"),
             ("loss_vs_time.png", 0, 1, "wall time since training start (s)", "training loss (rank 0, cross-entropy)",
              "Training loss vs wall time", "losses")]
    for name, xi, yi, xlabel, ylabel, title, which in specs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, tests, losses in runs:
            pts = tests if which == "tests" else losses
            if pts:
                ax.plot([p[xi] for p in pts], [p[yi] for p in pts], marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir, name))
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--csv", help="runs.csv written by scripts/bench_network.py")
    ap.add_argument("--runs", nargs="+", default=[], metavar="RUN_DIR", help="run folders with metrics.jsonl")
    ap.add_argument("--out", default=".", help="folder for the PNG files")
    args = ap.parse_args(argv)
    if not args.csv and not args.runs:
        ap.error("give --csv and/or --runs")
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.csv:
        if not os.path.exists(args.csv):
            ap.error(f"--csv: {args.csv} not found")
        written += plot_csv(args.csv, args.out)
    if args.runs:
        missing = [d for d in args.runs if not os.path.exists(os.path.join(d, metrics_file()))]
        if missing:
            ap.error(f"--runs: no metrics.jsonl in {', '.join(missing)}")
        written += plot_runs(args.runs, args.out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
