"""ssh for the launcher: the ssh argv, the script that starts a role on its host under remote.py, and the
cleanup that ends a host's process groups.

A role's script goes to `ssh HOST bash -s` on standard input (with the job secret: argv is visible to
every user via ps). It runs remote.py, which starts the role and reports on it, then reports how remote.py
itself ended: a wrapper killed from outside (SIGKILL) is named as such, not as a lost connection.
"""
import os
import shlex
import socket
import subprocess

from ssdsgd.env import MARK, WRAPPER_ENV
from ssdsgd.launch import remote

TERM_GRACE = remote.TERM_GRACE   # between SIGTERM and SIGKILL during cleanup, as remote.py ends a role
WRAPPER_MARK = 'wrapper'   # `MARK + 'wrapper CODE'`: how remote.py ended (the shell's $?)
_REMOTE_SOURCE = None  # remote.py's text, read on first use


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


class SshConfigError(Exception):
    """ssh refuses its own configuration (an unknown option, a bad -F file): its message."""


def _ssh_config_of(host, ssh_options):
    """{key: value} of ssh's configuration for `host` as `ssh -G` prints it (no connection is made), or None
    if ssh cannot be run; SshConfigError with ssh's message if it refuses the options or configuration."""
    argv = ssh_base(host, ssh_options)
    try:
        proc = subprocess.run([argv[0], '-G', *argv[1:]], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        raise SshConfigError(lines[0] if lines else f'ssh -G exited with code {proc.returncode}')
    return dict(line.partition(' ')[::2] for line in proc.stdout.splitlines())


def resolve_hosts(hosts, ssh_options=()):
    """[(host, the name ssh would look up, its addresses, or None and why it does not resolve)] for the
    hosts whose name is looked up here. The name is the ssh configuration's HostName (an alias in
    ~/.ssh/config or -F resolves through it); a host reached through a proxy (ProxyJump, ProxyCommand) or
    with CanonicalizeHostname is left out, as its name is looked up elsewhere or with ssh's own domain
    list. SshConfigError if ssh refuses the options."""
    found = []
    for host in dict.fromkeys(hosts):
        config = _ssh_config_of(host, ssh_options)
        if config is None or config.get('canonicalizehostname', 'false') not in ('false', 'no'):
            continue
        if any(config.get(key, 'none') != 'none' for key in ('proxycommand', 'proxyjump')):
            continue
        name = config.get('hostname', host.name)
        try:
            found.append((host, name, {info[4][0] for info in socket.getaddrinfo(name, None)}, None))
        except (socket.gaierror, UnicodeError) as e:
            found.append((host, name, None, getattr(e, 'strerror', None) or str(e)))
    return found


def unresolved_host(hosts, ssh_options=()):
    """(host, the name ssh would look up, why) for the first host whose name does not resolve here, else
    None (resolve_hosts)."""
    return next(((host, name, why) for host, name, addresses, why in resolve_hosts(hosts, ssh_options)
                 if addresses is None), None)


# What ssh prints when it cannot reach or log in to a host, and what the launcher then says instead of a
# lost connection (the role never started).
SSH_FAILURES = (
    ('Could not resolve hostname', 'ssh could not resolve the host name (check the host file, /etc/hosts, DNS or '
                                   'the ssh configuration)'),
    ('Connection refused', 'the host refused the ssh connection (is sshd listening on that port?)'),
    ('Connection timed out', 'the ssh connection timed out (the host is down, or a firewall drops it)'),
    ('No route to host', 'there is no route to the host'),
    ('Network is unreachable', 'the network of the host is unreachable from here'),
    ('Permission denied', 'ssh could not log in (the launcher needs passwordless ssh: BatchMode=yes)'),
    ('Host key verification failed', 'the host key differs from the one in known_hosts'),
)


def ssh_failure(lines):
    """What ssh's own messages among `lines` (a role's output before it started) say went wrong, or None."""
    for line in lines:
        for text, what in SSH_FAILURES:
            if text in line:
                return what
    return None


def _remote_source():
    global _REMOTE_SOURCE
    if _REMOTE_SOURCE is None:
        with open(remote.__file__) as f:
            _REMOTE_SOURCE = f.read()
    return _REMOTE_SOURCE


def role_script(env, python, cwd, argv):
    """The bash script that runs one role on its host: export `env`, cd to `cwd`, run `argv` under
    remote.py with `python`, then report remote.py's own exit status.

    PATH starts with the interpreter's folder, so a bare `python` in the command (or in a shell command)
    is that interpreter. remote.py and the report are one line: bash reads a whole line before running
    it, so nothing of the script is left on standard input, which remote.py watches for its end."""
    return ('set -e\n'
            + ''.join(f'export {k}={shlex.quote(v)}\n' for k, v in env.items())
            + f'export PATH={shlex.quote(os.path.dirname(python))}:"$PATH"\n'
            + f'cd {shlex.quote(cwd)}\n'
            + f'export {WRAPPER_ENV}=1\n'
            # bash's own stderr goes to /dev/null here: it would print remote.py's whole source with "Killed".
            + f'exec 3>&2 2>/dev/null; code=0; {shlex.quote(python)} -c {shlex.quote(_remote_source())} '
            + f'{shlex.join(argv)} 2>&3 3>&- || code=$?; echo "{MARK}{WRAPPER_MARK} $code"; exit $code\n')


# Run by `sh` on an ssh host with the process group ids as arguments: SIGTERM the groups, SIGKILL
# what is left after the grace period, exit 0 only when no process of any group is left. `kill -SIG -PGID`,
# not `kill -SIG -- -PGID`: dash (/bin/sh on Debian) refuses the `--` form ("Illegal number").
_REMOTE_KILL = """
alive() { left=; for g in "$@"; do kill -0 -$g 2>/dev/null && left="$left $g"; done; }
for g in "$@"; do kill -TERM -$g 2>/dev/null; kill -CONT -$g 2>/dev/null; done
n=0; alive "$@"
while [ -n "$left" ] && [ $n -lt %d ]; do sleep 0.1; n=$((n+1)); alive $left; done
for g in $left; do kill -KILL -$g 2>/dev/null; done
n=0; alive $left
while [ -n "$left" ] && [ $n -lt 20 ]; do sleep 0.1; n=$((n+1)); alive $left; done
[ -z "$left" ] || { echo "process groups still alive:$left"; exit 1; }
"""


def start_remote_kills(children):
    """One ssh per host that ends that host's reported process groups; [(host, [children], Popen)]."""
    by_host = {}
    for c in children:
        if c.ssh and c.pgid is not None:
            by_host.setdefault(tuple(c.ssh), []).append(c)
    kills = []
    for ssh, group in by_host.items():
        script = _REMOTE_KILL % int(TERM_GRACE * 10)
        argv = list(ssh) + [f'sh -c {shlex.quote(script)} kill ' + ' '.join(str(c.pgid) for c in group)]
        kills.append((group[0].host, group, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                             stderr=subprocess.STDOUT, start_new_session=True)))
    return kills
