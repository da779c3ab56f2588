"""What ssdsgd-run does between two launches (the restart back-off, the probes of the hosts, the wait for a lost
host), cut short by a stop. The launcher catches SIGTERM and SIGHUP during a job; between two launches nobody
did, and they killed the front end without a word, before launcher.log had a line of it or the folder locks
were released. Ctrl-C raises KeyboardInterrupt, as anywhere."""
import contextlib
import signal
import time


@contextlib.contextmanager
def stops_caught():
    """SIGTERM and SIGHUP are caught inside: yields the list of those received, in order (main thread only)."""
    received = []
    old = {s: signal.signal(s, lambda signum, frame: received.append(signum))
           for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield received
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def wait_unless_stopped(seconds, announce=None):
    """Sleep `seconds`; the signal (SIGTERM, SIGHUP) that stopped the wait, or None. announce: called first,
    once the signals are caught (the line saying the wait: a signal sent on seeing it found no handler yet, and
    killed the front end)."""
    with stops_caught() as received:
        if announce is not None:
            announce()
        end = time.monotonic() + seconds
        while True:   # short sleeps: a handler that returns does not cut a sleep short
            time.sleep(max(0.0, min(0.1, end - time.monotonic())))
            if received or time.monotonic() >= end:
                break
    return received[0] if received else None
