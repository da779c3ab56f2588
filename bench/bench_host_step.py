"""Microbenchmark of a sparse SSD-SGD worker's host work per step (issue 10): what after_backward
spends besides waiting for the servers, on this machine's CPU, in one process with no network.

The worker's three pieces of the steps-delay stage, on the real client (RoundClient with a stand-in
KVStore) and a real model's gradients:
  land    a landed ring pull: read the ring, bring the replica up to date, load the weights into
          the parameters and refresh the local optimizer (RoundClient._apply_pull: Downlink.land);
  local   the local update with this worker's gradient (RoundClient._local_update);
  encode  error feedback, top-k and the mailbox message (the buffer's SparseEncoder.message).
The servers' side is ssdsgd.ps.rounds.BufferState with the client's own downlink ring: each round sums
this worker's message and the same message from rank 1.

`land` and the gradient copy that starts `encode` are also timed the way the client did them
before commit b467dae ("per parameter": a slice, a reshape and a copy per parameter, then the
local optimizer's per-parameter refresh, GlobalMomentum.refresh; a concat of reshaped gradients),
the land on copies of the same weights and states fed the same rounds; both
ways must end with the same float32 bits (checked). The two ways alternate step by step, so a
slower moment of the machine hits both. The local update is one sgd_mom_update per parameter
either way.
Reported: the median milliseconds per step of each piece, and a forward and backward pass of the
model in the same process for scale.

    OMP_NUM_THREADS=1 python bench/bench_host_step.py [--config configs/fmnist_resnet20_ssd_topk.yaml] \
        [--set compression.density=0.1 ...] [--steps 40] [--out results/bench_host_step]
"""
import argparse
import copy
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import write_csv, write_manifest, write_text

# The time-to-accuracy setting of the Fashion-MNIST runs of docs/results.md.
DEFAULT_SETS = ["compression.density=0.1", "compression.momentum_masking=false", "model.hybridize=false"]


class _StandInKV:
    """What the client's planning reads of a KVStore: two workers, this one rank 0."""
    num_workers = 2
    rank = 0


def per_parameter_refresh(buffer, opt, weights, states, flat, rounds):
    """The client's refresh before commit b467dae: per parameter of the buffer, copy its piece of the
    flat weights in, then the local optimizer's refresh of that parameter."""
    import mxnet as mx
    source = mx.nd.array(flat, dtype=np.float32)
    for i, off, n in zip(buffer.params, buffer.offsets, buffer.sizes):
        source[off:off + n].reshape(weights[i].shape).copyto(weights[i])
        opt.refresh(states[i], weights[i], rounds)


def build(cfg_path, sets):
    import mxnet as mx
    from mxnet import autograd

    from ssdsgd.algorithms.policy import density_stage
    from ssdsgd.algorithms.ssd import RoundClient
    from ssdsgd.config import load_config
    from ssdsgd.ps.ring import DownlinkRing, RingLayout
    from ssdsgd.schedule import LRSchedule
    from ssdsgd.worker.loop import build_net
    cfg = load_config(cfg_path, sets)
    if cfg.algorithm.type != "ssd" or cfg.compression.downlink != "sparse" or cfg.compression.buffers != "one":
        raise SystemExit("error: the benchmark needs an ssd config with compression.downlink: sparse and "
                         "compression.buffers: one")
    if cfg.algorithm.local.optimizer != "global_momentum":
        raise SystemExit("error: the per-parameter baseline is GlobalMomentum's; "
                         "set algorithm.local.optimizer=global_momentum")
    shape = tuple(cfg.data.shape)
    net, params = build_net(cfg, 10, shape)
    x = mx.nd.random.uniform(shape=(cfg.train.batch_size,) + shape)
    y = mx.nd.array([i % 10 for i in range(cfg.train.batch_size)])
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    def fwd_bwd():
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        mx.nd.waitall()
    fwd_bwd()
    steps_per_epoch = 39
    total = steps_per_epoch * cfg.train.epochs
    schedule = LRSchedule(cfg.train.lr_schedule.type, base_lr=cfg.train.lr, total_updates=total,
                          final_lr=0.0)
    client = RoundClient(_StandInKV(), params, cfg, schedule, log=None, total_steps=total,
                         steps_per_epoch=steps_per_epoch)
    client._plan()
    if len(client.buffers) != 1 or client.downlink.plans[0] is None:
        raise SystemExit("error: the plan has no sparse downlink ring for its buffer")
    flat = np.concatenate([params[i].data().asnumpy().ravel() for i in client.buffers[0].params])   # buffer order
    replica = client.downlink.replicas[0]
    replica.bind(flat, version=client.warmup)
    client.versions = [client.warmup]
    stage = density_stage(client.warmup, steps_per_epoch, len(client.stages))
    ring = client.downlink.plans[0]["rings"][stage]
    server = copy.deepcopy(replica)
    b = client.stages[stage][0][0]
    server.formats = [b.wire]
    server.ring = DownlinkRing(RingLayout.of_plan(b.size, client.downlink.plans[0], ring))
    return client, params, server, stage, fwd_bwd


def measure(client, params, server, stage, fwd_bwd, steps):
    from ssdsgd.compression.encoders import copy_to_host, flatten
    from ssdsgd.ps.ring import RingLayout, read_ring
    grads = [p.grad() for p in params]
    pushed = [grads[i] for i in client.buffers[0].params]      # the buffer's order, as the worker pushes
    encoder = client.stages[stage][1][0]
    ring_buf = client.downlink.ring_bufs[0][stage]
    down = client.downlink.plans[0]
    layout = RingLayout.of_plan(client.buffers[0].size, down, down["rings"][stage])
    # the per-parameter way works on copies of the same weights, states and replica; the local update
    # (the same either way) runs on both
    old_w = [p.data().copy() for p in params]
    old_s = [s.copy() for s in client.local_states]
    old_opt = copy.deepcopy(client.local_opt)
    old_rep = copy.deepcopy(client.downlink.replicas[0])

    def old_local():
        for i, (w, g, s) in enumerate(zip(old_w, grads, old_s)):
            old_opt.update(i, w, g, s)

    def old_land():
        old_rep.catch_up(read_ring(ring_buf.asnumpy(), layout, from_round=old_rep.version))
        per_parameter_refresh(client.buffers[0], old_opt, old_w, old_s, old_rep.weights, 1)

    host = np.empty(encoder.buffer.size, np.float32)

    def flat_copy():          # what encode() does first: the gradients into one host array
        copy_to_host(pushed, host, encoder.offsets, encoder.buffer.sizes)

    pieces = {"land_flat": lambda: client._apply_pull(0), "land_per_parameter": old_land,
              "local": client._local_update, "local_on_the_copies": old_local,
              "gradient_copy_flat": flat_copy,
              "gradient_copy_per_parameter": lambda: flatten(pushed).asnumpy()}
    rows = []
    for i in range(steps):
        step = client.warmup + i
        row = {"step": i, "encode_ms": _timed(lambda: encoder.message(pushed, step, 0))}
        msg = encoder.message(pushed, step, 0).asnumpy()       # what the server gets (memory moved on: fine)
        server.receive(msg)
        msg[1] = 1                                              # the other worker's push of the round
        if server.receive(msg) != 1:
            raise SystemExit(f"error: round {step} was not applied on the server")
        ring_buf[:] = server.ring.array
        client.downlink.pulled[0] = stage
        # the order the client runs them in (land, then the local update), each way first every other step
        order = ["land_flat", "land_per_parameter", "local", "local_on_the_copies", "gradient_copy_flat",
                 "gradient_copy_per_parameter"]
        if i % 2:
            order = [order[j ^ 1] for j in range(len(order))]
        for name in order:
            row[f"{name}_ms"] = _timed(pieces[name])
        if i % 4 == 0:
            row["forward_backward_ms"] = _timed(fwd_bwd)
        rows.append(row)
    _check_same_end([p.data() for p in params] + client.local_states, old_w + old_s)
    return rows


def _check_same_end(flat_way, per_parameter_way):
    import mxnet as mx
    mx.nd.waitall()
    for a, b in zip(flat_way, per_parameter_way):
        if not np.array_equal(a.asnumpy().view(np.uint32), b.asnumpy().view(np.uint32)):
            raise SystemExit("error: the flat and the per-parameter ways ended with different weights or states")


def _timed(fn):
    import mxnet as mx
    t = time.perf_counter()
    fn()
    mx.nd.waitall()
    return 1e3 * (time.perf_counter() - t)


COMPARED = [("land", "land_per_parameter_ms", "land_flat_ms"),
            ("gradient copy (part of encode)", "gradient_copy_per_parameter_ms", "gradient_copy_flat_ms")]


def table(rows, args, sets):
    names = {k for r in rows for k in r if k.endswith("_ms")}
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in names}
    fwd_steps = sum(1 for r in rows if "forward_backward_ms" in r)
    lines = [f"Host work per step of a sparse SSD-SGD worker, {os.path.relpath(args.config, ROOT)} with "
             f"{' '.join(sets) or 'no overrides'}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, one "
             f"process, no network; median over {len(rows)} steps", "",
             "| piece | per parameter (before b467dae) | now | now / before |", "|---|---|---|---|"]
    for name, before, now in COMPARED:
        lines.append(f"| {name} | {med[before]:.2f} ms | {med[now]:.2f} ms | {med[now] / med[before]:.2f}x |")
    lines += ["", f"local update (one sgd_mom_update per parameter, unchanged): {med['local_ms']:.2f} ms; "
              f"encode as a whole (gradient copy, error feedback, top-k, message): {med['encode_ms']:.2f} ms; "
              f"land + local + encode now: {med['land_flat_ms'] + med['local_ms'] + med['encode_ms']:.2f} ms; "
              f"forward and backward of the model in the same process: {med['forward_backward_ms']:.0f} ms "
              f"(median of {fwd_steps})."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "fmnist_resnet20_ssd_topk.yaml"))
    ap.add_argument("--set", dest="sets", action="append", default=None, metavar="KEY=VALUE",
                    help=f"config overrides (default: {' '.join(DEFAULT_SETS)})")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="results/bench_host_step")
    args = ap.parse_args(argv)
    if args.steps < 4:
        ap.error("--steps must be at least 4 (one forward and backward every 4 steps)")
    sets = DEFAULT_SETS if args.sets is None else args.sets
    client, params, server, stage, fwd_bwd = build(args.config, sets)
    rows = measure(client, params, server, stage, fwd_bwd, args.steps)
    os.makedirs(args.out, exist_ok=True)      # only now: a refused config leaves no empty results folder
    write_csv(os.path.join(args.out, "steps.csv"), rows)
    text = table(rows, args, sets)
    write_text(os.path.join(args.out, "table.md"), text)
    write_manifest(args.out, [args.config], sets=sets)
    print(text)


if __name__ == "__main__":
    main()
