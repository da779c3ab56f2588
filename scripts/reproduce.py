"""SSGD, SSD-SGD and SSD-SGD + top-k 1% side by side on your data, with the shipped configs.

    python scripts/reproduce.py --suite cifar10 --data ROOT [--hostfile FILE] [--epochs N]
        [--seeds 0 1 2] [--set KEY=VALUE ...] [--out results/reproduce_cifar10]

Runs configs/<suite>_*_{ssgd,ssd,ssd_topk}.yaml one job at a time (seeds interleaved), each with
data.root=ROOT; with --hostfile on your cluster over ssh, without it on this machine. --epochs shortens
every variant alike (a check that the path works, not the recipe's result). Writes to --out:
runs.csv (a row per job), table.md (final accuracy, speed and traffic per variant), accuracy.png (test
accuracy per epoch), logs/<job>.log, runs/ (each job's run folder) and manifest.json (command,
configs, commit, machine, date). Refuses an --out that already holds results.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from results_io import MANIFEST, job_command, job_name, run_folder, summary_row, write_csv, write_manifest, write_text

from ssdsgd.metrics import ACC_TAG, read_metrics, read_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = {"cifar10": "cifar10_resnet20", "imagenet": "imagenet_resnet50", "fmnist": "fmnist_resnet20"}
VARIANTS = [("SSGD", "ssgd"), ("SSD-SGD", "ssd"), ("SSD-SGD + top-k 1%", "ssd_topk")]


def configs(suite):
    return [(label, os.path.join(ROOT, "configs", f"{SUITES[suite]}_{tail}.yaml")) for label, tail in VARIANTS]


def common_sets(args, out):
    sets = []
    if args.data:
        sets.append(f"data.root={os.path.abspath(args.data)}")
    if args.hostfile:
        sets += ["cluster.launcher=ssh", f"cluster.hostfile={os.path.abspath(args.hostfile)}"]
    else:
        sets.append("cluster.launcher=local")
    if args.epochs:
        sets.append(f"train.epochs={args.epochs}")
    return sets + args.set


def run_job(label, config, seed, sets, out):
    """One job, its output shown and kept in logs/<job>.log; returns its row."""
    name = job_name(label, seed)
    cmd = job_command(config, name, os.path.join(out, "runs"),
                      [f"seed={seed}", f"checkpoint.dir={os.path.join(out, 'checkpoints', name)}", *sets])
    log_path = os.path.join(out, "logs", name + ".log")
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        for line in proc.stdout:
            print("   ", line, end="", flush=True)
            log.write(line)
            lines.append(line)
        proc.wait()
    folder = run_folder("".join(lines), os.path.join(out, "runs"), name)
    row = {"variant": label, "seed": seed, "rc": proc.returncode, "run_dir": os.path.relpath(folder, out),
           "log": os.path.relpath(log_path, out)}
    if proc.returncode != 0 or not os.path.exists(os.path.join(folder, "summary.json")):
        return row
    return dict(row, **summary_row(read_summary(folder)))


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
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("images_per_sec", "push_bytes_per_step", "pull_bytes_per_step", "wall_seconds")}
        note = f" ({failed} failed)" if failed else ""
        lines.append(f"| {label}{note} | {statistics.mean(accs):.4f} ± {sd:.4f} | {' '.join(f'{a:.4f}' for a in accs)} "
                     f"| {med['images_per_sec']:.1f} | {med['push_bytes_per_step']:.0f} "
                     f"| {med['pull_bytes_per_step']:.0f} | {med['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n\nMedians over seeds; images/s of all workers, from each job's summary.json."


def plot(rows, out):
    """accuracy.png: the evaluated accuracy after each epoch, mean over seeds, one line per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    tags = set()
    for label, _ in VARIANTS:
        per_epoch = {}
        for r in rows:
            if r["variant"] != label or "final_acc" not in r:
                continue
            tag = ACC_TAG[r["eval_set"]]
            tags.add(r["eval_set"])
            for m in read_metrics(os.path.join(out, r["run_dir"])):
                if f"{tag}_acc" in m:
                    per_epoch.setdefault(m["epoch"] + 1, []).append(m[f"{tag}_acc"])
        if per_epoch:
            epochs = sorted(per_epoch)
            ax.plot(epochs, [100 * statistics.mean(per_epoch[e]) for e in epochs], marker="o", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(f"{'/'.join(sorted(tags)) or 'test'} accuracy (%), mean over seeds")
    ax.set_title("Accuracy after each epoch")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path = os.path.join(out, "accuracy.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/reproduce.py", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument("--data", help="data.root for every job (fmnist: default the configs' own)")
    ap.add_argument("--hostfile", help="run on these hosts over ssh (default: this machine)")
    ap.add_argument("--epochs", type=int, help="train every variant this many epochs (default: the configs')")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every job")
    ap.add_argument("--out", help="results folder (default results/reproduce_<suite>)")
    args = ap.parse_args(argv)
    if args.suite != "fmnist" and not args.data:
        ap.error(f"--data: the folder holding your {args.suite} data is required")
    if args.data and not os.path.isdir(args.data):
        ap.error(f"--data: {args.data} is not a folder")
    if args.hostfile and not os.path.isfile(args.hostfile):
        ap.error(f"--hostfile: {args.hostfile} does not exist")
    out = os.path.abspath(args.out or os.path.join(ROOT, "results", f"reproduce_{args.suite}"))
    if os.path.exists(os.path.join(out, MANIFEST)):
        ap.error(f"--out: {out} already holds results ({MANIFEST}); choose another folder")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    variants = configs(args.suite)
    write_manifest(out, [c for _, c in variants], finished=False)
    sets = common_sets(args, out)
    jobs = [(label, config, seed) for seed in args.seeds for label, config in variants]
    rows, t0 = [], time.monotonic()
    for i, (label, config, seed) in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}] {label}, seed {seed}: {os.path.relpath(config, ROOT)}", flush=True)
        rows.append(run_job(label, config, seed, sets, out))
        write_csv(os.path.join(out, "runs.csv"), rows)          # after every job: a partial result survives
        done, elapsed = i + 1, time.monotonic() - t0
        state = "ok" if rows[-1]["rc"] == 0 else f"FAILED (exit {rows[-1]['rc']}, see {rows[-1]['log']})"
        print(f"[{done}/{len(jobs)}] {state}; {elapsed / 60:.1f} min so far, about "
              f"{elapsed / done * (len(jobs) - done) / 60:.1f} min to go", flush=True)
    text = table(rows)
    write_text(os.path.join(out, "table.md"), text)
    plot(rows, out)
    write_manifest(out, [c for _, c in variants], finished=True, jobs=len(rows),
                   failed=sum(r["rc"] != 0 for r in rows), sets=sets)
    print(text)
    print(f"results: {out}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
