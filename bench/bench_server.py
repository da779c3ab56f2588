"""Microbenchmark of the server's per-round CPU time (issue 12, item 3): BufferState.receive() only,
no networking, no MXNet.

For each model size, codec and number of simulated workers N, every round feeds N mailbox messages
(ranks 0..N-1) to the BufferStates of the model's buffers and sums time.process_time() around each
receive() call; the last call of a round also applies it (the O(size) momentum update, once per
round). Reported: the median over the measured rounds (one warm-up round first), per round and per
value sent. "old" is the server as it was before this change (commit bec0361): what its receive()
did differently is reimplemented below (OldFormat: every sparse message densified, np.zeros(size) +
np.add.at, and a zero accumulator allocated per message) and fed to ssdsgd.ps.rounds.BufferState,
which sums and applies a round as it did then; "new" is BufferState with its own WireFormat. Both
get the same messages in the same order and must end with bit-identical weights (checked). Sparse
messages are 1% top-k-like: k = floor(density * buffer size) distinct uniform random indices per worker
and buffer, in increasing order as a top-k selection sends them, normal values.
Buffers are capped at 2**24 elements (codec.MAX_BUFFER_ELEMENTS), so a larger model is split into
equal buffers, as the server would hold them.

    OMP_NUM_THREADS=1 nice -n 19 python bench/bench_server.py      # -> results/bench_server/
"""
import argparse
import csv
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import write_manifest
from ssdsgd.compression.codec import MAX_BUFFER_ELEMENTS, WireFormat
from ssdsgd.ps.rounds import BufferState

MODELS = {"resnet20": 272_474, "resnet50": 25_557_032}


class OldFormat:
    """The fp32 mailbox as the server read it at commit bec0361, for BufferState.receive to sum and
    apply as it did then: every sparse message densified (np.zeros + np.add.at), and a zero
    accumulator allocated for every message (the default argument of its pending.setdefault)."""

    def __init__(self, codec, size, k):
        self.codec, self.size, self.k = codec, size, k

    def parse(self, message):
        rnd, rank, payload = int(message[0]), int(message[1]), message[2:]
        np.zeros(self.size, np.float32)           # the per-message accumulator of old, dropped unused
        if self.codec == "dense":
            return rnd, rank, payload
        idx = payload[:self.k].astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            raise ValueError("sparse payload index out of range")
        grad = np.zeros(self.size, np.float32)
        np.add.at(grad, idx, payload[self.k:].astype(np.float32))
        return rnd, rank, grad


def split(size):
    n = -(-size // MAX_BUFFER_ELEMENTS)
    return [size // n + (1 if i < size % n else 0) for i in range(n)]


def make_format(codec, size, k):
    return WireFormat(codec, size, k if codec == "sparse" else None)


def payloads(rng, codec, size, k, count):
    """`count` distinct [0, 0, payload] messages for one buffer (header rewritten before each push)."""
    out = []
    for _ in range(count):
        if codec == "dense":
            body = rng.standard_normal(size, dtype=np.float32)
        else:
            idx = np.sort(rng.choice(size, k, replace=False)).astype(np.float32)   # increasing, as top-k's
            body = np.concatenate([idx, rng.standard_normal(k, dtype=np.float32)])
        out.append(np.concatenate([np.zeros(2, np.float32), body]))
    return out


def run_rounds(fmt, sizes, ks, codec, workers, pools, rounds, warmup=1):
    """Per-round CPU seconds (warm-up rounds dropped) and the final weights of every buffer, the
    messages read by the formats `fmt(codec, size, k)` makes (OldFormat or make_format's WireFormat)."""
    schedule = lambda t: 0.1                                   # noqa: E731
    states = []
    for b, (size, k) in enumerate(zip(sizes, ks)):
        st = BufferState(size, workers, 32, 0.9, 1e-4, schedule, [fmt(codec, size, k)])
        st.bind(np.random.default_rng(100 + b).standard_normal(size, dtype=np.float32))
        states.append(st)
    times = []
    for rnd in range(warmup + rounds):
        total = 0.0
        for rank in range(workers):
            for st, pool in zip(states, pools):
                msg = pool[rank % len(pool)]
                msg[0], msg[1] = rnd, rank
                t0 = time.process_time()
                st.receive(msg)
                total += time.process_time() - t0
        assert all(st.version == rnd + 1 for st in states)
        if rnd >= warmup:
            times.append(total)
    return times, [st.weights for st in states]


def fit(xs, ys):
    a = np.vstack([np.ones(len(xs)), xs]).T
    (c0, c1), *_ = np.linalg.lstsq(a, ys, rcond=None)
    pred = c0 + c1 * np.asarray(xs)
    ss_res = float(((np.asarray(ys) - pred) ** 2).sum())
    ss_tot = float(((np.asarray(ys) - np.mean(ys)) ** 2).sum())
    return c0, c1, 1.0 - ss_res / ss_tot if ss_tot else 1.0


def scatter_methods(size, k, reps=5):
    """Ways to add one sparse message (k distinct indices) into an accumulator of `size`, ms; each
    repeat gets fresh indices (as each worker's message does), the accumulator is touched once."""
    rng = np.random.default_rng(7)
    msgs = [(rng.choice(size, k, replace=False), rng.standard_normal(k, dtype=np.float32)) for _ in range(reps)]
    acc = np.ones(size, np.float32)
    stamp, pos = np.ones(size, np.int32), np.arange(k, dtype=np.int32)
    idx = vals = None

    def densify():                                 # old: np.zeros + np.add.at, then a dense add
        d = np.zeros(size, np.float32)
        np.add.at(d, idx, vals)
        acc.__iadd__(d)

    def bincount():                                # float64 and O(size) (minlength), not bit-identical
        acc.__iadd__(np.bincount(idx, weights=vals, minlength=size).astype(np.float32))

    def repeat_check():                            # codec._RepeatFinder, O(k)
        stamp[idx] = pos
        bool((stamp[idx] != pos).any())

    def fancy_add():                               # SparseGrad.add_to, O(k)
        acc[idx] += vals

    methods = {"np.zeros + np.add.at + dense add (old)": densify,
               "np.add.at(acc, idx, vals)": lambda: np.add.at(acc, idx, vals),
               "np.bincount(idx, vals, minlength=size) + dense add": bincount,
               "acc[idx] += vals (new)": fancy_add,
               "repeat check, int32 scratch (new)": repeat_check,
               "repeat check, np.unique (sort)": lambda: np.unique(idx).size}
    out = {}
    for name, f in methods.items():
        ts = []
        for idx, vals in msgs:
            t0 = time.process_time()
            f()
            ts.append(time.process_time() - t0)
        out[name] = 1e3 * float(np.median(ts))
    return out


def measure(model, sizes, codec, density, n, pools, rounds, sweep):
    """Old and new on the same messages: two rows (their weights must be bit-identical)."""
    ks = [int(density * s) if codec == "sparse" else s for s in sizes]
    res = {impl: run_rounds(fmt, sizes, ks, codec, n, pools, rounds)
           for impl, fmt in (("old", OldFormat), ("new", make_format))}
    identical = all(np.array_equal(a, b) for a, b in zip(res["old"][1], res["new"][1]))
    if not identical:
        sys.exit(f"{model} {codec} N={n} density={density}: old and new weights differ")
    sent = n * sum(ks)
    rows = []
    for impl in ("old", "new"):
        t = np.array(res[impl][0])
        med = float(np.median(t))
        rows.append({"sweep": sweep, "model": model, "floats": sum(sizes), "buffers": len(sizes), "codec": codec,
                     "density": density if codec == "sparse" else 1.0, "impl": impl, "workers": n,
                     "values_per_worker": sum(ks), "values_sent": sent, "rounds": len(t),
                     "round_ms_median": round(1e3 * med, 4), "round_ms_min": round(1e3 * float(t.min()), 4),
                     "round_ms_max": round(1e3 * float(t.max()), 4),
                     "ns_per_value": round(1e9 * med / sent, 3), "bit_identical": identical})
        print(f"{sweep:7s} {model:9s} {codec:6s} d={rows[-1]['density']:<6g} {impl} N={n:3d}  "
              f"{1e3 * med:10.3f} ms/round  {1e9 * med / sent:8.2f} ns/value", flush=True)
    return rows


def fit_rows(pts, **key):
    xs, ys = [r["values_sent"] for r in pts], [r["round_ms_median"] for r in pts]
    c0, c1, r2 = fit(xs, ys)
    half = len(pts) // 2
    lo = fit(xs[:half + 1], ys[:half + 1])[1] if half >= 1 else float("nan")
    hi = fit(xs[half:], ys[half:])[1] if half >= 1 else float("nan")
    return dict(key, points=len(pts), intercept_ms=round(c0, 4), slope_ns_per_value=round(1e6 * c1, 4),
                r2=round(r2, 6), slope_low_half_ns=round(1e6 * lo, 4), slope_high_half_ns=round(1e6 * hi, 4),
                time_ratio_last_first=round(ys[-1] / ys[0], 3), values_ratio_last_first=round(xs[-1] / xs[0], 3))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--workers", nargs="+", type=int, default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--densities", nargs="*", type=float, default=[0.001, 0.01, 0.1],
                   help="density sweep of sparse messages at --sweep-workers (none: skip)")
    p.add_argument("--sweep-workers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15, help="measured rounds per point (models < 1M floats)")
    p.add_argument("--rounds-big", type=int, default=5, help="measured rounds per point (larger models)")
    p.add_argument("--dense-pool", type=int, default=4, help="distinct dense payloads per buffer (RAM)")
    p.add_argument("--out", default="results/bench_server")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    load0 = os.getloadavg()
    wall0, cpu0 = time.time(), time.process_time()
    rows, fits, methods = [], [], {}
    # Untimed first: the first allocations of a process (glibc's mmap threshold, page faults) made
    # the first measured point several times slower than the same point measured later.
    warm = split(MODELS[args.models[0]])
    warm_pools = [payloads(np.random.default_rng(2), "sparse", s, int(args.density * s), 4) for s in warm]
    measure("warm-up", warm, "sparse", args.density, 4, warm_pools, 2, "untimed")
    del warm_pools
    for model in args.models:
        sizes = split(MODELS[model])
        rounds = args.rounds if MODELS[model] < 1_000_000 else args.rounds_big
        methods[model] = scatter_methods(sizes[0], int(args.density * sizes[0]))
        for codec in ("sparse", "dense"):
            rng = np.random.default_rng(0)
            ks = [int(args.density * s) if codec == "sparse" else s for s in sizes]
            pool_n = max(args.workers) if codec == "sparse" else args.dense_pool
            pools = [payloads(rng, codec, s, k, pool_n) for s, k in zip(sizes, ks)]
            for n in args.workers:
                rows += measure(model, sizes, codec, args.density, n, pools, rounds, "workers")
            del pools
            for impl in ("old", "new"):
                pts = [r for r in rows if (r["sweep"], r["model"], r["codec"], r["impl"]) ==
                       ("workers", model, codec, impl)]
                fits.append(fit_rows(pts, sweep="workers", model=model, codec=codec, impl=impl))
        for d in args.densities:
            rng = np.random.default_rng(1)
            pools = [payloads(rng, "sparse", s, int(d * s), args.sweep_workers) for s in sizes]
            rows += measure(model, sizes, "sparse", d, args.sweep_workers, pools, rounds, "density")
            del pools
        if len(args.densities) > 1:
            for impl in ("old", "new"):
                pts = [r for r in rows if (r["sweep"], r["model"], r["impl"]) == ("density", model, impl)]
                fits.append(fit_rows(pts, sweep="density", model=model, codec="sparse", impl=impl))
    load1 = os.getloadavg()
    for name, data in (("bench.csv", rows), ("fits.csv", fits)):
        with open(os.path.join(args.out, name), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)
    write_table(args, rows, fits, methods, load0, load1, time.time() - wall0, time.process_time() - cpu0)
    write_manifest(args.out, [])


def write_table(args, rows, fits, methods, load0, load1, wall, cpu):
    get = {(r["sweep"], r["model"], r["codec"], r["impl"], r["workers"], r["density"]): r for r in rows}
    lines = ["# Server CPU per round: BufferState.receive(), old (dense materialisation) vs new (scatter-add)", "",
             f"`OMP_NUM_THREADS=1 nice -n 19 python bench/bench_server.py` "
             f"({' '.join(sys.argv[1:]) or 'defaults'}); numpy {np.__version__}, Python "
             f"{platform.python_version()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores. "
             f"time.process_time() summed over the receive() calls of a round (the last one applies the round), "
             f"median over {args.rounds} measured rounds (models < 1M floats) or {args.rounds_big} (larger), one "
             f"warm-up round first (and, before everything, an untimed pass of 4 workers). Top-k-like sparse "
             f"messages (distinct uniform random indices). Old and new "
             f"ended with bit-identical weights at every point. **The machine was shared** (other training jobs "
             f"running; load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end; {wall:.0f} s wall, "
             f"{cpu:.0f} s CPU): CPU time is less affected than wall time, but caches and memory bandwidth are "
             f"shared.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        r0 = next(r for r in rows if r["model"] == model)
        d = args.density
        lines += [f"## {model}-like: {r0['floats']:,} floats in {r0['buffers']} buffer(s), density {d}", "",
                  "| workers | sparse values sent | old ms/round | new ms/round | old / new | new ns/value "
                  "| dense old ms | dense new ms | dense new ns/value |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for n in args.workers:
            so, sn = get["workers", model, "sparse", "old", n, d], get["workers", model, "sparse", "new", n, d]
            do, dn = get["workers", model, "dense", "old", n, 1.0], get["workers", model, "dense", "new", n, 1.0]
            lines.append(f"| {n} | {sn['values_sent']:,} | {so['round_ms_median']:.3f} | {sn['round_ms_median']:.3f} "
                         f"| {so['round_ms_median'] / sn['round_ms_median']:.1f}x | {sn['ns_per_value']:.2f} "
                         f"| {do['round_ms_median']:.2f} | {dn['round_ms_median']:.2f} | {dn['ns_per_value']:.2f} |")
        lines.append("")
        if args.densities:
            lines += [f"Density sweep, {args.sweep_workers} workers:", "",
                      "| density | values sent | old ms/round | new ms/round | old / new | new ns/value |",
                      "|---:|---:|---:|---:|---:|---:|"]
            for dd in args.densities:
                o = get["density", model, "sparse", "old", args.sweep_workers, dd]
                n_ = get["density", model, "sparse", "new", args.sweep_workers, dd]
                lines.append(f"| {dd:g} | {n_['values_sent']:,} | {o['round_ms_median']:.3f} "
                             f"| {n_['round_ms_median']:.3f} | {o['round_ms_median'] / n_['round_ms_median']:.1f}x "
                             f"| {n_['ns_per_value']:.2f} |")
            lines.append("")
    lines += ["## Linear fits: ms/round = intercept + slope x values sent", "",
              "Over the worker counts (sweep `workers`) or the densities (sweep `density`); the slope is also "
              "fitted on the lower and the upper half of the points separately (equal slopes: linear).", "",
              "| sweep | model | codec | impl | intercept ms | slope ns/value | R^2 | slope, low half | "
              "slope, high half | time last / first | values last / first |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f in fits:
        lines.append(f"| {f['sweep']} | {f['model']} | {f['codec']} | {f['impl']} | {f['intercept_ms']:.3f} "
                     f"| {f['slope_ns_per_value']:.3f} | {f['r2']:.4f} | {f['slope_low_half_ns']:.3f} "
                     f"| {f['slope_high_half_ns']:.3f} | {f['time_ratio_last_first']:.2f} "
                     f"| {f['values_ratio_last_first']:g} |")
    lines += ["", f"## One sparse message (density {args.density}) into one buffer's accumulator "
              "(ms, median of 5, fresh indices each time)", "",
              "| method | " + " | ".join(f"{m} (1 buffer)" for m in methods) + " |",
              "|---|" + "---:|" * len(methods)]
    for name in next(iter(methods.values())):
        lines.append(f"| {name} | " + " | ".join(f"{methods[m][name]:.3f}" for m in methods) + " |")
    lines.append("")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
