"""Microbenchmark of a worker's host side with several devices (ssdsgd/worker/devices.py): what it costs per
step to sum the replicas' gradients into host memory (gather) and to write the host weights back to every
replica (scatter), on CPU replicas (cpu(1) ... cpu(D); on GPUs the copies cross PCIe instead).

  transfer  at ResNet-50's parameter shapes (25.6 M values), D = 1, 2 and 4 replicas: gather and scatter
            as the worker does them (buckets of consecutive parameters, one flat vector per device and
            bucket), against the same per tensor (a copy to the host and an add per tensor and replica;
            a copy per tensor and replica back);
  overlap   one ResNet-20 training step (batch 32 per replica) on D = 2 replicas: forward and backward
            alone, then with the gather, in buckets (the worker's) and as one bucket; the difference is
            the gather time the step does not hide behind backward.
Medians over --repeats; in every repeat each variant runs once, in turn, after one warm-up call each.

    OMP_NUM_THREADS=1 python bench/bench_devices.py                  # -> results/bench_devices/
    python bench/bench_devices.py --repeats 3 --out /tmp/x           # a quick look
"""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from ssdsgd.lean_mxnet import import_mxnet
mx = import_mxnet()
from mxnet import autograd, gluon
from scripts.gpu_check import medians_ms, parameters_of
from scripts.results_io import results_folder, write_csv, write_manifest, write_text
from ssdsgd.worker.devices import HOST, DeviceReplicas
from ssdsgd.worker.models import build_model, parameter_shapes


def per_tensor(params, contexts):
    """(gather, scatter) done tensor by tensor, into host arrays of the same shapes."""
    host_w = [mx.nd.zeros(p.shape, ctx=HOST) for p in params]
    host_g = [mx.nd.zeros(p.shape, ctx=HOST) for p in params]

    def gather():
        for p, g in zip(params, host_g):
            p.grad(contexts[0]).copyto(g)
            for c in contexts[1:]:
                g += p.grad(c).as_in_context(HOST)

    def scatter():
        for p, w in zip(params, host_w):
            for c in contexts:
                w.copyto(p.data(c))
    return gather, scatter


MODELS = {"resnet50": ("resnet50_v1", 1000, (3, 224, 224)), "resnet20": ("cifar_resnet20_v1", 10, (3, 32, 32))}


def transfer_rows(model, repeats):
    shapes = parameter_shapes(*MODELS[model])
    rows = []
    for d in (1, 2, 4):
        contexts = [mx.cpu(i) for i in range(1, d + 1)]
        params = parameters_of(shapes, contexts)
        replicas = DeviceReplicas(params, [], contexts)
        gather, scatter = per_tensor(params, contexts)
        ms = medians_ms({"gather_ms": replicas.gather, "scatter_ms": replicas.scatter,
                         "per_tensor_gather_ms": gather, "per_tensor_scatter_ms": scatter}, repeats)
        row = {"part": "transfer", "model": model, "replicas": d, "buckets": len(replicas.buckets), **ms}
        rows.append(row)
        print(row, flush=True)
        del params, replicas
    return rows


def overlap_rows(repeats, batch_per_replica=32, bucket_values=1 << 15):
    """ResNet-20's 0.27 M values make one bucket at the worker's default; bucket_values here cuts them into
    several so that the overlap can be seen at this size."""
    contexts = [mx.cpu(1), mx.cpu(2)]
    net = build_model("cifar_resnet20_v1", 10)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    net.hybridize(static_alloc=True, static_shape=True)
    net(mx.nd.zeros((2, 3, 32, 32), ctx=contexts[0]))
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    batch = batch_per_replica * len(contexts)
    data, label = mx.nd.random.uniform(shape=(batch, 3, 32, 32)), mx.nd.array(np.arange(batch) % 10)
    ways = {"one bucket": DeviceReplicas.of_net(net, params, contexts, bucket_values=1 << 30),
            "buckets": DeviceReplicas.of_net(net, params, contexts, bucket_values=bucket_values)}

    def step(replicas=None):
        autograd.backward(next(iter(ways.values())).forward(net, loss_fn, data, label))
        if replicas is not None:
            replicas.gather()
    ms = medians_ms({"alone": step, **{name: (lambda r=r: step(r)) for name, r in ways.items()}}, repeats)
    rows = [{"part": "overlap", "model": "resnet20", "replicas": 2, "buckets": 0, "step_ms": ms["alone"],
             "exposed_gather_ms": 0.0}]
    for name, replicas in ways.items():
        rows.append({"part": "overlap", "model": "resnet20", "replicas": 2, "buckets": len(replicas.buckets),
                     "step_ms": ms[name], "exposed_gather_ms": ms[name] - ms["alone"]})
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench_devices"))
    ap.add_argument("--note", default="", help="said in the manifest and the summary (e.g. other jobs ran)")
    ap.add_argument("--transfer-model", choices=sorted(MODELS), default="resnet50",
                    help="the parameter shapes the transfers are timed at")
    args = ap.parse_args(argv)
    out = results_folder(args.out)
    rows = transfer_rows(args.transfer_model, args.repeats)
    rows += overlap_rows(args.repeats)
    write_csv(os.path.join(out, "table.csv"), rows)
    lines = ["# Gather and scatter per step on CPU replicas (medians, ms)", ""]
    if args.note:
        lines += [f"Note: {args.note}", ""]
    lines += [f"| {args.transfer_model} size | moves a device | gather | scatter | per tensor: gather | scatter |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "transfer":
            lines.append(f"| {r['replicas']} replicas | {r['buckets']} | {r['gather_ms']:.1f} | {r['scatter_ms']:.1f} "
                         f"| {r['per_tensor_gather_ms']:.1f} | {r['per_tensor_scatter_ms']:.1f} |")
    lines += ["", "| ResNet-20 step, 2 replicas | buckets | step | gather not hidden |", "|---|---|---|---|"]
    for r in rows:
        if r["part"] == "overlap":
            what = "forward + backward" if not r["buckets"] else "with the gather"
            lines.append(f"| {what} | {r['buckets'] or '-'} | {r['step_ms']:.1f} | {r['exposed_gather_ms']:.1f} |")
    write_text(os.path.join(out, "summary.md"), "\n".join(lines) + "\n")
    write_manifest(out, [], repeats=args.repeats, note=args.note)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
