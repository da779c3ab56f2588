"""Evaluation of the global weights: on rank 0 (or each worker its share, train.eval_workers: all) after
an epoch, on the test set or the validation split, with the BatchNorm statistics optionally
recomputed for those weights first (train.eval_bn_batches).
"""
import itertools
import os
import time

import mxnet as mx
from mxnet import autograd, gluon

from ssdsgd.env import HEARTBEAT_ENV
from ssdsgd.worker.models import aux_params, with_weights


def count_correct(net, test_set, batch_size, part=0, parts=1, ctx=None):
    """(correct predictions, images) over the test set's batches part, part + parts, ..., run on ctx
    (default: where the batches are)."""
    correct, total = 0, 0
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    for data, label in test_set.batches(batch_size, part, parts):
        pred = net(data if ctx is None else data.as_in_context(ctx)).argmax(axis=1).as_in_context(label.context)
        correct += int((pred == label.astype(pred.dtype)).sum().asscalar())
        total += data.shape[0]
        if heartbeat:   # progress for the launcher too: an evaluation is no pause of the job
            with open(heartbeat, "a"):
                os.utime(heartbeat, None)
    mx.nd.waitall()
    return correct, total


def evaluate_if_due(run, counters, epoch, step, epoch_seconds):
    """On rank 0, or with train.eval_workers: all on every worker (its share), rank 0 reporting the
    summed counts."""
    cfg = run.cfg
    last = step >= run.total_steps or epoch == cfg.train.epochs - 1
    if not ((epoch + 1) % cfg.train.eval_every_epochs == 0 or last):
        return
    rank, shared = run.kv.rank, run.tally is not None
    if rank != 0 and not shared:
        return
    t_eval = time.perf_counter()
    bn_batches = None
    if cfg.train.eval_bn_batches:
        bn_batches = itertools.islice(run.data.train.epoch(epoch), cfg.train.eval_bn_batches)
    part, parts = (rank, run.kv.num_workers) if shared else (0, 1)
    (correct, images), pulled = evaluate_global(run.net, run.params, run.client, run.data.test,
                                                cfg.train.batch_size, step, bn_batches, part, parts,
                                                eval_net=run.eval_net, replicas=run.replicas)
    if shared:
        run.log.write(epoch=epoch, step=step, eval_share={"correct": correct, "images": images})
        run.tally.push(correct, images)
        if rank != 0:
            return
        correct, images = run.tally.wait_sum(run.data.test.num_samples)
    acc = correct / max(1, images)
    counters.add_eval(epoch, acc, pulled)
    # eval_seconds: how long rank 0 spent on this evaluation (with eval_workers: all, until every
    # worker's share was in), so a time-to-accuracy clock can leave evaluation out. Training stands
    # still that long where every worker evaluates or waits for rank 0 (eval_workers: all, or a
    # synchronous variant); see scripts/time_to_accuracy.py.
    eval_seconds = time.perf_counter() - t_eval
    # partial_epoch: a train.max_steps stop inside the epoch; a resume evaluates the whole epoch again.
    partial = {"partial_epoch": True} if step < (epoch + 1) * run.steps_per_epoch else {}
    run.log.write(epoch=epoch, step=step, epoch_seconds=epoch_seconds, eval_seconds=eval_seconds,
                  **{f"{counters.tag}_acc": acc}, **partial)
    print(f"epoch {epoch} {run.data.eval_set} accuracy {acc:.4f} (epoch {epoch_seconds:.1f} s, "
          f"evaluation {eval_seconds:.1f} s)", flush=True)


def evaluate_global(net, params, client, test_set, batch_size, steps_done, bn_batches=None, part=0, parts=1,
                    eval_net=None, replicas=None):
    """((correct, images), bytes pulled) of the global weights on the test set's share `part` of
    `parts` (count_correct). bn_batches: training batches on which to recompute the BatchNorm
    statistics for those weights first (None: use this worker's running statistics). eval_net: what
    runs the test batches (build_eval_net: net, or its static-graph twin sharing net's parameters);
    default net. The statistics are always recomputed through net, which can record a backward pass.
    replicas: the worker's DeviceReplicas (params are then its host parameters): the evaluation runs on
    the first device, with the first replica's statistics."""
    weights, pulled = client.global_weights(steps_done)
    eval_net = net if eval_net is None else eval_net
    ctx = replicas.first if replicas is not None else None

    def run():
        if bn_batches is None:
            return count_correct(eval_net, test_set, batch_size, part, parts, ctx)
        with bn_stats_restored(net, ctx):
            recompute_bn_stats(net, bn_batches, ctx)
            return count_correct(eval_net, test_set, batch_size, part, parts, ctx)
    return with_weights(params, weights, run, replicas.scatter if replicas is not None else None), pulled


class bn_stats_restored:
    """Context manager: the BatchNorm running statistics (on ctx; default the current context) are put
    back on exit."""

    def __init__(self, net, ctx=None):
        self.arrays = [p.data(ctx) for p in aux_params(net)]

    def __enter__(self):
        self.saved = [a.copy() for a in self.arrays]

    def __exit__(self, *exc):
        for a, s in zip(self.arrays, self.saved):
            s.copyto(a)


def recompute_bn_stats(net, batches, ctx=None):
    """Set every BatchNorm layer's running mean and variance to the average over `batches` of the
    batch statistics the current weights produce.

    Rank 0's running statistics were gathered on its local weights over the last few dozen steps;
    under SSD-SGD the global weights being evaluated are not those weights, and early in training
    (large steps) even SSGD's statistics lag the weights. In MXNet 1.9's CPU BatchNorm the running
    statistics are updated in the backward pass (r <- m*r + (1-m)*batch stat), so each batch is
    run forward and backward from zeroed statistics and its batch statistics read back as r/(1-m).
    The backward pass overwrites the parameters' gradient arrays: call between steps only. ctx: the
    replica whose statistics are recomputed (default the current context)."""
    layers = batchnorm_layers(net)
    sums = [[mx.nd.zeros_like(bn.running_mean.data(ctx)), mx.nd.zeros_like(bn.running_var.data(ctx))]
            for bn in layers]
    count = 0
    for data, _ in batches:
        for bn in layers:
            bn.running_mean.data(ctx)[:] = 0
            bn.running_var.data(ctx)[:] = 0
        with autograd.record():
            out = net(data if ctx is None else data.as_in_context(ctx))
        out.backward()
        # The backward pass writes the running statistics without declaring them to the engine as
        # outputs, so reads queued after it can run first: wait for it explicitly.
        mx.nd.waitall()
        for bn, (mean_sum, var_sum) in zip(layers, sums):
            keep = 1.0 - bn._kwargs["momentum"]
            mean_sum += bn.running_mean.data(ctx) / keep
            var_sum += bn.running_var.data(ctx) / keep
        count += 1
    if count == 0:
        raise ValueError("recompute_bn_stats: no batches")
    for bn, (mean_sum, var_sum) in zip(layers, sums):
        (mean_sum / count).copyto(bn.running_mean.data(ctx))
        (var_sum / count).copyto(bn.running_var.data(ctx))
    mx.nd.waitall()


def batchnorm_layers(net):
    found = []

    def walk(block):
        # Frozen layers (use_global_stats) never update their statistics: leave them alone.
        if isinstance(block, gluon.nn.BatchNorm) and not block._kwargs.get("use_global_stats"):
            found.append(block)
        for child in block._children.values():
            walk(child)
    walk(net)
    return found
