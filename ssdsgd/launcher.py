"""Fail-fast launcher for MXNet parameter-server jobs: 1 scheduler + S servers + W workers.

Like MXNet's tools/launch.py (dmlc tracker), every role runs the SAME command; the command
branches on DMLC_ROLE. Unlike the dmlc tracker, any crashed, killed or stalled process stops
the whole job with a non-zero exit code, and no process is left behind.

Exit codes: 0 success, 1 a process failed or stalled, 2 bad usage, 124 timeout,
128+signum when the launcher got SIGINT/SIGTERM.

Standard library only: this module must not import mxnet.
"""
import argparse
import collections
import ctypes
import errno
import fcntl
import os
import re
import secrets
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple, Optional

SECRET_ENV = 'SSDSGD_JOB_SECRET'
HEARTBEAT_ENV = 'SSDSGD_HEARTBEAT_FILE'
POLL_SECONDS = 0.1
SHUTDOWN_GRACE = 10.0  # ps-lite servers/scheduler exit by themselves shortly after the workers
TERM_GRACE = 3.0       # between SIGTERM and SIGKILL during cleanup
TAIL_LINES = 30        # output lines kept per process for failure reports
SSH_PORT = 22
SIOCGIFADDR = 0x8915   # <linux/sockios.h>
PR_SET_PDEATHSIG = 1   # <linux/prctl.h>

# Resolved once here: the preexec_fn runs between fork and exec and must do as little as possible.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_print_lock = threading.Lock()


class UsageError(Exception):
    """Bad arguments or environment: nothing is started and the exit code is 2."""


class _Spec(NamedTuple):
    name: str              # role name shown in output, e.g. 'worker 1'
    host: str              # where the command runs: 'localhost' or the ssh host
    argv: list             # what the launcher executes on this machine
    env: dict              # variables the launcher sets (added to os.environ locally, exported via stdin for ssh)
    stdin: Optional[str]   # script fed to `ssh ... bash -s`; None for local processes


def read_hostfile(path):
    """Return [(host, ssh_port)] from a file of `host` or `host:port` lines; '#' starts a comment."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f'cannot read hostfile {path}: {e.strerror}') from None
    hosts = []
    for line in text.splitlines():
        line = line.split('#', 1)[0].strip()
        if not line:
            continue
        host, sep, port = line.partition(':')
        if sep and not port.isdigit():
            raise UsageError(f'bad line in hostfile {path}: {line!r}')
        hosts.append((host, int(port) if sep else SSH_PORT))
    if not hosts:
        raise UsageError(f'hostfile {path} lists no hosts')
    return hosts


def interface_ip(name):
    """IPv4 address of a network interface on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack('256s', name.encode()[:15]))
        except OSError:
            raise UsageError(f'network interface {name!r} does not exist or has no IPv4 address') from None
    return socket.inet_ntoa(ifreq[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (family, port, addr)


def _pick_port(host, port):
    """Check that `port` is free on `host`, or pick a free one when port is None."""
    with socket.socket() as s:
        # Same option ZeroMQ uses, so a TIME_WAIT leftover is not reported as "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port or 0))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f'port {port} is already in use') from None
            raise UsageError(f'cannot bind {host}:{port}: {e.strerror}') from None
        return s.getsockname()[1]


def _roles(num_workers, num_servers):
    """(DMLC_ROLE, task id, role name) in start order: scheduler, servers, workers."""
    return ([('scheduler', 0, 'scheduler')]
            + [('server', i, f'server {i}') for i in range(num_servers)]
            + [('worker', i, f'worker {i}') for i in range(num_workers)])


def _role_env(job_env, role, task_id, name):
    return {**job_env, 'DMLC_ROLE': role, 'DMLC_TASK_ID': str(task_id), 'SSDSGD_ROLE_NAME': name}


def _ssh_specs(command, hosts, num_workers, num_servers, env, cwd):
    specs = []
    # Servers and workers share one round-robin counter, so servers do not pile up with worker 0.
    for i, (role, task_id, name) in enumerate(_roles(num_workers, num_servers)[1:]):
        host, ssh_port = hosts[i % len(hosts)]
        role_env = _role_env(env, role, task_id, name)
        # The environment (with the secret) goes on stdin: argv is visible to every user via ps.
        script = ('set -e\n'
                  + ''.join(f'export {k}={shlex.quote(v)}\n' for k, v in role_env.items())
                  + f'cd {shlex.quote(cwd)}\n'
                  + f'exec {shlex.join(command)}\n')
        argv = ['ssh', '-o', 'StrictHostKeyChecking=no', '-o', 'BatchMode=yes',
                '-p', str(ssh_port), host, 'bash -s']
        specs.append(_Spec(name, host, argv, role_env, script))
    return specs


def build_ssh_commands(command, hosts, num_workers, num_servers, env, cwd):
    """Plan the remote (server and worker) processes of an ssh job.

    hosts: [(host, ssh_port)] as returned by read_hostfile; env: job variables to export
    (DMLC_*, the secret, user variables); the per-role DMLC_ROLE, DMLC_TASK_ID and
    SSDSGD_ROLE_NAME are added here. Returns [(role_name, ssh_argv, stdin_script)].
    """
    return [(s.name, s.argv, s.stdin) for s in _ssh_specs(command, hosts, num_workers, num_servers, env, cwd)]


def _plan(command, num_workers, num_servers, launcher, hostfile, env, port, interface,
          timeout, stall_timeout, heartbeat_dir):
    """Validate the job and return (specs in start order, secret)."""
    if not command:
        raise UsageError('no command given')
    if num_workers < 1 or num_servers < 1:
        raise UsageError(f'need at least 1 worker and 1 server (got -n {num_workers} -s {num_servers})')
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f'port {port} is out of range')
    for label, value in (('--timeout', timeout), ('--stall-timeout', stall_timeout)):
        if value is not None and value <= 0:
            raise UsageError(f'{label} must be > 0')
    for key in env:
        if not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key):
            raise UsageError(f'bad environment variable name {key!r}')

    if launcher == 'local':
        interface = interface or 'lo'
        root_uri = '127.0.0.1'
    elif launcher == 'ssh':
        if stall_timeout is not None:
            raise UsageError('--stall-timeout needs --launcher local (heartbeat files are local files)')
        if not hostfile:
            raise UsageError('--launcher ssh needs -H HOSTFILE')
        hosts = read_hostfile(hostfile)
        if not interface:
            raise UsageError('--launcher ssh needs --interface (the network the hosts reach this machine on)')
        root_uri = interface_ip(interface)
    else:
        raise UsageError(f'unknown launcher {launcher!r}')

    secret = secrets.token_hex(32)
    job_env = {
        **env,
        'OMP_NUM_THREADS': env.get('OMP_NUM_THREADS', os.environ.get('OMP_NUM_THREADS', '1')),
        'DMLC_PS_ROOT_URI': root_uri,
        'DMLC_PS_ROOT_PORT': str(_pick_port(root_uri, port)),
        'DMLC_NUM_WORKER': str(num_workers),
        'DMLC_NUM_SERVER': str(num_servers),
        'DMLC_INTERFACE': interface,
        SECRET_ENV: secret,
    }
    if launcher == 'local':
        job_env['DMLC_NODE_HOST'] = root_uri  # ps-lite then binds loopback only
        specs = []
        for role, task_id, name in _roles(num_workers, num_servers):
            role_env = _role_env(job_env, role, task_id, name)
            if role == 'worker':
                role_env[HEARTBEAT_ENV] = os.path.join(heartbeat_dir, f'worker{task_id}.hb')
            specs.append(_Spec(name, 'localhost', list(command), role_env, None))
        return specs, secret
    # ssh: the scheduler runs here, on the interface the remote hosts connect to.
    scheduler = _Spec('scheduler', 'localhost', list(command), _role_env(job_env, 'scheduler', 0, 'scheduler'), None)
    return [scheduler] + _ssh_specs(command, hosts, num_workers, num_servers, job_env, os.getcwd()), secret


def _print_plan(specs, secret):
    for s in specs:
        env = ' '.join(f'{k}={shlex.quote(v)}' for k, v in s.env.items())
        print(f'{s.name} on {s.host}: {shlex.join(s.argv)}\n    env: {env}'.replace(secret, '<redacted>'))


def _die_with_parent(parent_pid):
    def preexec():
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # a SIGKILLed launcher takes its children along
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)
    return preexec


class _Child:
    """A started process, the tail of its output and its heartbeat file."""

    def __init__(self, spec):
        self.name = spec.name
        self.is_worker = spec.env['DMLC_ROLE'] == 'worker'
        self.heartbeat = spec.env.get(HEARTBEAT_ENV)
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            spec.argv,
            env=None if spec.stdin else {**os.environ, **spec.env},  # ssh itself gets only our environment
            stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: cleanup also reaches grandchildren
            preexec_fn=_die_with_parent(os.getpid()))
        if spec.stdin:
            try:
                with self.popen.stdin:
                    self.popen.stdin.write(spec.stdin.encode())
            except BrokenPipeError:
                pass  # ssh already exited; the supervisor reports its exit code
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self):
        with self.popen.stdout as pipe:
            for raw in pipe:
                line = raw.decode(errors='replace').rstrip('\r\n')
                self.tail.append(line)
                with _print_lock:  # one write per line, so lines of different roles never interleave
                    sys.stdout.write(f'[{self.name}] {line}\n')
                    sys.stdout.flush()

    def idle_seconds(self):
        """Seconds since the worker last touched its heartbeat file (since its start if it never did)."""
        try:
            return time.time() - os.stat(self.heartbeat).st_mtime
        except FileNotFoundError:
            return time.monotonic() - self.started

    def report(self, what):
        if self.popen.returncode is not None:
            self.reader.join(timeout=1.0)  # let the reader catch the last lines the process printed
        lines = [f'launch: {self.name} {what}']
        if self.tail:
            lines += [f'launch: last output of {self.name}:'] + [f'  {line}' for line in self.tail]
        print('\n'.join(lines), file=sys.stderr, flush=True)


def _describe_exit(returncode):
    if returncode >= 0:
        return f'exited with code {returncode}'
    try:
        return f'killed by {signal.Signals(-returncode).name}'
    except ValueError:  # e.g. real-time signals have no name
        return f'killed by signal {-returncode}'


def _supervise(children, timeout, stall_timeout, received):
    """Watch the children until the job is decided; return the exit code. Cleanup is the caller's."""
    workers = [c for c in children if c.is_worker]
    start = time.monotonic()
    workers_done_at = None
    while True:
        if received:
            print(f'launch: received {signal.Signals(received[0]).name}, stopping the job', file=sys.stderr)
            return 128 + received[0]
        for c in children:
            returncode = c.popen.poll()
            if returncode not in (None, 0):
                c.report(_describe_exit(returncode))
                return 1
        now = time.monotonic()
        if all(w.popen.returncode == 0 for w in workers):
            if all(c.popen.returncode == 0 for c in children):
                return 0
            workers_done_at = workers_done_at or now
            if now - workers_done_at > SHUTDOWN_GRACE:
                return 0  # the work is done; lingering servers/scheduler are killed by the cleanup
        else:
            if timeout is not None and now - start > timeout:
                print(f'launch: timeout after {timeout:g} s', file=sys.stderr)
                return 124
            for w in workers:
                if stall_timeout is not None and w.popen.returncode is None and w.idle_seconds() > stall_timeout:
                    w.report(f'made no progress for {stall_timeout:g} s')
                    return 1
        time.sleep(POLL_SECONDS)


def _signal_groups(children, signum):
    for c in children:
        try:
            os.killpg(c.popen.pid, signum)
        except ProcessLookupError:
            pass  # the whole group is gone already


def _cleanup(children):
    """SIGTERM every process group, SIGKILL whatever is left after TERM_GRACE, reap everything."""
    _signal_groups(children, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE
    while any(c.popen.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    _signal_groups(children, signal.SIGKILL)  # also hits grandchildren that outlived their group leader
    for c in children:
        c.popen.wait()
        c.reader.join(timeout=1.0)


def _catch_stop_signals(received):
    """Make SIGINT/SIGTERM set a flag the supervisor polls; return a function restoring the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # Python only allows signal handlers in the main thread
    old = {s: signal.signal(s, lambda signum, frame: received.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}

    def restore():
        for s, handler in old.items():
            signal.signal(s, handler)
    return restore


def _run(specs, timeout, stall_timeout):
    received = []
    restore_signals = _catch_stop_signals(received)
    children = []
    try:
        for spec in specs:
            try:
                children.append(_Child(spec))
            except OSError as e:
                print(f'launch: cannot start {spec.name}: {e}', file=sys.stderr)
                return 1
        return _supervise(children, timeout, stall_timeout, received)
    finally:
        _cleanup(children)
        restore_signals()


def run_job(command, num_workers, num_servers, *, launcher='local', hostfile=None, env=None,
            timeout=None, port=None, interface=None, stall_timeout=None, dry_run=False):
    """Run `command` as scheduler, servers and workers; return the exit code the CLI exits with.

    Call from the main thread: SIGINT/SIGTERM handling and PR_SET_PDEATHSIG (which fires when
    the forking *thread* exits) both assume it.
    """
    with tempfile.TemporaryDirectory(prefix='ssdsgd-launch-') as heartbeat_dir:
        try:
            specs, secret = _plan(command, num_workers, num_servers, launcher, hostfile, dict(env or {}),
                                  port, interface, timeout, stall_timeout, heartbeat_dir)
        except UsageError as e:
            print(f'launch: {e}', file=sys.stderr)
            return 2
        if dry_run:
            _print_plan(specs, secret)
            return 0
        return _run(specs, timeout, stall_timeout)


def _env_pair(text):
    key, sep, value = text.partition('=')
    if not sep or not key:
        raise argparse.ArgumentTypeError(f'expected K=V, got {text!r}')
    return key, value


def _parser():
    p = argparse.ArgumentParser(
        prog='launch.py',
        description='Run COMMAND as 1 scheduler + S servers + W workers of an MXNet parameter-server job; '
                    'the command branches on DMLC_ROLE. Fails fast when any process fails.')
    p.add_argument('-n', '--num-workers', type=int, required=True, help='number of workers')
    p.add_argument('-s', '--num-servers', type=int, required=True, help='number of servers')
    p.add_argument('--launcher', choices=('local', 'ssh'), default='local')
    p.add_argument('-H', '--hostfile', help='ssh launcher: one host or host:sshport per line')
    p.add_argument('--env', type=_env_pair, action='append', default=[], metavar='K=V',
                   help='extra environment variable for every process (repeat for more)')
    p.add_argument('--timeout', type=float, help='stop the job (exit 124) after this many seconds')
    p.add_argument('--port', type=int, help='scheduler port (default: a free one)')
    p.add_argument('--interface', help='network interface (default lo for local; required for ssh)')
    p.add_argument('--stall-timeout', type=float,
                   help='fail when a worker does not touch its heartbeat file for this many seconds')
    p.add_argument('--dry-run', action='store_true', help='print the planned processes and exit')
    p.add_argument('command', nargs=argparse.REMAINDER, help='command to run (optionally after --)')
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    sys.exit(run_job(command, args.num_workers, args.num_servers, launcher=args.launcher,
                     hostfile=args.hostfile, env=dict(args.env), timeout=args.timeout, port=args.port,
                     interface=args.interface, stall_timeout=args.stall_timeout, dry_run=args.dry_run))
