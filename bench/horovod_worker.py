"""One Horovod rank of bench/bench_horovod.py: the benchmark config's model, data and per-worker batch, trained
with horovod.mxnet's DistributedTrainer (ring all-reduce over Gloo), started by `horovodrun --gloo`.

    horovodrun --gloo -np 2 -H h1:1,h2:1 python bench/horovod_worker.py --config configs/bench_cifar_resnet20.yaml \
        --steps 40 --compression fp16 --out /tmp/hvd

The model, its seeded initial weights and each rank's shard of the data are ssdsgd's own (build_net,
data_from_config), so only the communication differs from an ssdsgd job. Rank 0's weights are broadcast first
(they equal every rank's anyway, from cfg.seed). Every rank writes <out>/rank<r>.json: the wall-clock time
(time.time()) at the end of every step, each step synced by reading its loss, and the steady-state images/s
(all ranks' images per step over the median step time from --steady-from on, and over the window's mean).

Horovod is a benchmark dependency (bench/install_horovod.sh); nothing in ssdsgd needs it.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: ssdsgd from this checkout

COMPRESSIONS = ("none", "fp16")


def steady_rates(times, images_per_step, steady_from):
    """(median, window) images/s from the end times of steps 1..n: images_per_step over the median of the
    step times after step `steady_from`, and the window's steps over its seconds; (None, None) if too short."""
    window = times[steady_from - 1:] if steady_from >= 1 else times
    if len(window) < 2:
        return None, None
    gaps = [b - a for a, b in zip(window, window[1:])]
    span = window[-1] - window[0]
    median = statistics.median(gaps)
    return (images_per_step / median if median > 0 else None,
            images_per_step * len(gaps) / span if span > 0 else None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--steady-from", type=int, default=10, help="first step of the steady window")
    ap.add_argument("--compression", choices=COMPRESSIONS, default="none")
    ap.add_argument("--out", required=True, help="folder for rank<r>.json")
    return ap.parse_args(argv)


def train(args):
    import horovod.mxnet as hvd
    import mxnet as mx
    from mxnet import autograd, gluon

    from ssdsgd.config import load_config
    from ssdsgd.worker.data import data_from_config
    from ssdsgd.worker.models import build_net

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cfg = load_config(args.config, args.set + [f"cluster.workers={size}"])
    data = data_from_config(cfg, rank, size)
    net, params = build_net(cfg, data.num_classes, data.image_shape)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
    opt = {"learning_rate": cfg.train.lr, "momentum": cfg.train.momentum, "wd": cfg.train.wd}
    # By name: given a list, DistributedTrainer sorts the Parameters, which do not compare.
    trainer = hvd.DistributedTrainer({p.name: p for p in params}, "sgd", opt, compression=compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    batch = cfg.train.batch_size
    times, loss_value, epoch = [], None, 0
    start = time.time()
    while len(times) < args.steps:
        for x, y in data.train.epoch(epoch):
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(batch)
            loss_value = float(loss.mean().asscalar())     # syncs the step
            times.append(time.time())
            if len(times) == args.steps:
                break
        epoch += 1
    mx.nd.waitall()
    median, window = steady_rates(times, batch * size, args.steady_from)
    return dict(rank=rank, workers=size, batch_size=batch, steps=len(times), compression=args.compression,
                steady_from=args.steady_from, start=start, times=times, final_loss=loss_value,
                images_per_sec_median=median, images_per_sec_window=window,
                images_per_sec_whole=batch * size * len(times) / (times[-1] - start))


def main(argv=None):
    args = parse_args(argv)
    result = train(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    print(f"horovod_worker rank {result['rank']}/{result['workers']}: "
          f"{result['images_per_sec_median'] or 0:.1f} img/s (median step), loss {result['final_loss']:.4f}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
