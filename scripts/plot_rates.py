"""Images/s against link rate, one panel per worker count, from a side-by-side table.csv
(bench/bench_horovod.py: columns system, variant, label, workers, rate_mbit, status, images_per_sec,
compute_bound, machine_bound). scripts/plot.py --csv draws it when the CSV has those columns."""
import statistics

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from scripts.results_io import rate_name

FIGURE = "images_per_sec_vs_rate.png"
COLUMNS = {"system", "variant", "label", "workers", "rate_mbit", "images_per_sec"}
BOUNDS = (("compute_bound", "--", "compute bound (N × one worker alone)"),
          ("machine_bound", ":", "this machine's bound (its cores shared by all N)"))


def log_axis(ax):
    """A log-scale y axis labelled at 1, 2 and 5 of each decade, in plain numbers."""
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def is_rate_table(rows):
    return bool(rows) and COLUMNS <= set(rows[0])


def _rate_order(rate):
    return float("inf") if not rate else rate      # unlimited (0) at the right


def rate_figure(rows, subplots):
    """A figure (subplots: pyplot.subplots) with one panel per worker count: a line per variant over the
    link rates, the bounds as horizontal lines."""
    ok = [r for r in rows if r.get("status", "ok") == "ok" and r.get("images_per_sec")]
    if not ok:
        return None
    counts = sorted({int(r["workers"]) for r in ok})
    rates = sorted({float(r["rate_mbit"] or 0) for r in ok}, key=_rate_order)
    labels = list(dict.fromkeys(r["label"] for r in ok))
    fig, axes = subplots(1, len(counts), figsize=(4.2 * len(counts), 4.8), sharey=True, squeeze=False,
                         layout="constrained")
    axes = list(axes[0])
    for ax, n in zip(axes, counts):
        here = [r for r in ok if int(r["workers"]) == n]
        for label in labels:
            points = {float(r["rate_mbit"] or 0): float(r["images_per_sec"]) for r in here if r["label"] == label}
            xs = [i for i, rate in enumerate(rates) if rate in points]
            style = "--" if label.lower().startswith("horovod") else "-"
            ax.plot(xs, [points[rates[i]] for i in xs], style, marker="o", markersize=4,
                    label=label if n == counts[0] else None)
        for field, style, words in BOUNDS:
            values = [float(r[field]) for r in here if r.get(field)]
            if values:
                ax.axhline(statistics.median(values), color="k", linestyle=style, linewidth=1,
                           label=words if n == counts[0] else None)
        log_axis(ax)
        ax.set_xticks(range(len(rates)))
        ax.set_xticklabels([rate_name(r) for r in rates], fontsize=8)
        ax.set_title(f"{n} workers", fontsize=10)
        ax.set_xlabel("link rate per host")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("images/s, all workers (steady-state median, log scale)")
    fig.suptitle("Training throughput against link rate: Horovod (dashed) and ssdsgd (solid)", fontsize=11)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    return fig
