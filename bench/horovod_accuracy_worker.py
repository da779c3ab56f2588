"""One Horovod rank of bench/horovod_accuracy.py: an ssdsgd SSGD job's training (config + --set overrides)
re-run with horovod.mxnet's DistributedTrainer, ending in the test accuracy of the final weights.

    horovodrun --gloo -np 2 -H localhost:2 python bench/horovod_accuracy_worker.py \
        --config configs/fmnist_resnet20_ssgd.yaml --set model.name=mlp ... --out /tmp/hvd

Everything but the communication is ssdsgd's own, read from the same config: each rank's shard and batch
order (data_from_config with cluster.workers = the Horovod size), the seeded model (build_net), the lr
schedule (schedule_from_config: warm-up, cosine, epochs x steps per epoch, train.max_steps), MXNet's
momentum SGD with train.lr, momentum and wd, and the evaluation (build_eval_net, count_correct on the
test set or validation split, batch train.batch_size). The gradient scale is the servers': ssdsgd's
dist_sync servers sum N gradients and rescale by 1/(N B); Horovod's CPU build sums them (Gloo) and the
trainer rescales by (1/N)/B, the same number when N and B are powers of two. The optimizer updates one
parameter at a time (no multi-tensor aggregation), as the servers' updater does.

Rank 0 writes <out>/result.json (final accuracy, losses, wall time) and, with --save-params, the final
weights in the form of an ssdsgd run's final.params, so the two can be compared array by array.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: ssdsgd from this checkout

RESULT_FILE = "result.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as for ssdsgd (repeatable)")
    ap.add_argument("--out", required=True, help=f"folder for rank 0's {RESULT_FILE}")
    ap.add_argument("--save-params", default=None, help="rank 0 writes the final weights here")
    return ap.parse_args(argv)


def make_trainer(cfg, params, schedule):
    """horovod.mxnet's DistributedTrainer with the stock servers' optimizer (ssdsgd/ps/server.py)."""
    import horovod.mxnet as hvd
    import mxnet as mx
    opt = mx.optimizer.SGD(learning_rate=cfg.train.lr, momentum=cfg.train.momentum, wd=cfg.train.wd,
                           lr_scheduler=schedule)
    opt.aggregate_num = 0          # one sgd_mom_update per parameter, as the servers' updater
    # By name: given a list, DistributedTrainer sorts the Parameters, which do not compare.
    return hvd.DistributedTrainer({p.name: p for p in params}, opt)


def train_steps(net, trainer, train_set, batch, total_steps):
    """ssdsgd's loop without its communication: epoch by epoch in ssdsgd's batch order until
    total_steps; the mean loss of every step."""
    from mxnet import autograd, gluon
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses, epoch = [], 0
    while len(losses) < total_steps:
        for x, y in train_set.epoch(epoch):
            if len(losses) == total_steps:
                break
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(batch)
            losses.append(float(loss.mean().asscalar()))
        epoch += 1
    return losses


def run(args):
    import horovod.mxnet as hvd
    import mxnet as mx

    from ssdsgd.config import load_config
    from ssdsgd.schedule import schedule_from_config
    from ssdsgd.worker.data import data_from_config
    from ssdsgd.worker.evaluate import count_correct
    from ssdsgd.worker.models import build_eval_net, build_net

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cfg = load_config(args.config, args.set + [f"cluster.workers={size}"])
    if cfg.algorithm.type != "ssgd" or cfg.compression.type != "none":
        raise SystemExit(f"horovod_accuracy_worker: re-runs plain SSGD only, the config has algorithm "
                         f"{cfg.algorithm.type}, compression {cfg.compression.type}")
    data = data_from_config(cfg, rank, size)
    net, params = build_net(cfg, data.num_classes, data.image_shape)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)      # equal anyway, from cfg.seed
    spe = data.train.steps_per_epoch
    schedule = schedule_from_config(cfg.train, spe)
    total = cfg.train.epochs * spe
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    trainer = make_trainer(cfg, params, schedule)
    start = time.perf_counter()
    losses = train_steps(net, trainer, data.train, cfg.train.batch_size, total)
    mx.nd.waitall()
    wall = time.perf_counter() - start
    if rank != 0:
        return None
    correct, images = count_correct(build_eval_net(cfg, net), data.test, cfg.train.batch_size)
    if args.save_params:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_params)), exist_ok=True)
        mx.nd.save(args.save_params, {name: p.data() for name, p in net._collect_params_with_prefix().items()})
    return dict(workers=size, seed=cfg.seed, steps=len(losses), steps_per_epoch=spe, batch_size=cfg.train.batch_size,
                lr=cfg.train.lr, eval_set=data.eval_set, final_acc=correct / max(1, images), losses=losses,
                final_lr=schedule(len(losses)), wall_seconds=wall)


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    if result is None:
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, RESULT_FILE), "w") as f:
        json.dump(result, f)
    print(f"horovod_accuracy_worker: {result['workers']} ranks, seed {result['seed']}, {result['steps']} steps: "
          f"final {result['eval_set']} accuracy {result['final_acc']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
