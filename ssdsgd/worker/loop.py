"""Worker role: data, model, the training loop, evaluation on rank 0, metrics and the summary.

The communication of each algorithm lives in a client (ssdsgd/algorithms, contract in base.py, chosen
by make_client): StockClient for the stock-KVStore baselines, RoundClient for SSD-SGD and compressed
SSGD. The loop is the same for all: forward/backward, then `client.after_backward(step)` pushes, pulls
and updates the local weights and returns a StepRecord, which Counters sums.
"""
import itertools
import json
import os
import shutil
import socket
import time
from typing import NamedTuple

import numpy as np

from ssdsgd.config import ssd_warmup_steps
from ssdsgd.env import HEARTBEAT_ENV, LOCKED_ENV, RUN_DIR_ENV
from ssdsgd.metrics import ACC_TAG


def _touch(path):
    if path:
        with open(path, "a"):
            os.utime(path, None)


def build_net(cfg, num_classes, image_shape):
    """The model with its seeded initial weights, and its trainable parameters in a fixed order.

    Every worker builds the same weights from cfg.seed (only rank 0's reach the servers anyway)."""
    import mxnet as mx
    from mxnet import autograd

    from ssdsgd.worker.models import build_model
    mx.random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    net = build_model(cfg.model.name, num_classes)
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2))
    # Materialise parameter shapes with a recorded forward (an inference-mode forward leaves oneDNN
    # layouts that kv.init cannot read).
    with autograd.record():
        net(mx.nd.zeros((2,) + tuple(image_shape)))
    if cfg.model.hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    return net, params


def build_eval_net(cfg, net):
    """What evaluates: the hybridized net itself, or a static-graph twin of the imperative one."""
    from ssdsgd.worker.models import inference_graph
    return net if cfg.model.hybridize else inference_graph(net)


def count_correct(net, test_set, batch_size, part=0, parts=1):
    """(correct predictions, images) over the test set's batches part, part + parts, ..."""
    import mxnet as mx
    correct, total = 0, 0
    for data, label in test_set.batches(batch_size, part, parts):
        pred = net(data).argmax(axis=1)
        correct += int((pred == label.astype(pred.dtype)).sum().asscalar())
        total += data.shape[0]
    mx.nd.waitall()
    return correct, total


class Counters:
    """What the training loop counts: this worker's totals, the steps after SSD-SGD's warm-up
    (synchronous; traffic after it is what the delay stage costs), the evaluations (rank 0), and
    the window of steps since the last log line."""

    def __init__(self, warmup_steps, eval_tag, t):
        self.warmup_steps = warmup_steps
        self.tag = eval_tag                  # test, or val when a validation split is evaluated
        self.push_bytes = self.pull_bytes = self.eval_pull_bytes = 0
        self.skipped_steps = 0
        self.wait_seconds = self.train_seconds = 0.0
        # Where the steps' time went: the forward and backward pass (until the non-finite check has
        # synchronised it), and the client's after_backward (its waits for the servers included).
        self.compute_seconds = self.client_seconds = 0.0
        self.after_warmup = {"steps": 0, "push_bytes": 0, "pull_bytes": 0}
        self.staleness = {"max": None, "sum": 0, "count": 0}
        self.best_acc, self.final_acc, self.history = 0.0, 0.0, []
        self.earlier_wall_seconds = 0.0      # wall seconds of the attempts before a resume
        self.new_window(t)

    # What a checkpoint keeps, so that a resumed run's summary counts every step exactly once.
    SAVED = ("push_bytes", "pull_bytes", "eval_pull_bytes", "skipped_steps", "wait_seconds", "train_seconds",
             "compute_seconds", "client_seconds", "after_warmup", "staleness", "best_acc", "final_acc", "history")

    def state(self, wall_seconds):
        """The counters as JSON-able values, for a checkpoint taken after wall_seconds of this attempt."""
        saved = {key: getattr(self, key) for key in self.SAVED}
        saved["wall_seconds"] = self.earlier_wall_seconds + wall_seconds
        return json.loads(json.dumps(saved))

    def load(self, saved):
        """Continue from a checkpoint's counters (state())."""
        for key in self.SAVED:
            setattr(self, key, saved[key])
        self.earlier_wall_seconds = saved["wall_seconds"]

    def new_window(self, t):
        """Start the counts of the steps up to the next log line, at time t."""
        self.window = {"t": t, "images": 0, "push": 0, "pull": 0, "n": 0, "compute": 0.0, "client": 0.0}

    def add_step(self, step, rec, images, times):
        """Count step `step`, whose StepRecord is rec and StepTimes `times`."""
        self.compute_seconds += times.compute
        self.client_seconds += times.client
        self.push_bytes += rec.push_bytes
        self.pull_bytes += rec.pull_bytes
        if step >= self.warmup_steps:
            self.after_warmup["steps"] += 1
            self.after_warmup["push_bytes"] += rec.push_bytes
            self.after_warmup["pull_bytes"] += rec.pull_bytes
        if rec.wait_seconds is not None:
            self.wait_seconds += rec.wait_seconds
        if rec.staleness is not None:
            st = self.staleness
            st["max"] = rec.staleness if st["max"] is None else max(st["max"], rec.staleness)
            st["sum"] += rec.staleness
            st["count"] += 1
        w = self.window
        w["images"] += images
        w["push"] += rec.push_bytes
        w["pull"] += rec.pull_bytes
        w["compute"] += times.compute
        w["client"] += times.client
        w["n"] += 1

    def add_eval(self, epoch, acc, pulled):
        self.eval_pull_bytes += pulled
        self.best_acc, self.final_acc = max(self.best_acc, acc), acc
        self.history.append({"epoch": epoch, f"{self.tag}_acc": acc})

    def part(self, rank, steps, images):
        """This worker's figures for the summary (its worker<rank>.json)."""
        st = self.staleness
        return {"rank": rank, "host": socket.gethostname(), "steps": steps, "images": images,
                "train_seconds": self.train_seconds, "push_bytes": self.push_bytes,
                "pull_bytes": self.pull_bytes, "wait_seconds": self.wait_seconds,
                "compute_seconds": self.compute_seconds, "client_seconds": self.client_seconds,
                "skipped_steps": self.skipped_steps, "max_staleness": st["max"],
                "mean_staleness": st["sum"] / st["count"] if st["count"] else None}


def summarize(cfg, run, counters, parts, steps, epochs, wall_seconds, checkpoint):
    """The run summary (summary.json) from rank 0's counters and every worker's part. wall_seconds: of
    every attempt of the run (a resumed run adds those before the resume)."""
    from ssdsgd.ps.commands import num_servers
    tag = counters.tag
    stal = [p["max_staleness"] for p in parts if p["max_staleness"] is not None]
    return {
        "name": cfg.name, "algorithm": cfg.algorithm.type, "compression": cfg.compression.type,
        "num_workers": run.kv.num_workers, "num_servers": num_servers(run.kv), "epochs": epochs, "steps": steps,
        "steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
        "eval_set": run.data.eval_set, "final_test_acc": None, "best_test_acc": None,
        f"final_{tag}_acc": counters.final_acc, f"best_{tag}_acc": counters.best_acc,
        f"{tag}_acc_history": counters.history,
        "images_per_sec": sum(p["images"] / max(1e-9, p["train_seconds"]) for p in parts),
        "wall_seconds": wall_seconds,
        "push_bytes": counters.push_bytes, "pull_bytes": counters.pull_bytes,
        "bytes_per_step": {"push": counters.push_bytes / max(1, steps),
                           "pull": counters.pull_bytes / max(1, steps)},
        "after_warmup": counters.after_warmup,
        "eval_pull_bytes": counters.eval_pull_bytes,
        "wait_seconds": counters.wait_seconds,
        "skipped_steps": sum(p["skipped_steps"] for p in parts),
        "max_staleness": max(stal) if stal else None,
        "mean_staleness": float(np.mean([p["mean_staleness"] for p in parts
                                         if p["mean_staleness"] is not None])) if stal else None,
        "workers": parts, "checkpoint": checkpoint, "client": run.client.stats,
        "note": "push_bytes/pull_bytes are rank 0's own traffic; per-worker figures under 'workers'",
    }


class _Run:
    """What one worker's job is made of (built by _start_run), passed to the loop's helpers."""

    def __init__(self, **parts):
        self.__dict__.update(parts)


def run_worker(cfg, resume=False, overwrite=False):
    import mxnet as mx

    from ssdsgd import folders
    run, held = _start_run(cfg, resume, overwrite)
    bsz, total_steps, step = cfg.train.batch_size, run.total_steps, run.step
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    # SSD-SGD's warm-up is synchronous; traffic after it is what the delay stage costs.
    warmup_steps = ssd_warmup_steps(cfg.algorithm, run.steps_per_epoch) if cfg.algorithm.type == "ssd" else 0
    t_start = time.perf_counter()
    counters = Counters(warmup_steps, ACC_TAG[run.data.eval_set], time.perf_counter())
    if run.saved_counters is not None:
        counters.load(run.saved_counters)
    run.t_start = t_start
    epochs_run = run.start_epoch
    for epoch in range(run.start_epoch, cfg.train.epochs):
        if step >= total_steps:
            break
        t_epoch = time.perf_counter()
        for data_batch, label in run.data.train.epoch(epoch):
            if step >= total_steps:
                break
            loss, rec, times = _train_step(run, counters, step, data_batch, label)
            counters.add_step(step, rec, bsz, times)
            step += 1
            _touch(heartbeat)
            if step % cfg.log.every_steps == 0 or step == total_steps:
                _log_steps(run, counters, epoch, step, loss, rec)
        mx.nd.waitall()
        epoch_seconds = time.perf_counter() - t_epoch
        counters.train_seconds += epoch_seconds
        epochs_run = epoch + 1
        _end_epoch(run, counters, epoch, step, epoch_seconds)
    run.client.finish()
    run.faults.at_finish(step - run.step)
    _finish_run(run, counters, step, epochs_run, t_start)
    folders.release(held)


def _start_run(cfg, resume, overwrite):
    """The KVStore, the run folder, the data, the model and the client, set up (and resumed)."""
    from mxnet import gluon

    from ssdsgd import checkpoint as ckpt
    from ssdsgd.algorithms import create_kvstore, make_client
    from ssdsgd.faults import FaultPlan
    from ssdsgd.metrics import MetricsLog
    from ssdsgd.ps.eval_tally import EvalTally
    from ssdsgd.schedule import schedule_from_config
    from ssdsgd.worker.data import data_from_config
    # The kvstore must exist before we know our rank; its type depends only on the config.
    kv = create_kvstore(cfg)
    rank, nworkers = kv.rank, kv.num_workers
    if nworkers != cfg.cluster.workers:
        raise RuntimeError(f"cluster.workers is {cfg.cluster.workers} but the job has {nworkers} workers")
    held, out_dir, point = _prepare_run_folder(cfg, kv, resume, overwrite)
    data = data_from_config(cfg, rank, nworkers)
    steps_per_epoch = data.train.steps_per_epoch
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)

    net, params = build_net(cfg, data.num_classes, data.image_shape)
    eval_net = build_eval_net(cfg, net)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    resume_dir, start_epoch, step, saved, manifest, saved_counters = None, 0, 0, None, None, None
    if resume:
        resume_dir, manifest = point
        arrays, meta = ckpt.load_npz(os.path.join(resume_dir, ckpt.worker_file(rank)))
        _load_net_state(net, params, arrays)
        saved = (arrays, meta)
        ckpt.check_against_run(manifest, resume_dir, steps_per_epoch, meta)
        start_epoch, step = manifest["epochs_done"], manifest["step"]
        saved_counters = meta.pop("counters")
        if rank == 0:
            print(f"resuming from {resume_dir}: {start_epoch} epochs, {step} steps done", flush=True)
    # A resumed run appends to its metrics, dropping what a failed attempt logged after the checkpoint.
    log = MetricsLog(out_dir, rank, keep_until_step=step if resume else None,
                     tensorboard=cfg.log.tensorboard and rank == 0)
    schedule = schedule_from_config(cfg.train, steps_per_epoch)
    client = make_client(cfg, kv, params, schedule, log, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                         measure_backward=lambda: _time_backward(net, loss_fn, data.train, params))
    client.setup(resume_dir, saved[1] if saved else None, manifest.get("plan") if resume else None)
    if saved is not None:
        client.load_state(*saved)
    tally = EvalTally(kv) if cfg.train.eval_workers == "all" else None
    run = _Run(cfg=cfg, kv=kv, out_dir=out_dir, log=log, data=data, net=net, eval_net=eval_net, params=params,
               loss_fn=loss_fn,
               schedule=schedule, client=client, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
               start_epoch=start_epoch, step=step, saved_counters=saved_counters, faults=FaultPlan(rank), tally=tally)
    if rank == 0:
        _print_start(run, steps_per_epoch)
    return run, held


def _prepare_run_folder(cfg, kv, resume, overwrite):
    """(folder locks, run folder, the verified checkpoint to resume from or None). Under ssdsgd.launch.run the
    front end chose the run folder and holds the locks (SSDSGD_RUN_DIR); under another launcher rank 0
    does both (folders.prepare, locks held until this process ends) and the other workers, after a
    barrier, take the folder the resumed checkpoint records or the one `latest` points at. Rank 0 writes
    the run's config: config.yaml for a new run, config.resume-step<N>.yaml for each resume (the first
    one stays)."""
    from ssdsgd import folders
    from ssdsgd.checkpoint import resume_point
    from ssdsgd.config import dump_config
    from ssdsgd.metrics import CONFIG_FILE
    held, out_dir, point = [], os.environ.get(RUN_DIR_ENV), None
    if not os.environ.get(LOCKED_ENV):
        # Started by another launcher than ssdsgd.launch.run: nobody opens a file in the run folder before
        # rank 0 has chosen it and holds the locks.
        if kv.rank == 0:
            held, out_dir = folders.prepare(cfg, resume, overwrite, "rank 0 of a job started without ssdsgd.launch.run")
        kv._barrier()
    if resume:
        point = resume_point(cfg)              # (folder, manifest), verified once per worker
    if not os.environ.get(LOCKED_ENV) and kv.rank != 0:
        out_dir = (folders.resumed_run_folder(point[1]) if resume else None) or folders.latest_run_folder(cfg)
    if not out_dir or not os.path.isdir(out_dir):
        raise RuntimeError(f"the run folder {out_dir!r} does not exist (the front end or rank 0 makes it)")
    if kv.rank == 0:
        name = CONFIG_FILE
        if resume:
            name = f"config.resume-step{point[1]['step']}.yaml"
        dump_config(cfg, os.path.join(out_dir, name))
    return held, out_dir, point


def _print_start(run, steps_per_epoch):
    from ssdsgd.ps.commands import num_servers
    cfg = run.cfg
    print(f"{cfg.name}: {cfg.algorithm.type} + compression {cfg.compression.type}, {run.kv.num_workers} workers, "
          f"{num_servers(run.kv)} servers, {steps_per_epoch} steps/epoch, {run.total_steps} steps, "
          f"{sum(p.data().size for p in run.params)} parameters", flush=True)


class StepTimes(NamedTuple):
    compute: float       # seconds of forward, backward and the non-finite check (which waits for them)
    client: float        # seconds in the client's after_backward: its host work and its waits


def _train_step(run, counters, step, data_batch, label):
    """Forward, backward, the non-finite check, then the client's push and pull:
    (loss, StepRecord, StepTimes)."""
    from mxnet import autograd
    run.faults.at_step(step, run.kv)
    data_batch = run.faults.batch(step, data_batch)
    start = time.perf_counter()
    with autograd.record():
        loss = run.loss_fn(run.net(data_batch), label)
    loss.backward()
    if not _finite(loss, run.params):
        _handle_nonfinite(run.cfg.train.nonfinite, loss, run.params, step, run.kv.rank, run.log)
        counters.skipped_steps += 1
    computed = time.perf_counter()
    rec = run.client.after_backward(step)
    return loss, rec, StepTimes(computed - start, time.perf_counter() - computed)


def _log_steps(run, counters, epoch, step, loss, rec):
    """One metrics line (and on rank 0 one printed line) for the steps since the last one."""
    from ssdsgd.metrics import human_bytes
    w = counters.window
    mean_loss = float(loss.mean().asscalar())        # syncs the step
    now = time.perf_counter()
    ips = w["images"] / max(1e-9, now - w["t"])
    run.log.write(epoch=epoch, step=step, loss=mean_loss, images_per_sec=ips,
                  push_bytes=w["push"] / w["n"], pull_bytes=w["pull"] / w["n"],
                  compute_seconds=w["compute"] / w["n"], client_seconds=w["client"] / w["n"],
                  staleness=rec.staleness, wait_seconds=rec.wait_seconds,
                  lr=run.schedule(step), residual_norm=run.client.residual_norm())
    if run.kv.rank == 0:
        print(f"epoch {epoch} step {step}/{run.total_steps} loss {mean_loss:.4f} "
              f"{ips:.1f} img/s push {human_bytes(w['push'] / w['n'])}/step "
              f"pull {human_bytes(w['pull'] / w['n'])}/step "
              f"staleness {rec.staleness}, {_progress(run, step, now)}", flush=True)
    counters.new_window(now)


def _clock(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _progress(run, step, now):
    """'41% 0:02:10 elapsed, ETA 0:03:07': this attempt's pace so far (its evaluations included)
    applied to the steps left."""
    done, elapsed = step - run.step, now - run.t_start
    eta = elapsed / done * (run.total_steps - step) if done else 0.0
    return f"{100 * step // max(1, run.total_steps)}% {_clock(elapsed)} elapsed, ETA {_clock(eta)}"


def _end_epoch(run, counters, epoch, step, epoch_seconds):
    """The evaluation when one is due, then a checkpoint when one is due (after the evaluation, so
    that it holds the accuracy too: a run resumed from its last checkpoint has its whole result)."""
    cfg = run.cfg
    _evaluate_if_due(run, counters, epoch, step, epoch_seconds)
    every = cfg.checkpoint.every_epochs
    if cfg.checkpoint.dir and every and (epoch + 1) % every == 0:
        _save_checkpoint(run, counters, epoch + 1, step)


def _evaluate_if_due(run, counters, epoch, step, epoch_seconds):
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
    (correct, images), pulled = _evaluate_global(run.net, run.params, run.client, run.data.test,
                                                 cfg.train.batch_size, step, bn_batches, part, parts,
                                                 eval_net=run.eval_net)
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
    run.log.write(epoch=epoch, step=step, epoch_seconds=epoch_seconds, eval_seconds=time.perf_counter() - t_eval,
                  **{f"{counters.tag}_acc": acc})
    print(f"epoch {epoch} {run.data.eval_set} accuracy {acc:.4f} ({epoch_seconds:.1f} s)", flush=True)


def _finish_run(run, counters, step, epochs_run, t_start):
    """The final weights (rank 0), every worker's part file, then rank 0's summary."""
    from ssdsgd.metrics import (
        FINAL_PARAMS_FILE,
        SUMMARY_FILE,
        summary_table,
        worker_part_file,
        write_json_atomic,
        write_metrics_csv,
    )
    rank, out_dir = run.kv.rank, run.out_dir
    checkpoint = None
    if rank == 0:
        checkpoint = os.path.join(out_dir, FINAL_PARAMS_FILE)
        weights, _ = run.client.global_weights(step)
        _with_weights(run.params, weights, lambda: run.net.save_parameters(checkpoint))
    part = counters.part(rank, step, step * run.cfg.train.batch_size)
    write_json_atomic(os.path.join(out_dir, worker_part_file(rank)), part)
    run.log.close()
    run.kv._barrier()                      # every worker's part file is written
    if rank == 0:
        parts = [json.load(open(os.path.join(out_dir, worker_part_file(r)))) for r in range(run.kv.num_workers)]
        wall = counters.earlier_wall_seconds + time.perf_counter() - t_start
        summary = summarize(run.cfg, run, counters, parts, step, epochs_run, wall, checkpoint)
        write_metrics_csv(out_dir)
        write_json_atomic(os.path.join(out_dir, SUMMARY_FILE), summary)
        print(summary_table(summary), flush=True)
        print(f"run folder: {out_dir}", flush=True)


def _aux_params(net):
    return [p for p in net.collect_params().values() if p.grad_req == "null"]


def _load_net_state(net, params, arrays):
    """Local weights and BatchNorm statistics from this worker's checkpoint file."""
    for name, group in (("param", params), ("aux", _aux_params(net))):
        for i, p in enumerate(group):
            saved = arrays[f"{name}{i}"]
            if saved.shape != p.shape:
                raise RuntimeError(f"checkpoint {name}{i} has shape {saved.shape}, model has {p.shape}")
            p.data()[:] = saved


def _save_checkpoint(run, counters, epochs_done, step):
    import mxnet as mx

    from ssdsgd import checkpoint as ckpt
    from ssdsgd.ps import commands
    cfg, kv, rank, net, params, client = run.cfg, run.kv, run.kv.rank, run.net, run.params, run.client
    directory = ckpt.epoch_dir(cfg.checkpoint.dir, epochs_done)
    mx.nd.waitall()                # this worker's pushes are acknowledged: the servers have them
    if rank == 0:
        # Whatever an earlier, interrupted run left in this folder must not end up in the manifest.
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.makedirs(directory)
    kv._barrier()
    os.makedirs(directory, exist_ok=True)
    if rank == 0:
        commands.send(kv, commands.SAVE, dir=os.path.abspath(directory))
    arrays, meta = client.state()
    arrays.update({f"param{i}": p.data().asnumpy() for i, p in enumerate(params)})
    arrays.update({f"aux{i}": p.data().asnumpy() for i, p in enumerate(_aux_params(net))})
    meta = dict(meta, step=step, counters=counters.state(time.perf_counter() - run.t_start))
    ckpt.save_npz(os.path.join(directory, ckpt.worker_file(rank)), arrays, meta)
    kv._barrier()
    if rank == 0:
        ckpt.write_manifest(directory, cfg, epochs_done, step, client.plan_record(), run.out_dir)
        print(f"checkpoint saved: {directory}", flush=True)


def _finite(loss, params):
    """One host sync per step: is the loss and every gradient finite? (A sum of squares that
    overflows also counts as a fault: such a gradient would wreck the global model just the same.)"""
    import mxnet as mx
    grads = [p.grad() for p in params]
    sq = mx.nd.multi_sum_sq(*grads, num_arrays=len(grads))
    return bool(np.isfinite((sq.sum() + loss.sum()).asscalar()))


class NonFiniteError(RuntimeError):
    pass


def _handle_nonfinite(policy, loss, params, step, rank, log):
    """Stop with the step, rank and parameter names, or zero the gradients (skip the step)."""
    import mxnet as mx
    bad = [p.name for p in params if not bool(mx.nd.contrib.isfinite(p.grad()).min().asscalar())]
    loss_bad = not bool(mx.nd.contrib.isfinite(loss).min().asscalar())
    what = ", ".join((["loss"] if loss_bad else []) + bad) or "sum of squared gradients overflowed"
    log.write(event="nonfinite", step=step, where=what, policy=policy)
    if policy == "fail":
        raise NonFiniteError(f"NaN/Inf at step {step} on rank {rank} in: {what} "
                             f"(train.nonfinite: fail; set it to skip to drop such steps)")
    print(f"rank {rank} step {step}: NaN/Inf in {what}; pushing a zero gradient instead", flush=True)
    for p in params:
        p.grad()[:] = 0


def _time_backward(net, loss_fn, train_set, params, repeats=3):
    """Median seconds of one backward pass on a real batch (for the fusion cost model).

    BatchNorm running statistics are restored afterwards, so the probe leaves no trace."""
    import mxnet as mx
    from mxnet import autograd
    aux = _aux_params(net)
    saved = [p.data().copy() for p in aux]
    data, label = next(iter(train_set.epoch(0)))
    times = []
    for _ in range(repeats):
        with autograd.record():
            loss = loss_fn(net(data), label)
        mx.nd.waitall()
        t0 = time.perf_counter()
        loss.backward()
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
    for p, s in zip(aux, saved):
        s.copyto(p.data())
    return float(np.median(times))


def _with_weights(params, weights, fn):
    """Run fn with the given weights loaded into params, then restore the local weights."""
    if weights is None:
        return fn()
    saved = [p.data().copy() for p in params]
    for p, w in zip(params, weights):
        w.copyto(p.data())
    try:
        return fn()
    finally:
        for p, s in zip(params, saved):
            s.copyto(p.data())


def _evaluate_global(net, params, client, test_set, batch_size, steps_done, bn_batches=None, part=0, parts=1,
                     eval_net=None):
    """((correct, images), bytes pulled) of the global weights on the test set's share `part` of
    `parts` (count_correct). bn_batches: training batches on which to recompute the BatchNorm
    statistics for those weights first (None: use this worker's running statistics). eval_net: what
    runs the test batches (build_eval_net: net, or its static-graph twin sharing net's parameters);
    default net. The statistics are always recomputed through net, which can record a backward pass."""
    weights, pulled = client.global_weights(steps_done)
    eval_net = net if eval_net is None else eval_net

    def run():
        if bn_batches is None:
            return count_correct(eval_net, test_set, batch_size, part, parts)
        with _bn_stats_restored(net):
            recompute_bn_stats(net, bn_batches)
            return count_correct(eval_net, test_set, batch_size, part, parts)
    return _with_weights(params, weights, run), pulled


class _bn_stats_restored:
    """Context manager: the BatchNorm running statistics (and gradients) are put back on exit."""

    def __init__(self, net):
        self.arrays = [p.data() for p in _aux_params(net)]

    def __enter__(self):
        self.saved = [a.copy() for a in self.arrays]

    def __exit__(self, *exc):
        for a, s in zip(self.arrays, self.saved):
            s.copyto(a)


def recompute_bn_stats(net, batches):
    """Set every BatchNorm layer's running mean and variance to the average over `batches` of the
    batch statistics the current weights produce.

    Rank 0's running statistics were gathered on its local weights over the last few dozen steps;
    under SSD-SGD the global weights being evaluated are not those weights, and early in training
    (large steps) even SSGD's statistics lag the weights. In MXNet 1.9's CPU BatchNorm the running
    statistics are updated in the backward pass (r <- m*r + (1-m)*batch stat), so each batch is
    run forward and backward from zeroed statistics and its batch statistics read back as r/(1-m).
    The backward pass overwrites the parameters' gradient arrays: call between steps only."""
    import mxnet as mx
    from mxnet import autograd

    layers = _batchnorm_layers(net)
    sums = [[mx.nd.zeros_like(bn.running_mean.data()), mx.nd.zeros_like(bn.running_var.data())]
            for bn in layers]
    count = 0
    for data, _ in batches:
        for bn in layers:
            bn.running_mean.data()[:] = 0
            bn.running_var.data()[:] = 0
        with autograd.record():
            out = net(data)
        out.backward()
        # The backward pass writes the running statistics without declaring them to the engine as
        # outputs, so reads queued after it can run first: wait for it explicitly.
        mx.nd.waitall()
        for bn, (mean_sum, var_sum) in zip(layers, sums):
            keep = 1.0 - bn._kwargs["momentum"]
            mean_sum += bn.running_mean.data() / keep
            var_sum += bn.running_var.data() / keep
        count += 1
    if count == 0:
        raise ValueError("recompute_bn_stats: no batches")
    for bn, (mean_sum, var_sum) in zip(layers, sums):
        (mean_sum / count).copyto(bn.running_mean.data())
        (var_sum / count).copyto(bn.running_var.data())
    mx.nd.waitall()


def _batchnorm_layers(net):
    from mxnet import gluon
    found = []

    def walk(block):
        # Frozen layers (use_global_stats) never update their statistics: leave them alone.
        if isinstance(block, gluon.nn.BatchNorm) and not block._kwargs.get("use_global_stats"):
            found.append(block)
        for child in block._children.values():
            walk(child)
    walk(net)
    return found
