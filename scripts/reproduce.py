"""SSGD, SSD-SGD and SSD-SGD + top-k (its density chosen for your link) side by side on your data, with the
shipped configs.

    python scripts/reproduce.py --suite cifar10 --data ROOT [--hostfile FILE --interface IF] [--epochs N]
        [--seeds 0 1 2] [--set KEY=VALUE ...] [--out runs/reproduce_cifar10] [--keep-done]

Runs configs/<suite>_*_{ssgd,ssd,ssd_topk}.yaml one job at a time (seeds interleaved), each with
data.root=ROOT; with --hostfile on your cluster over ssh, without it on this machine. --epochs shortens
every variant alike (a check that the path works, not the recipe's result); an SSD-SGD job that ends
before its synchronous warm-up does ran as SSGD, which it says at once and marks in the table. Writes to
--out: runs.csv (a row per job), table.md (final accuracy, speed and traffic per variant), accuracy.png
(accuracy against epochs and against training time), logs/<job>.log, runs/ (each job's run folder) and
manifest.json (command, configs, commit, machine, date). Refuses an --out that already holds results,
unless --keep-done: then the jobs finished there are kept (run folders, logs, rows) and only the others
run, a job with a checkpoint from an interrupted attempt resuming it. The config overrides of every job
are checked before anything starts. SIGTERM or SIGINT ends the running job (its process group) and the
script (exit 128+N).
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import (MANIFEST, dies_with_script, done_rows, earlier_runs, job_command, job_name,
                                job_overrides, run_folder, settings_problem, signal_group, stop_group, summary_row,
                                survive_closed_stdout, write_csv, write_manifest, write_text)
from ssdsgd.checkpoint import latest as latest_checkpoint
from ssdsgd.folders import unused_name
from ssdsgd.config import ConfigError, load_config
from ssdsgd.metrics import ACC_TAG, SUMMARY_FILE, read_metrics, read_summary

SUITES = {"cifar10": "cifar10_resnet20", "imagenet": "imagenet_resnet50", "fmnist": "fmnist_resnet20"}
VARIANTS = [("SSGD", "ssgd"), ("SSD-SGD", "ssd"), ("SSD-SGD + top-k auto", "ssd_topk")]
STOP_GRACE = 60.0      # seconds from SIGTERM to SIGKILL of a stopped job: ssdsgd-run's cleanup of ssh hosts takes ~25


class Stopper:
    """SIGTERM or SIGINT to this script (timeout, a batch scheduler, Ctrl-C) ends the running job, then the
    suite. The job runs in its own session, so that its whole process group can be ended and nothing of it
    outlives this script; a terminal's Ctrl-C then reaches only this script, which forwards it as SIGTERM
    (ssdsgd-run ends its roles and releases its locks). SIGKILL follows after STOP_GRACE, or at once at a
    second signal."""

    def __init__(self):
        self.signum = None
        self._proc = self._timer = None

    def install(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)

    def watch(self, proc):
        """The job to end on a stop (None: none is running); a stop that came before it ends it at once."""
        if self._timer:
            self._timer.cancel()
        self._proc, self._timer = proc, None
        if proc is not None and self.signum is not None:
            self._end(signal.SIGTERM)

    def _on_signal(self, signum, frame):
        again = self.signum is not None
        self.signum = self.signum or signum
        if self._proc is not None:
            self._end(signal.SIGKILL if again else signal.SIGTERM)

    def _end(self, signum):
        signal_group(self._proc, signum)
        if signum == signal.SIGTERM and self._timer is None:
            self._timer = threading.Timer(STOP_GRACE, signal_group, (self._proc, signal.SIGKILL))
            self._timer.daemon = True
            self._timer.start()


def configs(suite):
    return [(label, os.path.join(ROOT, "configs", f"{SUITES[suite]}_{tail}.yaml")) for label, tail in VARIANTS]


def common_sets(args, out):
    sets = []
    if args.data:
        sets.append(f"data.root={os.path.abspath(args.data)}")
    if args.hostfile:
        sets += ["cluster.launcher=ssh", f"cluster.hostfile={os.path.abspath(args.hostfile)}"]
        sets += [f"cluster.interface={args.interface}"] if args.interface else []
    else:   # the ImageNet configs name a host file and interface, which the local launcher refuses
        sets += ["cluster.launcher=local", "cluster.hostfile=null", "cluster.interface=null"]
    if args.epochs:
        sets.append(f"train.epochs={args.epochs}")
    return sets + args.set


def job_sets(name, seed, sets, out):
    """A job's own overrides (seed, checkpoint folder), then the suite's."""
    return [f"seed={seed}", f"checkpoint.dir={os.path.join(out, 'checkpoints', name)}", *sets]


def job_config(label, config, seed, sets, out):
    """The config as the job will load it (ConfigError if it cannot)."""
    name = job_name(label, seed)
    return load_config(config, job_overrides(name, os.path.join(out, "runs"), job_sets(name, seed, sets, out)))


def config_problem(jobs, sets, out):
    """The first job whose config does not load with its overrides, in one line; None if all do. Checked
    before any job starts: a typo in --set would otherwise fail every job in turn."""
    for label, config, seed in jobs:
        try:
            job_config(label, config, seed, sets, out)
        except ConfigError as err:
            return f"{label}, seed {seed} ({os.path.relpath(config, ROOT)}): {err}"
    return None


def fresh_log(out, name):
    """logs/<job>.log, or <job>.2.log, ... : a rerun (--keep-done) keeps the log of the attempt before."""
    return os.path.join(out, "logs", unused_name(os.path.join(out, "logs"), name, ".log"))


def run_job(label, config, seed, sets, out, stopper):
    """One job, its output shown and kept in its log; returns its row. A checkpoint in its checkpoint.dir
    (an interrupted earlier attempt) is resumed, in the attempt's run folder."""
    name = job_name(label, seed)
    cmd = job_command(config, name, os.path.join(out, "runs"), job_sets(name, seed, sets, out))
    cmd += ["--resume"] if latest_checkpoint(job_config(label, config, seed, sets, out).checkpoint.dir) else []
    log_path = fresh_log(out, name)
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
                                start_new_session=True, preexec_fn=dies_with_script())
        stopper.watch(proc)
        try:
            for line in proc.stdout:
                print("   ", line, end="", flush=True)
                log.write(line)
                lines.append(line)
            proc.wait()
        finally:
            stopper.watch(None)
            if proc.poll() is None:        # this script failed mid-job: the job must not outlive it
                stop_group(proc, STOP_GRACE)
    folder = run_folder("".join(lines), os.path.join(out, "runs"), name)
    row = {"variant": label, "seed": seed, "rc": proc.returncode, "run_dir": os.path.relpath(folder, out),
           "log": os.path.relpath(log_path, out)}
    if proc.returncode != 0 or not os.path.exists(os.path.join(folder, "summary.json")):
        return row
    return dict(row, **summary_row(read_summary(folder)))


def never_left_warmup(row):
    """Did this SSD-SGD job end before its delay stage began (it then ran as SSGD)?"""
    return row.get("delay_stage_steps") in (0, "0")


def table(rows):
    ok = [r for r in rows if r["rc"] == 0 and "final_acc" in r]
    which = sorted({r["eval_set"] for r in ok}) or ["test"]
    lines = [f"| variant | final {'/'.join(which)} acc (mean ± sd) | per seed | images/s | push B/step | pull B/step "
             f"| wall s |", "|---|---|---|---|---|---|---|"]
    for label, _ in VARIANTS:
        rs = [r for r in ok if r["variant"] == label]
        failed = sum(1 for r in rows if r["variant"] == label and r not in ok)
        if not rs:
            lines.append(f"| {label} | failed ({failed} of {failed} jobs) | | | | | |")
            continue
        accs = [r["final_acc"] for r in rs]
        spread = f" ± {statistics.stdev(accs):.4f}" if len(accs) > 1 else " (one seed)"   # no sd of one value
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("images_per_sec", "push_bytes_per_step", "pull_bytes_per_step", "wall_seconds")}
        note = f" ({failed} failed)" if failed else ""
        if all(never_left_warmup(r) for r in rs):
            note += " (never left its warm-up: ran as SSGD)"
        lines.append(f"| {label}{note} | {statistics.mean(accs):.4f}{spread} | {' '.join(f'{a:.4f}' for a in accs)} "
                     f"| {med['images_per_sec']:.1f} | {med['push_bytes_per_step']:.0f} "
                     f"| {med['pull_bytes_per_step']:.0f} | {med['wall_seconds']:.0f} |")
    return "\n".join(lines) + ("\n\nAccuracy: mean ± sd over seeds; images/s, bytes and wall seconds: medians over "
                                "seeds; images/s of all workers, from each job's summary.json.")


def accuracy_curves(rows, out):
    """{variant: [(epoch, training seconds so far, accuracy)]}, means over seeds at each evaluated epoch, and
    the evaluation set's name. Training seconds: the epochs' own time, evaluations left out."""
    curves, tags = {}, set()
    for label, _ in VARIANTS:
        per_epoch = {}
        for r in rows:
            if r["variant"] != label or "final_acc" not in r:
                continue
            tag = ACC_TAG[r["eval_set"]]
            tags.add(r["eval_set"])
            seconds = 0.0
            for m in read_metrics(os.path.join(out, r["run_dir"])):
                if f"{tag}_acc" in m:
                    seconds += m.get("epoch_seconds", 0.0)
                    per_epoch.setdefault(m["epoch"] + 1, []).append((seconds, m[f"{tag}_acc"]))
        curves[label] = [(e, statistics.mean(t for t, _ in got), statistics.mean(a for _, a in got))
                         for e, got in sorted(per_epoch.items())]
    return curves, "/".join(sorted(tags)) or "test"


def plot(rows, out):
    """accuracy.png: the evaluated accuracy (a fraction, as the tables give it), mean over seeds, one line per
    variant, against epochs and against training seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    curves, which = accuracy_curves(rows, out)
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for label, points in curves.items():
        if points:
            epochs, seconds, accs = zip(*points)
            by_epoch.plot(epochs, accs, marker="o", label=label)
            by_time.plot(seconds, accs, marker="o", label=label)
    epochs_seen = sorted({e for points in curves.values() for e, _, _ in points})
    if 0 < len(epochs_seen) <= 20:
        by_epoch.set_xticks(epochs_seen)          # whole epochs only, however few
    else:
        by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training seconds (evaluations left out)")
    for ax in (by_epoch, by_time):
        ax.set_ylabel(f"{which} accuracy, mean over seeds")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle("Accuracy after each epoch")
    path = os.path.join(out, "accuracy.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv):
    """The arguments, and the absolute --out; exits 2 with one line on a mistake."""
    ap = argparse.ArgumentParser(prog="scripts/reproduce.py", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument("--data", help="data.root for every job (fmnist: default the configs' own)")
    ap.add_argument("--hostfile", help="run on these hosts over ssh (default: this machine)")
    ap.add_argument("--interface", help="with --hostfile: the network interface the hosts share, e.g. eth0 "
                                        "(default: the config's; the ImageNet configs name eth0)")
    ap.add_argument("--epochs", type=int, help="train every variant this many epochs (default: the configs')")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every job")
    ap.add_argument("--out", help="results folder (default runs/reproduce_<suite>, beside the run folders)")
    ap.add_argument("--keep-done", action="store_true",
                    help="continue in an --out that holds results: keep its finished jobs, run the others")
    args = ap.parse_args(argv)
    if args.suite != "fmnist" and not args.data:
        ap.error(f"--data: the folder holding your {args.suite} data is required")
    if args.data and not os.path.isdir(args.data):
        ap.error(f"--data: {args.data} is not a folder")
    if args.hostfile and not os.path.isfile(args.hostfile):
        ap.error(f"--hostfile: {args.hostfile} does not exist")
    if args.interface and not args.hostfile:
        ap.error("--interface: only with --hostfile (this machine's jobs need none)")
    if args.hostfile and not args.interface and args.suite != "imagenet":
        ap.error(f"--interface: required with --hostfile for the {args.suite} configs, which name none "
                 f"(the network interface the hosts share, e.g. eth0)")
    out = os.path.abspath(args.out or os.path.join("runs", f"reproduce_{args.suite}"))
    if os.path.exists(os.path.join(out, MANIFEST)) and not args.keep_done:
        ap.error(f"--out: {out} already holds results ({MANIFEST}); --keep-done keeps its finished jobs and runs "
                 f"the rest, or choose another folder")
    return args, out


def kept_rows(out):
    """--keep-done: the rows of out's runs.csv whose job finished (exit 0, summary.json in its run folder)."""
    path = os.path.join(out, "runs.csv")
    rows = done_rows(path) if os.path.exists(path) else []
    return [r for r in rows if r.get("final_acc") not in (None, "")
            and os.path.exists(os.path.join(out, r.get("run_dir") or "-", SUMMARY_FILE))]


def run_jobs(jobs, rows, sets, out, stopper):
    """Run the jobs one at a time, runs.csv rewritten after each; stops early on a signal."""
    t0 = time.monotonic()
    for i, (label, config, seed) in enumerate(jobs):
        if stopper.signum:
            return
        print(f"[{i + 1}/{len(jobs)}] {label}, seed {seed}: {os.path.relpath(config, ROOT)}", flush=True)
        rows.append(run_job(label, config, seed, sets, out, stopper))
        write_csv(os.path.join(out, "runs.csv"), rows)          # after every job: a partial result survives
        done, elapsed = i + 1, time.monotonic() - t0
        state = "ok" if rows[-1]["rc"] == 0 else f"FAILED (exit {rows[-1]['rc']}, see {rows[-1]['log']})"
        if never_left_warmup(rows[-1]):
            print(f"reproduce.py: warning: {label}, seed {seed} ended within its synchronous warm-up "
                  f"({rows[-1]['steps']} steps), so it ran as SSGD: train longer (--epochs) or shorten "
                  f"algorithm.warmup_iters (--set) to compare SSD-SGD", flush=True)
        print(f"[{done}/{len(jobs)}] {state}; {elapsed / 60:.1f} min so far, about "
              f"{elapsed / done * (len(jobs) - done) / 60:.1f} min to go", flush=True)


def main(argv=None):
    args, out = parse_args(argv)
    survive_closed_stdout()
    stopper = Stopper()
    stopper.install()
    variants = configs(args.suite)
    sets = common_sets(args, out)
    jobs = [(label, config, seed) for seed in args.seeds for label, config in variants]
    problem = config_problem(jobs, sets, out)
    if problem:                                   # before anything is written to --out
        print(f"reproduce.py: config error in {problem}", file=sys.stderr)
        return 2
    problem = settings_problem(out, sets) if args.keep_done else None
    if problem:                                   # kept rows would not be comparable with new ones
        print(f"reproduce.py: {problem}", file=sys.stderr)
        return 2
    rows = kept_rows(out) if args.keep_done else []
    done = {(r["variant"], r["seed"]) for r in rows}
    pending = [j for j in jobs if (j[0], j[2]) not in done]
    if args.keep_done:
        print(f"--keep-done: {len(rows)} finished job(s) kept, {len(pending)} to run", flush=True)
    earlier = earlier_runs(out) if args.keep_done else []
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    write_manifest(out, [c for _, c in variants], finished=False, settings=sets, earlier=earlier)
    run_jobs(pending, rows, sets, out, stopper)
    if stopper.signum:
        print(f"reproduce.py: stopped by {signal.Signals(stopper.signum).name}; the running job was ended. "
              f"Finished jobs are kept in {out}: --keep-done runs the rest", file=sys.stderr)
        return 128 + stopper.signum
    text = table(rows)
    write_text(os.path.join(out, "table.md"), text)
    plot(rows, out)
    write_manifest(out, [c for _, c in variants], finished=True, jobs=len(rows),
                   failed=sum(r["rc"] != 0 for r in rows), settings=sets, earlier=earlier)
    print(text)
    print(f"results: {out}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
