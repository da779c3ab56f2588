"""Waits of ssdsgd-run between two launches (the restart back-off, the wait for a lost host) that a stop
cuts short: SIGTERM and SIGHUP are caught for the wait's length, as the launcher catches them during a job."""
import signal
import time


def wait_unless_stopped(seconds, announce=None):
    """Sleep `seconds`; the signal (SIGTERM, SIGHUP) that stopped the wait, or None. The launcher catches
    these during the job; between two launches nobody did, and they killed the front end without a word,
    before launcher.log had a line of it or the folder locks were released. Ctrl-C raises KeyboardInterrupt,
    as anywhere. announce: called first, once the signals are caught (the line saying the wait: a signal
    sent on seeing it found no handler yet, and killed the front end)."""
    received = []
    old = {s: signal.signal(s, lambda signum, frame: received.append(signum))
           for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if announce is not None:
            announce()
        end = time.monotonic() + seconds
        while True:   # short sleeps: a handler that returns does not cut a sleep short
            time.sleep(max(0.0, min(0.1, end - time.monotonic())))
            if received or time.monotonic() >= end:
                break
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return received[0] if received else None
