"""Fail-fast launcher for MXNet parameter-server jobs: 1 scheduler + S servers + W workers.

Like MXNet's tools/launch.py (dmlc tracker), every role runs the SAME command; the command
branches on DMLC_ROLE. Unlike the dmlc tracker, any crashed, killed or stalled process stops
the whole job with a non-zero exit code, and no process is left behind.

Two kinds of heartbeat, both files in the job folder whose mtime the supervisor reads: a worker touches
its own every step (progress; --stall-timeout), and the Python process of every server and of the
scheduler touches its own every second from a thread that pyhooks/sitecustomize.py starts (liveness;
--server-timeout). A stopped (SIGSTOP), hung or cut-off server never exits, so without the second one
it would only show up as a stalled worker; with it, the server is named, with its host.

Exit codes: 0 success, 1 a process failed or stalled (or a remote process could not be confirmed
gone), 2 bad usage, 124 timeout, 128+signum when the launcher got SIGINT/SIGTERM/SIGHUP.

ssh jobs: the scheduler runs here; each server and worker runs on its host under ssdsgd/launch/remote.py
(shipped as source), which starts it in its own process group, reports the group id and how the
role ended, and ends the group when the ssh connection closes. Cleanup ends every reported group
over ssh (SIGTERM, SIGKILL after TERM_GRACE) and checks that none is left.

Standard library only: this module must not import mxnet.
"""
import argparse
import collections
import ctypes
import errno
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple, Optional

from ssdsgd.env import (
    HEARTBEAT_ENV,
    HOST_INTERFACE_ENV,
    JOB_DIR_ENV,
    LIVENESS_ENV,
    RANK_MARK,
    ROLE_ENV,
    ROLE_NAME_ENV,
    SECRET_ENV,
    TASK_ID_ENV,
    WRAPPER_ENV,
)
from ssdsgd.launch import remote

LIVENESS_INTERVAL = 1.0  # seconds; pyhooks/sitecustomize.py's LIVENESS_INTERVAL (a test keeps them equal)

POLL_SECONDS = 0.1
SHUTDOWN_GRACE = 10.0  # ps-lite servers/scheduler exit by themselves shortly after the workers
TERM_GRACE = 3.0       # between SIGTERM and SIGKILL during cleanup
TAIL_LINES = 30        # output lines kept per process for failure reports
REMOTE_KILL_TIMEOUT = 20.0  # one ssh round to a host that ends and checks its process groups
PR_SET_PDEATHSIG = 1   # <linux/prctl.h>

HOOKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pyhooks')  # sitecustomize for roles
_REMOTE_SOURCE = None  # ssdsgd/launch/remote.py's text, read on first use

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
    ssh: Optional[list]    # ssh argv up to and including the host, for cleanup; None for local processes


class Host(NamedTuple):
    """One host file line: `host[:sshport] [slots=N] [interface=IF] [python=PATH]`."""
    name: str
    port: Optional[int] = None     # None: ssh's default (or the ssh config file's)
    slots: int = 1
    interface: Optional[str] = None
    python: Optional[str] = None


HOST_LIST = re.compile(r'[A-Za-z0-9_.-]+(:\d+)?(,[A-Za-z0-9_.-]+(:\d+)?)*')


def is_host_list(spec):
    """`h1:2,h2:2` or `h1,h2` (not a file of that name): a bare single name stays a host file's name, so a
    missing file is reported as such."""
    return not os.path.isfile(spec) and bool(HOST_LIST.fullmatch(spec)) and (',' in spec or ':' in spec)


def read_hosts(spec):
    """-H: a host file, or a list as horovodrun and mpirun take it (is_host_list): host:slots,
    comma-separated."""
    if not is_host_list(spec):
        return read_hostfile(spec)
    hosts = []
    for item in spec.split(','):
        name, _, slots = item.partition(':')
        if slots and int(slots) < 1:
            raise UsageError(f'-H {spec}: {item} has no slots (host:N takes N >= 1)')
        hosts.append(Host(name, slots=int(slots) if slots else 1))
    return hosts


def read_hostfile(path):
    """Return [Host] from a host file; '#' starts a comment. `slots=N` is the MPI-style count of
    processes the host takes before the next host gets one (default 1)."""
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
        first, *options = line.split()
        name, sep, port = first.partition(':')
        if not name or (sep and not port.isdigit()) or '=' in first:
            raise UsageError(f'bad host in hostfile {path}: {line!r} (expected host or host:sshport first)')
        fields = {}
        for opt in options:
            key, eq, value = opt.partition('=')
            if not eq or key not in ('slots', 'interface', 'python') or not value:
                raise UsageError(f'bad option {opt!r} in hostfile {path} (known: slots=N, interface=IF, python=PATH)')
            fields[key] = value
        if 'slots' in fields:
            if not fields['slots'].isdigit() or int(fields['slots']) < 1:
                raise UsageError(f'bad slots in hostfile {path}: {line!r} (a positive integer)')
            fields['slots'] = int(fields['slots'])
        hosts.append(Host(name, int(port) if sep else None, **fields))
    if not hosts:
        raise UsageError(f'hostfile {path} lists no hosts')
    return hosts


def interface_ip(name):
    """IPv4 address of a network interface on this machine."""
    address = remote.interface_ip(name)
    if address is None:
        raise UsageError(f'network interface {name!r} does not exist or has no IPv4 address')
    return address


def _remote_source():
    global _REMOTE_SOURCE
    if _REMOTE_SOURCE is None:
        with open(remote.__file__) as f:
            _REMOTE_SOURCE = f.read()
    return _REMOTE_SOURCE


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


def _role_env(job_env, role, task_id, name, job_dir=None, role_env=None):
    env = {**job_env, **(role_env or {}).get(role, {}),
           ROLE_ENV: role, TASK_ID_ENV: str(task_id), ROLE_NAME_ENV: name}
    if role == 'worker' and job_dir:
        env[HEARTBEAT_ENV] = os.path.join(job_dir, f'worker{task_id}.hb')  # the launcher watches its mtime
    elif job_dir:
        env[LIVENESS_ENV] = os.path.join(job_dir, f'{role}{task_id}.alive')
    return env


def ssh_base(host, ssh_options=(), server_timeout=None):
    """ssh argv up to the host. User options come first: ssh keeps the first value it sees.

    With a server timeout, ssh itself checks that the host answers (ServerAliveInterval, 3 misses): an
    unreachable host ends our ssh client with exit 255 within the server timeout, and the launcher names
    the role and the host as lost, whatever the role was doing (a role's liveness file can keep being
    touched on a shared file system the host still reaches)."""
    argv = ['ssh', *ssh_options, '-o', 'StrictHostKeyChecking=no', '-o', 'BatchMode=yes']
    if server_timeout is not None:
        argv += ['-o', f'ServerAliveInterval={max(1, int(server_timeout / 4))}', '-o', 'ServerAliveCountMax=3']
    if host.port is not None:
        argv += ['-p', str(host.port)]
    return argv + [host.name]


def _with_interpreter(command, python):
    """A command starting with `python`, `python3` or the launching interpreter runs `python` instead:
    roles use the launching interpreter (and its virtual environment) unless the host file names one."""
    if command and command[0] in ('python', 'python3', sys.executable):
        return [python] + list(command[1:])
    return list(command)


def _placement(hosts, count):
    """Host of each of `count` processes: round robin over the hosts, each taking `slots` in a row."""
    cycle = [h for h in hosts for _ in range(h.slots)]
    return [cycle[i % len(cycle)] for i in range(count)]


def _ssh_specs(command, hosts, num_workers, num_servers, env, cwd, ssh_options=(), job_dir=None, role_env=None,
               server_timeout=None):
    specs = []
    roles = _roles(num_workers, num_servers)[1:]
    # Servers and workers share one placement, so servers do not pile up with worker 0.
    for (role, task_id, name), host in zip(roles, _placement(hosts, len(roles))):
        this_env = _role_env(env, role, task_id, name, job_dir, role_env)
        if host.interface:
            this_env[HOST_INTERFACE_ENV] = host.interface
        if job_dir:
            this_env[JOB_DIR_ENV] = job_dir   # remote.py ends the role once the launcher removed it
        python = host.python or sys.executable
        # The environment (with the secret) goes on stdin: argv is visible to every user via ps.
        # PATH starts with the interpreter's folder, so a bare `python` in the command (or in a shell
        # command) is that interpreter: the launching one unless the host file names another.
        script = ('set -e\n'
                  + ''.join(f'export {k}={shlex.quote(v)}\n' for k, v in this_env.items())
                  + f'export PATH={shlex.quote(os.path.dirname(python))}:"$PATH"\n'
                  + f'cd {shlex.quote(cwd)}\n'
                  + f'export {WRAPPER_ENV}=1\n'
                  + f'exec {shlex.quote(python)} -c {shlex.quote(_remote_source())} '
                  + f'{shlex.join(_with_interpreter(command, python))}\n')
        base = ssh_base(host, ssh_options, server_timeout)
        specs.append(_Spec(name, host.name, base + ['bash -s'], this_env, script, base))
    return specs


def build_ssh_commands(command, hosts, num_workers, num_servers, env, cwd, ssh_options=()):
    """Plan the remote (server and worker) processes of an ssh job.

    hosts: [Host] as returned by read_hostfile; env: job variables to export
    (DMLC_*, the secret, user variables); the per-role DMLC_ROLE, DMLC_TASK_ID and
    SSDSGD_ROLE_NAME are added here. Returns [(role_name, ssh_argv, stdin_script)].
    """
    return [(s.name, s.argv, s.stdin)
            for s in _ssh_specs(command, hosts, num_workers, num_servers, env, cwd, ssh_options)]


def _plan(command, num_workers, num_servers, launcher, hostfile, env, port, interface,
          timeout, stall_timeout, job_dir, ssh_options=(), role_env=None, server_timeout=None):
    """Validate the job and return (specs in start order, secret). role_env: {role: {K: V}}."""
    if not command:
        raise UsageError('no command given')
    if num_workers < 1 or num_servers < 1:
        raise UsageError(f'need at least 1 worker and 1 server (got -n {num_workers} -s {num_servers})')
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f'port {port} is out of range')
    for label, value in (('--timeout', timeout), ('--stall-timeout', stall_timeout),
                         ('--server-timeout', server_timeout)):
        if value is not None and value <= 0:
            raise UsageError(f'{label} must be > 0')
    if server_timeout is not None and server_timeout < 3 * LIVENESS_INTERVAL:
        raise UsageError(f'--server-timeout must be at least {3 * LIVENESS_INTERVAL:g} s (a liveness file is touched '
                         f'every {LIVENESS_INTERVAL:g} s)')
    if server_timeout is not None and stall_timeout is not None and server_timeout >= stall_timeout:
        raise UsageError(f'--server-timeout ({server_timeout:g} s) must be shorter than --stall-timeout '
                         f'({stall_timeout:g} s): a stopped server stalls every worker')
    for key in [*env, *(k for r in (role_env or {}).values() for k in r)]:
        if not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key):
            raise UsageError(f'bad environment variable name {key!r}')
    if len(command) == 1 and re.search(r'[\s;&|<>$`\'"*?]', command[0]):
        command = ['/bin/sh', '-c', command[0]]  # one string: a shell command line, as MXNet's launcher runs it

    if launcher == 'local':
        interface = interface or 'lo'
        root_uri = '127.0.0.1'
    elif launcher == 'ssh':
        if not hostfile:
            raise UsageError('--launcher ssh needs -H HOSTFILE')
        hosts = read_hosts(hostfile)
        if not interface:
            raise UsageError('--launcher ssh needs --interface (the network the hosts reach this machine on)')
        root_uri = interface_ip(interface)
    else:
        raise UsageError(f'unknown launcher {launcher!r}')

    secret = secrets.token_hex(32)
    python_path = [HOOKS_DIR, env.get('PYTHONPATH', os.environ.get('PYTHONPATH'))]
    job_env = {
        **env,
        'DMLC_PS_ROOT_URI': root_uri,
        'DMLC_PS_ROOT_PORT': str(_pick_port(root_uri, port)),
        'DMLC_NUM_WORKER': str(num_workers),
        'DMLC_NUM_SERVER': str(num_servers),
        'DMLC_INTERFACE': interface,
        # pyhooks/sitecustomize.py: an uncaught exception ends a role at once. The package itself needs no
        # PYTHONPATH (it is installed); the hook does (see that file for why).
        'PYTHONPATH': os.pathsep.join(filter(None, python_path)),
        SECRET_ENV: secret,
    }
    if 'OMP_NUM_THREADS' not in env and 'OMP_NUM_THREADS' not in os.environ:
        # Several roles per machine would each start one thread per core and fight over them.
        print('launch: OMP_NUM_THREADS is not set; using 1 per process (set it to choose)', file=sys.stderr)
        job_env['OMP_NUM_THREADS'] = '1'
    elif launcher == 'ssh' and 'OMP_NUM_THREADS' not in env:
        job_env['OMP_NUM_THREADS'] = os.environ['OMP_NUM_THREADS']  # as MXNet's ssh launcher forwards it

    # Local processes: ps-lite binds this address; a bare `python` is the launching interpreter.
    local_env = {**job_env, 'DMLC_NODE_HOST': root_uri,
                 'PATH': os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')])}
    if launcher == 'local':
        specs = [_Spec(name, 'localhost', _with_interpreter(command, sys.executable),
                       _role_env(local_env, role, task_id, name, job_dir, role_env), None, None)
                 for role, task_id, name in _roles(num_workers, num_servers)]
        return specs, secret
    # ssh: the scheduler runs here, on the interface the remote hosts connect to.
    scheduler = _Spec('scheduler', 'localhost', _with_interpreter(command, sys.executable),
                      _role_env(local_env, 'scheduler', 0, 'scheduler', job_dir, role_env), None, None)
    return [scheduler] + _ssh_specs(command, hosts, num_workers, num_servers, job_env, os.getcwd(),
                                    ssh_options, job_dir, role_env, server_timeout), secret


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
    """A started process, the tail of its output, its heartbeat file and, for ssh, its remote group."""

    def __init__(self, spec):
        self.name = spec.name
        self.host = spec.host
        self.ssh = spec.ssh
        self.is_worker = spec.env[ROLE_ENV] == 'worker'
        self.heartbeat = spec.env.get(HEARTBEAT_ENV)
        self.liveness = spec.env.get(LIVENESS_ENV)
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.started = time.monotonic()
        self.rank = None
        self.pgid = None          # the remote process group (ssh), from remote.py's report
        self.remote_code = None   # how the remote role ended (negative: signal), from remote.py
        self.popen = subprocess.Popen(
            spec.argv,
            env=None if spec.stdin else {**os.environ, **spec.env},  # ssh itself gets only our environment
            stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: cleanup also reaches grandchildren
            preexec_fn=_die_with_parent(os.getpid()))
        if spec.stdin:
            # The pipe stays open: remote.py ends the role when it closes (when this ssh client dies).
            try:
                self.popen.stdin.write(spec.stdin.encode())
                self.popen.stdin.flush()
            except BrokenPipeError:
                pass  # ssh already exited; the supervisor reports its exit code
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def label(self):
        return self.name if self.rank is None else f'{self.name} (rank {self.rank})'

    def _marker(self, line):
        """Take in a `remote.MARK` line; False if it is not one of ours (it is shown then)."""
        words = line[len(remote.MARK):].split()
        try:
            if words[0] == 'pgid' and self.ssh:
                self.pgid = int(words[1])
            elif words[0] == 'exit' and self.ssh:
                self.remote_code = int(words[1])
            elif words[0] == RANK_MARK:
                self.rank = int(words[1])
            else:
                return False
        except (IndexError, ValueError):
            return False
        return True

    def _pump(self):
        with self.popen.stdout as pipe:
            for raw in pipe:
                line = raw.decode(errors='replace').rstrip('\r\n')
                if line.startswith(remote.MARK) and self._marker(line):
                    continue
                self.tail.append(line)
                with _print_lock:  # one write per line, so lines of different roles never interleave
                    sys.stdout.write(f'[{self.label()}] {line}\n')
                    sys.stdout.flush()

    def exit_code(self):
        """How the role ended: None while running; for ssh the remote role's own code or signal."""
        code = self.popen.poll()
        if code is None or not self.ssh:
            return code
        self.reader.join(timeout=1.0)  # the exit report is the last line remote.py prints
        return self.remote_code if self.remote_code is not None else code

    def describe_exit(self):
        code = self.exit_code()
        if self.ssh and self.remote_code is None:
            why = (f': the connection to {self.host} was lost or refused (an unreachable host ends ssh within the '
                   f'server timeout)' if code == 255 else '')
            return f'lost: ssh to {self.host} exited with code {code} before the role reported its end{why}'
        where = f' on {self.host}' if self.ssh else ''
        return _describe_exit(code) + where

    def idle_seconds(self, path=None):
        """Seconds since the worker last touched its heartbeat file (since its start if it never did);
        with `path`, since that file (the liveness file of a server or the scheduler) was touched."""
        try:
            return time.time() - os.stat(path or self.heartbeat).st_mtime
        except FileNotFoundError:
            return time.monotonic() - self.started

    def silence(self, seconds):
        """What to say about a server or the scheduler that gave no sign of life for `seconds`."""
        if self.ssh:
            why = (f'its process is stopped or hung, {self.host} is unreachable, or it lost the shared '
                   f'file system (the liveness file is there)')
        else:
            states = _group_states(self.popen.pid)
            why = ('its process is stopped (SIGSTOP or SIGTSTP)' if states & {'T', 't'}
                   else f'its process is hung (state {"".join(sorted(states)) or "unknown"})')
        return (f'on {self.host} gave no sign of life for {seconds:.0f} s (server timeout): {why}; the '
                f'workers cannot go on without it')

    def report(self, what):
        if self.popen.returncode is not None:
            self.reader.join(timeout=1.0)  # let the reader catch the last lines the process printed
        lines = [f'launch: {self.label()} {what}']
        if self.tail:
            lines += [f'launch: last output of {self.label()}:'] + [f'  {line}' for line in self.tail]
        print('\n'.join(lines), file=sys.stderr, flush=True)


def _group_states(pgid):
    """One-letter states (R, S, D, T, Z, ...) of the local processes of a process group, from /proc."""
    states = set()
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open(f'/proc/{pid}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()   # state, ppid, pgrp, ...
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            states.add(fields[0])
    return states


def _stalled_culprit(workers):
    """(worker, reason) to name once a worker stalled. A stopped worker stalls the others too: they wait
    for it in a synchronous step, and which heartbeat is older is chance. So a local worker whose process
    is stopped comes first (ssh roles: their state is not visible from here), then the one silent longest."""
    running = [w for w in workers if w.popen.returncode is None]
    for w in running:
        if not w.ssh and _group_states(w.popen.pid) & {'T', 't'}:
            return w, ': its process is stopped (SIGSTOP or SIGTSTP); the other workers wait for it'
    culprit = max(running, key=lambda w: w.idle_seconds())
    if culprit.ssh:
        # Every process is up (a dead one is reported first) and none is stopped that we can see: a link
        # that drops large packets or a firewall stalls the job just so (ps-lite retries nothing).
        return culprit, (f' (every role is still running: check the network between the hosts and their '
                         f'firewalls; `ping -M do -s 1472 {culprit.host}` sends the largest packet a 1500-byte '
                         f'MTU carries)')
    return culprit, ''


def _describe_exit(returncode):
    if returncode >= 0:
        return f'exited with code {returncode}'
    try:
        return f'killed by {signal.Signals(-returncode).name}'
    except ValueError:  # e.g. real-time signals have no name
        return f'killed by signal {-returncode}'


def _supervise(children, timeout, stall_timeout, received, server_timeout=None):
    """Watch the children until the job is decided; return the exit code. Cleanup is the caller's."""
    workers = [c for c in children if c.is_worker]
    watched = [c for c in children if c.liveness] if server_timeout is not None else []
    start = time.monotonic()
    workers_done_at = None
    while True:
        if received:
            print(f'launch: received {signal.Signals(received[0]).name}, stopping the job', file=sys.stderr)
            return 128 + received[0]
        for c in children:
            if c.exit_code() not in (None, 0):
                c.report(c.describe_exit())
                return 1
        now = time.monotonic()
        if all(w.exit_code() == 0 for w in workers):
            if all(c.exit_code() == 0 for c in children):
                return 0
            workers_done_at = workers_done_at or now
            if now - workers_done_at > SHUTDOWN_GRACE:
                return 0  # the work is done; lingering servers/scheduler are killed by the cleanup
        else:
            if timeout is not None and now - start > timeout:
                print(f'launch: timeout after {timeout:g} s', file=sys.stderr)
                return 124
            # Servers and the scheduler first: a stopped server stalls every worker, and it is the
            # one to name (server_timeout < stall_timeout).
            for c in watched:
                silent = c.idle_seconds(c.liveness)
                if c.popen.returncode is None and silent > server_timeout:
                    c.report(c.silence(silent))
                    return 1
            if stall_timeout is not None and any(w.popen.returncode is None and w.idle_seconds() > stall_timeout
                                                 for w in workers):
                w, why = _stalled_culprit(workers)
                w.report(f'made no progress for {stall_timeout:g} s{why}')
                return 1
        time.sleep(POLL_SECONDS)


def _signal_groups(children, signum):
    for c in children:
        try:
            os.killpg(c.popen.pid, signum)
        except ProcessLookupError:
            pass  # the whole group is gone already


# Run by `sh` on an ssh host with the process group ids as arguments: SIGTERM the groups, SIGKILL
# what is left after the grace period, exit 0 only when no process of any group is left.
_REMOTE_KILL = """
alive() { left=; for g in "$@"; do kill -0 -- -$g 2>/dev/null && left="$left $g"; done; }
for g in "$@"; do kill -TERM -- -$g 2>/dev/null; kill -CONT -- -$g 2>/dev/null; done
n=0; alive "$@"
while [ -n "$left" ] && [ $n -lt %d ]; do sleep 0.1; n=$((n+1)); alive $left; done
for g in $left; do kill -KILL -- -$g 2>/dev/null; done
n=0; alive $left
while [ -n "$left" ] && [ $n -lt 20 ]; do sleep 0.1; n=$((n+1)); alive $left; done
[ -z "$left" ] || { echo "process groups still alive:$left"; exit 1; }
""" % int(TERM_GRACE * 10)


def _start_remote_kills(children):
    """One ssh per host that ends that host's reported process groups; [(host, [children], Popen)]."""
    by_host = {}
    for c in children:
        if c.ssh and c.pgid is not None:
            by_host.setdefault(tuple(c.ssh), []).append(c)
    kills = []
    for ssh, group in by_host.items():
        argv = list(ssh) + [f'sh -c {shlex.quote(_REMOTE_KILL)} kill ' + ' '.join(str(c.pgid) for c in group)]
        kills.append((group[0].host, group, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                             stderr=subprocess.STDOUT, start_new_session=True)))
    return kills


def _cleanup(children):
    """End every process of the job, here and on every ssh host; False if that cannot be confirmed.

    Local process groups get SIGTERM (and SIGCONT, so a stopped process receives it at once), SIGKILL
    after TERM_GRACE. Remote groups are ended the same way
    over one ssh connection per host, in parallel; closing our ssh clients' stdin also tells remote.py
    to end its group, which covers roles that had not reported their group id yet."""
    kills = _start_remote_kills(children)
    for c in children:
        if c.popen.stdin:
            try:
                c.popen.stdin.close()
            except OSError:  # ssh already gone
                pass
    _signal_groups([c for c in children if not c.ssh], signal.SIGTERM)
    _signal_groups([c for c in children if not c.ssh], signal.SIGCONT)  # a stopped process gets SIGTERM now
    deadline = time.monotonic() + TERM_GRACE
    while any(c.popen.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    _signal_groups(children, signal.SIGKILL)  # also hits grandchildren that outlived their group leader
    for c in children:
        c.popen.wait()
        c.reader.join(timeout=1.0)
    ok = True
    for host, group, proc in kills:
        try:
            out, _ = proc.communicate(timeout=REMOTE_KILL_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        if proc.returncode != 0:
            ok = False
            names = ', '.join(c.label() for c in group)
            print(f'launch: cannot confirm that {names} on {host} ended (ssh exit {proc.returncode}): '
                  f'{out.decode(errors="replace").strip()}', file=sys.stderr, flush=True)
    lost = [c for c in children if c.ssh and c.pgid is None and c.remote_code is None]
    for c in lost:
        print(f'launch: {c.label()} on {c.host} never reported its process group; if it started, '
              f'it ends when its ssh connection closes', file=sys.stderr, flush=True)
    return ok


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
                children.append(_Child(spec))
            except OSError as e:
                print(f'launch: cannot start {spec.name}: {e}', file=sys.stderr)
                return 1
        code = _supervise(children, timeout, stall_timeout, received, server_timeout)
        return code
    finally:
        started = time.monotonic()
        if _cleanup(children):
            if any(c.ssh for c in children):
                print(f'launch: every process on every host has ended ({time.monotonic() - started:.1f} s '
                      f'cleanup)', file=sys.stderr, flush=True)
        elif code == 0:
            code = 1
        restore_signals()


JOB_DIR_PREFIX = 'ssdsgd-launch-'    # the launcher's job folder (heartbeat and liveness files)
OWNER_FILE = 'launcher'              # in it: host, PID and start time of the launcher that made it


def _start_time(pid):
    """The kernel's start time of process pid (clock ticks since boot), or None if there is none."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _write_owner(job_path):
    with open(os.path.join(job_path, OWNER_FILE), 'w') as f:
        f.write(f'{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}\n')


def remove_stale_job_dirs(parent, prefix):
    """Remove the job folders that launchers on this host left when they were SIGKILLed (no cleanup
    ran): those whose owner process is gone. A folder without an owner file, or made on another host
    (ssh job folders live on a shared file system), is left alone. Returns the removed paths."""
    import shutil
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                host, pid, started = f.read().split()
        except (OSError, ValueError):
            continue
        if host == socket.gethostname() and _start_time(int(pid)) != started:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def run_job(command, num_workers, num_servers=None, *, launcher='local', hostfile=None, env=None,
            timeout=None, port=None, interface=None, stall_timeout=None, dry_run=False, ssh_options=(),
            role_env=None, server_timeout=None):
    """Run `command` as scheduler, servers and workers; return the exit code the CLI exits with.

    num_servers defaults to num_workers (as in MXNet's launcher). ssh_options: extra ssh arguments
    (e.g. ['-F', config, '-i', key, '-l', user, '-o', 'Opt=v']); role_env: {role: {K: V}} added for
    that role only ('scheduler', 'server', 'worker'). Call from the main thread:
    SIGINT/SIGTERM handling and PR_SET_PDEATHSIG (which fires when the forking *thread* exits) both
    assume it.
    """
    if num_servers is None:
        num_servers = num_workers
    # Heartbeat files: ssh workers write them from their hosts, so for ssh jobs they live under the
    # working directory, which every host shares (the remote roles run in it too).
    prefix, parent = ('.' + JOB_DIR_PREFIX, os.getcwd()) if launcher == 'ssh' else (JOB_DIR_PREFIX, None)
    try:
        remove_stale_job_dirs(parent or tempfile.gettempdir(), prefix)
        job_dir = tempfile.TemporaryDirectory(prefix=prefix, dir=parent)
        _write_owner(job_dir.name)
    except OSError as e:
        print(f'launch: cannot create the job folder in {os.getcwd()} (the ssh launcher needs a writable '
              f'working directory on the file system the hosts share): {e.strerror}', file=sys.stderr)
        return 2
    with job_dir as job_path:
        try:
            specs, secret = _plan(command, num_workers, num_servers, launcher, hostfile, dict(env or {}),
                                  port, interface, timeout, stall_timeout, job_path, list(ssh_options),
                                  role_env, server_timeout)
        except UsageError as e:
            print(f'launch: {e}', file=sys.stderr)
            return 2
        if dry_run:
            _print_plan(specs, secret)
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


def _parser():
    p = argparse.ArgumentParser(
        prog='launch.py',
        description='Run COMMAND as 1 scheduler + S servers + W workers of an MXNet parameter-server job; '
                    'the command branches on DMLC_ROLE. Fails fast when any process fails.')
    p.add_argument('-n', '--num-workers', type=int, required=True, help='number of workers')
    p.add_argument('-s', '--num-servers', type=int, help='number of servers (default: the number of workers)')
    p.add_argument('--launcher', choices=('local', 'ssh'), default='local')
    p.add_argument('-H', '--hostfile',
                   help='ssh launcher: a file with one `host[:sshport] [slots=N] [interface=IF] [python=PATH]` a '
                        'line, or a list `h1:2,h2:2` (host:slots, as horovodrun and mpirun take it)')
    p.add_argument('--env', type=lambda t: _env_item(t, allow_name=True), action='append', default=[],
                   metavar='K=V|NAME', help='environment variable for every process; a bare NAME passes its '
                                            'value from here (repeat for more)')
    p.add_argument('--env-server', type=lambda t: _env_item(t, allow_name=False), action='append', default=[],
                   metavar='K=V', help='environment variable for the servers (and the scheduler) only')
    p.add_argument('--env-worker', type=lambda t: _env_item(t, allow_name=False), action='append', default=[],
                   metavar='K=V', help='environment variable for the workers only')
    p.add_argument('--timeout', type=float, help='stop the job (exit 124) after this many seconds')
    p.add_argument('--port', type=int, help='scheduler port (default: a free one)')
    p.add_argument('--interface', help='network interface of this machine (default lo for local; required '
                                       'for ssh: the one the hosts reach it on)')
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
    p.add_argument('--sync-dst-dir', help=argparse.SUPPRESS)
    p.add_argument('--dry-run', action='store_true', help='print the planned processes and exit')
    p.add_argument('command', nargs=argparse.REMAINDER, help='command to run (optionally after --)')
    return p


def ssh_options(user=None, identity=None, config=None, options=()):
    """ssh arguments for the launcher from the CLI's or the YAML's ssh settings."""
    argv = []
    if config:
        argv += ['-F', config]
    if identity:
        argv += ['-i', identity]
    if user:
        argv += ['-l', user]
    for opt in options:
        argv += ['-o', opt]
    return argv


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.sync_dst_dir:
        # MXNet's launcher copies the working folder to every host; ours runs it in place on shared storage.
        print('launch: --sync-dst-dir is not supported: the working directory must be on a file system '
              'every host shares (the roles run in it)', file=sys.stderr)
        sys.exit(2)
    for path, what in ((args.ssh_identity, '--ssh-identity'), (args.ssh_config, '--ssh-config')):
        if path and not os.path.isfile(path):
            print(f'launch: {what}: file {path} does not exist', file=sys.stderr)
            sys.exit(2)
    command = args.command[1:] if args.command[:1] == ['--'] else args.command
    env = dict(args.env)
    role_env = {'server': dict(args.env_server), 'scheduler': dict(args.env_server),
                'worker': dict(args.env_worker)}
    sys.exit(run_job(command, args.num_workers, args.num_servers, launcher=args.launcher,
                     hostfile=args.hostfile, env=env, timeout=args.timeout, port=args.port,
                     interface=args.interface, stall_timeout=args.stall_timeout,
                     server_timeout=args.server_timeout, dry_run=args.dry_run,
                     ssh_options=ssh_options(args.ssh_user, args.ssh_identity, args.ssh_config, args.ssh_option),
                     role_env=role_env))
