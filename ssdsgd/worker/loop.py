"""The training loop of a worker: forward/backward, then the client's push and pull, the log lines, the
end of each epoch (evaluation, checkpoint) and the end of the run (final weights, summary).

The communication of each algorithm lives in a client (ssdsgd/algorithms, contract in base.py, chosen
by make_client): StockClient for the stock-KVStore baselines, RoundClient for SSD-SGD and compressed
SSGD. The loop is the same for all: forward/backward, then `client.after_backward(step)` pushes, pulls
and updates the local weights and returns a StepRecord, which Counters sums. Setting the run up is
start.py's, evaluating evaluate.py's, counting and summarising counters.py's.
"""
import json
import os
import shutil
import time

import numpy as np

from ssdsgd.config import algorithm_of, ssd_warmup_steps
from ssdsgd.env import HEARTBEAT_ENV
from ssdsgd.errors import JobError
from ssdsgd.metrics import ACC_TAG
from ssdsgd.worker.counters import Counters, StepTimes, summarize
from ssdsgd.worker.evaluate import evaluate_if_due
from ssdsgd.worker.models import with_weights
# Scripts (bench_step, bench_host_step) build the model as the loop does, importing these from here.
from ssdsgd.worker.models import build_eval_net, build_net  # noqa: F401
from ssdsgd.worker.start import start_run


def _touch(path):
    if path:
        with open(path, "a"):
            os.utime(path, None)


def run_worker(cfg, resume=False, overwrite=False):
    import mxnet as mx

    from ssdsgd import folders
    run, held = start_run(cfg, resume, overwrite)
    bsz, total_steps, step = cfg.train.batch_size, run.total_steps, run.step
    heartbeat = os.environ.get(HEARTBEAT_ENV)
    # An algorithm's warm-up (SSD-SGD's) is synchronous; traffic after it is what its own stage costs.
    warmup_steps = ssd_warmup_steps(cfg.algorithm, run.steps_per_epoch) if algorithm_of(cfg).warmup else 0
    t_start = time.perf_counter()
    counters = Counters(warmup_steps, ACC_TAG[run.data.eval_set], time.perf_counter())
    if run.saved_counters is not None:
        counters.load(run.saved_counters)
        counters.drop_evals_from(run.start_epoch)
    run.t_start = t_start
    run.epoch_ends, run.epoch_end_seconds = 0, 0.0      # this attempt's evaluations and checkpoints
    epochs_run = run.start_epoch
    for epoch in range(run.start_epoch, cfg.train.epochs):
        if step >= total_steps:
            break
        batches = run.data.train.epoch(epoch)
        # Batches of this epoch trained before a resume (a run stopped by train.max_steps in mid-epoch):
        # drawn and dropped, so that the rest come in the uninterrupted run's order with its augmentation;
        # before the epoch's clock, and alive for the stall check (ImageNet decodes each one).
        for _ in range(step - epoch * run.steps_per_epoch):
            next(batches)
            _touch(heartbeat)
        t_epoch = time.perf_counter()
        for data_batch, label in batches:
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
        t_end = time.perf_counter()
        _end_epoch(run, counters, epoch, step, epoch_seconds)
        # Evaluation and checkpoint time: out of the next line's images/s, and timed apart for the ETA.
        spent = time.perf_counter() - t_end
        counters.leave_out_of_window(spent)
        run.epoch_ends += 1
        run.epoch_end_seconds += spent
    run.client.finish()
    run.faults.at_finish(step - run.step)
    _finish_run(run, counters, step, epochs_run, t_start)
    folders.release(held)


def _train_step(run, counters, step, data_batch, label):
    """Forward and backward on every device (the gradients summed on the host), the non-finite check,
    the client's push and pull, then the new weights onto every device: (loss, StepRecord, StepTimes)."""
    run.faults.at_step(step, run.kv)
    data_batch = run.faults.batch(step, data_batch)
    start = time.perf_counter()
    loss = run.replicas.forward_backward(run.net, run.loss_fn, data_batch, label)
    if not _finite(loss, run.params):
        _handle_nonfinite(run.cfg.train.nonfinite, loss, run.params, step, run.kv.rank, run.log)
        counters.skipped_steps += 1
    computed = time.perf_counter()
    rec = run.client.after_backward(step)
    run.replicas.scatter()
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
              f"{ips:.1f} img/s (this worker) push {human_bytes(w['push'] / w['n'])}/step "
              f"pull {human_bytes(w['pull'] / w['n'])}/step "
              f"staleness {rec.staleness}, {_progress(run, epoch, step, now)}", flush=True)
    counters.new_window(now)


def _clock(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _progress(run, epoch, step, now):
    """'41% 0:02:10 elapsed, ETA 0:03:07': this attempt's pace of training applied to the steps left,
    plus its mean time per epoch end (evaluation, checkpoint) for the epoch ends left; before the
    first epoch end that time is not known, and the ETA says it leaves evaluations out."""
    elapsed = now - run.t_start
    ends_left = -(-run.total_steps // run.steps_per_epoch) - epoch        # this epoch's end included
    eta, known = eta_seconds(elapsed - run.epoch_end_seconds, step - run.step, run.total_steps - step,
                             run.epoch_end_seconds, run.epoch_ends, ends_left)
    later = "" if known else " + evaluations"
    return f"{100 * step // max(1, run.total_steps)}% {_clock(elapsed)} elapsed, ETA {_clock(eta)}{later}"


def eta_seconds(train_seconds, steps_done, steps_left, end_seconds, ends_done, ends_left):
    """(seconds left, whether the epoch ends are in it): training at its pace so far, plus the epoch
    ends left at their mean time so far (left out while none has happened)."""
    train = train_seconds / steps_done * steps_left if steps_done else 0.0
    if not ends_done:
        return train, ends_left <= 0
    return train + end_seconds / ends_done * max(0, ends_left), True


def _end_epoch(run, counters, epoch, step, epoch_seconds):
    """The evaluation when one is due, then a checkpoint when one is due (after the evaluation, so
    that it holds the accuracy too: a run resumed from its last checkpoint has its whole result)."""
    cfg = run.cfg
    evaluate_if_due(run, counters, epoch, step, epoch_seconds)
    every = cfg.checkpoint.every_epochs
    if cfg.checkpoint.dir and every and (epoch + 1) % every == 0:
        _save_checkpoint(run, counters, epoch + 1, step)


def _finish_run(run, counters, step, epochs_run, t_start):
    """The final weights (rank 0), every worker's part file, then rank 0's summary."""
    from ssdsgd.metrics import (
        FINAL_PARAMS_FILE,
        SUMMARY_FILE,
        summary_table,
        worker_part_file,
        write_atomic,
        write_json_atomic,
        write_metrics_csv,
    )
    rank, out_dir = run.kv.rank, run.out_dir
    checkpoint = None
    if rank == 0:
        checkpoint = os.path.join(out_dir, FINAL_PARAMS_FILE)
        weights, _ = run.client.global_weights(step)
        # Whole or not at all: a full disk is one line (WriteError), not MXNet's traceback and a cut-off file.
        with_weights(run.params, weights,
                     lambda: write_atomic(checkpoint, lambda path: run.replicas.save_global(run.net, path)))
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


def _save_checkpoint(run, counters, epochs_done, step):
    import mxnet as mx

    from ssdsgd import checkpoint as ckpt
    from ssdsgd.checkpoint_dir import prune_checkpoints
    from ssdsgd.ps import commands
    cfg, kv, rank, client = run.cfg, run.kv, run.kv.rank, run.client
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
    arrays.update(run.replicas.state())
    meta = dict(meta, step=step, counters=counters.state(time.perf_counter() - run.t_start))
    ckpt.save_npz(os.path.join(directory, ckpt.worker_file(rank)), arrays, meta)
    kv._barrier()
    if rank == 0:
        ckpt.write_manifest(directory, cfg, epochs_done, step, client.plan_record(), run.out_dir)
        whole = epochs_done * run.steps_per_epoch
        part = "" if step >= whole else f" (epoch {epochs_done} in part: {step - whole + run.steps_per_epoch} of " \
                                        f"its {run.steps_per_epoch} steps; a resume continues inside it)"
        print(f"checkpoint saved: {directory}{part}", flush=True)
        for old in prune_checkpoints(cfg.checkpoint.dir, cfg.checkpoint.keep, run.steps_per_epoch):
            print(f"checkpoint deleted: {old} (checkpoint.keep: {cfg.checkpoint.keep})", flush=True)


def _finite(loss, params):
    """One host sync per step: is the loss and every gradient finite? (A sum of squares that
    overflows also counts as a fault: such a gradient would wreck the global model just the same.)"""
    import mxnet as mx
    grads = [p.grad() for p in params]
    sq = mx.nd.multi_sum_sq(*grads, num_arrays=len(grads))
    return bool(np.isfinite((sq.sum() + loss.sum()).asscalar()))


class NonFiniteError(JobError):
    """A step went NaN/Inf under train.nonfinite: fail. Its message names the step, rank and
    parameters, so the worker reports it as one line (a traceback would add nothing)."""


def nonfinite_summary(names, shown=3):
    """Where a step went non-finite, for a one-line message: the first few names (a diverging model
    is non-finite in every parameter at once; the run's metrics log keeps the whole list)."""
    if not names:
        return "sum of squared gradients overflowed"
    more = len(names) - shown
    rest = f" and {more} more parameters (all named in this rank's metrics log)" if more > 0 else ""
    return ", ".join(names[:shown]) + rest


def _handle_nonfinite(policy, loss, params, step, rank, log):
    """Stop with the step, rank and parameter names, or zero the gradients (skip the step)."""
    import mxnet as mx
    bad = [p.name for p in params if not bool(mx.nd.contrib.isfinite(p.grad()).min().asscalar())]
    loss_bad = not bool(mx.nd.contrib.isfinite(loss).min().asscalar())
    names = (["loss"] if loss_bad else []) + bad
    log.write(event="nonfinite", step=step, where=nonfinite_summary(names, shown=len(names)), policy=policy)
    what = nonfinite_summary(names)
    if policy == "fail":
        raise NonFiniteError(f"NaN/Inf at step {step} on rank {rank} in: {what} "
                             f"(train.nonfinite: fail; set it to skip to drop such steps)")
    print(f"rank {rank} step {step}: NaN/Inf in {what}; pushing a zero gradient instead", flush=True)
    for p in params:
        p.grad()[:] = 0
