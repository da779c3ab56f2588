"""Whether ssh hosts answer: `ssh HOST true`, bounded, all hosts at once. ssdsgd-run asks it before a
restart (spares.py): a host that does not answer gets no role.

A host answers when ssh connects, logs in and runs `true` within CONNECT_TIMEOUT (ssh's ConnectTimeout,
unless the user's ssh options or configuration set one: theirs comes first) plus RUN_GRACE for the login
and the command. Anything else (no route, a refused or timed-out connection, a refused login, no answer
in time) is a host the job cannot use now, said in ssh's words where it has some (ssh.SSH_FAILURES).
"""
import os
import signal
import subprocess
import time

from ssdsgd.launch.ssh import ssh_base, ssh_failure

CONNECT_TIMEOUT = 5     # seconds: ssh's ConnectTimeout for a probe
RUN_GRACE = 10          # seconds after the connect timeout before a probe that hangs counts as no answer


def start_probe(host, ssh_options=()):
    """The running `ssh HOST true` of a probe (its own process group, so that it can be ended whole)."""
    argv = ssh_base(host, [*ssh_options, '-o', f'ConnectTimeout={CONNECT_TIMEOUT:g}']) + ['true']
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _verdict(proc, deadline):
    """None if the probe's host answered, else why not."""
    try:
        out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f'no answer within {CONNECT_TIMEOUT + RUN_GRACE:g} s'
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in out.decode(errors='replace').splitlines() if line.strip()]
    said = ssh_failure(lines)
    if said:
        return said
    return f'ssh exited with code {proc.returncode}' + (f': {lines[-1]}' if lines else '')


def probe_hosts(hosts, ssh_options=()):
    """{host: why it does not answer} of the hosts that do not; the probes run at the same time, so the whole
    takes at most CONNECT_TIMEOUT + RUN_GRACE seconds."""
    unique = list(dict.fromkeys(hosts))
    deadline = time.monotonic() + CONNECT_TIMEOUT + RUN_GRACE
    running = [(host, start_probe(host, ssh_options)) for host in unique]
    found = {}
    for host, proc in running:
        why = _verdict(proc, deadline)
        if why is not None:
            found[host] = why
    return found
