"""Supervision of a running job: the first role that fails, stalls or goes silent decides the job.

Two kinds of heartbeat, both files in the job folder whose mtime is read here: a worker touches its own
every step (progress; --stall-timeout), and the Python process of every server and of the scheduler
touches its own every second from a thread that pyhooks/sitecustomize.py starts (liveness;
--server-timeout). A stopped (SIGSTOP), hung or cut-off server never exits, so without the second one it
would only show up as a stalled worker; with it, the server is named, with its host.
"""
import os
import re
import signal
import socket
import sys
import time

from ssdsgd.launch.children import group_states
from ssdsgd.launch.strangers import Roll, abort_note

POLL_SECONDS = 0.1
SHUTDOWN_GRACE = 10.0  # ps-lite servers/scheduler exit by themselves shortly after the workers
NOTE_SECONDS = 5.0     # a pause longer than this (and than 3 usual step gaps) is said as it happens
USUAL_GAPS = 20        # the step gaps the usual one is the median of


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


def _mtime(path):
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


PAUSE_NOTE = re.compile(r'launch: \d\d:\d\d:\d\d ')   # how _say's lines start: no failure (scripts/chaos.py)


def _say(text):
    # With the time of day: launcher.log (ssdsgd-run's copy of these lines) then tells when it happened.
    print(f'launch: {time.strftime("%H:%M:%S")} {text}', file=sys.stderr, flush=True)


class Pauses:
    """Says, as it happens, when the job stops making progress for longer than usual and when it goes on:
    no worker touching its heartbeat (a step) for NOTE_SECONDS and 3 usual step gaps, or a server or the
    scheduler not touching its liveness file (every second) for NOTE_SECONDS. A host cut off for a while,
    a stopped role or an overloaded machine then leaves a trace though the job goes on; the timeouts alone
    say nothing of a pause shorter than they are. Start-up is left out: only files touched once count."""

    def __init__(self, workers, watched, stall_timeout, server_timeout):
        self.workers, self.watched = workers, watched
        self.stall_timeout, self.server_timeout = stall_timeout, server_timeout
        self.newest_step, self.gaps, self.paused_since = None, [], None
        self.silent = {}   # child -> when its liveness file was last touched, while it is said to be silent

    def _usual_gap(self):
        gaps = sorted(self.gaps)
        return gaps[len(gaps) // 2] if gaps else 0.0

    def check(self, now):
        self._check_steps(now)
        for c in self.watched:
            self._check_liveness(c, now)

    def _check_steps(self, now):
        touched = [t for t in (_mtime(w.heartbeat) for w in self.workers if w.heartbeat) if t is not None]
        if not touched:
            return
        newest = max(touched)
        if self.newest_step is not None and newest > self.newest_step:
            if self.paused_since is not None:
                _say(f'the workers go on after {newest - self.paused_since:.0f} s without a step')
                self.paused_since = None
            self.gaps = (self.gaps + [newest - self.newest_step])[-USUAL_GAPS:]
        self.newest_step = newest
        limit = max(NOTE_SECONDS, 3 * self._usual_gap())
        if (self.paused_since is None and self.gaps and now - newest > limit
                and (self.stall_timeout is None or limit < self.stall_timeout)):
            self.paused_since = newest
            timeout = f' (stall timeout {self.stall_timeout:g} s)' if self.stall_timeout is not None else ''
            _say(f'no worker has made a step for {limit:.0f} s{timeout}')

    def _check_liveness(self, c, now):
        touched = _mtime(c.liveness)
        if touched is None or c.popen.returncode is not None:
            return
        if c in self.silent and touched > self.silent[c]:
            _say(f'{c.label()} on {c.host} is alive again after {touched - self.silent.pop(c):.0f} s of silence')
        elif c not in self.silent and now - touched > NOTE_SECONDS and NOTE_SECONDS < self.server_timeout:
            self.silent[c] = touched
            _say(f'{c.label()} on {c.host} has given no sign of life for {NOTE_SECONDS:g} s (server timeout '
                 f'{self.server_timeout:g} s)')


def _name_strangers(c, roll, children):
    """After the report of a failed scheduler: the line naming a stranger that made ps-lite abort, if one did."""
    groups = {c.popen.pid for c in children if not c.ssh} | {c.pgid for c in children if c.pgid is not None}
    hosts = set()
    for host in {c.host for c in children if c.ssh}:
        try:
            hosts.add(socket.gethostbyname(host))
        except OSError:
            pass
    note = abort_note(c, roll, groups, hosts, sum(w.is_worker for w in children),
                      sum(w.name.startswith('server') for w in children))
    if note:
        print(note, file=sys.stderr, flush=True)


def supervise(children, timeout, stall_timeout, received, server_timeout=None):
    """Watch the children until the job is decided; return the exit code. Cleanup is the caller's. Until a
    worker's first step, the connections to the scheduler are looked at (strangers.Roll)."""
    workers = [c for c in children if c.is_worker]
    roots = [c.root for c in children if c.name == 'scheduler' and c.root[1]]
    roll = Roll(int(roots[0][1]), roots[0][0]) if roots else None
    watched = [c for c in children if c.liveness] if server_timeout is not None else []
    pauses = Pauses(workers, watched, stall_timeout, server_timeout)
    start = time.monotonic()
    workers_done_at = None
    while True:
        if received:
            print(f'launch: received {signal.Signals(received[0]).name}, stopping the job', file=sys.stderr)
            return 128 + received[0]
        for c in children:
            if c.exit_code() not in (None, 0):
                c.report(c.describe_exit())
                _name_strangers(c, roll, children)
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
        else:
            pauses.check(time.time())   # file times are wall-clock times
            if roll is not None and not any(_mtime(w.heartbeat) for w in workers if w.heartbeat):
                roll.look(now)
        time.sleep(POLL_SECONDS)
