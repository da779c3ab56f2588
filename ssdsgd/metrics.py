"""Run folder outputs: metrics.jsonl lines, per-worker parts, summary.json, and progress lines; and
write_atomic, by which every file of a run or checkpoint is written whole or not at all."""
import csv
import errno
import json
import os
import sys
import time

from ssdsgd.errors import JobError

CONFIG_FILE = "config.yaml"            # the validated config of the run
RUN_MANIFEST_FILE = "manifest.json"     # how the run was made: command, commit, machine, date
SUMMARY_FILE = "summary.json"          # written last, by rank 0: the run finished
LAUNCHER_LOG_FILE = "launcher.log"     # ssdsgd-run's own messages: which role failed where, restarts, cleanup
FINAL_PARAMS_FILE = "final.params"     # the global weights at the end


def metrics_file(rank=0):
    return "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"


def worker_part_file(rank):
    """A worker's figures for the summary."""
    return f"worker{rank}.json"


def read_summary(directory):
    """The summary.json of a run folder, as a dict."""
    with open(os.path.join(directory, SUMMARY_FILE)) as f:
        return json.load(f)


def read_metrics(directory, rank=0):
    """The metrics records of a run folder, one dict per line."""
    with open(os.path.join(directory, metrics_file(rank))) as f:
        return [json.loads(line) for line in f]


TENSORBOARD_DIR = "tensorboard"
# Metrics record key -> TensorBoard tag (the scalars worth a curve; x axis: the global step).
TENSORBOARD_TAGS = {"loss": "train/loss", "images_per_sec": "speed/images_per_sec", "lr": "train/lr",
                    "push_bytes": "traffic/push_bytes_per_step", "pull_bytes": "traffic/pull_bytes_per_step",
                    "staleness": "train/staleness", "compute_seconds": "speed/compute_seconds_per_step",
                    "client_seconds": "speed/client_seconds_per_step", "test_acc": "eval/test_acc",
                    "val_acc": "eval/val_acc", "epoch_seconds": "speed/epoch_seconds"}


class MetricsLog:
    """One JSON object per line. Rank 0 writes metrics.jsonl, rank r>0 metrics.rank<r>.jsonl.

    keep_until_step: a resumed run's log keeps the records up to the checkpoint's step (and those
    without a step) and appends after them, so every step is recorded once, across any resumes.
    tensorboard: also write the TENSORBOARD_TAGS scalars as TensorBoard events (a resumed run adds an
    event file; a failed attempt's steps after its checkpoint stay in the older one)."""

    def __init__(self, directory, rank, keep_until_step=None, tensorboard=False):
        self.rank = rank
        self.path = os.path.join(directory, metrics_file(rank))
        if keep_until_step is not None and os.path.exists(self.path):
            _keep_records(self.path, keep_until_step)
        self.file = open(self.path, "w" if keep_until_step is None else "a")
        self.tensorboard = None
        if tensorboard:
            from tensorboardX import SummaryWriter   # only with log.tensorboard (slow to import)
            self.tensorboard = SummaryWriter(os.path.join(directory, TENSORBOARD_DIR), flush_secs=10)

    def write(self, **record):
        record.setdefault("rank", self.rank)
        record.setdefault("time", round(time.time(), 3))
        append_whole(self.file.fileno(), (json.dumps(record) + "\n").encode(), self.path)   # no cut-off line
        if self.tensorboard is not None and isinstance(record.get("step"), int):
            for key, tag in TENSORBOARD_TAGS.items():
                value = record.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(tag, value, record["step"], walltime=record["time"])

    def close(self):
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


CSV_FILE = "metrics.csv"
CSV_COLUMNS = ["time", "epoch", "step", "loss", "images_per_sec", "push_bytes", "pull_bytes", "lr", "staleness",
               "wait_seconds", "compute_seconds", "client_seconds", "residual_norm", "test_acc", "val_acc",
               "epoch_seconds", "eval_seconds"]


def write_metrics_csv(directory):
    """metrics.csv from rank 0's metrics.jsonl (its step and evaluation lines; written at the end of a
    run, so it holds the whole history across resumes): one row per line, CSV_COLUMNS."""
    rows = [r for r in read_metrics(directory) if "loss" in r or "epoch_seconds" in r]

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    write_atomic(os.path.join(directory, CSV_FILE), write)


def _keep_records(path, last_step):
    """Rewrite a metrics file (atomically) without the records of steps after last_step. A line that
    does not parse (a write cut short by a crash) is dropped."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record.get("step"), int) or record["step"] <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")

    def write(tmp):
        with open(tmp, "w") as f:
            f.writelines(kept)
    write_atomic(path, write)


def write_json_atomic(path, obj):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    write_atomic(path, write)


class WriteError(JobError):
    """A file of the job could not be written (a full disk, a quota, a read-only folder)."""


def append_whole(fd, data, path):
    """Write the bytes `data` at the end of the open file fd, whole or not at all: a write that a full disk cuts
    short is taken back (the file is cut to where it ended before), so no partial line stays behind. WriteError
    naming path and the cause."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as err:
        try:
            os.ftruncate(fd, end)
            os.lseek(fd, end, os.SEEK_SET)
        except OSError:
            pass
        raise WriteError(f"cannot write {path}: {write_problem(err, path)}") from None


NEARLY_FULL = 1 << 20       # MXNet's write errors hide errno: one with less free than this ran out of space


def write_atomic(path, write, suffix=""):
    """write(tmp) to a temporary name beside path, then rename it over path: a reader sees the old file
    or the whole new one. suffix: what the writer adds to any name (np.savez: '.npz'). If the write
    fails (OSError, MXNetError), the temporary file is removed (a full disk must not stay full of
    half-written files) and WriteError names path and the cause; anything else is raised as it is."""
    tmp = f"{path}.tmp{os.getpid()}{suffix}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        free = _free_bytes(tmp)             # before the partial file goes: was the disk full?
        try:
            os.remove(tmp)
        except OSError:
            pass
        problem = write_problem(err, path, free)
        if problem is None:
            raise
        raise WriteError(f"cannot write {path}: {problem}") from None


def write_problem(err, path, free=None):
    """What went wrong writing path, in a few words, or None if err is not a failed write. free: the
    bytes free when it failed, if known."""
    mxnet = sys.modules.get("mxnet.base")       # loaded if the writer was MXNet's
    if isinstance(err, OSError):
        said, full = err.strerror or str(err), err.errno in (errno.ENOSPC, errno.EDQUOT)
    elif mxnet is not None and isinstance(err, mxnet.MXNetError):
        lines = [line for line in str(err).splitlines() if line.strip()]
        said = lines[-1].removeprefix("MXNetError: ") if lines else "MXNet could not write it"
        free = _free_bytes(path) if free is None else free
        full = free is not None and free < NEARLY_FULL
    else:
        return None
    if not full:
        return said
    folder = os.path.dirname(os.path.abspath(path))
    now = _free_bytes(path)
    left = f", {human_bytes(now)} free" if now is not None else ""
    return f"No space left on device (the file system of {folder}{left})"


def _free_bytes(path):
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def human_bytes(n):
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0


# Accuracy keys are named after what was evaluated: final_test_acc, or final_val_acc when the run
# evaluates a validation split carved from the training set (data.validation); the other is null.
ACC_TAG = {"test": "test", "validation": "val"}


def final_acc(summary):
    """(final accuracy, 'test' or 'validation') of a summary.json dict."""
    eval_set = summary.get("eval_set", "test")
    return summary[f"final_{ACC_TAG[eval_set]}_acc"], eval_set


def summary_table(summary):
    acc, eval_set = final_acc(summary)
    tag = ACC_TAG[eval_set]
    rows = [("algorithm", summary["algorithm"]), ("compression", summary["compression"]),
            ("workers", summary["num_workers"]), ("epochs / steps", f"{summary['epochs']} / {summary['steps']}"),
            (f"final {eval_set} acc", f"{acc:.4f}"),
            (f"best {eval_set} acc", f"{summary[f'best_{tag}_acc']:.4f}"),
            ("images/s (all workers)", f"{summary['images_per_sec']:.1f}"),
            ("wall seconds", f"{summary['wall_seconds']:.1f}"),
            ("push / pull per step", f"{human_bytes(summary['bytes_per_step']['push'])} / "
                                      f"{human_bytes(summary['bytes_per_step']['pull'])}"),
            ("max staleness", summary["max_staleness"])]
    width = max(len(r[0]) for r in rows)
    lines = ["-" * (width + 24)] + [f"{k:<{width}}  {v}" for k, v in rows] + ["-" * (width + 24)]
    return "\n".join(lines)


def comparison_table(summaries):
    """Side-by-side rows of several runs' summary.json dicts (the demo's and benchmarks' output). The
    accuracy column names the set evaluated (test or val); where runs evaluated different sets, each value
    says which, so that a validation accuracy is never read as a test one."""
    accs = [final_acc(s) for s in summaries]
    sets = {ACC_TAG[eval_set] for _, eval_set in accs}
    acc_head = f"{sets.pop()} acc" if len(sets) == 1 else "final acc"
    head = f"{'run':<28} {'algorithm':<9} {'compr.':<7} {acc_head:>11} {'img/s':>9} " \
           f"{'push/step':>11} {'pull/step':>11} {'staleness':>9}"
    lines = [head, "-" * len(head)]
    for s, (acc, eval_set) in zip(summaries, accs):
        bps = s["bytes_per_step"]
        shown = f"{acc:.4f}" if acc_head != "final acc" else f"{acc:.4f} {ACC_TAG[eval_set]}"
        lines.append(f"{s['name']:<28} {s['algorithm']:<9} {s['compression']:<7} {shown:>11} "
                     f"{s['images_per_sec']:>9.1f} {human_bytes(bps['push']):>11} {human_bytes(bps['pull']):>11} "
                     f"{str(s['max_staleness']):>9}")
    return "\n".join(lines)
