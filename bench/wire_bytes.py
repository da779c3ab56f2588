"""Bytes on the wire of the compressed push path, from the kernel's own counters.

    sudo python bench/wire_bytes.py [--seed 0] [--out results/wire_bytes]

Runs the digits demo (SSD-SGD + top-k, 2 workers, 1 server) once per wire variant, each in a
fresh network namespace, and compares the namespace's loopback byte counter with what the workers
say they pushed and pulled (summary.json), each variant against the one it is compared with. The fp16
wire should save 2 bytes per sent value, the density warm-up should cost its extra values, and at 10%
with the sparse downlink (k = 1) the bitmap index coding should save what the plan says on the pushes
and the ring pulls; a mismatch between the kernel's difference and the workers' figures would mean the
wire is not what the plan says. Writes jobs.csv and table.md.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from testbed.netns import Namespace, tools_problem
from scripts.results_io import (job_command, job_name, job_summary, results_folder, run_captured, stop_on_sigterm,
                                write_csv, write_manifest, write_text)

CONFIG = "configs/demo_digits_ssd_topk.yaml"
TOPK10 = ["compression.density=0.1", "algorithm.delay=1", "compression.downlink=sparse"]
# label -> (overrides, the label it is compared with)
VARIANTS = {
    "fp32 values": ([], None),
    "fp16 values": (["compression.fp16_values=true"], "fp32 values"),
    # DGC's warm-up densities above the demo's 1% (a stage below it is refused: it would not be a warm-up).
    "fp16 values + density warm-up": (["compression.fp16_values=true",
                                       "compression.warmup=[0.25,0.0625,0.015625]"], "fp32 values"),
    "top-k 10%, k = 1, sparse downlink, index list": (TOPK10 + ["compression.index_coding=list"], None),
    "top-k 10%, k = 1, sparse downlink, bitmap": (TOPK10, "top-k 10%, k = 1, sparse downlink, index list"),
}


def run(label, sets, seed, out, timeout):
    name = job_name(label, seed)
    cmd = job_command(os.path.join(ROOT, CONFIG), name, f"{out}/runs",
                      [f"seed={seed}", f"cluster.timeout={timeout}",
                       "compression.buffers=one", *sets])        # the same single buffer in every variant
    with Namespace(rate_mbit=0) as ns:
        before = ns.counters()["tx_bytes"]
        proc = run_captured(ns.argv(cmd))
        kernel = ns.counters()["tx_bytes"] - before
    row = {"variant": label, "seed": seed, "rc": proc.returncode, "kernel_bytes": kernel}
    s = job_summary(proc, os.path.join(out, "runs", name))
    if s is None:
        return row
    row.update(final_test_acc=s["final_test_acc"], steps=s["steps"],
               push_bytes_all_workers=sum(w["push_bytes"] for w in s["workers"]),
               pull_bytes_all_workers=sum(w["pull_bytes"] for w in s["workers"]))
    return row


def table(rows, variants=VARIANTS):
    ok = {r["variant"]: r for r in rows if r["rc"] == 0}
    lines = ["| variant | final acc | pushed by workers (MB) | pulled by workers (MB) | kernel bytes (MB) "
             "| compared with | Δ pushed + pulled (MB) | Δ kernel (MB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["rc"] != 0:
            lines.append(f"| {r['variant']} | failed | | | | | | |")
            continue
        base = ok.get(variants[r["variant"]][1])
        d_moved = d_kernel = "–"
        if base is not None:
            moved = r["push_bytes_all_workers"] + r["pull_bytes_all_workers"]
            d_moved = f"{(moved - base['push_bytes_all_workers'] - base['pull_bytes_all_workers']) / 1e6:+.3f}"
            d_kernel = f"{(r['kernel_bytes'] - base['kernel_bytes']) / 1e6:+.3f}"
        lines.append(f"| {r['variant']} | {r['final_test_acc']:.4f} | {r['push_bytes_all_workers'] / 1e6:.3f} "
                     f"| {r['pull_bytes_all_workers'] / 1e6:.3f} | {r['kernel_bytes'] / 1e6:.3f} "
                     f"| {base['variant'] if base else '–'} | {d_moved} | {d_kernel} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per job, seconds")
    ap.add_argument("--out", default="results/wire_bytes")
    args = ap.parse_args()
    stop_on_sigterm()
    problem = tools_problem()
    if problem:
        print(f"wire_bytes: {problem}", file=sys.stderr)
        return 2
    out = results_folder(args.out)
    write_manifest(out, [os.path.join(ROOT, CONFIG)], finished=False)
    rows = []
    for label, (sets, _) in VARIANTS.items():
        print(f"{label}", flush=True)
        rows.append(run(label, sets, args.seed, out, args.timeout))
    write_csv(os.path.join(out, "jobs.csv"), rows)
    text = table(rows)
    write_text(os.path.join(out, "table.md"), text)
    write_manifest(out, [os.path.join(ROOT, CONFIG)], finished=True, jobs=len(rows),
                   failed=sum(r["rc"] != 0 for r in rows))
    print(text)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
