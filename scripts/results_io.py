"""Small helpers the experiment scripts share: their input and output files, names used in their
tables, and their SIGTERM handling."""
import csv
import json
import os
import signal

COMPUTE_BOUND = "compute_bound"          # bench_network's algorithm key for the 1-worker, no-comm. run


def rate_name(rate):
    """A link rate in Mbit/s as the tables and plots print it (0 or None: no limit)."""
    return "unlimited" if not rate else f"{rate:g} Mbit/s"


def read_jsonl(path):
    """Records of a metrics.jsonl ([] when the file is missing); lines that do not parse, such as a
    last line cut off by a killed job, are skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


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
    background `nohup` run ignores SIGINT; SIGTERM is how it gets stopped). Returns the previous
    handler, for callers that put it back."""
    return signal.signal(signal.SIGTERM, _stop)
