"""What a worker counts while it trains (Counters: bytes, waits, staleness, evaluations, the window since
the last log line), what a checkpoint keeps of it, and the run summary rank 0 writes from every
worker's part (summarize).
"""
import json
import socket
from typing import NamedTuple

import numpy as np

from ssdsgd.ps.commands import num_servers


class StepTimes(NamedTuple):
    compute: float       # seconds of forward, backward and the non-finite check (which waits for them)
    client: float        # seconds in the client's after_backward: its host work and its waits


class Counters:
    """What the training loop counts: this worker's totals, the steps after SSD-SGD's warm-up
    (synchronous; traffic after it is what the delay stage costs), the evaluations (rank 0), the
    window of steps since the last log line, and this attempt's clock (the ETA's): when it started (t),
    and how many epoch ends (evaluations, checkpoints) it had and how long they took."""

    def __init__(self, warmup_steps, eval_tag, t):
        self.t_start = t
        self.epoch_ends, self.epoch_end_seconds = 0, 0.0
        self.warmup_steps = warmup_steps
        self.tag = eval_tag                  # test, or val when a validation split is evaluated
        self.push_bytes = self.pull_bytes = self.eval_pull_bytes = 0
        self.skipped_steps = 0
        self.wait_seconds = self.train_seconds = 0.0
        # Where the steps' time went: the forward and backward pass (until the non-finite check has
        # synchronised it), and the client's after_backward (its waits for the servers included).
        self.compute_seconds = self.client_seconds = 0.0
        self.after_warmup = {"steps": 0, "push_bytes": 0, "pull_bytes": 0}
        self.staleness = {"max": None, "sum": 0, "count": 0}
        self.best_acc, self.final_acc, self.history = 0.0, 0.0, []
        self.earlier_wall_seconds = 0.0      # wall seconds of the attempts before a resume
        self.new_window(t)

    # What a checkpoint keeps, so that a resumed run's summary counts every step exactly once.
    SAVED = ("push_bytes", "pull_bytes", "eval_pull_bytes", "skipped_steps", "wait_seconds", "train_seconds",
             "compute_seconds", "client_seconds", "after_warmup", "staleness", "best_acc", "final_acc", "history")

    def state(self, wall_seconds):
        """The counters as JSON-able values, for a checkpoint taken after wall_seconds of this attempt."""
        saved = {key: getattr(self, key) for key in self.SAVED}
        saved["wall_seconds"] = self.earlier_wall_seconds + wall_seconds
        return json.loads(json.dumps(saved))

    def load(self, saved):
        """Continue from a checkpoint's counters (state())."""
        for key in self.SAVED:
            setattr(self, key, saved[key])
        self.earlier_wall_seconds = saved["wall_seconds"]

    def drop_evals_from(self, epoch):
        """Forget the evaluations of `epoch` and later: a run that train.max_steps stopped in mid-epoch
        evaluated its weights there, and its resume evaluates that epoch again once it is whole (the
        stopped run's figures stay in its summary.step<N>.json and metrics)."""
        self.history = [h for h in self.history if h["epoch"] < epoch]
        accs = [h[f"{self.tag}_acc"] for h in self.history]
        self.best_acc, self.final_acc = max(accs, default=0.0), (accs[-1] if accs else 0.0)

    def new_window(self, t):
        """Start the counts of the steps up to the next log line, at time t."""
        self.window = {"t": t, "images": 0, "push": 0, "pull": 0, "n": 0, "compute": 0.0, "client": 0.0}

    def leave_out_of_window(self, seconds):
        """Time spent on other work (an evaluation, a checkpoint) does not count in the window's images/s."""
        self.window["t"] += seconds

    def add_epoch_end(self, seconds):
        """An epoch's end (its evaluation, its checkpoint) took `seconds`: left out of the window's
        images/s, and counted for the ETA."""
        self.leave_out_of_window(seconds)
        self.epoch_ends += 1
        self.epoch_end_seconds += seconds

    def add_step(self, step, rec, images, times):
        """Count step `step`, whose StepRecord is rec and StepTimes `times`."""
        self.compute_seconds += times.compute
        self.client_seconds += times.client
        self.push_bytes += rec.push_bytes
        self.pull_bytes += rec.pull_bytes
        if step >= self.warmup_steps:
            self.after_warmup["steps"] += 1
            self.after_warmup["push_bytes"] += rec.push_bytes
            self.after_warmup["pull_bytes"] += rec.pull_bytes
        if rec.wait_seconds is not None:
            self.wait_seconds += rec.wait_seconds
        if rec.staleness is not None:
            st = self.staleness
            st["max"] = rec.staleness if st["max"] is None else max(st["max"], rec.staleness)
            st["sum"] += rec.staleness
            st["count"] += 1
        w = self.window
        w["images"] += images
        w["push"] += rec.push_bytes
        w["pull"] += rec.pull_bytes
        w["compute"] += times.compute
        w["client"] += times.client
        w["n"] += 1

    def add_eval(self, epoch, acc, pulled):
        self.eval_pull_bytes += pulled
        self.best_acc, self.final_acc = max(self.best_acc, acc), acc
        self.history.append({"epoch": epoch, f"{self.tag}_acc": acc})

    def part(self, rank, steps, images):
        """This worker's figures for the summary (its worker<rank>.json)."""
        st = self.staleness
        return {"rank": rank, "host": socket.gethostname(), "steps": steps, "images": images,
                "train_seconds": self.train_seconds, "push_bytes": self.push_bytes,
                "pull_bytes": self.pull_bytes, "wait_seconds": self.wait_seconds,
                "compute_seconds": self.compute_seconds, "client_seconds": self.client_seconds,
                "skipped_steps": self.skipped_steps, "max_staleness": st["max"],
                "mean_staleness": st["sum"] / st["count"] if st["count"] else None}


def summarize(cfg, run, counters, parts, steps, epochs, wall_seconds, checkpoint):
    """The run summary (summary.json) from rank 0's counters and every worker's part. wall_seconds: of
    every attempt of the run (a resumed run adds those before the resume)."""
    tag = counters.tag
    stal = [p["max_staleness"] for p in parts if p["max_staleness"] is not None]
    return {
        "name": cfg.name, "algorithm": cfg.algorithm.type, "compression": cfg.compression.type,
        "num_workers": run.kv.num_workers, "num_servers": num_servers(run.kv), "epochs": epochs, "steps": steps,
        "steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
        "eval_set": run.data.eval_set, "final_test_acc": None, "best_test_acc": None,
        f"final_{tag}_acc": counters.final_acc, f"best_{tag}_acc": counters.best_acc,
        f"{tag}_acc_history": counters.history,
        "images_per_sec": sum(p["images"] / max(1e-9, p["train_seconds"]) for p in parts),
        "wall_seconds": wall_seconds,
        "push_bytes": counters.push_bytes, "pull_bytes": counters.pull_bytes,
        "bytes_per_step": {"push": counters.push_bytes / max(1, steps),
                           "pull": counters.pull_bytes / max(1, steps)},
        "after_warmup": counters.after_warmup,
        "eval_pull_bytes": counters.eval_pull_bytes,
        "wait_seconds": counters.wait_seconds,
        "skipped_steps": sum(p["skipped_steps"] for p in parts),
        "max_staleness": max(stal) if stal else None,
        "mean_staleness": float(np.mean([p["mean_staleness"] for p in parts
                                         if p["mean_staleness"] is not None])) if stal else None,
        "workers": parts, "checkpoint": checkpoint, "client": run.client.stats,
        "note": "push_bytes/pull_bytes are rank 0's own traffic; per-worker figures under 'workers'",
    }
