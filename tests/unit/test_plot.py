"""scripts/plot.py draws figures a person can read: titles and labels in words and inside the figure,
legends beside or below the data with no run-folder names in them, a target line on the time-to-accuracy
figures, integer epoch ticks; and every committed PNG names the command that redraws it."""
import csv

from scripts import plot
import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def bench_rows():
    rows = [{"algorithm": "compute_bound", "label": "compute bound", "rate_mbit": "0", "status": "ok",
             "steady_images_per_sec": "160", "steady_kernel_bytes_per_step": "1000", "peak_rss_worker_mb": "400",
             "num_workers": "1", "bound_workers": "2"}]
    for alg, label, speed in (("ssgd", "SSGD", 1.0), ("ssd_topk", "SSD-SGD+top-k 1%", 3.0),
                              ("ssd_topk_s2k", "ssd_topk_s2k", 4.0)):
        for rate, repeat in ((100.0, 1), (100.0, 2), (20.0, 1)):
            rows.append({"algorithm": alg, "label": label, "rate_mbit": str(rate), "status": "ok",
                         "steady_images_per_sec": str(speed * rate + repeat),
                         "steady_kernel_bytes_per_step": str(4e6 / speed), "peak_rss_worker_mb": str(400 + 10 * speed),
                         "num_workers": "2", "bound_workers": ""})
    return rows


def eval_rows():
    """SSGD and a top-k variant, 2 seeds each; the top-k seed 1 run was resumed and evaluated epoch 2 twice."""
    rows = []
    for variant, epochs, per_epoch in (("SSGD", 3, 100.0), ("SSD-SGD + top-k 10%", 4, 40.0)):
        for seed in (0, 1):
            for epoch in range(1, epochs + 1):
                rows.append({"variant": variant, "seed": seed, "epoch": epoch, "seconds": per_epoch * epoch + 10,
                             "train_seconds": per_epoch * epoch, "test_acc": 0.5 + 0.1 * epoch + 0.01 * seed})
    rows.append(dict(rows[-3], seconds=rows[-3]["seconds"] + 5))
    return rows


def _inside(fig, artist):
    box = artist.get_window_extent(fig.canvas.get_renderer())
    whole = fig.bbox
    return whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1


def _check_readable(fig, title, xlabel, ylabel):
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_title().startswith(title)
    assert ax.get_xlabel() == xlabel and ax.get_ylabel() == ylabel
    for artist in (ax.title, ax.xaxis.label, ax.yaxis.label):
        assert _inside(fig, artist), f"clipped: {artist.get_text()!r}"
    assert len(fig.legends) == 1 and not ax.get_legend()
    legend = fig.legends[0]
    assert _inside(fig, legend)
    for artist in (ax, ax.title):
        assert not legend.get_window_extent().overlaps(artist.get_window_extent()), f"the legend covers {artist}"
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts and all("_" not in t for t in texts), texts
    return texts


@pytest.mark.parametrize("make, title, ylabel", [
    (plot.throughput_figure, "Training throughput by link rate", "steady-state throughput (images/s, all workers)"),
    (plot.bytes_figure, "Loopback bytes sent per training step", "kernel bytes per step (MB, log scale)"),
    (plot.rss_figure, "Worker peak resident memory", "peak RSS of a worker (MB)"),
])
def test_bar_figures_are_readable(make, title, ylabel):
    fig = make(bench_rows())
    texts = _check_readable(fig, title, "link rate (loopback tbf)", ylabel)
    assert "SSD-SGD + top-k 1%" in texts and "ssd topk s2k" in texts
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["100 Mbit/s", "20 Mbit/s"]
    plot.plt.close(fig)


@pytest.mark.parametrize("clock", ["seconds", "train_seconds", "epoch"])
def test_accuracy_figures_are_readable(clock):
    evals = eval_rows()
    fig = plot.accuracy_figure(evals, clock, context="Digits demo at 20 Mbit/s")
    words = {"seconds": "wall-clock time", "train_seconds": "training time", "epoch": "epoch"}[clock]
    xlabel = {"seconds": "wall seconds since launch", "train_seconds": "training seconds (wall seconds minus "
              "evaluations)", "epoch": "epochs completed"}[clock]
    texts = _check_readable(fig, f"Test accuracy vs {words}\nDigits demo at 20 Mbit/s", xlabel,
                            "test accuracy (fraction)")
    assert "SSGD, median of 2 seeds (0, 1)" in texts
    assert "SSD-SGD + top-k 10%, median of 2 seeds (0, 1)" in texts
    ax = fig.axes[0]
    target = [line for line in ax.get_lines() if line.get_label().startswith(plot.TARGET_LABEL)]
    assert len(target) == 1 and target[0].get_linestyle() == "--"
    assert target[0].get_ydata()[0] == pytest.approx(0.5 + 0.3 + 0.005)    # median of SSGD's final accuracies
    if clock == "epoch":
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plot.plt.close(fig)


def test_a_clock_not_recorded_draws_no_figure():
    evals = [dict(e, train_seconds=None) for e in eval_rows()]
    assert plot.accuracy_figure(evals, "train_seconds") is None
    assert plot.accuracy_figure(evals, "seconds") is not None
    plot.plt.close("all")


def test_main_writes_every_figure(tmp_path):
    _write(tmp_path / "runs.csv", bench_rows())
    _write(tmp_path / "evals.csv", eval_rows())
    out = tmp_path / "plots"
    assert plot.main(["--csv", str(tmp_path / "runs.csv"), "--evals", str(tmp_path / "evals.csv"),
                      "--title", "Digits demo at 20 Mbit/s", "--out", str(out)]) == 0
    for name in ("throughput.png", "bytes_per_step.png", "worker_rss.png", "accuracy_vs_time.png",
                 "accuracy_vs_train_time.png", "accuracy_vs_epoch.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
