"""Time to accuracy on a slow link: SSGD vs SSD-SGD vs SSD-SGD + top-k 1%, on the digits demo or on
the Fashion-MNIST ResNet-20 configs.

    sudo python scripts/time_to_accuracy.py [--suite digits|fmnist|fmnist_tta] [--rate 20] [--seeds 0 1 2]
        [--set KEY=VALUE ...] [--set-for LABEL KEY=VALUE ...] [--variants LABEL ...] [--reuse DIR ...]
        [--out results/time_to_accuracy]

Each job runs in a fresh network namespace whose loopback is limited to --rate Mbit/s (tc tbf), jobs
interleaved by seed. Writes evals.csv (variant, seed, epoch, seconds since launch, train_seconds, test
accuracy), jobs.csv (one row per job, with the namespace's own byte counter), table.md (medians; the
time each variant needs to reach the SSGD run's final accuracy of the same seed, and its ratio to
SSGD's, on two clocks: wall seconds since launch, and train_seconds, the same minus rank 0's
eval_seconds so far, i.e. minus the time training stood still for the per-epoch evaluations, which
every variant pays alike per epoch; start-up stays in. That holds where an evaluation stops every
worker: synchronous variants, and SSD-SGD with train.eval_workers: all, as the Fashion-MNIST runs use;
with rank 0 evaluating alone under an asynchronous variant the others go on training, so the clock
would undercount. Not summary.json's train_seconds, the sum of the epochs' training seconds), and
accuracy-vs-time / accuracy-vs-epoch plots through scripts/plot.py, and manifest.json (command, configs,
commit, machine, date). `--set` overrides every job's
config, `--set-for LABEL KEY=VALUE` only that variant's (a longer schedule or another density for top-k),
so that one invocation runs differently configured variants interleaved by seed, each seed's pair on
the machine at about the same time. `--variants` runs only some variants;
`--reuse DIR ...` then takes the SSGD baseline's jobs from earlier runs' jobs.csv and evals.csv (when SSGD
is not run; each seed from exactly one folder), and the table names the folders: those figures come from
other runs of the machine.
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from testbed.netns import Namespace, tools_problem
from scripts.results_io import (job_command, job_name, job_summary, read_csv, results_folder, run_captured,
                                run_folder, stop_on_sigterm, write_csv, write_manifest, write_text)
from ssdsgd.metrics import read_metrics

SUITES = {
    "digits": ("Digits demo", {
        "SSGD": "configs/demo_digits_ssgd.yaml",
        "SSD-SGD": "configs/demo_digits_ssd.yaml",
        "SSD-SGD + top-k 1%": "configs/demo_digits_ssd_topk.yaml"}),
    "fmnist": ("Fashion-MNIST, ResNet-20", {
        "SSGD": "configs/fmnist_resnet20_ssgd.yaml",
        "SSD-SGD": "configs/fmnist_resnet20_ssd.yaml",
        "SSD-SGD + top-k auto": "configs/fmnist_resnet20_ssd_topk.yaml"}),
    # The README's headline comparison, each variant's settings in its own config.
    "fmnist_tta": ("Fashion-MNIST, ResNet-20, time-to-accuracy settings", {
        "SSGD": "configs/fmnist_resnet20_ssgd_tta.yaml",
        "SSD-SGD + top-k 10%": "configs/fmnist_resnet20_ssd_topk10_tta.yaml"}),
}


def relabel(label, overrides):
    """The label a job is filed under: a compression.density override replaces the top-k variant's
    density (1%, or auto for the shipped config that chooses it), so that a run at another density does not
    read as the config's."""
    densities = [s.split("=", 1)[1] for s in overrides if s.startswith("compression.density=")]
    named = next((t for t in ("top-k 1%", "top-k auto") if t in label), None)
    if not densities or named is None:
        return label
    # The last override is the one the job runs with.
    density = densities[-1]
    return label.replace(named, "top-k auto" if density == "auto" else f"top-k {float(density) * 100:g}%")


def variant_overrides(label, common, per_variant):
    """A variant's config overrides: --set for every job (common), then its own --set-for ones
    (per_variant: {suite label: overrides}), which therefore win."""
    return list(common) + list(per_variant.get(label, ()))


def plan_jobs(seeds, variants, chosen, common, per_variant):
    """The jobs in the order they run, [(seed, label, config, overrides)]: by seed, then by the
    suite's variant order. The label is relabel()'s for the job's own overrides."""
    jobs = []
    for seed in seeds:
        for label, config in variants.items():
            if label in chosen:
                overrides = variant_overrides(label, common, per_variant)
                jobs.append((seed, relabel(label, overrides), config, overrides))
    return jobs


def run(label, config, seed, rate, out, timeout, overrides=()):
    name = job_name(label, seed)
    cmd = job_command(os.path.join(ROOT, config), name, f"{out}/runs",
                      [f"seed={seed}", f"cluster.timeout={timeout}", *overrides])
    with Namespace(rate_mbit=rate) as ns:
        before = ns.counters()["tx_bytes"]
        t0 = time.time()
        proc = run_captured(ns.argv(cmd))
        seconds = time.time() - t0
        kernel_bytes = ns.counters()["tx_bytes"] - before
    run_dir = run_folder(proc.stdout, os.path.join(out, "runs"), name)
    job = {"variant": label, "seed": seed, "rate_mbit": rate, "rc": proc.returncode, "seconds": seconds,
           "kernel_bytes": kernel_bytes, "run_dir": run_dir}
    evals = []
    summary = job_summary(proc, run_dir)
    if summary is None:
        return job, evals
    job["final_test_acc"] = summary["final_test_acc"]
    evaluating = 0.0                      # seconds spent in evaluations so far (rank 0's eval_seconds)
    for m in read_metrics(run_dir):
        if "test_acc" in m:
            # A run without eval_seconds (written by older code) has no training clock.
            evaluating = None if evaluating is None or "eval_seconds" not in m else evaluating + m["eval_seconds"]
            seconds = m["time"] - t0
            evals.append({"variant": label, "seed": seed, "epoch": m["epoch"] + 1, "seconds": seconds,
                          "train_seconds": None if evaluating is None else seconds - evaluating,
                          "test_acc": m["test_acc"]})
    return job, evals


def time_to(evals, target, clock="seconds"):
    """The first time (on `clock`: seconds or train_seconds) an evaluation reached `target`; None if
    none did. UnknownClock if the clock was not recorded."""
    if any(e[clock] is None for e in evals):
        raise UnknownClock(clock)
    hit = [e[clock] for e in evals if e["test_acc"] >= target]
    return min(hit) if hit else None


class UnknownClock(ValueError):
    """The evaluations of a job have no figure on this clock (train_seconds before eval_seconds was logged)."""


def table(jobs, evals, rate, title, variants):
    lines = [f"{title} at {rate:g} Mbit/s (2 workers, 1 server; medians over seeds; "
             f"target = the SSGD run's final accuracy of the same seed; wall: seconds since launch; "
             f"training: the same minus the evaluations)", "",
             "| variant | final acc | job seconds | kernel MB | time to SSGD's final acc, wall (s) | vs SSGD "
             "| time to SSGD's final acc, training (s) | vs SSGD |",
             "|---|---|---|---|---|---|---|---|"]
    seeds = sorted({j["seed"] for j in jobs})
    target = {s: next((j.get("final_test_acc") for j in jobs if j["variant"] == "SSGD" and j["seed"] == s
                       and j["rc"] == 0), None) for s in seeds}

    def of(label, seed):
        return [e for e in evals if e["variant"] == label and e["seed"] == seed]
    for label in variants:
        tried = [j for j in jobs if j["variant"] == label]
        js = [j for j in tried if j["rc"] == 0]
        if not js:
            lines.append(f"| {label} | {'failed' if tried else 'not run'} | | | | | | |")
            continue
        cells = []
        for clock in ("seconds", "train_seconds"):
            tta, ratio, unknown = [], [], False
            for j in js:
                if target.get(j["seed"]) is None:
                    continue
                try:
                    t = time_to(of(label, j["seed"]), target[j["seed"]], clock)
                    base = time_to(of("SSGD", j["seed"]), target[j["seed"]], clock)
                except UnknownClock:
                    unknown = True
                    continue
                if t is not None:
                    tta.append(t)
                    if base:
                        ratio.append(t / base)
            if unknown:             # a run from before eval_seconds was logged: no training clock
                cells += ["n/a (no eval_seconds)", "–"]
                continue
            cells.append(f"{statistics.median(tta):.1f} ({len(tta)}/{len(js)} reached)" if tta else "not reached")
            cells.append(f"{statistics.median(ratio):.2f}x" if ratio else "–")
        lines.append(f"| {label} | {statistics.median(j['final_test_acc'] for j in js):.4f} "
                     f"| {statistics.median(j['seconds'] for j in js):.1f} "
                     f"| {statistics.median(j['kernel_bytes'] for j in js) / 1e6:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_earlier(directory, variant="SSGD"):
    """Jobs and evaluations of one variant (the baseline) from an earlier run of this script."""
    def rows(name):
        return [r for r in read_csv(os.path.join(directory, name)) if r["variant"] == variant]
    jobs = [dict(r, seed=int(r["seed"]), rc=int(r["rc"]), seconds=float(r["seconds"]),
                 kernel_bytes=float(r["kernel_bytes"]), final_test_acc=float(r["final_test_acc"] or "nan"))
            for r in rows("jobs.csv")]
    # train_seconds: absent from folders written before it was recorded.
    evals = [dict(r, seed=int(r["seed"]), epoch=int(r["epoch"]), seconds=float(r["seconds"]),
                  train_seconds=float(r["train_seconds"]) if r.get("train_seconds") else None,
                  test_acc=float(r["test_acc"])) for r in rows("evals.csv")]
    return jobs, evals


class ReuseError(ValueError):
    pass


def read_baselines(directories, seeds):
    """The SSGD jobs and evaluations of `seeds` from earlier output folders; every seed must be in
    exactly one of them."""
    jobs, evals, where = [], [], {}
    for d in directories:
        js, es = read_earlier(d)
        for j in js:
            if j["seed"] in where:
                raise ReuseError(f"--reuse: seed {j['seed']} has an SSGD job in both {where[j['seed']]} and {d}")
            where[j["seed"]] = d
        jobs += [j for j in js if j["seed"] in seeds]
        evals += [e for e in es if e["seed"] in seeds]
    missing = sorted(set(seeds) - set(where))
    if missing:
        raise ReuseError(f"--reuse: no SSGD job for seed(s) {missing} in {', '.join(directories)}")
    return jobs, evals


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=20.0, help="link rate in Mbit/s (0 = unlimited)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--suite", choices=sorted(SUITES), default="digits")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every job (repeatable)")
    ap.add_argument("--set-for", action="append", nargs=2, default=[], metavar=("LABEL", "KEY=VALUE"),
                    help="config override for one variant's jobs, after --set (repeatable)")
    ap.add_argument("--timeout", type=float, default=900, help="per job, seconds")
    ap.add_argument("--out", default="results/time_to_accuracy")
    ap.add_argument("--variants", nargs="+", help="labels to run (default: all of the suite's)")
    ap.add_argument("--reuse", metavar="DIR", nargs="+",
                    help="take the SSGD baseline from these earlier output folders (each seed from one)")
    return ap.parse_args(argv)


def chosen_variants(args):
    """(the variants to run, their --set-for overrides {label: [KEY=VALUE]}); ValueError naming a
    variant the suite does not have or a --set-for of one this run does not run."""
    variants = SUITES[args.suite][1]
    unknown = sorted(set(args.variants or ()) - set(variants))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; the {args.suite} suite has {list(variants)}")
    chosen = args.variants or list(variants)
    per_variant = {}
    for label, override in args.set_for:
        if label not in chosen:
            raise ValueError(f"--set-for {label!r}: not a variant this run runs ({', '.join(chosen)})")
        per_variant.setdefault(label, []).append(override)
    return chosen, per_variant


def overrides_note(common, per_variant):
    """What the title says of a run with overrides (without it, the folder reads as the shipped
    configs' result); '' without any."""
    if not common and not per_variant:
        return ""
    return "; the jobs run here with " + " ".join(
        [f"--set {s}" for s in common] +
        [f"--set-for '{label}' {s}" for label, sets in per_variant.items() for s in sets])


def main(argv=None):
    stop_on_sigterm()
    args = parse_args(argv)
    # The command line first: a mistake there is reported as such, before any root-only check.
    title, variants = SUITES[args.suite]
    try:
        chosen, per_variant = chosen_variants(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problem = tools_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out = results_folder(args.out)
    jobs, evals = [], []
    if args.reuse and "SSGD" not in chosen:
        try:
            jobs, evals = read_baselines(args.reuse, args.seeds)
        except (ReuseError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        names = " and ".join(os.path.relpath(os.path.abspath(d), ROOT) for d in args.reuse)
        title += f" (SSGD from the earlier run{'s' if len(args.reuse) > 1 else ''} in {names})"
    title += overrides_note(args.set, per_variant)
    planned = plan_jobs(args.seeds, variants, chosen, args.set, per_variant)
    used = sorted({os.path.join(ROOT, config) for _, _, config, _ in planned})
    write_manifest(out, used, finished=False, rate_mbit=args.rate)
    for seed, label, config, overrides in planned:
        print(f"[seed {seed}] {label} at {args.rate:g} Mbit/s", flush=True)
        job, ev = run(label, config, seed, args.rate, out, args.timeout, overrides)
        jobs.append(job)
        evals += ev
        print(f"  exit {job['rc']}, {job['seconds']:.1f} s, {job['kernel_bytes'] / 1e6:.1f} MB on the link",
              flush=True)
    rows = [relabel(label, variant_overrides(label, args.set, per_variant)) for label in variants]
    finish(args, out, used, jobs, evals, table(jobs, evals, args.rate, title, rows))
    return 0 if all(j["rc"] == 0 for j in jobs) else 1


def finish(args, out, used, jobs, evals, text):
    """jobs.csv, evals.csv, table.md (text, also printed), the finished manifest and the plots."""
    write_csv(os.path.join(out, "jobs.csv"), jobs)
    write_csv(os.path.join(out, "evals.csv"), evals)
    write_text(os.path.join(out, "table.md"), text)
    print(text)
    plot = ["python", "scripts/plot.py", "--evals", os.path.join(os.path.relpath(out, ROOT), "evals.csv"),
            "--title", f"{SUITES[args.suite][0]} at {args.rate:g} Mbit/s", "--out", os.path.relpath(out, ROOT)]
    names = ["accuracy_vs_time.png", "accuracy_vs_train_time.png", "accuracy_vs_epoch.png"]
    write_manifest(out, used, finished=True, rate_mbit=args.rate, jobs=len(jobs),
                   failed=sum(j["rc"] != 0 for j in jobs), plots={n: shlex.join(plot) for n in names} if evals else {})
    if evals:
        subprocess.call([sys.executable, *plot[1:]], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
