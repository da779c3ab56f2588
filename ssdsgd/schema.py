"""The configuration's schema: every key a run can use, with its type, default and allowed range
(SCHEMA), and the field types that check a value. Read by ssdsgd.config (loading, overrides, the checks
across keys), by the checkpoint fingerprint and by scripts/gen_config_doc.py (docs/config.md).
"""
import copy
import math
import reprlib

from ssdsgd.compression.registry import compression_types
from ssdsgd.errors import JobError
from ssdsgd.registry import algorithm_names
from ssdsgd.schedule import KINDS as SCHEDULE_KINDS


class ConfigError(JobError, ValueError):
    """Invalid configuration. `str(err)` starts with the offending key path."""


SHOWN_CHARS = 100      # the longest excerpt of a value an error message quotes
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple = 3, 8, 8, 8
_SHORT.maxstring = _SHORT.maxlong = _SHORT.maxother = 60


def shown(value):
    """A value as an error message quotes it: its repr, cut to a short excerpt. A value can be huge (a
    million-item list, a long string) and a message that printed all of it could fill a disk."""
    text = _SHORT.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def key_name(key):
    """A key (or dotted key path) as a message names it: as written if it is a short printable string, else
    its excerpt."""
    return key if isinstance(key, str) and len(key) <= SHOWN_CHARS and key.isprintable() else shown(key)


class Field:
    """One leaf of the schema: allowed types, default, and optional range/choices."""

    def __init__(self, types, default, *, choices=None, min=None, max=None, gt=None,
                 nullable=False, keywords=(), doc=""):
        self.types = types if isinstance(types, tuple) else (types,)
        self.default = default
        self.keywords = keywords         # words that stand for a value the run decides (density: auto)
        self.choices = choices
        self.min, self.max, self.gt = min, max, gt
        self.nullable = nullable
        self.doc = doc

    def check(self, path, value):
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{path}: must be set (got null)")
        if isinstance(value, str) and value in self.keywords:
            return value
        # YAML gives ints where floats are meant ("lr: 1"); bools are not numbers here.
        if float in self.types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        # ...and ints where a name is meant ("--set name=123", "name: 2024"): the digits are the name.
        if self.types == (str,) and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, bool) and bool not in self.types:
            hint = (" (YAML reads yes, no, on, off, true and false as booleans: quote the text, "
                    "e.g. --set 'name=\"off\"')") if str in self.types else ""
            raise ConfigError(f"{path}: expected {self._type_names()}, got {shown(value)}{hint}")
        if not isinstance(value, self.types):
            raise ConfigError(f"{path}: expected {self._type_names()}, got {shown(value)}")
        # YAML reads .nan and .inf as floats; no setting here means anything with them.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number; got {shown(value)}")
        choices = self.choices() if callable(self.choices) else self.choices     # callable: read when checked
        if choices is not None and value not in choices:
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, choices))}; got {shown(value)}")
        if self.min is not None and value < self.min:
            raise ConfigError(f"{path}: must be >= {self.min}; got {shown(value)}")
        if self.max is not None and value > self.max:
            raise ConfigError(f"{path}: must be <= {self.max}; got {shown(value)}")
        if self.gt is not None and value <= self.gt:
            raise ConfigError(f"{path}: must be > {self.gt}; got {shown(value)}")
        return value

    def _type_names(self):
        return " or ".join([t.__name__ for t in self.types] + list(self.keywords))


def _number_list(path, value, item):
    def ok(v):
        if isinstance(v, bool):
            return False
        return isinstance(v, int) or (item is float and isinstance(v, float))
    noun = "integers" if item is int else "numbers"
    if not isinstance(value, list) or not all(ok(v) for v in value):
        raise ConfigError(f"{path}: expected a list of {noun}, got {shown(value)}")
    return [item(v) for v in value]


class ListField(Field):
    """A list of positive numbers (ints by default), optionally of fixed length or bounded above."""

    def __init__(self, default, *, item=int, nullable=False, length=None, max=None, doc=""):
        super().__init__(list, default, nullable=nullable, max=max, doc=doc)
        self.item = item
        self.length = length

    def check(self, path, value):
        if value is None and self.nullable:
            return None
        value = _number_list(path, value, self.item)
        if self.length is not None and len(value) != self.length:
            raise ConfigError(f"{path}: expected {self.length} values, got {shown(value)}")
        if any(v <= 0 for v in value):
            raise ConfigError(f"{path}: values must be positive, got {shown(value)}")
        if self.max is not None and any(v > self.max for v in value):
            raise ConfigError(f"{path}: values must be <= {self.max}, got {shown(value)}")
        return value


class IdListField(Field):
    """A list of distinct non-negative integers (device ids), or null."""

    def __init__(self, doc=""):
        super().__init__(list, None, nullable=True, doc=doc)

    def check(self, path, value):
        if value is None:
            return None
        value = _number_list(path, value, int)
        if not value or any(v < 0 for v in value) or len(set(value)) != len(value):
            raise ConfigError(f"{path}: expected distinct ids >= 0, got {value!r}")
        return value


class StrListField(Field):
    """A list of non-empty strings."""

    def __init__(self, default, doc=""):
        super().__init__(list, default, doc=doc)

    def check(self, path, value):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{path}: expected a list of strings, got {shown(value)}")
        return list(value)


DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist", "imagenet", "synthetic")
IN_MEMORY_DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist")   # can be cut down and split
VALIDATION_SOURCES = ("subset", "rest")      # data.validation_from: the kept images, or the ones left out
ROOTED_DATASETS = ("cifar10", "mnist", "fashion_mnist", "imagenet")   # read from data.root
# data.format (cifar10): auto finds the first of the others in data.root, in this order.
CIFAR_FORMATS = ("auto", "binary", "python", "archive", "recordio")
RING_DOWNLINKS = ("sparse", "compressed")   # compression.downlink values that rebuild weights from the rounds' ring
# compression.density: auto picks one of these (fractions of each tensor's values a worker sends).
AUTO_DENSITIES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
SYNTHETIC_SHAPE = (3, 32, 32)   # a synthetic data set's images when data.shape is not set
MIN_SERVER_TIMEOUT = 3.0   # seconds: three missed touches of a liveness file (pyhooks/sitecustomize.py)

SCHEMA = {
    "name": Field(str, None, nullable=True, doc="run name; default: the config file name"),
    "seed": Field(int, 0, min=0),
    "plugins": StrListField([], doc="modules imported before the rest of the config is read, each registering "
                                    "algorithms (algorithm.type) or sparsifiers (compression.type) of its own "
                                    "(docs/design.md, Extending); every host must be able to import them"),
    "cluster": {
        "workers": Field(int, 2, min=1, max=64),
        "servers": Field(int, 1, min=1, max=64),
        "launcher": Field(str, "local", choices=("local", "ssh")),
        "hostfile": Field(str, None, nullable=True),
        "interface": Field(str, None, nullable=True,
                           doc="ssh launcher: the network interface the hosts reach this machine on; an error with "
                               "local"),
        "timeout": Field(float, 3600.0, gt=0, doc="global job timeout, seconds"),
        "stall_timeout": Field(float, 300.0, nullable=True, min=0,
                               doc="a worker silent this long fails the job; null or 0: never"),
        "server_timeout": Field(float, 60.0, nullable=True, min=0,
                                doc="a server or the scheduler without a sign of life this long (stopped, hung, "
                                    "host unreachable) fails the job; null or 0: never"),
        "ssh_user": Field(str, None, nullable=True, doc="ssh launcher: login user (ssh -l)"),
        "ssh_identity": Field(str, None, nullable=True, doc="ssh launcher: private key file (ssh -i)"),
        "ssh_config": Field(str, None, nullable=True, doc="ssh launcher: ssh configuration file (ssh -F)"),
        "ssh_options": StrListField([], doc="ssh launcher: extra `Option=value` items (ssh -o)"),
        "port": Field(int, None, nullable=True, min=1, max=65535, doc="scheduler port; default: a free one"),
        "max_restarts": Field(int, 0, min=0, max=100,
                              doc="a job that fails after a complete checkpoint is restarted with --resume "
                                  "at most this many times (ssh: a host that does not answer is first replaced "
                                  "by a spare host, or waited for, cluster.host_wait)"),
        "device": Field(str, "cpu", choices=("cpu", "gpu"),
                        doc="what the workers train on: train.devices CPU contexts (cpu(1) ... cpu(D); one: the "
                            "process's own, as MXNet's default) or GPUs (each worker its own train.devices GPUs, "
                            "given by the launcher through CUDA_VISIBLE_DEVICES; needs a GPU build of MXNet)"),
        "gpus": IdListField(doc="cluster.device gpu: the GPU ids of each host that the workers share out, "
                                "train.devices to a worker, in order (a host file line's gpus= overrides it for "
                                "that host); null: 0, 1, 2, ... as many as the host's workers take"),
        "restart_backoff": Field(float, 1.0, min=0,
                                 doc="seconds before a restart, doubled for each restart in a row that found no "
                                     "newer checkpoint (at most 60 s), so a cause that persists (a full disk) "
                                     "does not use up max_restarts at once; 0: restart at once"),
        "host_wait": Field(float, 300.0, min=0,
                           doc="ssh launcher: seconds a restart waits for a host that does not answer ssh when no "
                               "spare host (host file `spare`) is left to take its roles, probing it every 5 s, "
                               "before giving up; 0: give up at once"),
    },
    "data": {
        "dataset": Field(str, "digits", choices=DATASETS),
        "root": Field(str, None, nullable=True),
        "format": Field(str, "auto", choices=CIFAR_FORMATS,
                        doc="cifar10: the form in data.root: binary or python batches (in it or in its "
                            "cifar-10-batches-bin/-py folder), archive (cifar-10-binary.tar.gz or "
                            "cifar-10-python.tar.gz as downloaded), recordio (im2rec train.rec and "
                            "test.rec); auto: the first found, in that order"),
        "shape": ListField(None, nullable=True, length=3, max=4096, doc="[C, H, W]"),
        "num_classes": Field(int, None, nullable=True, min=2, max=100_000),
        "synthetic_samples": Field(int, 1024, min=1, max=10_000_000,
                                   doc="training images of the synthetic data set (its test set: a quarter); "
                                       "all of them at most 16 GiB of float32"),
        "augment": Field(bool, True),
        "preprocess_threads": Field(int, 2, min=1, max=256),
        "train_per_class": Field(int, None, nullable=True, min=1,
                                 doc="keep the first n training images of each class (a fixed subset; a class "
                                     "with fewer keeps all it has). This key and the three below work on the "
                                     "in-memory data sets, not on ImageNet's RecordIO"),
        "train_offset": Field(int, 0, min=0,
                              doc="skip the first n training images of each class before data.train_per_class "
                                  "keeps its n: offsets 0, n, 2n, ... give disjoint subsets of one size"),
        "validation": Field(float, 0.0, min=0,
                            doc="fraction (< 1) or count of training images held out for validation; "
                                "evaluation then uses them instead of the test set"),
        "validation_from": Field(str, "subset", choices=VALIDATION_SOURCES,
                                 doc="where data.validation draws from: the kept training images (subset) or "
                                     "the training images data.train_per_class leaves out (rest)"),
    },
    "model": {
        "name": Field(str, "small_cnn"),
        "hybridize": Field(bool, True),
    },
    "train": {
        "epochs": Field(int, 10, min=1, max=100_000),
        "batch_size": Field(int, 32, min=1, doc="per worker"),
        "devices": Field(int, 1, min=1, max=64,
                         doc="replicas of the model per worker (GPUs or CPU contexts, see cluster.device): the "
                             "worker's batch is split over them and their gradients summed before the push; "
                             "BatchNorm normalises per replica"),
        "lr": Field(float, 0.1, gt=0, doc="global (server) learning rate"),
        "momentum": Field(float, 0.9, min=0, max=1),
        "wd": Field(float, 1e-4, min=0),
        "lr_schedule": {
            "type": Field(str, "constant", choices=SCHEDULE_KINDS),
            "milestones": ListField([], doc="epochs at which a step schedule multiplies by factor"),
            "factor": Field(float, 0.1, gt=0),
            "power": Field(float, 2.0, gt=0),
            "final_lr": Field(float, 0.0, min=0),
            "warmup_epochs": Field(float, 0.0, min=0),
        },
        "max_steps": Field(int, None, nullable=True, min=1, doc="stop after this many steps"),
        "eval_every_epochs": Field(int, 1, min=1),
        "eval_workers": Field(str, "rank0", choices=("rank0", "all"),
                              doc="rank0: rank 0 evaluates the whole set while the others wait; all: every "
                                  "worker evaluates every N-th batch with its own BatchNorm statistics and "
                                  "the counts are summed through the KVStore"),
        "eval_bn_batches": Field(int, 0, min=0,
                                 doc="recompute BatchNorm statistics for the evaluated global weights on this "
                                     "many training batches first (0: rank 0's running statistics)"),
        "nonfinite": Field(str, "fail", choices=("fail", "skip"),
                           doc="NaN/Inf in loss or gradient: stop, or push a zero gradient"),
    },
    "algorithm": {
        "type": Field(str, "ssgd", choices=algorithm_names),
        "warmup_iters": Field(int, None, nullable=True, min=0,
                              doc="synchronous steps before the delay stage; null: one epoch (the paper's "
                                  "scripts: 500)"),
        "delay": Field(int, 1, min=1, doc="k: pull the global weights every k steps (the paper's scripts: 5)"),
        "max_staleness": Field(int, None, nullable=True, min=1, doc="S; default k"),
        "strict": Field(bool, False),
        "lr_cap": Field(float, 0.1, nullable=True, gt=0,
                        doc="the steps-delay stage's learning rate at most this: a higher train.lr is carried by "
                            "momentum instead (algorithm.lr, algorithm.momentum); null: no cap"),
        "lr": Field(float, None, nullable=True, gt=0,
                    doc="the steps-delay stage's peak learning rate (the schedule scales it as it scales "
                        "train.lr); null: the smaller of train.lr and lr_cap"),
        "momentum": Field(float, None, nullable=True, min=0, max=1,
                          doc="momentum of the steps-delay stage (servers, local update, momentum correction); "
                              "null: 1 - (1 - train.momentum) * algorithm.lr / train.lr, which keeps SSGD's "
                              "lr / (1 - momentum)"),
        "local": {
            "optimizer": Field(str, "global_momentum", choices=("glu", "sgd", "global_momentum"),
                               doc="the local update between refreshes: momentum SGD carrying the global "
                                   "velocity (global_momentum), plain sgd, or the paper's GLU rule (glu)"),
            "lr": Field(float, None, nullable=True, gt=0),
            "lr_scale": Field(float, None, nullable=True, gt=0,
                              doc="local lr = lr_scale * the delay stage's lr (algorithm.lr), if local.lr is "
                                  "unset; null: the number of workers (a worker's own gradient stands in for "
                                  "all of theirs), 4 for glu (the paper's)"),
            "c": Field(float, 0.5, min=0, doc="GLU compensation coefficient"),
        },
    },
    "compression": {
        "type": Field(str, "none", choices=compression_types),
        "density": Field(float, 0.01, gt=0, max=1, keywords=("auto",),
                         doc="fraction of each tensor's values a worker sends per step; auto: the highest of "
                             f"{', '.join(f'{d:g}' for d in AUTO_DENSITIES)} (those at most a given warm-up's "
                             "last density) whose predicted step, from the step, encoding and link rates the "
                             "workers measure at the start of the synchronous warm-up, stays within auto_slack of "
                             "the compute bound (the choice is printed, written into the run folder's config.yaml "
                             "and kept by every checkpoint and resume)"),
        "auto_slack": Field(float, 0.05, gt=0, max=1,
                            doc="density: auto: how far above the compute bound (forward and backward alone) "
                                "the predicted step may be"),
        "error_feedback": Field(bool, True),
        "momentum_correction": Field(bool, None, nullable=True,
                                     doc="DGC's momentum correction: the workers accumulate the momentum before "
                                         "sparsifying; null: true with a sparsifier, false otherwise"),
        "momentum_masking": Field(bool, True,
                                  doc="momentum correction: zero the worker's momentum where a value was sent "
                                      "(DGC's momentum factor masking); false: keep it, so the servers apply "
                                      "exactly SSGD's momentum updates, each value delayed until it is sent"),
        "rescale_held": Field(bool, False,
                              doc="what the workers' error feedback and momentum correction hold back is "
                                  "multiplied by old lr / new lr when the learning rate changes, so each gradient "
                                  "is applied at its own step's rate, as SSGD applies it; false: at the rate of "
                                  "the step that sends it (less, under a decaying schedule)"),
        "fp16_values": Field(bool, False),
        "index_coding": Field(str, "auto", choices=("auto", "list"),
                              doc="sparse messages and sparse-downlink rounds on the fp32 wire: auto sends the "
                                  "indices as a bitmap (size/24 words) where that is smaller than the index list "
                                  "(above ~4.2% density for a push; not the fp16 wire, whose pushes keep their "
                                  "index digits); list: always k indices"),
        "selection": Field(str, "auto", choices=("auto", "exact", "sampled"),
                           doc="how the sparse encoders find the k largest values (top-k, and the per-tensor "
                               "quotas of allocation: gradient): exact partitions every value; sampled takes them "
                               "among the values above a threshold estimated from a random sample, the same set "
                               "(up to ties) in one masked pass; auto: sampled with a sparsifier"),
        "min_dense_bytes": Field(int, 0, min=0, doc="tensors smaller than this are sent dense"),
        "fusion": Field(str, "ahead", choices=("ahead", "behind")),
        "allocation": Field(str, "auto", choices=("auto", "size", "gradient"),
                            doc="fusion ahead: k_i proportional to tensor size, or re-allocated from the "
                                "accumulated gradient every allocate_every steps (same total per buffer); "
                                "auto: gradient with a sparsifier and fusion ahead, size otherwise"),
        "allocate_every": Field(int, 1, min=1, doc="steps between re-allocations (allocation: gradient)"),
        "buffers": Field(str, "one", choices=("one", "consecutive", "fixed", "cost_model"),
                         doc="one: a buffer per server, consecutive tensors unless only placing whole tensors "
                             "by size brings every server within 10% of the mean size (more buffers, as few as fit, "
                             "where a server's share is over the 2^24 values one buffer holds: ResNet-50 on 1 "
                             "server); consecutive: a buffer per server, always consecutive tensors (each "
                             "ready as backward reaches it, as "
                             "`one` split before); fixed: buffers of at most buffer_bytes (as many on every "
                             "server, evenly sized); cost_model: planned from link costs measured at job start"),
        "buffer_bytes": Field(int, 4 << 20, min=1024),
        "threshold": Field(float, 0.5, gt=0, doc="2bit threshold"),
        "warmup": ListField(None, item=float, max=1, nullable=True,
                            doc="density of each of the first epochs, e.g. DGC's [0.25, 0.0625, 0.015625, "
                                "0.004]; `density` from then on. null: with a sparsifier and a learning-rate "
                                "warm-up (train.lr_schedule.warmup_epochs), 0.25 through the lr warm-up's "
                                "epochs, then a quarter of the last each epoch while above density (1%: "
                                "[0.25, 0.0625, 0.015625] after a one-epoch lr warm-up), in at most "
                                "(train.epochs - 1) // 2 epochs; [] otherwise"),
        "downlink": Field(str, "auto", choices=("auto", "dense", *RING_DOWNLINKS),
                          doc="round-based runs with a sparsifier: refresh from dense weight pulls, or from "
                              "the rounds' aggregated sparse updates applied to a replica of the servers' state "
                              "(per buffer, only where that is smaller); sparse: the exact sums (a pull grows "
                              "with the workers, up to N pushes); compressed: where the exact sums would be over "
                              "2 pushes' bytes, the servers apply and send each sum's largest values rounded to "
                              "one byte (4 significant bits), packed with their index gaps into 2 pushes' bytes "
                              "(their own error feedback keeps the rest); auto: sparse with a sparsifier, dense "
                              "otherwise"),
        "downlink_check_every": Field(int, 50, min=0,
                                      doc="downlink sparse or compressed: every this many rounds the servers "
                                          "publish a CRC-32 of a buffer's weights in its ring and the replica must "
                                          "match it (0: never)"),
    },
    "checkpoint": {
        "dir": Field(str, None, nullable=True),
        "every_epochs": Field(int, 0, min=0),
        "keep": Field(int, 0, min=0,
                      doc="how many of the newest checkpoints to keep: once a checkpoint is complete the older "
                          "ones beyond this many are deleted (each worker saves its own part, so they grow with the "
                          "model and the workers); "
                          "0: keep every one"),
    },
    "log": {
        "dir": Field(str, "runs"),
        "every_steps": Field(int, 10, min=1),
        "tensorboard": Field(bool, True,
                             doc="rank 0 also writes its scalars (loss, accuracy, images/s, bytes, lr) as "
                                 "TensorBoard event files in the run folder's tensorboard/ (tensorboardX)"),
    },
}


def defaults(schema):
    """The config every key left out gives: {key: default} for a schema or one of its sections."""
    return {k: defaults(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in schema.items()}
