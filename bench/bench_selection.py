"""Microbenchmark of the worker's sparse encoding per step against one pass over the gradient (issue 36,
item 6; issue 62, item 5): does selection + encoding stay within 2x `np.abs` of the whole flat gradient
as the model grows from ResNet-20 (0.27 M values) to ResNet-50 (25.6 M)?

Per model the parameter shapes come from the model itself (gluoncv, pretrained=False, one forward
pass to fix the deferred shapes) and the encoders from the model's shipped SSD-SGD + top-k config
(its compression section: fusion, allocation, buffers, error feedback, momentum correction) at 1% density
(DENSITY: the config chooses its own for the link),
built by ssdsgd.compression.encoders.make_encoders exactly as the worker builds them. Each measured
step, in this order and in the same process:
  pass     np.abs(flat), flat the whole model's gradient as one float32 numpy array (a new output,
           as the expression allocates it);
  encode   every buffer's SparseEncoder.message(grads, step, rank) as the worker's push calls it,
           then mx.nd.waitall(): reading the gradient on the host, error feedback, momentum
           correction, the per-tensor quota allocation, selection, index coding and the message;
           of it, timed inside the same calls:
  read     getting the gradient to numpy: encoders.host_views (no copy, fusion ahead) or
           encoders.copy_to_host;
  memory   the Memory's calls: accumulate (error feedback and momentum correction, in one compiled
           pass, ssdsgd/compression/kernels.py; with the magnitudes a sampled search needs, or, on a
           fused step, accumulate_candidates collecting its candidates in the same pass), peek (the
           sample's magnitudes, before that pass), take and update (the values sent, forgotten);
  select   the rest, encode - read - memory: threshold, quotas, top-k, message.
The gradients are normal noise scaled per tensor by a log-uniform factor (10^-2..1, so tensors differ
in scale as real gradients do), two sets alternated so that the memory sees a changing gradient.
Reported: medians over the measured steps (after two warm-up steps) and the ratio encode / pass,
per model and per compression.selection. The kernels are compiled (or loaded from numba's cache) when
the encoders are made, before the first step, as on the worker; the manifest records numba's version.

    OMP_NUM_THREADS=1 python bench/bench_selection.py          # -> results/bench_selection/
    python bench/bench_selection.py --models resnet20 --steps 5 --out /tmp/x   # a quick look
"""
import argparse
import os
import statistics
import sys
import time

import mxnet as mx
import numba
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import write_csv, write_manifest, write_text
from ssdsgd.compression import encoders as encoders_module
from ssdsgd.compression.encoders import make_encoders
from ssdsgd.compression.memory import Memory
from ssdsgd.config import load_config
from ssdsgd.worker.models import parameter_shapes

# model -> (config whose compression section the worker would run, input shape of one sample)
MODELS = {
    "resnet20": ("configs/cifar10_resnet20_ssd_topk.yaml", (3, 32, 32)),
    "resnet50": ("configs/imagenet_resnet50_ssd_topk.yaml", (3, 224, 224)),
}
SELECTIONS = ("exact", "sampled")
DENSITY = 0.01


def fake_gradients(shapes, seed):
    """Normal noise, each tensor scaled by a log-uniform factor in [0.01, 1]."""
    rng = np.random.default_rng(seed)
    return [mx.nd.array(rng.standard_normal(s, dtype=np.float32) * np.float32(10 ** rng.uniform(-2, 0)))
            for s in shapes]


def timed(fn):
    """(wall seconds, CPU seconds of the whole process: every thread, MXNet's engine too) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def encode_step(buffers, encoders, grads, step):
    """One step's messages, as the worker's push makes them."""
    for b, e in zip(buffers, encoders):
        e.message([grads[i] for i in b.params], step, 0)
    mx.nd.waitall()


class PartTimer:
    """Wall and CPU seconds spent inside chosen functions, summed until reset: installed on the
    module (encoders' host_views, copy_to_host) or class (Memory's methods) the encoder calls. A call
    made inside another timed call (Memory.take calling update) is counted once, in the outer one."""

    def __init__(self):
        self.spent = {}
        self.saved = []
        self.depth = 0

    def wrap(self, owner, name, part):
        original = getattr(owner, name)
        self.saved.append((owner, name, original))

        def timed_call(*args, **kwargs):
            if self.depth:
                return original(*args, **kwargs)
            self.depth += 1
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                w, c = self.spent.get(part, (0.0, 0.0))
                self.spent[part] = (w + time.perf_counter() - wall, c + time.process_time() - cpu)
        setattr(owner, name, timed_call)

    def take(self, part):
        return self.spent.pop(part, (0.0, 0.0))

    def restore(self):
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)


def bench_model(name, selection, steps, seed):
    config, sample_shape = MODELS[name]
    cfg = load_config(os.path.join(ROOT, config), [f"compression.selection={selection}",
                                                   f"compression.density={DENSITY}"])
    comp = cfg.compression
    shapes = parameter_shapes(cfg.model.name, cfg.data.num_classes or 10, sample_shape)   # CIFAR-10: null classes
    buffers, encoders = make_encoders(shapes, cfg.cluster.servers, comp, 0, momentum=cfg.train.momentum,
                                      seed=seed)
    sets = [fake_gradients(shapes, seed + i) for i in range(2)]
    flats = [np.concatenate([g.asnumpy().reshape(-1) for g in grads]) for grads in sets]
    scratch = np.empty_like(flats[0])
    parts = PartTimer()
    parts.wrap(encoders_module, "host_views", "read")
    parts.wrap(encoders_module, "copy_to_host", "read")
    for method in ("accumulate", "accumulate_candidates", "peek", "take", "update"):
        parts.wrap(Memory, method, "memory")
    rows = []
    try:
        for step in range(steps + 2):
            grads = sets[step % 2]
            row = {"pass": timed(lambda: np.abs(flats[step % 2])),
                   "warm": timed(lambda: np.abs(flats[step % 2], out=scratch)),
                   "encode": timed(lambda: encode_step(buffers, encoders, grads, step))}
            row["read"], row["memory"] = parts.take("read"), parts.take("memory")
            row["select"] = tuple(e - r - m for e, r, m in zip(row["encode"], row["read"], row["memory"]))
            if step >= 2:
                rows.append(row)
    finally:
        parts.restore()
    med = {f"{k}_{clock}": statistics.median(r[k][i] for r in rows) for k in rows[0]
           for i, clock in enumerate(("wall", "cpu"))}
    return {"model": name, "selection": selection, "values": int(flats[0].size), "buffers": len(buffers),
            "sent": sum(b.topk_count for b in buffers), "steps": len(rows),
            **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            **{f"ratio_{clock}": med[f"encode_{clock}"] / med[f"pass_{clock}"] for clock in ("wall", "cpu")},
            **{f"ratio_select_{clock}": med[f"select_{clock}"] / med[f"pass_{clock}"] for clock in ("wall", "cpu")},
            **{f"ratio_warm_{clock}": med[f"encode_{clock}"] / med[f"warm_{clock}"] for clock in ("wall", "cpu")}}


def table(rows, clock="cpu"):
    """Medians of one clock: cpu (the process's CPU time, what a shared machine distorts least) or wall."""
    lines = ["| model | values | buffers | selection | np.abs (ms) | np.abs, out= (ms) | encode (ms) "
             "| of it read (ms) | memory (ms) | select (ms) | encode / np.abs | encode / np.abs out= "
             "| select / np.abs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = {k: r[f"{k}_{clock}_ms"] for k in ("pass", "warm", "encode", "read", "memory", "select")}
        lines.append(f"| {r['model']} | {r['values']:,} | {r['buffers']} | {r['selection']} | {ms['pass']:.1f} "
                     f"| {ms['warm']:.1f} | {ms['encode']:.1f} | {ms['read']:.1f} | {ms['memory']:.1f} "
                     f"| {ms['select']:.1f} | {r[f'ratio_{clock}']:.2f} | {r[f'ratio_warm_{clock}']:.2f} "
                     f"| {r[f'ratio_select_{clock}']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--selections", nargs="+", default=list(SELECTIONS), choices=list(SELECTIONS))
    p.add_argument("--steps", type=int, default=10, help="measured steps per model and selection")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench_selection"))
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for name in args.models:
        for selection in args.selections:
            rows.append(bench_model(name, selection, args.steps, args.seed))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "bench.csv"), rows)
    write_text(os.path.join(args.out, "table.md"), "CPU time of the process (median per step)\n\n" + table(rows)
               + "\n\nWall time (median per step)\n\n" + table(rows, "wall"))
    write_manifest(args.out, [os.path.join(ROOT, MODELS[m][0]) for m in args.models],
                   environment={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "numba": numba.__version__},
                   load_average_before=load_before, load_average_after=os.getloadavg(),
                   note="the machine was shared with other jobs (2 cores; the load averages above); medians "
                        "over the measured steps")
    print(table(rows))
    print(table(rows, "wall"))


if __name__ == "__main__":
    main()
