"""bench/scaling_model.py's ring all-reduce against every measured Horovod layout of bench/bench_horovod.py.

  python bench/ring_check.py results/horovod_vs_ssdsgd      # writes ring_check.csv and ring_check.md there

Per Horovod row of <folder>/table.csv (status ok): the model's images/s (scaling_model.layout with kind
"ring", ring_step) from the same inputs its validation uses: the single worker's compute (wall and CPU
seconds per step) from the compute-bound runs of <folder>/ssdsgd_n*/runs.csv (scaling_model.measured_compute),
no latency on the virtual cluster, the machine's cores less the share other processes used during the run,
and 2 bytes a value for Horovod's fp16 compression. Two predictions: with the workers sharing the cores
(the model) and with each worker on a core of its own (the ring step before it shared the cores), and the
worker link's bytes per step measured against the model's. Error = predicted / measured - 1; target 20%.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from bench import horovod_table  # noqa: E402
from bench import scaling_model as sm  # noqa: E402
from scripts.results_io import COMPUTE_BOUND, rate_name, read_csv, write_csv, write_text  # noqa: E402

TARGET = 0.20
VALUE_BYTES = {"horovod_fp32": 4.0, "horovod_fp16": 2.0}


def compute_rows(folder):
    """The ok compute-bound rows of every ssdsgd runs.csv in the folder (the same single worker)."""
    return [r for (system, _), rows in horovod_table.read_runs(folder).items() if system == "ssdsgd"
            for r in rows if r["algorithm"] == COMPUTE_BOUND and r["status"] == "ok"]


def predict(row, cfg, measured, cores, other_share):
    """(images/s with shared cores, images/s with a core per worker, worker link tx bytes per step)."""
    n = int(float(row["workers"]))
    rate = float(row["rate_mbit"] or 0) * 1e6 / 8
    inputs = dict(t_c=measured["t_c"], cpu_w=measured["cpu_w"], per_byte=0.0, latency=0.0, terms=None)
    value_bytes = VALUE_BYTES[row["variant"]]
    out = []
    for free in (cores * (1.0 - other_share), None):
        lay = sm.layout(cfg, n, 1, rate, dict(inputs, cores=free), kind="ring")
        t, limit = sm.ring_step(dict(lay, value_bytes=value_bytes))
        out.append((n * cfg.train.batch_size / t, limit))
    sent = sm.ring_allreduce_bytes(lay["bytes"]["values"], n, value_bytes)
    return out[0], out[1], sm.wire(sent, sent)


def check(folder, config, sets, cores):
    """ring_check.csv's rows: one per ok Horovod layout of <folder>/table.csv."""
    cb = compute_rows(folder)
    if not cb:
        raise sm.ModelError(f"{folder}: no ok compute-bound run in ssdsgd_n*/runs.csv")
    measured = sm.measured_compute(cb, folder, config, sets)
    rows = []
    for r in read_csv(os.path.join(folder, "table.csv")):
        if r["system"] != "horovod" or r["status"] != "ok" or not r["images_per_sec"]:
            continue
        cfg = sm.load(config, [*sets, f"cluster.workers={r['workers']}"])
        (shared, limit), (own, _), wire_tx = predict(r, cfg, measured, cores, float(r["other_cpu_share"] or 0))
        meas = float(r["images_per_sec"])
        tx = float(r["worker_tx_bytes_per_step"]) if r["worker_tx_bytes_per_step"] else None
        rows.append(dict(variant=r["variant"], workers=int(r["workers"]), rate_mbit=float(r["rate_mbit"] or 0),
                         measured_images_per_sec=round(meas, 1), predicted_images_per_sec=round(shared, 1),
                         error=round(shared / meas - 1, 4), limited_by=limit,
                         predicted_own_core_images_per_sec=round(own, 1), error_own_core=round(own / meas - 1, 4),
                         measured_worker_tx_kb=None if tx is None else round(tx / 1e3, 1),
                         predicted_worker_tx_kb=round(wire_tx / 1e3, 1),
                         other_cpu_share=r["other_cpu_share"]))
    return rows, measured


def markdown(rows, measured, cores):
    lines = ["# Ring all-reduce model (bench/scaling_model.py) against measured Horovod", "",
             f"Single worker: {measured['t_c'] * 1e3:.1f} ms per step (CPU {measured['cpu_w'] * 1e3:.1f} ms) from "
             f"{measured['runs']} compute-bound run(s); {cores} cores less the run's other_cpu_share; no latency.", "",
             "| variant | N | link | measured img/s | predicted | error | limited by | a core per worker | error "
             "| worker tx KB/step meas./pred. |", "|---|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['workers']} | {rate_name(r['rate_mbit'])} "
                     f"| {r['measured_images_per_sec']:.1f} | {r['predicted_images_per_sec']:.1f} "
                     f"| {r['error']:+.1%} | {r['limited_by']} | {r['predicted_own_core_images_per_sec']:.1f} "
                     f"| {r['error_own_core']:+.1%} | {r['measured_worker_tx_kb']} / {r['predicted_worker_tx_kb']} |")
    worst = max((abs(r["error"]) for r in rows), default=None)
    within = sum(abs(r["error"]) <= TARGET for r in rows)
    lines += ["", f"Within {TARGET:.0%}: {within} of {len(rows)} layouts; largest error "
                  + ("–" if worst is None else f"{worst:.1%}") + "."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a results folder of bench/bench_horovod.py")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_cifar_resnet20.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    try:
        rows, measured = check(args.folder, args.config, args.set, args.cores)
    except (sm.ModelError, OSError, ValueError) as e:
        print(f"ring_check: {e}", file=sys.stderr)
        return 2
    write_csv(os.path.join(args.folder, "ring_check.csv"), rows)
    text = markdown(rows, measured, args.cores)
    write_text(os.path.join(args.folder, "ring_check.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
