"""Ending every process of a job, here and on every ssh host, and saying whether that is confirmed.

Local process groups get SIGTERM (and SIGCONT, so a stopped process receives it at once), SIGKILL after
TERM_GRACE. Remote groups are ended the same way over one ssh connection per host, in parallel; closing
our ssh clients' stdin also tells remote.py to end its group, which covers roles that had not reported
their group id yet.
"""
import os
import signal
import subprocess
import sys
import time

from ssdsgd.launch.ssh import TERM_GRACE, start_remote_kills
from ssdsgd.launch.watch import POLL_SECONDS

REMOTE_KILL_TIMEOUT = 20.0  # one ssh round to a host that ends and checks its process groups


def signal_groups(children, signum):
    for c in children:
        try:
            os.killpg(c.popen.pid, signum)
        except ProcessLookupError:
            pass  # the whole group is gone already


def _end_local(children):
    for c in children:
        if c.popen.stdin:
            try:
                c.popen.stdin.close()
            except OSError:  # ssh already gone
                pass
    local = [c for c in children if not c.ssh]
    signal_groups(local, signal.SIGTERM)
    signal_groups(local, signal.SIGCONT)  # a stopped process gets SIGTERM now
    deadline = time.monotonic() + TERM_GRACE
    while any(c.popen.poll() is None for c in children) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    signal_groups(children, signal.SIGKILL)  # also hits grandchildren that outlived their group leader
    for c in children:
        c.popen.wait()
        c.reader.join(timeout=1.0)


def _confirm_remote(kills):
    """Wait for the remote kills; False (and say which roles) where a host did not confirm."""
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
    return ok


def cleanup(children):
    """End every process of the job, here and on every ssh host; False if that cannot be confirmed."""
    kills = start_remote_kills(children)
    _end_local(children)
    ok = _confirm_remote(kills)
    lost = [c for c in children if c.ssh and c.pgid is None and c.remote_code is None and not c.never_reached()]
    for c in lost:
        print(f'launch: {c.label()} on {c.host} never reported its process group; if it started, '
              f'it ends when its ssh connection closes', file=sys.stderr, flush=True)
    return ok
