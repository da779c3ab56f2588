"""The results of bench/bench_horovod.py as one table: <out>/table.csv (one row per layout), table.md (the same,
with SSD-SGD + top-k's ratio to Horovod per N and rate) and images_per_sec_vs_rate.png (scripts/plot.py:
images/s against link rate, one panel per N). Reads <out>/ssdsgd_n<N>/runs.csv and <out>/horovod_n<N>/runs.csv
(bench_network's columns); needs neither Horovod nor root, so `bench_horovod.py --table-only` and the tests
run it anywhere."""
import csv
import glob
import os
import re
import shlex
import statistics

from scripts.results_io import COMPUTE_BOUND, ROOT, rate_name, read_csv, write_text

SYSTEMS = {"ssdsgd": "ssdsgd", "horovod": "Horovod"}
TOPK = "ssd_topk_sparse"                       # the product's setting: SSD-SGD + top-k 1%, exact downlink
PEERS = ("horovod_fp32", "horovod_fp16")
# table.csv's columns from a runs.csv row (bench_network's names) after the ones table_rows sets itself.
COPIED = {"images_per_sec_whole_job": "images_per_sec", "median_step_images_per_sec": "median_step_images_per_sec",
          **{f"{r}_{d}_bytes_per_step": f"steady_{r}_{d}_bytes_per_step" for r in ("worker", "server")
             for d in ("tx", "rx")},
          **{f"{r}_{d}_util": f"{r}_{d}_util" for r in ("worker", "server") for d in ("tx", "rx")},
          "kernel_bytes_per_step": "steady_kernel_bytes_per_step", "qdisc_drops": "qdisc_drops",
          "other_cpu_share": "other_cpu_share", "final_loss": "final_loss", "error": "error"}
COLUMNS = ["system", "variant", "label", "workers", "servers", "rate_mbit", "status", "images_per_sec",
           "compute_bound", "machine_bound", "share_of_compute_bound", *COPIED, "attempts", "source"]


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def read_runs(out):
    """{(system, N): rows} from every <out>/<system>_n<N>[_<suffix>]/runs.csv (a suffixed folder holds layouts
    run again, e.g. after a failed attempt: its rows come after the unsuffixed folder's)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "*_n*", "runs.csv"))):
        m = re.fullmatch(r"(ssdsgd|horovod)_n(\d+)(_\w+)?", os.path.basename(os.path.dirname(path)))
        if m:
            rows = read_csv(path)
            for r in rows:
                r["source"] = os.path.relpath(path, out)
            found.setdefault((m.group(1), int(m.group(2))), []).extend(rows)
    return found


def single_worker(found, n):
    """One worker's steady images/s without communication: N's own compute-bound run, else the median over
    the other N's (the same single worker), else None."""
    def of(rows):
        return [_num(r["steady_images_per_sec"]) or _num(r["images_per_sec"]) for r in rows
                if r["algorithm"] == COMPUTE_BOUND and r["status"] == "ok"]
    own = [v for v in of(found.get(("ssdsgd", n), [])) if v]
    if own:
        return statistics.median(own)
    every = [v for (system, _), rows in found.items() if system == "ssdsgd" for v in of(rows) if v]
    return statistics.median(every) if every else None


def last_attempts(runs):
    """Per (algorithm, rate), in first-seen order: the last ok run, else the last run, and how many runs
    were made (a layout rerun after a failed attempt has both in its runs.csv)."""
    by = {}
    for r in runs:
        by.setdefault((r["algorithm"], r["rate_mbit"]), []).append(r)
    out = []
    for tried in by.values():
        ok = [r for r in tried if r["status"] == "ok"]
        out.append(((ok or tried)[-1], len(tried)))
    return out


def table_rows(found, cores):
    """One table.csv row per layout (compute-bound runs are columns, not rows)."""
    rows = []
    for (system, n), runs in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0] != "horovod", kv[0][0])):
        one = single_worker(found, n)
        for r, attempts in last_attempts(runs):
            if r["algorithm"] == COMPUTE_BOUND:
                continue
            ips = _num(r["steady_images_per_sec"])
            bound = one * n if one else None
            row = dict(system=system, variant=r["algorithm"], label=r["label"], workers=n,
                       servers=int(_num(r["num_servers"]) or 0) if system == "ssdsgd" else 0,
                       rate_mbit=_num(r["rate_mbit"]), status=r["status"], images_per_sec=ips,
                       compute_bound=None if bound is None else round(bound, 1),
                       machine_bound=None if one is None else round(one * min(n, cores), 1),
                       share_of_compute_bound=round(ips / bound, 3) if ips and bound else None,
                       attempts=attempts, source=r["source"])
            row.update({k: r.get(v, "") for k, v in COPIED.items()})
            if system == "ssdsgd" and not row["servers"]:
                row["servers"] = 1          # the runs that failed before their summary: the config's one server
            rows.append(row)
    return rows


def ratios(rows):
    """Per (N, rate): SSD-SGD + top-k 1% (exact downlink) images/s over each Horovod variant's."""
    by = {(r["workers"], r["rate_mbit"], r["variant"]): r["images_per_sec"] for r in rows if r["status"] == "ok"}
    out = []
    for (n, rate, variant), ips in sorted(by.items()):
        if variant != TOPK:
            continue
        entry = dict(workers=n, rate_mbit=rate, topk_images_per_sec=ips)
        for peer in PEERS:
            other = by.get((n, rate, peer))
            entry[f"over_{peer}"] = round(ips / other, 2) if ips and other else None
        out.append(entry)
    return out


def _fmt(v, spec="{:.1f}"):
    return "–" if v in (None, "") else spec.format(float(v))


def markdown(rows, cores):
    lines = ["# Horovod against ssdsgd on per-host links (bench/bench_horovod.py)", "",
             f"images/s: steady window; compute bound: N x one worker without communication; machine bound: "
             f"min(N, {cores} cores) x one worker. One run per layout. Other CPU: the share of the machine's CPU "
             f"that processes outside the job used while it ran (other users' jobs).", "",
             "| N | link | system | variant | images/s | compute bound | machine bound | worker tx/rx B/step "
             "| server tx/rx B/step | worker tx util | other CPU | status |",
             "|---:|---|---|---|---:|---:|---:|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {rate_name(r['rate_mbit'])} | {SYSTEMS[r['system']]} | {r['label']} "
                     f"| {_fmt(r['images_per_sec'])} | {_fmt(r['compute_bound'])} | {_fmt(r['machine_bound'])} "
                     f"| {_fmt(r['worker_tx_bytes_per_step'], '{:,.0f}')} / "
                     f"{_fmt(r['worker_rx_bytes_per_step'], '{:,.0f}')} "
                     f"| {_fmt(r['server_tx_bytes_per_step'], '{:,.0f}')} / "
                     f"{_fmt(r['server_rx_bytes_per_step'], '{:,.0f}')} "
                     f"| {_fmt(r['worker_tx_util'], '{:.0%}')} | {_fmt(r['other_cpu_share'], '{:.0%}')} "
                     f"| {r['status']} |")
    lines += ["", "SSD-SGD + top-k 1% (exact downlink) over Horovod, images/s:", "",
              "| N | link | top-k images/s | / Horovod fp32 | / Horovod fp16 |", "|---:|---|---:|---:|---:|"]
    for q in ratios(rows):
        lines.append(f"| {q['workers']} | {rate_name(q['rate_mbit'])} | {_fmt(q['topk_images_per_sec'])} "
                     f"| {_fmt(q['over_horovod_fp32'], '{:.2f}x')} | {_fmt(q['over_horovod_fp16'], '{:.2f}x')} |")
    return "\n".join(lines)


def plot_command(out):
    """The command that redraws the folder's figure from its table.csv (the manifest's "plots" entry)."""
    folder = os.path.relpath(os.path.abspath(out), ROOT)
    return shlex.join(["python", "scripts/plot.py", "--csv", os.path.join(folder, "table.csv"), "--out", folder])


def write_outputs(out, cores=None):
    """table.csv, table.md and the plot (scripts/plot.py, as plot_command says) in `out`; returns table.md's text."""
    cores = cores or os.cpu_count()
    rows = table_rows(read_runs(out), cores)
    write_csv_ordered(os.path.join(out, "table.csv"), rows)
    text = markdown(rows, cores)
    write_text(os.path.join(out, "table.md"), text)
    if rows:
        from scripts import plot     # matplotlib: here, not at import (bench/ring_check.py reads tables only)
        plot.plot_csv(os.path.join(out, "table.csv"), out)
    return text


def write_csv_ordered(path, rows):
    """table.csv in COLUMNS' order (results_io.write_csv sorts its columns)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: "" if r.get(k) is None else r.get(k) for k in COLUMNS} for r in rows)
