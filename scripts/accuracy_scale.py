"""The suites of scripts/accuracy.py that ask what adding workers does to accuracy, as users scale: the
per-worker batch fixed at 128, Goyal et al.'s linear rule (lr 0.1 x N/2, a one-epoch linear lr warm-up,
cosine), SSD-SGD's synchronous warm-up one epoch.

scale_ablation  one change at a time away from the shipped SSD-SGD at N = 4 and 8, 300 steps, on a proxy
                cheap enough for many runs on 2 cores: an MLP on 28x28 Fashion-MNIST (50,000 training
                images, validation from the rest). Run it with a validation split.
scale_compressor the compressor's share at N = 8 and 1,000 steps: top-k 1% with and without its density
                warm-up, and other ways to hold back less under the lr warm-up
scale_budget    SSGD, SSD-SGD and SSD-SGD + top-k 1% (the shipped defaults, and the delay stage without
                its rate cap) at N = 4 and 8 and 300, 1,000 and 3,000 steps, on the same proxy.
"""
import math

SSGD = "configs/fmnist_resnet20_ssgd.yaml"
SSD = "configs/fmnist_resnet20_ssd.yaml"
TOPK = "configs/fmnist_resnet20_ssd_topk.yaml"
PER_WORKER_BATCH = 128
TRAIN_PER_CLASS = 5000                       # 50,000 training images; validation and test from the rest
PROXY = ["model.name=mlp", "data.shape=[1,28,28]", "data.augment=false", f"data.train_per_class={TRAIN_PER_CLASS}"]
BUDGETS = (300, 1000, 3000)
UNCAPPED = ["algorithm.lr_cap=null"]         # the delay stage at SSGD's rate, as before the cap


def epochs_for(steps, workers):
    """The whole epochs closest to `steps` steps for N workers on the proxy's training set."""
    per_epoch = TRAIN_PER_CLASS * 10 // (workers * PER_WORKER_BATCH)
    return max(1, round(steps / per_epoch))


def scaled_by_linear_rule(workers, per_worker_batch=PER_WORKER_BATCH, base_lr=0.1, base_workers=2):
    """N workers at a fixed per-worker batch, as users scale: Goyal et al.'s linear rule (lr = the 2-worker
    configs' 0.1 x N/2) with a linear lr warm-up over the first epoch."""
    return [f"cluster.workers={workers}", f"train.batch_size={per_worker_batch}",
            f"train.lr={base_lr * workers / base_workers:g}", "train.lr_schedule.warmup_epochs=1"]


def linear_rule(workers, steps):
    """The proxy at N workers by the linear rule for about `steps` steps, SSD-SGD's warm-up one epoch."""
    return [*scaled_by_linear_rule(workers), "algorithm.warmup_iters=null",
            f"train.epochs={epochs_for(steps, workers)}", *PROXY]


def _ablation(n):
    """label -> (config, overrides) at N = n: each row one change away from the shipped SSD-SGD as it was
    before the delay stage's rate cap (the first SSD-SGD row)."""
    base = linear_rule(n, 300)
    one_epoch = TRAIN_PER_CLASS * 10 // (n * PER_WORKER_BATCH)
    old = base + UNCAPPED
    return {
        f"N={n} SSGD": (SSGD, base),
        f"N={n} SSD-SGD, uncapped delay-stage rate": (SSD, old),
        # The delay alone: gradients on one-round-old weights with no local update to speak of.
        f"N={n} SSD-SGD, uncapped, staleness alone": (SSD, old + ["algorithm.local.optimizer=sgd",
                                                                   "algorithm.local.lr_scale=1e-9"]),
        f"N={n} SSD-SGD, uncapped, global velocity only": (SSD, old + ["algorithm.local.lr_scale=1e-9"]),
        f"N={n} SSD-SGD, uncapped, local rate 1x": (SSD, old + ["algorithm.local.lr_scale=1"]),
        f"N={n} SSD-SGD, uncapped, local rate sqrt(N)x": (SSD, old + [f"algorithm.local.lr_scale={math.sqrt(n):.4f}"]),
        f"N={n} SSD-SGD, uncapped, plain local SGD (no velocity)": (SSD, old + ["algorithm.local.optimizer=sgd"]),
        f"N={n} SSD-SGD, uncapped, paper's GLU (4x, c 0.5)": (SSD, old + ["algorithm.local.optimizer=glu"]),
        f"N={n} SSD-SGD, uncapped, delay momentum 0.8": (SSD, old + ["algorithm.momentum=0.8"]),
        f"N={n} SSD-SGD, uncapped, 3 warm-up epochs": (SSD, old + [f"algorithm.warmup_iters={3 * one_epoch}"]),
        f"N={n} SSD-SGD, uncapped, 3-epoch lr warm-up": (SSD, old + ["train.lr_schedule.warmup_epochs=3"]),
        f"N={n} SSD-SGD, uncapped, k=2": (SSD, old + ["algorithm.delay=2"]),
        f"N={n} SSD-SGD, rate cap 0.2": (SSD, base + ["algorithm.lr_cap=0.2"]),
        f"N={n} SSD-SGD, rate cap 0.1 (shipped)": (SSD, base),
        f"N={n} SSD-SGD, rate cap 0.05": (SSD, base + ["algorithm.lr_cap=0.05"]),
        f"N={n} SSGD + top-k 1%": (TOPK, base + ["algorithm.type=ssgd"]),
        f"N={n} SSD-SGD + top-k 1%, uncapped": (TOPK, old),
        f"N={n} SSD-SGD + top-k 1% (shipped)": (TOPK, base),
    }


def _budget(n, steps):
    base = linear_rule(n, steps)
    return {
        f"N={n}, {steps} steps: SSGD": (SSGD, base),
        f"N={n}, {steps} steps: SSD-SGD (shipped)": (SSD, base),
        f"N={n}, {steps} steps: SSD-SGD + top-k 1% (shipped)": (TOPK, base),
        f"N={n}, {steps} steps: SSD-SGD, uncapped": (SSD, base + UNCAPPED),
        f"N={n}, {steps} steps: SSD-SGD + top-k 1%, uncapped": (TOPK, base + UNCAPPED),
    }


def _compressor(n, steps=1000):
    """The compressor's share at N = n: the shipped top-k 1% (with its density warm-up, the default under
    an lr warm-up) against one change at a time, and SSGD + top-k, which has no delay stage."""
    base = linear_rule(n, steps)
    none = base + ["compression.warmup=[]"]            # the density warm-up off: as shipped before it
    return {
        f"N={n}, {steps} steps: SSGD": (SSGD, base),
        f"N={n}, {steps} steps: SSD-SGD + top-k 1% (shipped)": (TOPK, base),
        f"N={n}, {steps} steps: top-k 1%, no density warm-up": (TOPK, none),
        f"N={n}, {steps} steps: top-k 1%, density warm-up [0.25] (the lr warm-up's epoch)":
            (TOPK, base + ["compression.warmup=[0.25]"]),
        f"N={n}, {steps} steps: top-k 1%, no density warm-up, held values rescaled":
            (TOPK, none + ["compression.rescale_held=true"]),
        f"N={n}, {steps} steps: top-k 4%, no density warm-up": (TOPK, none + ["compression.density=0.04"]),
        f"N={n}, {steps} steps: SSGD + top-k 1%, no density warm-up": (TOPK, none + ["algorithm.type=ssgd"]),
        f"N={n}, {steps} steps: SSGD + top-k 1%": (TOPK, base + ["algorithm.type=ssgd"]),
    }


def at_one_percent(variants, configs=(TOPK,)):
    """The variants with compression.density=0.01 before their own overrides where they run one of `configs`:
    the shipped top-k configs choose their density for the link (compression.density: auto), and these
    suites run on loopback, where auto would take the densest; each variant runs at the density its label
    names, 1% unless its overrides give another."""
    return {label: (config, (["compression.density=0.01"] if config in configs else []) + list(sets))
            for label, (config, sets) in variants.items()}


SCALE_ABLATION = at_one_percent({**_ablation(8), **_ablation(4)})
SCALE_COMPRESSOR = at_one_percent(_compressor(8))
SCALE_BUDGET = at_one_percent({label: v for steps in BUDGETS for n in (8, 4) for label, v in _budget(n, steps).items()})
