"""`ssdsgd-run --config FILE [--set k=v ...] [--resume] [--dry-run]`: one command for a whole job.

Reads the `cluster` section and starts scheduler, servers and workers through the launcher, each
running `python -m ssdsgd.train` with the same config and overrides.
"""
import ipaddress
import json
import os
import shlex
import signal
import sys

import yaml

# Called through their modules (ckpt.latest, folders.prepare, ...): the tests stand in for some of their functions.
from ssdsgd import checkpoint as ckpt
from ssdsgd import checkpoint_dir, folders
from ssdsgd.cli import config_from_args, parse_args
from ssdsgd.config import ROOTED_DATASETS, density_note
from ssdsgd.env import COMMAND_ENV, LOCKED_ENV, RUN_DIR_ENV
from ssdsgd.errors import JobError
from ssdsgd.launch.hosts import is_host_list, read_hosts
from ssdsgd.launch.launcher import run_job
from ssdsgd.launch.launcher_log import messages_also_in, open_launcher_log
from ssdsgd.launch.plan import interface_ip, pick_port, scheduler_address
from ssdsgd.launch.spares import HostPool
from ssdsgd.launch.ssh import SshConfigError, resolve_hosts, ssh_options
from ssdsgd.launch.stoppable import wait_unless_stopped
from ssdsgd.launch.usage import UsageError
from ssdsgd.paths import file_problem
from ssdsgd.worker.data import DataError, check_data
from ssdsgd.worker.model_names import ModelError, check_model_name


def preflight(cfg):
    """Problems that can be found before any process starts; None if there are none. The data set is read
    once, as rank 0 will read it."""
    try:
        check_model_name(cfg.model.name)
    except ModelError as err:
        return str(err)
    if cfg.cluster.device == "gpu" and cfg.cluster.launcher == "local":
        # (ssh hosts have their own MXNet: a worker there says so when it starts.)
        # Imported here: devices.py imports MXNet (seconds), which only this check of the front end needs.
        from ssdsgd.worker.devices import DeviceError, check_gpu_build
        try:
            check_gpu_build()
        except DeviceError as err:
            return str(err)
    root = cfg.data.root
    if cfg.data.dataset in ROOTED_DATASETS and not os.path.isdir(root):
        what = "is a file, not a folder" if os.path.exists(root) else "does not exist"
        return (f"data.root: {root} {what} (put the {cfg.data.dataset} files in that folder; "
                f"nothing is downloaded)")
    # Read the data once here, as rank 0 will (digits and synthetic: count it): a missing, damaged or too
    # small data set then stops the job with one line, before any process starts (the workers meet the same
    # error).
    try:
        check_data(cfg)
    except DataError as err:
        return str(err)
    if cfg.cluster.launcher == "ssh":
        for key in ("hostfile", "ssh_identity", "ssh_config"):
            path = getattr(cfg.cluster, key)
            if not path or (key == "hostfile" and not os.path.lexists(path) and is_host_list(path)):
                continue
            problem = file_problem(path)
            if problem:
                return f"cluster.{key}: {problem}"
        problem = ssh_problem(cfg.cluster)
        if problem:
            return problem
    return port_problem(cfg.cluster)


def port_problem(cl):
    """cluster.port taken on this machine, where the scheduler listens: named before the run folder is
    made (the launcher checks it again when it starts the scheduler)."""
    if not cl.port:
        return None
    try:
        pick_port(scheduler_address(cl.launcher, cl.interface), cl.port)
    except UsageError as err:
        return f"cluster.port: {err}"
    return None


def ssh_problem(cl):
    """What the launcher would refuse in an ssh job's host file or interface, named by its key; None if
    nothing. Checked here, before the run folder is made: a refused job must leave no empty run folder
    behind, nor move `latest` to one."""
    try:
        hosts = read_hosts(cl.hostfile)
    except UsageError as err:
        return f"cluster.hostfile: {err}"
    if not cl.interface:
        return ("cluster.interface: required when cluster.launcher is ssh (the network interface the hosts "
                "reach this machine on)")
    try:
        address = interface_ip(cl.interface)
    except UsageError as err:
        return f"cluster.interface: {err}"
    return hosts_problem(cl, hosts, address)


def hosts_problem(cl, hosts, address):
    """What ssh would only say once the job has started, named here with the host file: ssh refusing its
    options, a host whose name does not resolve as ssh looks it up, or a host elsewhere while `address`, the
    scheduler's, is a loopback one it could not reach."""
    try:
        resolved = resolve_hosts(hosts, ssh_options(cl.ssh_user, cl.ssh_identity, cl.ssh_config, cl.ssh_options))
    except SshConfigError as err:
        return f"cluster.ssh_options / cluster.ssh_config: ssh refuses them: {err}"
    for host, name, addresses, why in resolved:
        # ssh looks a host up in lower case: Node1 is no alias of node1.
        alias = f" (its HostName in the ssh configuration is {name})" if name.lower() != host.name.lower() else ""
        if addresses is None:
            return (f"cluster.hostfile: {cl.hostfile} lists host {host.name}, whose name does not resolve here"
                    f"{alias}: {why}; correct the name, or add it to /etc/hosts, DNS or the ssh configuration")
        if ipaddress.ip_address(address).is_loopback and not all(
                ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
            return (f"cluster.interface: {cl.interface} is a loopback interface ({address}), which host "
                    f"{host.name}{alias} cannot reach the scheduler on: name the interface the hosts reach "
                    f"this machine on")
    return None


def take_folders(cfg, args):
    """Lock checkpoint.dir and the run folder (new, or the resumed run's), clean what interrupted saves
    left, check the checkpoint to resume from, open launcher.log: (held locks, run folder, launcher log); a
    JobError (RunFinished for a resume with nothing left to train) if the job cannot start."""
    what, log = "python -m ssdsgd --config " + args.config, []
    held, run_dir = folders.prepare(cfg, args.resume, args.overwrite, what,
                                    start=lambda folder: log.append(open_launcher_log(folder, args.command)))
    return held, run_dir, log[0]


def _own_options(ap):
    ap.add_argument("--dry-run", action="store_true",
                    help="print the effective config and the planned processes, start nothing; exit 2 if the run "
                         "would stop on an error (printed last), as the run itself would")


def dry_run(cfg, args):
    """The config as the job would run it and the launcher's plan, then what the run would refuse before
    its processes start (the data, the host file, the interface, checkpoint.dir and --resume, the folders it
    would make): exit 2 then, so that a script can check a config with it. Nothing is written, nothing is started."""
    print(f"# effective config of {args.config}" + "".join(f" --set {s}" for s in args.set))
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    for note in (*cfg.ignored, density_note(cfg)):
        if note:
            print(f"# note: {note}")
    problem = preflight(cfg) or folders.start_problem(cfg, args.resume, args.overwrite)
    print("# planned processes")
    try:
        code = _launch(cfg, args, args.resume, "<run folder>", dry_run=True)
    except UsageError as err:
        code, problem = 2, problem or str(err)   # preflight's word first: it names the key
    if problem:
        print(f"# error: a run would stop here: {problem}")
        return 2
    return code


def user_command(argv):
    """The command the user typed, as the run folder's manifest records it: `ssdsgd-run ...` or
    `python -m ssdsgd ...` (the roles' own command, python -m ssdsgd.train, cannot be run by hand)."""
    head = ["ssdsgd-run"] if os.path.basename(sys.argv[0]) == "ssdsgd-run" else [sys.executable, "-m", "ssdsgd"]
    return head + list(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, prog="ssdsgd-run", description=__doc__.splitlines()[0], extra=_own_options)
    args.command, args.argv = user_command(argv), list(argv)
    cfg = config_from_args(args)
    if cfg is None:
        return 2
    if args.dry_run:
        return dry_run(cfg, args)
    problem = preflight(cfg)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    folders.make_private()          # run and checkpoint folders: 0700, files 0600 (roles inherit it)
    try:
        held, run_dir, log = take_folders(cfg, args)   # WriteError (a full log.dir): one line, exit 2
    except folders.RunFinished as done:
        print(f"run: {done}", file=sys.stderr)
        return 0
    except JobError as err:                # a folder in use, a checkpoint that cannot be resumed, ...
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run folder: {run_dir}", flush=True)
    try:
        with messages_also_in(log):
            code = _run_with_restarts(cfg, args, run_dir)
            if code != 0:
                print(how_to_continue(cfg, args), file=sys.stderr, flush=True)
            return code
    finally:
        folders.release(held)


def how_to_continue(cfg, args):
    """The last line after a job that did not finish: the newest checkpoint and the exact command that goes
    on from it (the user's, with --resume; without --overwrite, which would delete the checkpoints)."""
    head = args.command[:len(args.command) - len(args.argv)]   # `ssdsgd-run` or `python -m ssdsgd`
    again = head + ["--config", args.config] + (["--set", *args.set] if args.set else [])
    directory = ckpt.latest(cfg.checkpoint.dir)
    if directory is None:
        why = (f"no complete checkpoint in {cfg.checkpoint.dir}" if cfg.checkpoint.dir
               else "checkpoint.dir is not set, so no checkpoint")
        return f"run: {why} to continue from; to start again: {shlex.join(again)}"
    try:
        with open(os.path.join(directory, ckpt.MANIFEST)) as f:
            manifest = json.load(f)
        at = f" (epoch {manifest['epochs_done']}, step {manifest['step']})"
    except (OSError, ValueError, KeyError, TypeError):
        at = ""
    return f"run: to continue from the newest checkpoint, {directory}{at}: {shlex.join(again + ['--resume'])}"


RESTARTABLE = 1        # the launcher's code for a failed or stalled process (not a timeout or a stop)
MAX_BACKOFF = 60.0     # seconds: the longest wait before a restart


def backoff_seconds(base, stuck):
    """The wait before a restart: cluster.restart_backoff doubled for each earlier restart in a row that
    resumed from the same checkpoint (`stuck`: the job made no checkpointed progress since), capped."""
    return min(base * 2 ** stuck, MAX_BACKOFF) if base else 0.0


def _ended(code, limit, run_dir, cfg):
    """The exit code when a job that ended with `code` is not to be restarted, else None. Only a failed
    process (RESTARTABLE) is restarted, and not after the summary was written: then the result is complete
    and the job counts as done. A timeout or a stop keeps its code."""
    if code == 0:
        return 0
    finished = folders.finished_message(run_dir, cfg)
    note = "; not restarted" if limit else ""
    if code == RESTARTABLE and finished:
        print(f"run: a role failed (exit {code}) after the run finished{note}: {run_dir} holds the complete "
              f"result (summary.json)", file=sys.stderr, flush=True)
        return 0
    if code != RESTARTABLE:
        if limit or finished:
            print(f"run: the job ended with exit {code} (a timeout or a stop, not a failed process){note}"
                  + (f"; the run had finished: {run_dir} holds its complete result (summary.json)" if finished else ""),
                  file=sys.stderr, flush=True)
        return code
    return code if limit == 0 else None


def _run_with_restarts(cfg, args, run_dir):
    """Run the job; while it fails after a complete checkpoint, restart it with --resume, at most
    cluster.max_restarts times. The folder locks stay held throughout. A job that fails after its
    summary was written is not restarted: its result is complete and stays as it is (_ended). An ssh job's
    restart first gives a lost host's roles to a spare, or waits for the host (spares.py); with spares in the
    host file, its first launch too (without waiting)."""
    limit, pool = cfg.cluster.max_restarts, HostPool.of(cfg)
    stopped = pool.before_start() if pool else None   # a host file with spares: a host down now is replaced too
    if stopped is not None:
        return stopped
    resume, previous, stuck = args.resume, None, 0
    for attempt in range(limit + 1):
        code = _launch(cfg, args, resume, run_dir) if pool is None else _launch(cfg, args, resume, run_dir,
                                                                                hosts=pool.hosts)
        ended = _ended(code, limit, run_dir, cfg)
        if ended is not None:
            return ended
        if attempt == limit:
            print(f"run: the job failed again; cluster.max_restarts ({limit}) restarts used, giving up",
                  file=sys.stderr, flush=True)
            return code
        root = cfg.checkpoint.dir
        if not root or ckpt.latest(root) is None:
            print(f"run: the job failed before its first complete checkpoint; not restarted: {_no_checkpoint(cfg)}",
                  file=sys.stderr, flush=True)
            return code
        checkpoint_dir.remove_leftovers(root, lambda msg: print(f"run: {msg}", file=sys.stderr, flush=True))
        try:
            directory, _ = ckpt.resume_point(cfg)
        except ckpt.CheckpointError as err:
            print(f"run: not restarted: {err}", file=sys.stderr, flush=True)
            return 2
        stuck = stuck + 1 if directory == previous else 0
        stopped = pool.before_restart(attempt + 1) if pool else None
        if stopped is not None:   # a host lost for good, or a stop while waiting for it
            return stopped
        wait = backoff_seconds(cfg.cluster.restart_backoff, stuck)
        said = (f"run: restart {attempt + 1} of {limit} in {wait:g} s: the job failed (exit {code}); resuming from "
                f"{directory}" + (" (no newer checkpoint than at the last restart)" if stuck else ""))
        try:   # said once the wait catches SIGTERM and SIGHUP: one sent on seeing the line is a stop
            signum = wait_unless_stopped(wait, lambda: print(said, file=sys.stderr, flush=True))
        except KeyboardInterrupt:   # Ctrl-C while waiting: a stop, as during the job (128 + SIGINT)
            print(f"run: stopped before restart {attempt + 1}; not restarted", file=sys.stderr, flush=True)
            return 130
        if signum is not None:
            print(f"run: received {signal.Signals(signum).name} before restart {attempt + 1}; not restarted",
                  file=sys.stderr, flush=True)
            return 128 + signum
        resume, previous = True, directory


def _no_checkpoint(cfg):
    """Why a failed job has no checkpoint to restart from: a key not set, or none written yet."""
    ck = cfg.checkpoint
    unset = [key for key, value in (("checkpoint.dir", ck.dir), ("checkpoint.every_epochs", ck.every_epochs))
             if not value]
    if unset:
        return (f"cluster.max_restarts restarts from a checkpoint, and {' and '.join(unset)} "
                f"{'is' if len(unset) == 1 else 'are'} not set")
    return (f"no checkpoint was written yet (checkpoint.every_epochs: {ck.every_epochs}, in {ck.dir}), so there is "
            f"nothing to restart from")


def _launch(cfg, args, resume, run_dir, dry_run=False, hosts=None):
    """Start the job once; hosts: the [Host] to place its roles on (spares.py), else cluster.hostfile's."""
    cl = cfg.cluster
    command = [sys.executable, "-m", "ssdsgd.train", "--config", os.path.abspath(args.config)]
    for text in args.set:
        command += ["--set", text]
    if resume:
        command.append("--resume")
    env = {LOCKED_ENV: "1", RUN_DIR_ENV: run_dir if dry_run else os.path.abspath(run_dir),   # dry run: a placeholder
           COMMAND_ENV: json.dumps(args.command)}
    return run_job(command, cl.workers, cl.servers, launcher=cl.launcher, hostfile=hosts or cl.hostfile,
                   env=env, timeout=cl.timeout, dry_run=dry_run, interface=cl.interface,
                   stall_timeout=cl.stall_timeout or None, server_timeout=cl.server_timeout or None,
                   port=cl.port, ssh_options=ssh_options(cl.ssh_user, cl.ssh_identity, cl.ssh_config,
                                                         cl.ssh_options), raise_usage=dry_run,
                   gpus_per_worker=cfg.train.devices if cl.device == "gpu" else 0, gpu_ids=cl.gpus)


if __name__ == "__main__":
    sys.exit(main())
