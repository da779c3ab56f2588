"""Check a machine's devices before training on them: run this first on one GPU host.

    python scripts/gpu_check.py --devices gpu:4            # 4 GPUs per worker, as train.devices: 4
    python scripts/gpu_check.py --devices cpu:2 --sizes resnet20   # the same on 2 CPU contexts (the tests)
    python scripts/gpu_check.py --devices gpu:4 --out DIR  # also write DIR/table.csv and its manifest

Checks, each PASS or FAIL (exit 1 if any fails):
  answers  every device computes and hands a result back;
  sum      the gradients of a batch split over the devices and summed on the host equal one CPU
           context's gradients of the whole batch (a model without BatchNorm; float tolerance);
  jobs     a 1-server 1-worker job per algorithm (SSGD, SSD-SGD, SSD-SGD + top-k 1%) on the devices
           gives the losses of the same job on the CPU over its first steps;
and measurements (no pass or fail): training images/s of ResNet-20 on the devices; per step at ResNet-20
and ResNet-50 size, the milliseconds of the gather (the gradients summed into host memory), of the
scatter (the host weights to every device) and of the worker's top-k 1% encoding.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.* and ssdsgd from this checkout
import numpy as np
from ssdsgd.lean_mxnet import import_mxnet
mx = import_mxnet()
from mxnet import gluon

from scripts.results_io import job_command, read_jsonl, results_folder, run_folder, write_csv, write_manifest
from ssdsgd.worker.devices import HOST, DeviceReplicas, gpu_build

JOB_CONFIGS = {"ssgd": "configs/demo_digits_ssgd.yaml", "ssd": "configs/demo_digits_ssd.yaml",
               "ssd_topk": "configs/demo_digits_ssd_topk.yaml"}
JOB_STEPS = 5
# Loss agreement of a job on the devices with the CPU job: the replicas' sum and the devices' kernels
# round differently, and the difference grows a little with each step.
LOSS_RTOL = 1e-3
SIZES = {"resnet20": ("cifar_resnet20_v1", (3, 32, 32), 10), "resnet50": ("resnet50_v1", (3, 224, 224), 1000)}


def parse_devices(text):
    """'gpu:4' -> [gpu(0) .. gpu(3)]; 'cpu:2' -> [cpu(1), cpu(2)] (as train.devices places CPU replicas)."""
    kind, _, count = text.partition(":")
    if kind not in ("cpu", "gpu") or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected cpu:N or gpu:N, got {text!r}")
    n = int(count)
    return kind, n, ([mx.gpu(i) for i in range(n)] if kind == "gpu" else [mx.cpu(i) for i in range(1, n + 1)])


def _mlp(contexts, seed=0):
    from ssdsgd.worker.models import build_model
    mx.random.seed(seed)
    net = build_model("mlp", 10)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    net(mx.nd.zeros((1, 1, 8, 8), ctx=contexts[0]))
    return net, [p for p in net.collect_params().values() if p.grad_req != "null"]


def check_answers(contexts):
    bad = [str(c) for c in contexts if (mx.nd.arange(1000, ctx=c) * 2).sum().asscalar() != 999000]
    return not bad, "every device answered" if not bad else f"wrong answers from {', '.join(bad)}"


def check_sum(contexts):
    rng = np.random.RandomState(0)
    data, label = mx.nd.array(rng.rand(64, 1, 8, 8)), mx.nd.array(rng.randint(0, 10, 64))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    grads = []
    for ctxs in ([HOST], contexts):
        net, params = _mlp(ctxs)
        replicas = DeviceReplicas.of_net(net, params, ctxs)
        replicas.forward_backward(net, loss_fn, data, label)
        grads.append(np.concatenate([h.grad().asnumpy().ravel() for h in replicas.host]))
    err = float(np.abs(grads[1] - grads[0]).max() / max(1e-12, np.abs(grads[0]).max()))
    return err < 1e-4, f"largest difference {err:.1e} of the largest gradient value"


def _job_losses(config, sets, log_dir, name):
    cmd = job_command(os.path.join(ROOT, config), name, log_dir,
                      ["model.name=mlp", "cluster.workers=1", f"train.max_steps={JOB_STEPS}", "log.every_steps=1",
                       "train.eval_every_epochs=1000", "log.tensorboard=false", *sets])
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        return None, (out.stdout + out.stderr).strip().splitlines()[-1:]
    run_dir = run_folder(out.stdout, log_dir, name)
    return [r["loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r], None


def check_jobs(kind, count, log_dir):
    results = []
    for alg, config in JOB_CONFIGS.items():
        warm = ["algorithm.warmup_iters=1"] if alg != "ssgd" else []     # local updates from the second step
        base, why = _job_losses(config, warm, log_dir, f"{alg}_cpu")
        mine, why_mine = _job_losses(config, [*warm, f"cluster.device={kind}", f"train.devices={count}"], log_dir,
                                     f"{alg}_{kind}{count}")
        if base is None or mine is None:
            results.append((alg, False, f"the job failed: {' '.join(why or why_mine)}"))
            continue
        ok = len(base) == len(mine) == JOB_STEPS and np.allclose(mine, base, rtol=LOSS_RTOL, atol=0)
        results.append((alg, ok, "losses " + ", ".join(f"{a:.5f}/{b:.5f}" for a, b in zip(mine, base))
                        + " (devices/CPU)"))
    return results


def medians_ms(fns, repeats):
    """{name: median ms} of each fn, called in turn in every repeat (a slow moment of the machine hits them
    all), after one warm-up call each (the first call allocates, and on GPUs tunes cuDNN)."""
    times = {name: [] for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            mx.nd.waitall()
            t0 = time.perf_counter()
            fn()
            mx.nd.waitall()
            if r:
                times[name].append(1000 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def parameters_of(shapes, contexts):
    """Gluon parameters of the given shapes on the contexts (random weights and gradients), as a model's."""
    params = []
    for i, shape in enumerate(shapes):
        p = gluon.Parameter(f"p{i}", shape=shape)
        p.initialize(mx.init.Normal(0.01), ctx=contexts)
        for g in p.list_grad():
            g[:] = mx.nd.random.normal(shape=shape, ctx=g.context)
        params.append(p)
    return params


def transfer_ms(shapes, contexts, repeats):
    """(gather ms, scatter ms): medians per step of DeviceReplicas at these parameter shapes."""
    replicas = DeviceReplicas(parameters_of(shapes, contexts), [], contexts)
    ms = medians_ms({"gather": replicas.gather, "scatter": replicas.scatter}, repeats)
    return ms["gather"], ms["scatter"]


def encode_ms(shapes, repeats):
    """Median ms of the worker's top-k 1% encoding of one step (the shipped top-k config's compression)."""
    from ssdsgd.compression.encoders import make_stages, time_encoding
    from ssdsgd.config import load_config
    comp = load_config(os.path.join(ROOT, "configs/cifar10_resnet20_ssd_topk.yaml"),
                       ["compression.density=0.01"]).compression
    buffers, encoders = make_stages(shapes, 1, comp, 0, momentum=0.9)[-1]
    return 1000 * time_encoding(buffers, encoders, shapes, repeats=repeats)


def images_per_sec(contexts, batch, steps):
    from ssdsgd.worker.models import build_model
    net = build_model("cifar_resnet20_v1", 10)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    net.hybridize(static_alloc=True, static_shape=True)
    net(mx.nd.zeros((2, 3, 32, 32), ctx=contexts[0]))
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    replicas = DeviceReplicas.of_net(net, params, contexts)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    data, label = mx.nd.random.uniform(shape=(batch, 3, 32, 32)), mx.nd.array(np.arange(batch) % 10)

    def step():
        replicas.forward_backward(net, loss_fn, data, label)
        replicas.scatter()
    return batch / (medians_ms({"step": step}, steps)["step"] / 1000)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=parse_devices, required=True, help="gpu:N or cpu:N")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (medians)")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"model sizes to time transfers at ({', '.join(SIZES)})")
    ap.add_argument("--out", help="a results folder for table.csv and manifest.json")
    args = ap.parse_args(argv)
    sizes = args.sizes.split(",")
    if not set(sizes) <= set(SIZES):
        ap.error(f"--sizes: expected some of {', '.join(SIZES)}, got {args.sizes!r}")
    kind, count, contexts = args.devices
    if kind == "gpu" and not gpu_build():
        print(f"gpu_check: this MXNet ({mx.__version__}) was built without CUDA: install a GPU build (README: "
              f"GPUs)", file=sys.stderr)
        return 2
    if kind == "gpu" and mx.context.num_gpus() < count:
        print(f"gpu_check: {count} GPUs asked for, {mx.context.num_gpus()} found", file=sys.stderr)
        return 2
    rows, failed = [], 0

    def report(check, ok, detail):
        nonlocal failed
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {check:<14} {detail}", flush=True)
        rows.append({"check": check, "result": "pass" if ok else "fail", "detail": detail})

    report("answers", *check_answers(contexts))
    report("sum", *check_sum(contexts))
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as log_dir:
        for alg, ok, detail in check_jobs(kind, count, log_dir):
            report(f"job {alg}", ok, detail)

    def measure(what, value, unit):
        print(f"      {what:<32} {value:10.1f} {unit}", flush=True)
        rows.append({"check": what, "result": f"{value:.3f}", "detail": unit})

    batch = 32 * count
    measure(f"resnet20 training, batch {batch}", images_per_sec(contexts, batch, args.repeats), "images/s")
    from ssdsgd.worker.models import parameter_shapes
    for size in sizes:
        model, sample, classes = SIZES[size]
        shapes = parameter_shapes(model, classes, sample)
        gather, scatter = transfer_ms(shapes, contexts, args.repeats)
        measure(f"{size} gather", gather, "ms/step")
        measure(f"{size} scatter", scatter, "ms/step")
        measure(f"{size} top-k 1% encoding", encode_ms(shapes, args.repeats), "ms/step")
    if args.out:
        out = results_folder(args.out)
        write_csv(os.path.join(out, "table.csv"), rows)
        write_manifest(out, [], devices=f"{kind}:{count}")
    print(f"gpu_check: {'all checks passed' if not failed else f'{failed} checks FAILED'} on {kind}:{count}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
