"""Final accuracy and traffic of each variant of a suite (algorithms, ablations, settings), over seeds.

The suites (--suite):
  digits             the digits demo's algorithms and ablations (the default)
  fmnist             Fashion-MNIST with ResNet-20: the shipped settings, and one change at a time away
  defaults           a config that leaves every setting at the schema's default beside the one that
                     writes them out
  selection          the shipped Fashion-MNIST top-k config with exact and with sampled selection
  scale              SSGD, SSD-SGD and SSD-SGD + top-k 1% (exact and compressed downlink) at 8, 4 and 2
                     workers with the 2-worker configs' global batch
  scale_fixed_batch  SSGD, SSD-SGD and SSD-SGD + top-k 1% at 8 and 4 workers with the configs' per-worker
                     batch and the linear learning-rate rule
  budget             the shipped top-k settings and candidate changes to them against SSGD, for other
                     budgets and training subsets
  scale_ablation     at 4 and 8 workers with the linear rule, one change at a time (scripts/accuracy_scale.py)
  scale_budget       at 4 and 8 workers with the linear rule, 300, 1,000 and 3,000 steps (the same file)
  scale_compressor   top-k 1% at 8 workers, 1,000 steps: its density warm-up and the alternatives (the same file)

    python scripts/accuracy.py [--suite digits] [--seeds 0 1 2] [--variants LABEL ...]
        [--set KEY=VALUE ...] [--out results/accuracy_digits] [--keep-done]

Every variant runs through the real launcher (1 scheduler, 1 server, 2 workers unless the variant
says otherwise), one job at a time, seeds interleaved, with the time to go printed after each job.
Writes runs.csv (one row per job), table.md (mean and spread per variant)
and manifest.json (command, configs, commit, machine, date), and prints the table. `--set
data.validation=0.1` tunes on a validation split carved from the training set (the table then says
so); without it the runs report the test set.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.accuracy_scale import (SCALE_ABLATION, SCALE_BUDGET, SCALE_COMPRESSOR, at_one_percent,
                                    scaled_by_linear_rule)
from scripts.results_io import (done_rows, earlier_runs, job_command, job_name, job_summary, results_folder,
                                run_captured, run_folder, settings_problem, summary_row, survive_closed_stdout,
                                write_csv, write_manifest, write_text)
from ssdsgd.schema import AUTO_DENSITIES

SSGD = "configs/demo_digits_ssgd.yaml"
SSD = "configs/demo_digits_ssd.yaml"
TOPK = "configs/demo_digits_ssd_topk.yaml"
RESNET20 = ["model.name=cifar_resnet20_v1", "data.shape=[3,32,32]", "train.epochs=10", "log.every_steps=100"]
# label -> (config, overrides)
VARIANTS = {
    "SSGD": (SSGD, []),
    "ASGD": (SSGD, ["algorithm.type=asgd"]),
    "SSD-SGD k=4 (GLU)": (SSD, []),
    "SSD-SGD k=4, plain local SGD": (SSD, ["algorithm.local.optimizer=sgd"]),
    "OD-SGD (k=1, GLU)": (SSD, ["algorithm.delay=1"]),
    "SSD-SGD k=5 + top-k 1% ahead": (TOPK, []),
    "SSD-SGD k=5 + top-k 1% behind": (TOPK, ["compression.fusion=behind"]),
    "SSGD + top-k 1%": (TOPK, ["algorithm.type=ssgd"]),
    "SSD-SGD k=5 + top-k 1% ahead, S=2k": (TOPK, ["algorithm.max_staleness=10"]),
    # Where sparsification-ahead fusion should matter most: sparser, or without error feedback.
    "SSD-SGD + top-k 0.1% ahead": (TOPK, ["compression.density=0.001"]),
    "SSD-SGD + top-k 0.1% behind": (TOPK, ["compression.density=0.001", "compression.fusion=behind"]),
    "SSD-SGD + top-k 1% ahead, no EF": (TOPK, ["compression.error_feedback=false",
                                                "compression.momentum_correction=false"]),
    "SSD-SGD + top-k 1% behind, no EF": (TOPK, ["compression.error_feedback=false",
                                                 "compression.momentum_correction=false",
                                                 "compression.fusion=behind"]),
    # A deeper model whose tensors differ widely in size and gradient scale (conv, BatchNorm, dense):
    # where sparsification-behind fusion can starve whole tensors.
    "ResNet-20 SSGD": (SSGD, RESNET20),
    "ResNet-20 SSD-SGD + top-k 1% ahead": (TOPK, RESNET20),
    "ResNet-20 SSD-SGD + top-k 1% behind": (TOPK, RESNET20 + ["compression.fusion=behind"]),
    # One whole-model buffer: behind fusion is then one global top-k (SyncEA), where the cost-model
    # buffers above are nearly one per layer on loopback and leave little to choose between the two.
    "top-k 1% ahead, one buffer": (TOPK, ["compression.buffers=one"]),
    "top-k 1% behind, one buffer": (TOPK, ["compression.buffers=one", "compression.fusion=behind"]),
    "top-k 0.1% ahead, one buffer": (TOPK, ["compression.buffers=one", "compression.density=0.001"]),
    "top-k 0.1% behind, one buffer": (TOPK, ["compression.buffers=one", "compression.density=0.001",
                                             "compression.fusion=behind"]),
    # Small tensors (biases, BatchNorm scale and shift) sent whole, as DGC and SAFusion practice do.
    # Behind gets the same total k (its one top-k spends the small tensors' budget wherever it wants),
    # so both push exactly the same bytes.
    "top-k 1% ahead, small dense, one buffer": (TOPK, ["compression.buffers=one", "compression.min_dense_bytes=1024"]),
    "top-k 1% behind, small dense, one buffer": (TOPK, ["compression.buffers=one", "compression.min_dense_bytes=1024",
                                                        "compression.fusion=behind"]),
    "ResNet-20 top-k 1% ahead, small dense, one buffer": (TOPK, RESNET20 + ["compression.buffers=one",
                                                                            "compression.min_dense_bytes=1024"]),
    "ResNet-20 top-k 1% behind, small dense, one buffer": (TOPK, RESNET20 + ["compression.buffers=one",
                                                                             "compression.min_dense_bytes=1024",
                                                                             "compression.fusion=behind"]),
    # The wire format and the density warm-up (DGC's 25% -> 6.25% -> 1.56%, one epoch each, down to the 1%
    # density; DGC's 0.4% stage is below it, which the config refuses).
    "top-k 1% ahead, fp16 values": (TOPK, ["compression.fp16_values=true"]),
    "top-k 1% ahead, density warm-up": (TOPK, ["compression.warmup=[0.25,0.0625,0.015625]"]),
    "ResNet-20 top-k 1% ahead, one buffer": (TOPK, RESNET20 + ["compression.buffers=one"]),
    "ResNet-20 top-k 1% behind, one buffer": (TOPK, RESNET20 + ["compression.buffers=one",
                                                                "compression.fusion=behind"]),
}

F_SSGD = "configs/fmnist_resnet20_ssgd.yaml"
F_SSD = "configs/fmnist_resnet20_ssd.yaml"
F_TOPK = "configs/fmnist_resnet20_ssd_topk.yaml"
F_SHORT = "configs/fmnist_resnet20_short_ssd_topk.yaml"          # only type: ssd, type: topk, density: auto
# The shipped settings, and one change at a time away from them (the ablation of the convergence work).
F_OLD_LOCAL = ["algorithm.local.optimizer=glu", "algorithm.local.lr_scale=4.0"]
FMNIST = {
    "SSGD": (F_SSGD, []),
    "SSD-SGD": (F_SSD, []),
    "SSD-SGD + top-k 1%": (F_TOPK, []),
    "SSGD + top-k 1%": (F_TOPK, ["algorithm.type=ssgd"]),
    "SSD-SGD, GLU local update (4x lr)": (F_SSD, F_OLD_LOCAL),
    "SSD-SGD, plain local SGD (2x lr)": (F_SSD, ["algorithm.local.optimizer=sgd"]),
    "SSD-SGD + top-k 1%, GLU local update (4x lr)": (F_TOPK, F_OLD_LOCAL),
    "SSD-SGD + top-k 1%, quotas by size": (F_TOPK, ["compression.allocation=size"]),
    "SSD-SGD + top-k 1%, quotas by size, GLU (4x lr)": (F_TOPK, ["compression.allocation=size"] + F_OLD_LOCAL),
    "SSD-SGD + top-k 1%, behind (one global top-k)": (F_TOPK, ["compression.allocation=size",
                                                              "compression.fusion=behind"]),
    "SSD-SGD + top-k 1%, no momentum correction": (F_TOPK, ["compression.momentum_correction=false"]),
}
# A config that says only `type: ssd` and `type: topk` against the one that writes the settings out.
DEFAULTS = {
    "SSD-SGD + top-k 1%, fmnist_resnet20_ssd_topk.yaml": (F_TOPK, []),
    "SSD-SGD + top-k 1%, fmnist_resnet20_short_ssd_topk.yaml (defaults)":
        (F_SHORT, []),
}
# compression.selection: the exact top-k search against the sampled one (issue 36, item 6).
SELECTION = {
    "SSD-SGD + top-k 1%, exact selection": (F_TOPK, ["compression.selection=exact"]),
    "SSD-SGD + top-k 1%, sampled selection": (F_TOPK, ["compression.selection=sampled"]),
}


def _same_global_batch(workers, global_batch=256):
    """N workers sharing the 2-worker configs' global batch and schedule (what N does to the algorithm,
    not to the batch): per-worker batch global/N, the local update's lr N times the global one."""
    return [f"cluster.workers={workers}", f"train.batch_size={global_batch // workers}",
            f"algorithm.local.lr_scale={float(workers)}"]


# Past two workers (issue 36): SSGD, SSD-SGD, SSD-SGD + top-k 1% with the exact and the compressed downlink, at
# N = 8, 4 and 2 workers (largest first: the runs that matter most finish first).
SCALE = {}
for _n in (8, 4, 2):
    _sets = _same_global_batch(_n)
    SCALE.update({
        f"N={_n} SSGD": (F_SSGD, _sets[:2]),                  # no local update: no local lr
        f"N={_n} SSD-SGD": (F_SSD, _sets),                    # no compression: what the delay stage costs
        f"N={_n} SSD-SGD + top-k 1%, exact downlink": (F_TOPK, _sets + ["compression.downlink=sparse"]),
        f"N={_n} SSD-SGD + top-k 1%, compressed downlink": (F_TOPK, _sets + ["compression.downlink=compressed"]),
        f"N={_n} SSD-SGD + top-k 1%, exact downlink, rescaled": (
            F_TOPK, _sets + ["compression.downlink=sparse", "compression.rescale_held=true"]),
        f"N={_n} SSD-SGD + top-k 1%, compressed downlink, rescaled": (
            F_TOPK, _sets + ["compression.downlink=compressed", "compression.rescale_held=true"]),
    })


def _fixed_worker_batch(workers):
    """N workers at the configs' per-worker batch (global batch 128 N) by the linear rule
    (accuracy_scale.scaled_by_linear_rule); the local update's lr N times the global one. SSD-SGD's
    synchronous warm-up is one epoch at every N (`algorithm.warmup_iters: null`), as the configs' 39 steps
    are one epoch at 2 workers."""
    return [*scaled_by_linear_rule(workers), f"algorithm.local.lr_scale={float(workers)}"]


# The same algorithms at N = 8 and 4 with a fixed per-worker batch (issue 36, item 1, second view).
SCALE_FIXED_BATCH = {}
for _n in (8, 4):
    _sets = _fixed_worker_batch(_n)
    SCALE_FIXED_BATCH.update({
        f"N={_n} SSGD, linear rule": (F_SSGD, [s for s in _sets if "local" not in s]),
        f"N={_n} SSD-SGD, linear rule": (F_SSD, _sets + ["algorithm.warmup_iters=null"]),
        f"N={_n} SSD-SGD + top-k 1%, linear rule": (F_TOPK, _sets + ["algorithm.warmup_iters=null"]),
    })
# Settings for any budget and subset (issue 36, item 2): the shipped top-k settings against SSGD, the same
# compression without the delay stage (what top-k alone costs), DGC's density warm-up (the first epochs
# after the synchronous one at 6.25% and 1.56%) and denser pushes, to be run on an untuned subset
# (data.train_offset) with a validation split and a budget given by --set train.epochs.
BUDGET = {
    "SSGD": (F_SSGD, []),
    "SSD-SGD + top-k 1%": (F_TOPK, []),
    "SSGD + top-k 1%": (F_TOPK, ["algorithm.type=ssgd"]),
    "SSD-SGD + top-k 1%, density warm-up": (F_TOPK, ["compression.warmup=[0.25,0.0625,0.015625]"]),
    # Denser pushes without DGC's momentum factor masking: the servers then apply exactly momentum SGD's
    # updates, each value delayed until it is sent.
    "SSD-SGD + top-k 5%, no masking": (F_TOPK, ["compression.density=0.05", "compression.momentum_masking=false"]),
    "SSD-SGD + top-k 10%, no masking": (F_TOPK, ["compression.density=0.1", "compression.momentum_masking=false"]),
    # What is held back, rescaled as the learning rate falls (compression.rescale_held), so each gradient is
    # applied at its own step's rate rather than at the lower rate of the step that sends it.
    "SSD-SGD + top-k 1%, rescaled": (F_TOPK, ["compression.rescale_held=true"]),
    "SSD-SGD + top-k 1%, rescaled, no masking": (F_TOPK, ["compression.rescale_held=true",
                                                         "compression.momentum_masking=false"]),
    # Error feedback on the plain gradient and the momentum on the servers (no DGC momentum correction,
    # so nothing to mask): a value that is sent gets SSGD's whole momentum, however rarely it is sent. It lost
    # 3-4.6 points to the shipped correction at 5 and 8 epochs (docs/design.md), so it stays a screen.
    "SSD-SGD + top-k 1%, servers' momentum": (F_TOPK, ["compression.momentum_correction=false"]),
}
# Every density compression.density: auto chooses from, each run at its number: a strict run with auto is the run
# with the number it chose, bit for bit (which density which link gets: docs/results.md, "Which density").
BUDGET.update({f"SSD-SGD + top-k {d * 100:g}%": (F_TOPK, [f"compression.density={d}"])
               for d in AUTO_DENSITIES if d != 0.01})
SUITES = {name: at_one_percent(variants, (F_TOPK, F_SHORT)) for name, variants in {
    "digits": VARIANTS, "fmnist": FMNIST, "defaults": DEFAULTS, "selection": SELECTION, "scale": SCALE,
    "scale_fixed_batch": SCALE_FIXED_BATCH, "budget": BUDGET}.items()}
SUITES.update(scale_ablation=SCALE_ABLATION, scale_budget=SCALE_BUDGET, scale_compressor=SCALE_COMPRESSOR)


def run(label, config, sets, seed, out):
    name = job_name(label, seed)
    proc = run_captured(job_command(config, name, f"{out}/runs", [f"seed={seed}", *sets]))
    s = job_summary(proc, run_folder(proc.stdout, os.path.join(out, "runs"), name))
    if s is None:
        return {"variant": label, "seed": seed, "rc": proc.returncode}
    return {"variant": label, "seed": seed, "rc": 0, **summary_row(s)}


def _staleness(rows):
    values = [r["max_staleness"] for r in rows if r["max_staleness"] not in (None, "")]
    return max(values) if values else "n/a (not tracked for ASGD)"


def table(rows, variants=VARIANTS):
    sets = sorted({r["eval_set"] for r in rows if r["rc"] == 0}) or ["test"]
    lines = [f"| variant | final {'/'.join(sets)} acc (mean ± sd over seeds) | per seed | push B/step | pull B/step "
             f"| max staleness |", "|---|---|---|---|---|---|"]
    for label in variants:
        rs = [r for r in rows if r["variant"] == label and r["rc"] == 0]
        if not any(r["variant"] == label for r in rows):
            continue                                  # not run (--variants)
        if not rs:
            lines.append(f"| {label} | failed | | | | |")
            continue
        accs = [r["final_acc"] for r in rs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(f"| {label} | {statistics.mean(accs):.4f} ± {sd:.4f} | {' '.join(f'{a:.4f}' for a in accs)} "
                     f"| {statistics.median(r['push_bytes_per_step'] for r in rs):.0f} "
                     f"| {statistics.median(r['pull_bytes_per_step'] for r in rs):.0f} "
                     f"| {_staleness(rs)} |")
    return "\n".join(lines)


def paired_ahead_behind(rows, variants=VARIANTS):
    """Per-seed comparison of every 'ahead' variant with its 'behind' twin (same seeds, same config
    otherwise): wins / ties / losses of ahead, and the mean and sd of the paired difference."""
    lines = []
    for label in variants:
        twin = label.replace("ahead", "behind")
        if "ahead" not in label or twin not in variants:
            continue
        acc = {v: {r["seed"]: r["final_acc"] for r in rows if r["variant"] == v and r["rc"] == 0}
               for v in (label, twin)}
        seeds = sorted(set(acc[label]) & set(acc[twin]))
        if not seeds:
            continue
        diffs = [100 * (acc[label][s] - acc[twin][s]) for s in seeds]
        wins = sum(d > 1e-9 for d in diffs)
        losses = sum(d < -1e-9 for d in diffs)
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        lines.append(f"- {label} vs behind, {len(seeds)} seeds: ahead wins {wins}, ties {len(seeds) - wins - losses}, "
                     f"loses {losses}; difference {statistics.mean(diffs):+.2f} ± {sd:.2f} points (mean ± sd)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)   # the suites, as written
    ap.add_argument("--suite", choices=sorted(SUITES), default="digits", help="the variants to run (default digits)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", help="labels to run (default: all of the suite's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every job (repeatable), e.g. data.validation=0.1")
    ap.add_argument("--out", default=None, help="default: results/accuracy_<suite>")
    ap.add_argument("--keep-done", action="store_true",
                    help="keep the finished jobs of --out's runs.csv and run only the others")
    args = ap.parse_args()
    survive_closed_stdout()
    variants = SUITES[args.suite]
    unknown = [v for v in args.variants or [] if v not in variants]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; the {args.suite} suite has: {', '.join(variants)}")
    out = results_folder(args.out or f"results/accuracy_{args.suite}")
    csv_path = os.path.join(out, "runs.csv")
    if os.path.exists(csv_path) and not args.keep_done:
        sys.exit(f"accuracy.py: {csv_path} exists; --keep-done keeps its finished jobs and runs the rest, "
                 f"or choose another --out")
    used = sorted({os.path.join(ROOT, variants[label][0]) for label in args.variants or variants})
    problem = settings_problem(out, args.set) if args.keep_done else None
    if problem:                                   # kept rows would not be comparable with new ones
        sys.exit(f"accuracy.py: {problem}")
    earlier = earlier_runs(out) if args.keep_done else []
    write_manifest(out, used, finished=False, settings=args.set, earlier=earlier)
    rows = done_rows(csv_path) if os.path.exists(csv_path) else []
    done = {(r["variant"], r["seed"]) for r in rows}
    jobs = [(s, v) for s in args.seeds for v in args.variants or list(variants) if (v, s) not in done]
    started = time.monotonic()
    for i, (seed, label) in enumerate(jobs):
        config, sets = variants[label]
        print(f"[{i + 1}/{len(jobs)}, seed {seed}] {label}", flush=True)
        rows.append(run(label, config, sets + args.set, seed, out))
        if rows[-1]["rc"] == 0:
            print(f"  final {rows[-1]['eval_set']} accuracy {rows[-1]['final_acc']:.4f}", flush=True)
        write_csv(os.path.join(out, "runs.csv"), rows)          # after every job: a partial result survives
        elapsed = time.monotonic() - started
        print(f"  {elapsed / 60:.0f} min so far; about {elapsed / (i + 1) * (len(jobs) - i - 1) / 60:.0f} min to go",
              flush=True)
    text = table(rows, variants)
    pairs = paired_ahead_behind(rows, variants)
    if pairs:
        text += "\n\n" + pairs
    write_text(os.path.join(out, "table.md"), text)
    write_manifest(out, used, finished=True, jobs=len(rows), failed=sum(r["rc"] != 0 for r in rows),
                   settings=args.set, earlier=earlier)
    print(text)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
