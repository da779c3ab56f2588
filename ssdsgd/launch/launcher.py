"""Fail-fast launcher for MXNet parameter-server jobs: 1 scheduler + S servers + W workers.

Like MXNet's tools/launch.py (dmlc tracker), every role runs the SAME command; the command
branches on DMLC_ROLE. Unlike the dmlc tracker, any crashed, killed or stalled process stops
the whole job with a non-zero exit code, and no process is left behind.

The parts: usage.py (argument checks), hosts.py (host files, placement), command_line.py (argv or
shell), plan.py (which process runs where, with what environment), ssh.py (ssh argv, the remote role
script, remote cleanup), children.py (a started role and what to say about it), watch.py (failure,
stall and liveness detection), cleanup.py (ending every process), job_dir.py (the heartbeat folder).

Exit codes: 0 success, 1 a process failed or stalled (or a remote process could not be confirmed
gone), 2 bad usage, 124 timeout, 128+signum when the launcher got SIGINT/SIGTERM/SIGHUP.

ssh jobs: the scheduler runs here; each server and worker runs on its host under ssdsgd/launch/remote.py
(shipped as source), which starts it in its own process group, reports the group id and how the
role ended, and ends the group when the ssh connection closes. Cleanup ends every reported group
over ssh (SIGTERM, SIGKILL after TERM_GRACE) and checks that none is left.

Standard library only: this module must not import mxnet.
"""
import argparse
import os
import re
import signal
import sys
import threading
import time

from ssdsgd.launch.children import Child
from ssdsgd.launch.cleanup import cleanup
from ssdsgd.launch.gpus import parse_ids
from ssdsgd.launch.job_dir import job_dir_parent, make_job_dir
from ssdsgd.launch.plan import plan, print_plan
from ssdsgd.launch.ssh import ssh_options
from ssdsgd.launch.usage import UsageError
from ssdsgd.launch.watch import supervise


def _catch_stop_signals(received):
    """Make SIGINT/SIGTERM/SIGHUP set a flag the supervisor polls; return a function restoring the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # Python only allows signal handlers in the main thread
    old = {s: signal.signal(s, lambda signum, frame: received.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}   # SIGHUP: the terminal closed

    def restore():
        for s, handler in old.items():
            signal.signal(s, handler)
    return restore


def _run(specs, timeout, stall_timeout, server_timeout=None):
    received = []
    restore_signals = _catch_stop_signals(received)
    children = []
    code = 1
    try:
        for spec in specs:
            try:
                children.append(Child(spec))
            except OSError as e:
                print(f'launch: cannot start {spec.name}: {e}', file=sys.stderr)
                break
        else:
            code = supervise(children, timeout, stall_timeout, received, server_timeout)
    finally:
        started = time.monotonic()
        if cleanup(children):
            if any(c.ssh for c in children):
                print(f'launch: every process on every host has ended ({time.monotonic() - started:.1f} s '
                      f'cleanup)', file=sys.stderr, flush=True)
        elif code == 0:
            code = 1
        restore_signals()
    if received and code in (0, 1):
        # Stopped during the cleanup (which takes seconds): say so in the code, so that ssdsgd-run does
        # not restart a job its user stopped (it restarts after exit 1).
        print(f'launch: received {signal.Signals(received[0]).name} during the cleanup', file=sys.stderr)
        code = 128 + received[0]
    return code


def run_job(command, num_workers, num_servers=None, *, launcher='local', hostfile=None, env=None,
            timeout=None, port=None, interface=None, stall_timeout=None, dry_run=False, ssh_options=(),
            role_env=None, server_timeout=None, raise_usage=False, gpus_per_worker=0, gpu_ids=None):
    """Run `command` as scheduler, servers and workers; return the exit code the CLI exits with.

    num_servers defaults to num_workers (as in MXNet's launcher). hostfile: a host file, a host list
    (`h1:2,h2`) or a [Host] list (ssdsgd-run's, once a spare took a lost host's roles).
    ssh_options: extra ssh arguments (e.g. ['-F', config, '-i', key, '-l', user, '-o', 'Opt=v']);
    role_env: {role: {K: V}} added for that role only ('scheduler', 'server', 'worker'). gpus_per_worker,
    gpu_ids: each worker's own GPUs (plan.plan, gpus.py). raise_usage: raise a UsageError instead of printing it
    and returning 2 (ssdsgd-run --dry-run prints it after the plan). Call from the main thread:
    SIGINT/SIGTERM handling and PR_SET_PDEATHSIG (which fires when the forking *thread* exits) both
    assume it.
    """
    if num_servers is None:
        num_servers = num_workers
    # Heartbeat files: ssh workers write them from their hosts, so for ssh jobs they live under the
    # working directory, which every host shares (the remote roles run in it too).
    try:
        job_dir = make_job_dir(shared=launcher == 'ssh')
    except OSError as e:
        why = (' (the ssh launcher needs a writable working directory on the file system the hosts share)'
               if launcher == 'ssh' else '')
        print(f'launch: cannot create the job folder in {job_dir_parent(launcher == "ssh")}{why}: {e.strerror}',
              file=sys.stderr)
        return 2
    with job_dir as job_path:
        try:
            specs, secret = plan(command, num_workers, num_servers, launcher, hostfile, dict(env or {}),
                                 port, interface, timeout, stall_timeout, job_path, list(ssh_options),
                                 role_env, server_timeout, gpus_per_worker, gpu_ids)
        except UsageError as e:
            if raise_usage:
                raise
            print(f'launch: {e}', file=sys.stderr)
            return 2
        if dry_run:
            print_plan(specs, secret)
            return 0
        return _run(specs, timeout, stall_timeout, server_timeout)


def _env_item(text, *, allow_name):
    """`K=V`, MXNet's `K:V`, or (with allow_name) a bare NAME taking its value from this environment."""
    for sep in ('=', ':'):
        key, found, value = text.partition(sep)
        if found and key:
            return key, value
    if allow_name and re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', text):
        if text not in os.environ:
            raise argparse.ArgumentTypeError(f'--env {text}: {text} is not set in this environment')
        return text, os.environ[text]
    raise argparse.ArgumentTypeError(f'expected K=V{", K:V or NAME" if allow_name else " or K:V"}, got {text!r}')


def _prog():
    """The name the usage shows: as the user ran it (the script or the installed command)."""
    return 'ssdsgd-launch' if os.path.basename(sys.argv[0]) == 'ssdsgd-launch' else 'launch.py'


def _parser():
    p = argparse.ArgumentParser(
        prog=_prog(),
        description='Run COMMAND as 1 scheduler + S servers + W workers of an MXNet parameter-server job; '
                    'the command branches on DMLC_ROLE. Fails fast when any process fails.')
    p.add_argument('-n', '--num-workers', type=int, required=True, help='number of workers')
    p.add_argument('-s', '--num-servers', type=int, help='number of servers (default: the number of workers)')
    # No argparse choices: MXNet's other launchers get a line saying why they are not supported (_check_cli).
    p.add_argument('--launcher', metavar='{local,ssh}',
                   help='local or ssh; default: ssh with -H (as in MXNet\'s launch.py), else local')
    p.add_argument('-H', '--hostfile',
                   help='ssh launcher: a file with one `host[:sshport] [slots=N] [interface=IF] [python=PATH] '
                        '[gpus=IDS] [spare]` a line (a spare gets no role here; ssdsgd-run gives it a lost host\'s '
                        'roles), or a list `h1:2,h2:2` (host:slots, as horovodrun and mpirun take it)')
    p.add_argument('--env', type=lambda t: _env_item(t, allow_name=True), action='append', default=[],
                   metavar='K=V|NAME', help='environment variable for every process; a bare NAME passes its '
                                            'value from here (repeat for more)')
    p.add_argument('--env-server', type=lambda t: _env_item(t, allow_name=False), action='append', default=[],
                   metavar='K=V', help='environment variable for the servers (and the scheduler) only')
    p.add_argument('--env-worker', type=lambda t: _env_item(t, allow_name=False), action='append', default=[],
                   metavar='K=V', help='environment variable for the workers only')
    p.add_argument('--timeout', type=float, help='stop the job (exit 124) after this many seconds')
    p.add_argument('--port', type=int, help='scheduler port (default: a free one)')
    p.add_argument('--interface', help='ssh launcher: the network interface of this machine the hosts reach it on; '
                                       'default: the one MXNet\'s launcher finds (the address this machine\'s name '
                                       'resolves to, or if loopback, the route out), said in one line')
    p.add_argument('--stall-timeout', type=float,
                   help='fail when a worker does not touch its heartbeat file for this many seconds')
    p.add_argument('--server-timeout', type=float,
                   help='fail when a server or the scheduler gives no sign of life (a file its Python process '
                        'touches every second) for this many seconds: stopped, hung or unreachable')
    p.add_argument('--ssh-user', help='ssh: log in as this user (ssh -l)')
    p.add_argument('--ssh-identity', help='ssh: private key file (ssh -i)')
    p.add_argument('--ssh-config', help='ssh: configuration file (ssh -F)')
    p.add_argument('--ssh-option', action='append', default=[], metavar='OPT=VALUE',
                   help='ssh: extra option (ssh -o; repeat for more)')
    p.add_argument('--sync-dst-dir', metavar='DIR',
                   help="MXNet's copy of the working folder to every host: refused for ssh (see the README); "
                        'the local launcher ignores it, as MXNet\'s does')
    p.add_argument('--p3', action='store_true',
                   help="ps-lite's P3 van (priority-based parameter propagation) for every role, as MXNet's --p3: "
                        'DMLC_PS_VAN_TYPE=p3 DMLC_PS_WATER_MARK=10')
    p.add_argument('--gpus-per-worker', type=int, default=0, metavar='D',
                   help='give each worker D GPUs of its host of its own (CUDA_VISIBLE_DEVICES); servers and the '
                        'scheduler see none')
    p.add_argument('--gpus', metavar='IDS',
                   help='with --gpus-per-worker: the GPU ids of each host (0,1,2,3, or a count) where its host file '
                        'line has no gpus=; default 0, 1, 2, ...')
    p.add_argument('--dry-run', action='store_true', help='print the planned processes and exit')
    p.add_argument('command', nargs=argparse.REMAINDER, help='command to run (optionally after --)')
    return p


P3_ENV = {'DMLC_PS_VAN_TYPE': 'p3', 'DMLC_PS_WATER_MARK': '10'}   # what MXNet's --p3 sets
SYNC_DST_DIR_REFUSED = (
    '--sync-dst-dir is not supported by the ssh launcher: the roles run in this working directory on a file '
    'system every host shares, because the launcher watches the heartbeat and liveness files they write there '
    '(and the run folder and checkpoints live there); a copy on each host would leave those unseen. Put the '
    'working directory on shared storage (e.g. NFS) and drop the option')


# MXNet's launchers that start and own the processes themselves (README, docs/design.md): what does.
NOT_SUPPORTED_LAUNCHERS = {'mpi': 'mpirun', 'sge': "SGE's qsub", 'yarn': 'YARN'}
LAUNCHERS = ('local', 'ssh')


def _launcher_problem(launcher):
    if launcher in NOT_SUPPORTED_LAUNCHERS:
        return (f'--launcher {launcher}: not supported; ssdsgd runs local and ssh ({NOT_SUPPORTED_LAUNCHERS[launcher]} '
                f'starts and owns the processes, so this launcher could not watch, time out or end them)')
    if launcher not in LAUNCHERS:
        return f'--launcher {launcher}: unknown; use local or ssh'
    return None


def _ssh_only_options(args):
    """The ssh-only options given, as the user spells them."""
    given = [('-H', args.hostfile), ('--interface', args.interface), ('--ssh-user', args.ssh_user),
             ('--ssh-identity', args.ssh_identity), ('--ssh-config', args.ssh_config),
             ('--ssh-option', args.ssh_option)]
    return [name for name, value in given if value]


def _refuse(message):
    print(f'launch: {message}', file=sys.stderr)
    sys.exit(2)


def _check_cli(args):
    """Refuse what the CLI cannot do, naming the option (exit 2)."""
    chosen = args.launcher is not None
    if not chosen:
        # As MXNet's launch.py: ssh is its default, and it needs -H (without it MXNet's fails at once).
        args.launcher = 'ssh' if args.hostfile else 'local'
    problem = _launcher_problem(args.launcher)
    if problem:
        _refuse(problem)
    ssh_only = _ssh_only_options(args)
    if args.launcher == 'local' and ssh_only:
        # These would run every role on localhost, not where the user meant.
        them = 'it' if len(ssh_only) == 1 else 'them'
        way_out = (f'use --launcher ssh (the default with -H), or drop {them}' if chosen
                   else f'add -H HOSTFILE to run over ssh, or drop {them}')
        _refuse(f'{", ".join(ssh_only)}: only for the ssh launcher, but the launcher is local'
                f'{"" if chosen else " (the default without -H)"}, which runs every role on this machine: {way_out}')
    if args.sync_dst_dir and args.launcher == 'ssh':
        _refuse(SYNC_DST_DIR_REFUSED)
    if args.sync_dst_dir:
        print('launch: --sync-dst-dir only applies to the ssh launcher; ignored (as MXNet\'s local launcher does)',
              file=sys.stderr)
    if args.gpus_per_worker < 0:
        _refuse(f'--gpus-per-worker: expected a count >= 0, got {args.gpus_per_worker}')
    if args.gpus and not args.gpus_per_worker:
        _refuse('--gpus: lists the GPUs that --gpus-per-worker shares out; add --gpus-per-worker')
    if args.gpus:
        try:
            parse_ids(args.gpus, '--gpus')
        except UsageError as err:
            _refuse(str(err))
    for path, what in ((args.ssh_identity, '--ssh-identity'), (args.ssh_config, '--ssh-config')):
        if path and not os.path.isfile(path):
            _refuse(f'{what}: file {path} does not exist')


def main(argv=None):
    args = _parser().parse_args(argv)
    _check_cli(args)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    env = dict(args.env)
    if args.p3:
        env.update(P3_ENV)   # MXNet's launcher puts them in front of the command, so they win there too
    role_env = {'server': dict(args.env_server), 'scheduler': dict(args.env_server),
                'worker': dict(args.env_worker)}
    sys.exit(run_job(command, args.num_workers, args.num_servers, launcher=args.launcher,
                     hostfile=args.hostfile, env=env, timeout=args.timeout, port=args.port,
                     interface=args.interface, stall_timeout=args.stall_timeout,
                     server_timeout=args.server_timeout, dry_run=args.dry_run,
                     ssh_options=ssh_options(args.ssh_user, args.ssh_identity, args.ssh_config, args.ssh_option),
                     role_env=role_env, gpus_per_worker=args.gpus_per_worker,
                     gpu_ids=parse_ids(args.gpus, '--gpus') if args.gpus else None))
