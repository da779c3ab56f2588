"""Microbenchmark of one worker's compute per step: forward and backward of a model on one batch,
imperative against hybridized (`model.hybridize`), on this machine's CPU; with --task eval, the
inference forward pass of an evaluation batch instead, imperative against the static graph.

Why: on some CPUs MXNet 1.9.1's hybridized graph (static_alloc, as the worker hybridizes it) trains
slower than the imperative model, and a job's epoch time follows. This tells which mode to use here.
An imperative model (`model.hybridize: false`) is still evaluated through a static graph that shares
its parameters (ssdsgd.worker.models.inference_graph); --task eval measures what that saves.

Each mode runs in a fresh process (`--copies 2` runs two at once, as the two workers of a job on
2 cores do), builds and initialises the model as ssdsgd.worker.loop does, takes --warmup untimed steps,
then times --steps steps of record, forward, loss, backward and waitall. Reported: the median step
time per mode and its ratio to the imperative median.

    OMP_NUM_THREADS=1 python bench/bench_step.py [--model cifar_resnet20_v1] [--batch 128] \
        [--copies 1 2] [--task train|eval] [--out results/bench_step]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import stop_on_sigterm, write_csv, write_manifest, write_text

MODES = ("imperative", "hybridized")


def child(mode, task, model, batch, shape, warmup, steps):
    """Time `steps` training steps (task train) or evaluation batches (task eval: forward, argmax) in
    this process; print one JSON list of seconds."""
    from types import SimpleNamespace

    from ssdsgd.lean_mxnet import import_mxnet
    mx = import_mxnet()                 # each copy is a process of its own: MXNet without SciPy's imports
    from mxnet import autograd

    from ssdsgd.worker.loop import build_eval_net, build_net
    hybridize = mode == "hybridized" and task == "train"
    cfg = SimpleNamespace(seed=0, model=SimpleNamespace(name=model, hybridize=hybridize))
    net, _ = build_net(cfg, 10, shape)
    # task eval: the imperative net itself, or the static graph the worker evaluates it through
    infer = build_eval_net(cfg, net) if mode == "hybridized" else net
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.random.uniform(shape=(batch,) + shape)
    y = mx.nd.array([i % 10 for i in range(batch)])
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        if task == "train":
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
        else:
            infer(x).argmax(axis=1)
        mx.nd.waitall()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    print(json.dumps(times))


def cpu_name():
    """The CPU's model name and which of the vector extensions oneDNN may pick kernels by it has."""
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile") if f in flags]
    return f"{name} ({' '.join(shown)})" if shown else name


def run_mode(args, mode, copies):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--task", args.task, "--model", args.model,
           "--batch", str(args.batch), "--shape", args.shape, "--warmup", str(args.warmup),
           "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(copies)]
    deadline = time.monotonic() + args.timeout
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(0.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                raise SystemExit(f"error: the {mode} benchmark ({copies} process(es) at once) did not finish "
                                 f"within --timeout {args.timeout:g} s") from None
    finally:
        for proc in procs:  # on a timeout, an error or a stop signal, no copy outlives the benchmark
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rows = []
    for copy, (proc, out) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise SystemExit(f"error: the {mode} benchmark process (copy {copy}) exited with {proc.returncode}")
        for step, seconds in enumerate(json.loads(out.strip().splitlines()[-1])):
            rows.append({"mode": mode, "copies": copies, "copy": copy, "step": step, "seconds": seconds})
    return rows


def table(rows, args):
    what = ("Forward + backward" if args.task == "train" else
            "Evaluation (inference forward and argmax; hybridized = the static-graph twin)")
    unit, units = ("step", "steps") if args.task == "train" else ("batch", "batches")
    lines = [f"{what} of {args.model}, batch {args.batch}, input {args.shape}, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, CPU: {cpu_name()}; "
             f"median over {args.steps} timed {units} per process after {args.warmup} untimed", "",
             f"| processes at once | mode | median s/{unit} | vs imperative |", "|---|---|---|---|"]
    for copies in args.copies:
        medians = {m: statistics.median(r["seconds"] for r in rows if r["mode"] == m and r["copies"] == copies)
                   for m in MODES}
        for mode in MODES:
            lines.append(f"| {copies} | {mode} | {medians[mode]:.3f} | "
                         f"{medians[mode] / medians['imperative']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cifar_resnet20_v1")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--shape", default="3,32,32", help="one image's shape, C,H,W")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--copies", type=int, nargs="+", default=[1, 2],
                    help="how many benchmark processes run at once (one measurement per value)")
    ap.add_argument("--timeout", type=float, default=900, help="per measurement, seconds")
    ap.add_argument("--task", choices=("train", "eval"), default="train",
                    help="time training steps, or evaluation batches (imperative vs the static graph)")
    ap.add_argument("--out", default="results/bench_step")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        ap.error(f"--shape: expected three positive integers C,H,W, got {args.shape!r}")
    for flag, value, least in (("--batch", args.batch, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--copies", min(args.copies), 1)):
        if value < least:
            ap.error(f"{flag}: must be at least {least}, got {value}")
    if args.child:
        child(args.child, args.task, args.model, args.batch, shape, args.warmup, args.steps)
        return 0
    stop_on_sigterm()
    rows = []
    for copies in args.copies:
        for mode in MODES:
            print(f"{mode}, {copies} process(es) at once ...", flush=True)
            rows += run_mode(args, mode, copies)
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "steps.csv"), rows)
    text = table(rows, args)
    write_text(os.path.join(args.out, "table.md"), text)
    write_manifest(args.out, [])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
