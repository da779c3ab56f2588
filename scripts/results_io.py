"""Small helpers the experiment scripts share: their output files and their SIGTERM handling."""
import csv
import signal


def write_csv(path, rows):
    """One row per dict; the columns are every key any row has, sorted."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text + "\n")


def _stop(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm():
    """Make SIGTERM unwind like Ctrl-C, so a running job is ended and its namespace deleted (a
    background `nohup` run ignores SIGINT; SIGTERM is how it gets stopped)."""
    signal.signal(signal.SIGTERM, _stop)
