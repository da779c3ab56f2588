"""Setting a worker's run up: the KVStore, the run folder (chosen by the front end, or by rank 0 under
another launcher), the data, the model, the client, and on --resume this worker's checkpoint.
"""
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import mxnet as mx
import numpy as np
from mxnet import gluon

from ssdsgd import checkpoint as ckpt
from ssdsgd import folders, provenance
from ssdsgd.algorithms import create_kvstore, make_client
from ssdsgd.algorithms.auto_density import choose_density
from ssdsgd.algorithms.base import Client
from ssdsgd.config import Config, dump_config, resumed_density
from ssdsgd.env import COMMAND_ENV, LOCKED_ENV, RUN_DIR_ENV
from ssdsgd.faults import FaultPlan
from ssdsgd.metrics import CONFIG_FILE, RUN_MANIFEST_FILE, MetricsLog, write_json_atomic
from ssdsgd.ps.commands import num_servers
from ssdsgd.ps.eval_tally import EvalTally
from ssdsgd.run_id import run_id
from ssdsgd.schedule import schedule_from_config
from ssdsgd.worker.data import data_from_config
from ssdsgd.worker.datasets import DataBundle
from ssdsgd.worker.devices import DeviceReplicas, HostParameter, worker_contexts
from ssdsgd.worker.models import build_eval_net, build_net


@dataclass(frozen=True)
class Run:
    """What one worker's job is made of, built once by start_run and passed to the loop's helpers (which
    keep what changes while it trains, this attempt's clock included, in their Counters)."""
    cfg: Config
    kv: mx.kvstore.KVStore
    out_dir: str                          # the run folder
    log: MetricsLog                       # this rank's metrics
    data: DataBundle                      # this worker's shard of the training set, the whole test set
    net: gluon.Block                      # the model on every device
    eval_net: gluon.Block                 # what evaluates it: net, or its static-graph twin
    params: list[HostParameter]           # the host arrays the client pushes, pulls and updates
    replicas: DeviceReplicas              # the model's replicas on this worker's devices
    loss_fn: gluon.loss.Loss
    schedule: Callable[[int], float]      # the learning rate of a step
    client: Client                        # the algorithm's communication
    total_steps: int                      # of the whole run, resumes included
    steps_per_epoch: int
    start_epoch: int                      # where this attempt starts: 0, or a resume's epoch
    start_step: int                       # the steps done before this attempt
    saved_counters: Optional[dict]        # the resumed checkpoint's Counters.state(), or None
    faults: FaultPlan                     # test-only fault injection
    tally: Optional[EvalTally]            # the shared evaluation's tally (train.eval_workers: all), or None


def start_run(cfg, resume, overwrite):
    """The KVStore, the run folder, the data, the model and the client, set up (and resumed)."""
    # The kvstore must exist before we know our rank; its type depends only on the config.
    kv = create_kvstore(cfg)
    rank, nworkers = kv.rank, kv.num_workers
    if nworkers != cfg.cluster.workers:   # ssdsgd.train refused a mismatch with DMLC_NUM_WORKER: not expected here
        raise RuntimeError(f"cluster.workers is {cfg.cluster.workers} but the job has {nworkers} workers")
    held, out_dir, point, cfg = _prepare_run_folder(cfg, kv, resume, overwrite)
    data = data_from_config(cfg, rank, nworkers)
    if rank == 0:
        for note in (*cfg.ignored, *data.notes):
            print(f"note: {note}", flush=True)
    steps_per_epoch = data.train.steps_per_epoch
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)

    contexts = worker_contexts(cfg.cluster.device, cfg.train.devices)
    net, gluon_params = build_net(cfg, data.num_classes, data.image_shape, contexts)
    replicas = DeviceReplicas.of_net(net, gluon_params, contexts)
    params = replicas.host                 # what the client pushes, pulls and updates: host arrays
    eval_net = build_eval_net(cfg, net)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    resume_dir, manifest = point if resume else (None, None)
    start_epoch, step, saved, saved_counters = 0, 0, None, None
    if resume:
        start_epoch, step, saved, saved_counters = _load_checkpoint(point, rank, replicas, steps_per_epoch,
                                                                    total_steps)
    # A resumed run appends to its metrics, dropping what a failed attempt logged after the checkpoint.
    log = MetricsLog(out_dir, rank, keep_until_step=step if resume else None,
                     tensorboard=cfg.log.tensorboard and rank == 0)
    choice = None
    if cfg.compression.density == "auto" and ckpt.round_based(cfg):
        cfg, choice = choose_density(cfg, kv, [p.shape for p in params], lambda: _time_backward(
            net, loss_fn, data.train, replicas, with_forward=True))
        if rank == 0:
            print(choice.line(), flush=True)
            dump_config(cfg, os.path.join(out_dir, CONFIG_FILE))     # the run's config: with the density chosen
    schedule = schedule_from_config(cfg.train, steps_per_epoch)
    client = make_client(cfg, kv, params, schedule, log, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                         measure_backward=lambda: _time_backward(net, loss_fn, data.train, replicas))
    client.setup(resume_dir, saved[1] if saved else None, manifest.get("plan") if resume else None)
    if choice is not None:
        client.stats["density_choice"] = choice.record()
    if saved is not None:
        client.load_state(*saved)
    replicas.scatter()                     # the weights setup pulled (or the checkpoint's) onto every device
    tally = EvalTally(kv) if cfg.train.eval_workers == "all" else None
    run = Run(cfg=cfg, kv=kv, out_dir=out_dir, log=log, data=data, net=net, eval_net=eval_net, params=params,
              replicas=replicas, loss_fn=loss_fn, schedule=schedule, client=client, total_steps=total_steps,
              steps_per_epoch=steps_per_epoch, start_epoch=start_epoch, start_step=step,
              saved_counters=saved_counters, faults=FaultPlan(rank), tally=tally)
    if rank == 0:
        _print_start(run, steps_per_epoch)
    return run, held


def _load_checkpoint(point, rank, replicas, steps_per_epoch, total_steps):
    """This worker's part of the checkpoint to resume from (point: its folder and manifest, verified):
    the weights and every replica's BatchNorm statistics loaded; (epochs done, steps done, (arrays, meta) for
    the client, the saved counters)."""
    resume_dir, manifest = point
    arrays, meta = ckpt.load_npz(os.path.join(resume_dir, ckpt.worker_file(rank)))
    replicas.load_state(arrays)
    ckpt.check_against_run(manifest, resume_dir, steps_per_epoch, meta)
    epochs_done, step = manifest["epochs_done"], manifest["step"]
    saved_counters = meta.pop("counters")
    # train.max_steps can stop a run inside an epoch; its checkpoint (named for that epoch) then holds
    # part of it, and a resume that trains further goes on inside that epoch (run_worker skips the
    # batches done). One with nothing left to train (a restart after the stop's checkpoint) ends as
    # the stopped run did, with its evaluation.
    partial = step < epochs_done * steps_per_epoch and step < total_steps
    start_epoch = epochs_done - 1 if partial else epochs_done
    if rank == 0:
        within = step - start_epoch * steps_per_epoch
        part = f"; epoch {start_epoch} goes on after its first {within} of {steps_per_epoch} steps" if partial else ""
        print(f"resuming from {resume_dir}: {start_epoch} epochs, {step} steps done{part}", flush=True)
    return start_epoch, step, (arrays, meta), saved_counters


def _prepare_run_folder(cfg, kv, resume, overwrite):
    """(folder locks, run folder, the verified checkpoint to resume from or None, cfg: with a resumed run's
    density if it was auto: config.resumed_density). Under ssdsgd.launch.run the
    front end chose the run folder and holds the locks (SSDSGD_RUN_DIR); under another launcher rank 0
    does both (folders.prepare, locks held until this process ends) and the other workers, after a
    barrier, take the folder the resumed checkpoint records or the one `latest` points at. Rank 0 writes
    the run's config: config.yaml for a new run, config.resume-step<N>.yaml for each resume (the first
    one stays)."""
    held, out_dir, point = [], os.environ.get(RUN_DIR_ENV), None
    if not os.environ.get(LOCKED_ENV):
        # Started by another launcher than ssdsgd.launch.run: nobody opens a file in the run folder before
        # rank 0 has chosen it and holds the locks.
        if kv.rank == 0:
            held, out_dir = folders.prepare(cfg, resume, overwrite, "rank 0 of a job started without ssdsgd.launch.run")
        kv._barrier()
    if resume:
        point = ckpt.resume_point(cfg)            # (folder, manifest), verified once per worker
        cfg = resumed_density(cfg, point[1])      # density: auto goes on with the density the run chose
    if not os.environ.get(LOCKED_ENV) and kv.rank != 0:
        # the folder rank 0 chose: the resumed run's, or else the new one `latest` points at
        out_dir = (folders.resume_run_folder(cfg, point[1])[0] if resume else None) or folders.latest_run_folder(cfg)
    if not out_dir or not os.path.isdir(out_dir):
        raise RuntimeError(f"the run folder {out_dir!r} does not exist (the front end or rank 0 makes it)")
    if kv.rank == 0:
        name, made = CONFIG_FILE, RUN_MANIFEST_FILE
        if resume:
            name = f"config.resume-step{point[1]['step']}.yaml"
            made = folders.unused_name(out_dir, f"manifest.resume-step{point[1]['step']}", ".json")
        dump_config(cfg, os.path.join(out_dir, name))
        _write_run_record(os.path.join(out_dir, made), name, point[0] if resume else None,
                          run_id(out_dir))
    return held, out_dir, point, cfg


def _write_run_record(path, config_file, resumed_from, folder_id):
    """How this run (or this resume of it) was made: the user's command (config file and every --set;
    ssdsgd-run passes it down) and each role's, the commit, the machine and the date; config_file: the
    validated config beside it. Under another launcher the user's command is not known here: the roles'
    command stands for it. folder_id: the run folder's run id (ssdsgd.run_id), which its checkpoints record."""
    role_command = [os.path.basename(sys.executable), "-m", "ssdsgd.train", *sys.argv[1:]]
    command = json.loads(os.environ[COMMAND_ENV]) if os.environ.get(COMMAND_ENV) else role_command
    write_json_atomic(path, provenance.record(command, role_command=role_command, config=config_file,
                                              resumed_from=resumed_from, run_id=folder_id))


def data_line(cfg, data):
    """'data: cifar10 (binary form in /data/cifar10): 50,000 training images, 10,000 test images'."""
    source = f" ({data.source})" if data.source else ""
    return (f"data: {cfg.data.dataset}{source}: {data.train.num_samples:,} training images, "
            f"{data.test.num_samples:,} {data.eval_set} images")


def _print_start(run, steps_per_epoch):
    cfg = run.cfg
    print(data_line(cfg, run.data), flush=True)
    print(f"{cfg.name}: {cfg.algorithm.type} + compression {cfg.compression.type}, {run.kv.num_workers} workers, "
          f"{num_servers(run.kv)} servers, {steps_per_epoch} steps/epoch, {run.total_steps} steps, "
          f"{sum(p.data().size for p in run.params)} parameters", flush=True)


def _time_backward(net, loss_fn, train_set, replicas, repeats=3, with_forward=False):
    """Median seconds of one backward pass (with_forward: forward and backward) on a real batch, over every
    device, with the gradients summed on the host (for the fusion cost model and density: auto).

    BatchNorm running statistics are restored afterwards, so the probe leaves no trace."""
    saved = [[a.copy() for a in per_replica] for per_replica in replicas.aux_arrays()]
    data, label = next(iter(train_set.epoch(0)))
    times = []
    for _ in range(repeats):
        mx.nd.waitall()
        t0 = time.perf_counter()
        losses = replicas.forward(net, loss_fn, data, label)
        mx.nd.waitall()
        t1 = time.perf_counter()
        replicas.backward(losses)
        mx.nd.waitall()
        times.append(time.perf_counter() - (t0 if with_forward else t1))
    for per_replica, copies in zip(replicas.aux_arrays(), saved):
        for a, s in zip(per_replica, copies):
            s.copyto(a)
    return float(np.median(times))
