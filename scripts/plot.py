"""PNG plots of benchmark results and training runs (matplotlib, Agg backend: no display needed).

  python scripts/plot.py --csv results/bench_network/runs.csv --out results/bench_network/
      throughput.png      images/s per algorithm, grouped by link rate (median, min-max bars), with the
                          compute bound (N x one worker without communication) as a dashed line
      bytes_per_step.png  kernel (loopback tx) bytes per training step per algorithm and rate
      worker_rss.png      peak resident memory of a worker per algorithm and rate
  python scripts/plot.py --csv results/horovod_vs_ssdsgd/table.csv --out results/horovod_vs_ssdsgd/
      images_per_sec_vs_rate.png  bench/bench_horovod.py's table: images/s against link rate, a panel per N
  python scripts/plot.py --evals results/X/evals.csv --title "Fashion-MNIST, ResNet-20 at 20 Mbit/s" --out results/X
      from the evals.csv that scripts/time_to_accuracy.py writes (variant, seed, epoch, seconds, train_seconds,
      test_acc); one line per variant, the median over seeds, thin lines for the single seeds, and a dashed
      line at SSGD's final accuracy (median over seeds), the target of the time-to-accuracy tables:
      accuracy_vs_time.png        test accuracy vs wall seconds since launch
      accuracy_vs_train_time.png  test accuracy vs training seconds (wall minus evaluations), when recorded
      accuracy_vs_epoch.png       test accuracy vs epochs completed
  python scripts/plot.py --runs runs/a runs/b --out plots/
      the same accuracy figures from run folders (metrics.jsonl; summary.json and config.yaml for labels; runs/<name>
      stands for its latest run), time counted from the training start, and loss_vs_time.png (rank 0's loss)
The modes can be combined.
"""
import argparse
import json
import os
import statistics
import sys

import matplotlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.plot_rates import FIGURE as RATE_FIGURE
from scripts.plot_rates import is_rate_table, log_axis, rate_figure
from scripts.results_io import COMPUTE_BOUND, rate_name, read_csv, read_jsonl, resolve_run_dir
from ssdsgd.metrics import CONFIG_FILE, SUMMARY_FILE, metrics_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

DPI = 110
TARGET_LABEL = "target: SSGD's final accuracy"
# Each accuracy figure's x axis: (file, axis label, title words). The clocks are docs/results.md's.
CLOCKS = {
    "seconds": ("accuracy_vs_time.png", "wall seconds since launch", "wall-clock time"),
    "train_seconds": ("accuracy_vs_train_time.png", "training seconds (wall seconds minus evaluations)",
                      "training time"),
    "epoch": ("accuracy_vs_epoch.png", "epochs completed", "epoch"),
}
RUN_START_LABEL = "seconds since training start"      # --runs: a run folder does not record its launch
ALGORITHM_WORDS = {"ssgd": "SSGD", "ssd": "SSD-SGD", "asgd": "ASGD"}
COMPRESSION_WORDS = {"topk": "top-k", "2bit": "2-bit"}


def _num(v):
    try:
        return float(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _words(label):
    """A label as words: no underscores, spaces around '+'."""
    text = str(label).replace("_", " ").replace("+", " + ")
    return " ".join(text.split())


def _figure(width, height):
    return plt.subplots(figsize=(width, height), layout="constrained")


def _save(fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# ---- bar charts from bench/bench_network.py's runs.csv -------------------------------------------------

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
        labels[r["algorithm"]] = _words(r.get("label") or r["algorithm"])
        v = _num(r.get(field))
        if v is None and fallback:
            v = _num(r.get(fallback))
        if v is not None:
            values.setdefault((r["algorithm"], rate), []).append(v)
    return algs, rates, labels, values


def _bar_chart(rows, field, fallback=None, scale=1.0, value_fmt="%.0f"):
    """(fig, ax) with one bar per algorithm and link rate (median, error bars min to max); None without values."""
    algs, rates, labels, values = _grouped(rows, field, fallback)
    if not values:
        return None
    fig, ax = _figure(max(7.0, 1.5 + 0.42 * len(algs) * len(rates)), 5.2)
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
    ax.margins(y=0.08)
    return fig, ax


def _finish_bars(fig, ax, title, ylabel, note="median over repeats"):
    ax.set_title(f"{title}\n{note}; error bars: min to max", fontsize=11)
    ax.set_ylabel(ylabel)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)  # below the bars, never over them


def _field(rows, steady, whole):
    return steady if any(_num(r.get(steady)) for r in rows) else whole


def throughput_figure(rows):
    field = _field(rows, "steady_images_per_sec", "images_per_sec")
    made = _bar_chart(rows, field, fallback="images_per_sec")
    if made is None:
        return None
    fig, ax = made
    cb = [r for r in rows if r["algorithm"] == COMPUTE_BOUND and r.get("status") == "ok"]
    single = [v for v in (_num(r.get(field)) or _num(r.get("images_per_sec")) for r in cb) if v]
    if single:
        n = _num(cb[0].get("bound_workers")) or max(
            [_num(r.get("num_workers")) or 1 for r in rows if r["algorithm"] != COMPUTE_BOUND] or [1])
        bound = n * statistics.median(single)
        ax.axhline(bound, color="k", linestyle="--", linewidth=1.2,
                   label=f"compute bound: {n:g} × one worker\nwithout communication ({bound:.0f} images/s)")
    kind = "steady-state " if field.startswith("steady") else ""
    _finish_bars(fig, ax, "Training throughput by link rate", f"{kind}throughput (images/s, all workers)")
    return fig


def bytes_figure(rows):
    field = _field(rows, "steady_kernel_bytes_per_step", "kernel_bytes_per_step")
    made = _bar_chart(rows, field, fallback="kernel_bytes_per_step", scale=1e-6, value_fmt="%.2f")
    if made is None:
        return None
    fig, ax = made
    log_axis(ax)
    which = "steady-state window" if field.startswith("steady") else "whole job incl. start-up"
    _finish_bars(fig, ax, "Loopback bytes sent per training step, all workers",
                 "kernel bytes per step (MB, log scale)", f"{which}, median over repeats")
    return fig


def rss_figure(rows):
    made = _bar_chart(rows, "peak_rss_worker_mb")
    if made is None:
        return None
    fig, ax = made
    _finish_bars(fig, ax, "Worker peak resident memory", "peak RSS of a worker (MB)",
                 "VmHWM, max over workers, median over repeats")
    return fig


def plot_csv(csv_path, out_dir):
    rows = read_csv(csv_path)
    if is_rate_table(rows):         # bench/bench_horovod.py's side-by-side table
        return [_save(rate_figure(rows, plt.subplots), out_dir, RATE_FIGURE)]
    written = []
    for name, make in (("throughput.png", throughput_figure), ("bytes_per_step.png", bytes_figure),
                       ("worker_rss.png", rss_figure)):
        fig = make(rows)
        if fig is not None:
            written.append(_save(fig, out_dir, name))
    return written


# ---- accuracy figures from evals.csv (scripts/time_to_accuracy.py) or run folders ------------------------

def read_evals(path):
    """The rows of a time-to-accuracy evals.csv, typed; train_seconds None where it was not recorded."""
    rows = read_csv(path)
    return [{"variant": r["variant"], "seed": int(r["seed"]), "epoch": int(float(r["epoch"])),
             "seconds": _num(r.get("seconds")), "train_seconds": _num(r.get("train_seconds")),
             "test_acc": float(r["test_acc"])} for r in rows]


def _series(evals):
    """{variant: {seed: [evaluations by epoch]}}, SSGD first; an epoch evaluated twice (a resume) keeps its last."""
    by = {}
    for e in evals:
        by.setdefault(e["variant"], {}).setdefault(e["seed"], {})[e["epoch"]] = e
    order = sorted(by, key=lambda v: v != "SSGD")
    return {v: {s: [by[v][s][k] for k in sorted(by[v][s])] for s in sorted(by[v])} for v in order}


def ssgd_target(evals):
    """(median over seeds of SSGD's final accuracy, number of seeds); (None, 0) without SSGD."""
    runs = _series(evals).get("SSGD")
    if not runs:
        return None, 0
    finals = [pts[-1]["test_acc"] for pts in runs.values()]
    return statistics.median(finals), len(finals)


def _median_curve(runs, clock):
    """Median over seeds of the clock and of the accuracy, at each epoch every seed evaluated."""
    common = set.intersection(*({p["epoch"] for p in pts} for pts in runs.values()))
    xs, ys = [], []
    for epoch in sorted(common):
        at = [next(p for p in pts if p["epoch"] == epoch) for pts in runs.values()]
        xs.append(statistics.median(p[clock] for p in at))
        ys.append(statistics.median(p["test_acc"] for p in at))
    return xs, ys


def _draw_variant(ax, color, variant, runs, clock):
    seeds = sorted(runs)
    if len(seeds) > 1:
        for pts in runs.values():
            ax.plot([p[clock] for p in pts], [p["test_acc"] for p in pts], color=color, linewidth=0.8, alpha=0.35)
        label = f"{_words(variant)}, median of {len(seeds)} seeds ({', '.join(map(str, seeds))})"
    else:
        label = f"{_words(variant)}, seed {seeds[0]}"
    xs, ys = _median_curve(runs, clock)
    ax.plot(xs, ys, color=color, linewidth=2, marker="o", markersize=3, label=label)


def accuracy_figure(evals, clock, context="", xlabel=None):
    """Test accuracy vs `clock` (a CLOCKS key), one line per variant; None if a row lacks that clock."""
    if not evals or any(e[clock] is None for e in evals):
        return None
    _, default_xlabel, words = CLOCKS[clock]
    fig, ax = _figure(8, 5.4)
    series = _series(evals)
    for i, (variant, runs) in enumerate(series.items()):
        _draw_variant(ax, f"C{i}", variant, runs, clock)
    target, n = ssgd_target(evals)
    if target is not None:
        seeds = f"median of {n} seeds" if n > 1 else "1 seed"
        ax.axhline(target, color="k", linestyle="--", linewidth=1.2, label=f"{TARGET_LABEL} ({seeds}): {target:.4f}")
    if clock == "epoch":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.set_xlim(left=0)                          # the clocks start at launch (or the training start)
    ax.set_xlabel(xlabel or default_xlabel)
    ax.set_ylabel("test accuracy (fraction)")
    ax.set_title(f"Test accuracy vs {words}" + (f"\n{context}" if context else ""), fontsize=11)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(len(runs) > 1 for runs in series.values()):
        handles.append(Line2D([], [], color="grey", linewidth=0.8, alpha=0.6))
        labels.append("thin lines: single seeds")
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8)
    return fig


def plot_evals(evals, out_dir, context="", xlabel=None):
    """The accuracy figures of a list of evaluations (read_evals' rows); the paths written."""
    written = []
    for clock, (name, _, _) in CLOCKS.items():
        fig = accuracy_figure(evals, clock, context, xlabel if clock == "seconds" else None)
        if fig is not None:
            written.append(_save(fig, out_dir, name))
    return written


def _run_words(run_dir):
    """(variant in words, seed) of a run folder, from summary.json and config.yaml where present."""
    cfg = {}
    if os.path.exists(os.path.join(run_dir, CONFIG_FILE)):
        try:
            import yaml
            with open(os.path.join(run_dir, CONFIG_FILE)) as f:
                cfg = yaml.safe_load(f) or {}
        except Exception:  # a damaged config only costs the label and the start-time correction
            cfg = {}
    variant = _words(os.path.basename(os.path.normpath(run_dir)))
    if os.path.exists(os.path.join(run_dir, SUMMARY_FILE)):
        with open(os.path.join(run_dir, SUMMARY_FILE)) as f:
            s = json.load(f)
        variant = ALGORITHM_WORDS.get(s.get("algorithm"), _words(s.get("algorithm", variant)))
        comp = s.get("compression")
        if comp not in (None, "none"):
            density = (cfg.get("compression") or {}).get("density")
            variant += f" + {COMPRESSION_WORDS.get(comp, _words(comp))}" + (f" {density:.0%}" if density else "")
    return variant, cfg.get("seed", 0), cfg


def load_run(run_dir):
    """(evaluation rows as in evals.csv, loss points [(seconds, loss)], variant) of a run folder."""
    records = read_jsonl(os.path.join(run_dir, metrics_file()))
    variant, seed, cfg = _run_words(run_dir)
    t0 = _start_time(records, (cfg.get("train") or {}).get("batch_size"))
    evals = [{"variant": variant, "seed": seed, "epoch": r["epoch"] + 1, "seconds": r["time"] - t0,
              "train_seconds": None, "test_acc": r["test_acc"]} for r in records
             if "test_acc" in r and "time" in r and "epoch" in r]
    losses = [(r["time"] - t0, r["loss"]) for r in records if "loss" in r and "time" in r]
    return evals, losses, variant


def _start_time(records, batch):
    """Training start: the first step record's time minus the time its window took (from its images/s)."""
    steps = [r for r in records if "loss" in r and "time" in r]
    first = records[0]["time"] if records else 0.0
    if not steps:
        return first
    r = steps[0]
    if batch and r.get("images_per_sec") and r.get("step"):
        return r["time"] - r["step"] * batch / r["images_per_sec"]
    return first


def loss_figure(runs):
    """Rank 0's training loss vs seconds since training start, one line per run folder."""
    fig, ax = _figure(8, 5.4)
    for _, losses, variant in runs:
        if losses:
            ax.plot([p[0] for p in losses], [p[1] for p in losses], marker="o", markersize=3, label=variant)
    ax.set_xlabel(RUN_START_LABEL)
    ax.set_ylabel("training loss (rank 0, cross-entropy)")
    ax.set_title("Training loss vs wall-clock time", fontsize=11)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    return fig


def plot_runs(run_dirs, out_dir):
    runs = [load_run(d) for d in run_dirs]
    keys = [(run[0][0]["variant"], run[0][0]["seed"]) for run in runs if run[0]]
    for run, d in zip(runs, run_dirs):      # two folders of one variant and seed: tell them apart by name
        for e in run[0]:
            if keys.count((e["variant"], e["seed"])) > 1:
                e["variant"] += f" ({os.path.basename(os.path.normpath(d))})"
    evals = [e for run in runs for e in run[0]]
    written = plot_evals(evals, out_dir, xlabel=RUN_START_LABEL)
    written.append(_save(loss_figure(runs), out_dir, "loss_vs_time.png"))
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--csv", help="runs.csv of bench/bench_network.py or table.csv of bench/bench_horovod.py")
    ap.add_argument("--evals", help="evals.csv written by scripts/time_to_accuracy.py")
    ap.add_argument("--title", default="", help="a second title line for the accuracy figures (data, link)")
    ap.add_argument("--runs", nargs="+", default=[], metavar="RUN_DIR", help="run folders with metrics.jsonl")
    ap.add_argument("--out", default=".", help="folder for the PNG files")
    args = ap.parse_args(argv)
    if not (args.csv or args.evals or args.runs):
        ap.error("give --csv, --evals and/or --runs")
    for flag, path in (("--csv", args.csv), ("--evals", args.evals)):
        if path and not os.path.exists(path):
            ap.error(f"{flag}: {path} not found")
    try:                # log.dir/<name> stands for its latest run, as in compare.py (reproduce.sh passes those)
        args.runs = [resolve_run_dir(d) for d in args.runs]
    except ValueError as err:
        ap.error(f"--runs: {err}")
    missing = [d for d in args.runs if not os.path.exists(os.path.join(d, metrics_file()))]
    if missing:
        ap.error(f"--runs: no metrics.jsonl in {', '.join(missing)}")
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.csv:
        written += plot_csv(args.csv, args.out)
    if args.evals:
        written += plot_evals(read_evals(args.evals), args.out, args.title)
    if args.runs:
        written += plot_runs(args.runs, args.out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
