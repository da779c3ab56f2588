"""Supervision of a running job: the first role that fails, stalls or goes silent decides the job.

Two kinds of heartbeat, both files in the job folder whose mtime is read here: a worker touches its own
every step (progress; --stall-timeout), and the Python process of every server and of the scheduler
touches its own every second from a thread that pyhooks/sitecustomize.py starts (liveness;
--server-timeout). A stopped (SIGSTOP), hung or cut-off server never exits, so without the second one it
would only show up as a stalled worker; with it, the server is named, with its host.
"""
import signal
import sys
import time

from ssdsgd.launch.children import group_states

POLL_SECONDS = 0.1
SHUTDOWN_GRACE = 10.0  # ps-lite servers/scheduler exit by themselves shortly after the workers


def stalled_culprit(workers):
    """(worker, reason) to name once a worker stalled. A stopped worker stalls the others too: they wait
    for it in a synchronous step, and which heartbeat is older is chance. So a local worker whose process
    is stopped comes first (ssh roles: their state is not visible from here), then the one silent longest."""
    running = [w for w in workers if w.popen.returncode is None]
    for w in running:
        if not w.ssh and group_states(w.popen.pid) & {'T', 't'}:
            return w, ': its process is stopped (SIGSTOP or SIGTSTP); the other workers wait for it'
    culprit = max(running, key=lambda w: w.idle_seconds())
    if culprit.ssh:
        # Every process is up (a dead one is reported first) and none is stopped that we can see: a link
        # that drops large packets or a firewall stalls the job just so (ps-lite retries nothing).
        return culprit, (f' (every role is still running: check the network between the hosts and their '
                         f'firewalls; `ping -M do -s 1472 {culprit.host}` sends the largest packet a 1500-byte '
                         f'MTU carries)')
    return culprit, ''


def _silent_or_stalled(watched, workers, stall_timeout, server_timeout):
    """Report the first silent server or scheduler, else the stalled worker; True if one was reported.
    Servers and the scheduler first: a stopped server stalls every worker, and it is the one to name
    (server_timeout < stall_timeout)."""
    for c in watched:
        silent = c.idle_seconds(c.liveness)
        if c.popen.returncode is None and silent > server_timeout:
            c.report(c.silence(silent))
            return True
    if stall_timeout is not None and any(w.popen.returncode is None and w.idle_seconds() > stall_timeout
                                         for w in workers):
        w, why = stalled_culprit(workers)
        w.report(f'made no progress for {stall_timeout:g} s{why}')
        return True
    return False


def supervise(children, timeout, stall_timeout, received, server_timeout=None):
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
        elif timeout is not None and now - start > timeout:
            print(f'launch: timeout after {timeout:g} s', file=sys.stderr)
            return 124
        elif _silent_or_stalled(watched, workers, stall_timeout, server_timeout):
            return 1
        time.sleep(POLL_SECONDS)
