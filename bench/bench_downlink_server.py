"""Microbenchmark of what the compressed downlink costs the servers: CPU time of BufferState.receive()
per round (summing the N workers' messages, applying the round and publishing it in the ring), with the
exact ring (compression.downlink: sparse) and with the compressed one (packed, two pushes' bytes:
ssdsgd.ps.ring_packing), on the same 1% top-k-like messages (uniform random indices, increasing, fresh each round);
no networking, no MXNet. Also reported: the values a compressed round carries against the non-zero
entries of the exact round sum, and a worker's push bytes (results.csv; a slot is two of them).

    OMP_NUM_THREADS=1 python bench/bench_downlink_server.py      # -> results/bench_downlink_server/
"""
import argparse
import csv
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from bench.bench_server import MODELS, payloads, split
from scripts.results_io import write_manifest, write_text
from ssdsgd.algorithms.downlink import ring_choice
from ssdsgd.compression.codec import WireFormat
from ssdsgd.ps.ring import DownlinkRing
from ssdsgd.ps.rounds import BufferState


def run(sizes, density, workers, downlink, rounds, warmup=1):
    """Per-round CPU seconds (warm-up rounds dropped), values published per round, non-zero entries of
    the exact round sums per round, and the ring kinds, for one downlink."""
    comp = SimpleNamespace(downlink=downlink, index_coding="auto", fp16_values=False)
    rng = np.random.default_rng(0)
    ks = [int(density * size) for size in sizes]
    states, pools, kinds = [], [], []
    for b, (size, k) in enumerate(zip(sizes, ks)):
        kind, layout = ring_choice(comp, 1, size, k, workers)
        kinds.append(kind)
        st = BufferState(size, workers, 32, 0.0, 1e-4, lambda t: 0.1, [WireFormat("sparse", size, k)])
        st.bind(np.random.default_rng(100 + b).standard_normal(size, dtype=np.float32))
        st.ring = DownlinkRing(layout)
        states.append(st)
        pools.append(payloads(rng, "sparse", size, k, workers))
    times, published, union = [], [], []
    for rnd in range(warmup + rounds):
        total = 0.0
        for rank in range(workers):
            for st, pool in zip(states, pools):
                msg = pool[rank]
                msg[0], msg[1] = rnd, rank
                t0 = time.process_time()
                st.receive(msg)
                total += time.process_time() - t0
        if rnd >= warmup:
            times.append(total)
            published.append(sum(int(st.ring.array[1]) for st in states))
            union.append(sum(np.unique(np.concatenate([msg[2:2 + k] for msg in pool])).size
                             for pool, k in zip(pools, ks)))
        for size, k, pool in zip(sizes, ks, pools):    # fresh indices next round, as workers' selections move
            for msg in pool:
                msg[2:2 + k] = np.sort(rng.choice(size, k, replace=False))
    return times, published, union, kinds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet20"], choices=list(MODELS))
    p.add_argument("--workers", nargs="+", type=int, default=[4, 8, 16])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_downlink_server"))
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for model in args.models:
        sizes = split(MODELS[model])
        push = sum(WireFormat.planned(s, int(args.density * s)).bytes for s in sizes)
        for n in args.workers:
            for downlink in ("sparse", "compressed"):
                t, published, union, kinds = run(sizes, args.density, n, downlink, args.rounds)
                med = float(np.median(t))
                rows.append({"model": model, "floats": sum(sizes), "workers": n, "downlink": downlink,
                             "ring": "+".join(sorted(set(kinds))), "rounds": len(t),
                             "round_ms_median": round(1e3 * med, 3),
                             "values_per_round": int(np.median(published)),
                             "round_sum_entries": int(np.median(union)), "push_bytes": push})
                print(f"{model} N={n:3d} {downlink:10s} {1e3 * med:9.3f} ms/round, "
                      f"{rows[-1]['values_per_round']} of {rows[-1]['round_sum_entries']} values", flush=True)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| model | N | downlink (ring) | ms per round, median | values a round carries | "
             "entries of the exact round sum |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['workers']} | {r['downlink']} ({r['ring']}) | {r['round_ms_median']} | "
                     f"{r['values_per_round']} | {r['round_sum_entries']} |")
    write_text(os.path.join(args.out, "table.md"), "\n".join(lines))
    write_manifest(args.out, [], rounds=args.rounds, density=args.density)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
