"""Experiment configuration: one YAML file per run, validated against SCHEMA.

Every key a run can use is declared here with its type, default and allowed range, so a typo or a
wrong value stops the job before any process starts (ConfigError names the key path; the CLIs exit 2).
`--set a.b=value` overrides use the same validation; values are parsed as YAML scalars/lists.
"""
import copy
import math
import os
import re

import yaml

from ssdsgd.compression.registry import NATIVE_2BIT, SPARSIFIERS, compression_types, is_sparsifier
from ssdsgd.errors import JobError
from ssdsgd.schedule import KINDS as SCHEDULE_KINDS


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` as a string (it wants a dot); learning rates are written that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _mapping_without_duplicates(loader, node, deep=False):
    """A YAML mapping; a key given twice is an error (PyYAML would keep the last one silently, so a
    section written twice would lose the first one's keys)."""
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"{key}: given twice in the same section (lines {seen[key] + 1} and "
                              f"{key_node.start_mark.line + 1})")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _yaml_load(text):
    return yaml.load(text, Loader=_Loader)


class ConfigError(JobError, ValueError):
    """Invalid configuration. `str(err)` starts with the offending key path."""


class Field:
    """One leaf of the schema: allowed types, default, and optional range/choices."""

    def __init__(self, types, default, *, choices=None, min=None, max=None, gt=None,
                 nullable=False, doc=""):
        self.types = types if isinstance(types, tuple) else (types,)
        self.default = default
        self.choices = choices
        self.min, self.max, self.gt = min, max, gt
        self.nullable = nullable
        self.doc = doc

    def check(self, path, value):
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{path}: must be set (got null)")
        # YAML gives ints where floats are meant ("lr: 1"); bools are not numbers here.
        if float in self.types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in self.types:
            raise ConfigError(f"{path}: expected {self._type_names()}, got {value!r}")
        if not isinstance(value, self.types):
            raise ConfigError(f"{path}: expected {self._type_names()}, got {value!r}")
        # YAML reads .nan and .inf as floats; no setting here means anything with them.
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: must be a finite number; got {value!r}")
        choices = self.choices() if callable(self.choices) else self.choices     # callable: read when checked
        if choices is not None and value not in choices:
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, choices))}; got {value!r}")
        if self.min is not None and value < self.min:
            raise ConfigError(f"{path}: must be >= {self.min}; got {value!r}")
        if self.max is not None and value > self.max:
            raise ConfigError(f"{path}: must be <= {self.max}; got {value!r}")
        if self.gt is not None and value <= self.gt:
            raise ConfigError(f"{path}: must be > {self.gt}; got {value!r}")
        return value

    def _type_names(self):
        return " or ".join(t.__name__ for t in self.types)


def _number_list(path, value, item):
    def ok(v):
        if isinstance(v, bool):
            return False
        return isinstance(v, int) or (item is float and isinstance(v, float))
    noun = "integers" if item is int else "numbers"
    if not isinstance(value, list) or not all(ok(v) for v in value):
        raise ConfigError(f"{path}: expected a list of {noun}, got {value!r}")
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
            raise ConfigError(f"{path}: expected {self.length} values, got {value!r}")
        if any(v <= 0 for v in value):
            raise ConfigError(f"{path}: values must be positive, got {value!r}")
        if self.max is not None and any(v > self.max for v in value):
            raise ConfigError(f"{path}: values must be <= {self.max}, got {value!r}")
        return value


class StrListField(Field):
    """A list of non-empty strings."""

    def __init__(self, default, doc=""):
        super().__init__(list, default, doc=doc)

    def check(self, path, value):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
        return list(value)


ALGORITHMS = ("ssgd", "asgd", "ssd")
DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist", "imagenet", "synthetic")
IN_MEMORY_DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist")   # can be cut down and split
VALIDATION_SOURCES = ("subset", "rest")      # data.validation_from: the kept images, or the ones left out
ROOTED_DATASETS = ("cifar10", "mnist", "fashion_mnist", "imagenet")   # read from data.root
# data.format (cifar10): auto finds the first of the others in data.root, in this order.
CIFAR_FORMATS = ("auto", "binary", "python", "archive", "recordio")
MIN_SERVER_TIMEOUT = 3.0   # seconds: three missed touches of a liveness file (pyhooks/sitecustomize.py)

SCHEMA = {
    "name": Field(str, None, nullable=True, doc="run name; default: the config file name"),
    "seed": Field(int, 0, min=0),
    "cluster": {
        "workers": Field(int, 2, min=1, max=64),
        "servers": Field(int, 1, min=1, max=64),
        "launcher": Field(str, "local", choices=("local", "ssh")),
        "hostfile": Field(str, None, nullable=True),
        "interface": Field(str, None, nullable=True, doc="network interface for ssh runs"),
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
                                  "at most this many times"),
    },
    "data": {
        "dataset": Field(str, "digits", choices=DATASETS),
        "root": Field(str, None, nullable=True),
        "format": Field(str, "auto", choices=CIFAR_FORMATS,
                        doc="cifar10: the form in data.root: binary or python batches (in it or in its "
                            "cifar-10-batches-bin/-py folder), archive (cifar-10-binary.tar.gz or "
                            "cifar-10-python.tar.gz as downloaded), recordio (im2rec train.rec and "
                            "test.rec); auto: the first found, in that order"),
        "shape": ListField(None, nullable=True, length=3, doc="[C, H, W]"),
        "num_classes": Field(int, None, nullable=True, min=2),
        "synthetic_samples": Field(int, 1024, min=1),
        "augment": Field(bool, True),
        "preprocess_threads": Field(int, 2, min=1),
        "train_per_class": Field(int, None, nullable=True, min=1,
                                 doc="keep the first n training images of each class (a fixed subset)"),
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
        "epochs": Field(int, 10, min=1),
        "batch_size": Field(int, 32, min=1, doc="per worker"),
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
        "type": Field(str, "ssgd", choices=ALGORITHMS),
        "warmup_iters": Field(int, None, nullable=True, min=0,
                              doc="synchronous steps before the delay stage; null: one epoch (the paper's "
                                  "scripts: 500)"),
        "delay": Field(int, 1, min=1, doc="k: pull the global weights every k steps (the paper's scripts: 5)"),
        "max_staleness": Field(int, None, nullable=True, min=1, doc="S; default k"),
        "strict": Field(bool, False),
        "momentum": Field(float, None, nullable=True, min=0, max=1,
                          doc="momentum of the steps-delay stage (servers, local update, momentum correction); "
                              "default train.momentum"),
        "local": {
            "optimizer": Field(str, "global_momentum", choices=("glu", "sgd", "global_momentum"),
                               doc="the local update between refreshes: momentum SGD carrying the global "
                                   "velocity (global_momentum), plain sgd, or the paper's GLU rule (glu)"),
            "lr": Field(float, None, nullable=True, gt=0),
            "lr_scale": Field(float, None, nullable=True, gt=0,
                              doc="local lr = lr_scale * global lr (if lr unset); null: the number of workers "
                                  "(a worker's own gradient stands in for all of theirs), 4 for glu (the "
                                  "paper's)"),
            "c": Field(float, 0.5, min=0, doc="GLU compensation coefficient"),
        },
    },
    "compression": {
        "type": Field(str, "none", choices=compression_types),
        "density": Field(float, 0.01, gt=0, max=1),
        "error_feedback": Field(bool, True),
        "momentum_correction": Field(bool, None, nullable=True,
                                     doc="DGC's momentum correction: the workers accumulate the momentum before "
                                         "sparsifying; null: true with a sparsifier, false otherwise"),
        "decay_momentum": Field(bool, False,
                                doc="momentum correction: the servers apply the weight decay through a momentum "
                                    "of their own (SSGD's decay strength, as DGC's reference optimizer does); "
                                    "false: without momentum, 1/(1 - momentum) times weaker"),
        "momentum_masking": Field(bool, True,
                                  doc="momentum correction: zero the worker's momentum where a value was sent "
                                      "(DGC's momentum factor masking); false: keep it, so the servers apply "
                                      "exactly SSGD's momentum updates, each value delayed until it is sent"),
        "masking_min_wait": Field(int, 0, min=0,
                                  doc="momentum masking only where the value sent had been held back at least "
                                      "this many steps in a row just before (1: not where it was also sent at "
                                      "the previous step); 0: everywhere, as DGC masks"),
        "lr_weighted": Field(bool, False,
                             doc="error feedback and momentum correction hold lr-weighted gradients (EF-SGD's "
                                 "form): a value held back is applied at the lr of the step that computed it; "
                                 "false: at the lr of the step that sends it"),
        "lookahead": Field(float, 0.0, min=0, max=1,
                           doc="workers compute gradients at the global weights minus lookahead x what their "
                               "held-back values will move (own residual x workers, at the next round's lr): "
                               "error feedback's virtual iterate; 0: off"),
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
        "clip_norm": Field(float, None, nullable=True, gt=0,
                           doc="DGC's local gradient clipping (sparsifiers, fusion ahead): the L2 threshold for "
                               "each tensor's gradient averaged over the whole step (all workers' samples); each "
                               "worker clips its share at clip_norm / sqrt(workers) before momentum correction "
                               "and error feedback; null: off"),
        "fusion": Field(str, "ahead", choices=("ahead", "behind")),
        "allocation": Field(str, "auto", choices=("auto", "size", "gradient"),
                            doc="fusion ahead: k_i proportional to tensor size, or re-allocated from the "
                                "accumulated gradient every allocate_every steps (same total per buffer); "
                                "auto: gradient with a sparsifier and fusion ahead, size otherwise"),
        "allocate_every": Field(int, 1, min=1, doc="steps between re-allocations (allocation: gradient)"),
        "buffers": Field(str, "one", choices=("one", "fixed", "cost_model")),
        "buffer_bytes": Field(int, 4 << 20, min=1024),
        "threshold": Field(float, 0.5, gt=0, doc="2bit threshold"),
        "warmup": ListField([], item=float, max=1,
                            doc="density of each of the first epochs, e.g. DGC's [0.25, 0.0625, 0.015625, "
                                "0.004]; `density` from then on"),
        "downlink": Field(str, "auto", choices=("auto", "dense", "sparse"),
                          doc="round-based runs with a sparsifier: refresh from dense weight pulls, or from "
                              "the rounds' aggregated sparse updates applied to a replica of the servers' state "
                              "(per buffer, only where that is smaller); auto: sparse with a sparsifier, dense "
                              "otherwise"),
        "downlink_check_every": Field(int, 50, min=0,
                                      doc="downlink sparse: every this many rounds the servers publish a CRC-32 of "
                                          "a buffer's weights in its ring and the replica must match it (0: never)"),
    },
    "checkpoint": {
        "dir": Field(str, None, nullable=True),
        "every_epochs": Field(int, 0, min=0),
    },
    "log": {
        "dir": Field(str, "runs"),
        "every_steps": Field(int, 10, min=1),
        "tensorboard": Field(bool, True,
                             doc="rank 0 also writes its scalars (loss, accuracy, images/s, bytes, lr) as "
                                 "TensorBoard event files in the run folder's tensorboard/ (tensorboardX)"),
    },
}


class Config:
    """Read-only attribute view of a validated config dict: cfg.train.lr."""

    def __init__(self, data):
        object.__setattr__(self, "_data", data)

    def __getattr__(self, key):
        try:
            value = self._data[key]
        except KeyError:
            raise AttributeError(key) from None
        return Config(value) if isinstance(value, dict) else value

    def __setattr__(self, key, value):
        raise AttributeError("Config is read-only; use --set on the command line")

    def to_dict(self):
        return copy.deepcopy(self._data)


def _defaults(schema):
    return {k: _defaults(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in schema.items()}


def _validate(schema, user, path=""):
    if not isinstance(user, dict):
        raise ConfigError(f"{path or '<top level>'}: expected a mapping, got {user!r}")
    out = _defaults(schema)
    for key, value in user.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise ConfigError(f"{full}: unknown key (known here: {known})")
        spec = schema[key]
        out[key] = _validate(spec, value, full) if isinstance(spec, dict) else spec.check(full, value)
    return out


def _sparsifier_names():
    names = list(SPARSIFIERS)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _check_compression(c, sparsifier):
    """The compression section's keys against each other (and train.epochs)."""
    comp = c["compression"]
    # Settings that only mean something for a sparse push: (set?, why), per key.
    sparse_only = {
        "fp16_values": (comp["fp16_values"], "only sparse pushes have an fp16 wire format"),
        "index_coding": (comp["index_coding"] != "auto", "only sparse messages carry indices"),
        "clip_norm": (comp["clip_norm"] is not None, "local gradient clipping runs in the sparse encoders"),
        "lr_weighted": (comp["lr_weighted"], "it weights the error-feedback memory of the sparse encoders"),
        "lookahead": (comp["lookahead"] > 0, "it looks ahead by the error-feedback residual of the sparse encoders"),
        "warmup": (bool(comp["warmup"]), "a density warm-up needs a sparsifier"),
        "selection": (comp["selection"] == "sampled", "only the sparse encoders select values"),
        "downlink": (comp["downlink"] == "sparse", "sparse rebuilds the global weights from the rounds' sparse "
                                                  "updates, so it needs a sparsifier"),
    }
    for key, (is_set, why) in sparse_only.items():
        if is_set and not sparsifier:
            raise ConfigError(f"compression.{key}: {why}; set compression.type to {_sparsifier_names()} "
                              f"(got {comp['type']})")
    if comp["allocation"] == "gradient" and (not sparsifier or comp["fusion"] != "ahead"):
        raise ConfigError("compression.allocation: gradient re-allocates the per-tensor quotas of "
                          "sparsification ahead of fusion; it needs compression.fusion: ahead and a "
                          f"sparsifier (got fusion {comp['fusion']}, type {comp['type']})")
    if comp["clip_norm"] is not None and comp["fusion"] != "ahead":
        raise ConfigError("compression.clip_norm: clips each tensor's gradient, and fusion: behind fuses the "
                          "tensors before the error-feedback memory sees them; use compression.fusion: ahead")
    if comp["masking_min_wait"] and not (comp["momentum_masking"] and comp["momentum_correction"]):
        raise ConfigError("compression.masking_min_wait: narrows momentum factor masking; it needs "
                          "compression.momentum_correction: true and compression.momentum_masking: true")
    if not comp["momentum_masking"] and not comp["momentum_correction"]:
        raise ConfigError("compression.momentum_masking: masks the momentum of DGC's momentum correction; "
                          "false needs compression.momentum_correction: true")
    if comp["lr_weighted"] and not (comp["error_feedback"] or comp["momentum_correction"]):
        raise ConfigError("compression.lr_weighted: weights what error feedback and momentum correction hold "
                          "back; true needs compression.error_feedback or momentum_correction: true")
    if comp["lookahead"] > 0 and not comp["error_feedback"]:
        raise ConfigError("compression.lookahead: looks ahead by the error-feedback residual; it needs "
                          "compression.error_feedback: true")
    if comp["decay_momentum"] and not comp["momentum_correction"]:
        raise ConfigError("compression.decay_momentum: without momentum correction the servers' momentum "
                          "already carries the weight decay; true needs compression.momentum_correction: true")
    if any(d < comp["density"] for d in comp["warmup"]):
        raise ConfigError(f"compression.warmup: a warm-up density below compression.density "
                          f"({comp['density']}) would not be a warm-up; got {comp['warmup']}")
    if len(comp["warmup"]) >= c["train"]["epochs"]:
        raise ConfigError(f"compression.warmup: {len(comp['warmup'])} warm-up epochs but train.epochs is "
                          f"{c['train']['epochs']}; the run would never reach compression.density")


def _resolve_auto(c):
    """The keys whose default depends on other keys (null or auto in SCHEMA) made concrete, so that the
    run folder's config.yaml, the checkpoint fingerprint and the code all see what runs. (A warm-up of
    null, one epoch, is resolved where the epoch's length is known: ssd_warmup_steps.)"""
    alg, comp = c["algorithm"], c["compression"]
    sparsifier = is_sparsifier(comp["type"])
    if alg["max_staleness"] is None:
        alg["max_staleness"] = alg["delay"]
    if alg["local"]["lr_scale"] is None:
        alg["local"]["lr_scale"] = 4.0 if alg["local"]["optimizer"] == "glu" else float(c["cluster"]["workers"])
    if comp["momentum_correction"] is None:
        comp["momentum_correction"] = sparsifier
    if comp["allocation"] == "auto":
        comp["allocation"] = "gradient" if sparsifier and comp["fusion"] == "ahead" else "size"
    if comp["downlink"] == "auto":
        comp["downlink"] = "sparse" if sparsifier else "dense"
    if comp["selection"] == "auto":
        comp["selection"] = "sampled" if sparsifier else "exact"


def ssd_warmup_steps(algorithm, steps_per_epoch):
    """SSD-SGD's synchronous warm-up in steps: algorithm.warmup_iters, or one epoch when it is null."""
    return steps_per_epoch if algorithm.warmup_iters is None else algorithm.warmup_iters


def _check_consistency(c):
    alg, comp = c["algorithm"], c["compression"]
    if alg["max_staleness"] is not None and alg["max_staleness"] < alg["delay"]:
        raise ConfigError(
            f"algorithm.max_staleness: must be >= algorithm.delay ({alg['delay']}), since the local "
            f"weights are refreshed only every delay steps; got {alg['max_staleness']}")
    sparsifier = is_sparsifier(comp["type"])
    if c["train"]["eval_workers"] == "all" and comp["type"] == NATIVE_2BIT:
        raise ConfigError("train.eval_workers: all sums the workers' counts through the KVStore, and "
                          "compression.type 2bit would quantise those pushes too; use train.eval_workers: rank0")
    if c["train"]["eval_workers"] == "all" and alg["type"] == "asgd":
        raise ConfigError("train.eval_workers: all: asgd workers do not wait for one another, so their shares "
                          "would be counted on different global weights; use train.eval_workers: rank0")
    if comp["type"] == NATIVE_2BIT and alg["type"] == "ssd":
        raise ConfigError("compression.type: 2bit is MXNet's native compression and only works on the "
                          f"stock KVStore path (algorithm.type ssgd or asgd); use {'/'.join(SPARSIFIERS)} with ssd")
    if sparsifier and alg["type"] == "asgd":
        raise ConfigError(f"compression.type: {comp['type']} needs the round-based server "
                          "(algorithm.type ssd or ssgd); asgd supports none or 2bit")
    _check_compression(c, sparsifier)
    cl = c["cluster"]
    if cl["launcher"] == "ssh" and not cl["hostfile"]:
        raise ConfigError("cluster.hostfile: required when cluster.launcher is ssh")
    if cl["server_timeout"] and cl["server_timeout"] < MIN_SERVER_TIMEOUT:
        raise ConfigError(f"cluster.server_timeout: at least {MIN_SERVER_TIMEOUT:g} s (the liveness file is touched "
                          f"every second; a shorter timeout fails live jobs); 0 or null turns it off; got "
                          f"{cl['server_timeout']:g}")
    if cl["server_timeout"] and cl["stall_timeout"] and cl["server_timeout"] >= cl["stall_timeout"]:
        raise ConfigError(f"cluster.server_timeout: must be shorter than cluster.stall_timeout, so a stopped or "
                          f"unreachable server is named before a worker is blamed for the stall it causes; got "
                          f"server_timeout {cl['server_timeout']:g} s, stall_timeout {cl['stall_timeout']:g} s")
    d = c["data"]
    for key in ("train_per_class", "validation"):
        if d[key] and d["dataset"] not in IN_MEMORY_DATASETS:
            raise ConfigError(f"data.{key}: works on the in-memory datasets ({', '.join(IN_MEMORY_DATASETS)}), "
                              f"not on {d['dataset']}")
    if d["validation"] >= 1 and d["validation"] != int(d["validation"]):
        raise ConfigError(f"data.validation: a fraction below 1 or a whole count; got {d['validation']}")
    if d["validation_from"] == "rest" and not d["train_per_class"]:
        raise ConfigError("data.validation_from: 'rest' draws the validation images from the training images that "
                          "data.train_per_class leaves out; set data.train_per_class too")
    if d["format"] != "auto" and d["dataset"] != "cifar10":
        raise ConfigError(f"data.format: picks the form of a cifar10 copy; {d['dataset']} has one form, "
                          f"leave it auto (got {d['format']})")
    if c["data"]["dataset"] in ROOTED_DATASETS and not c["data"]["root"]:
        raise ConfigError(f"data.root: required for dataset {c['data']['dataset']} "
                          "(the local folder holding the dataset files; nothing is downloaded)")


def parse_override(text):
    """'a.b=value' -> (['a', 'b'], parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    try:
        value = _yaml_load(raw) if raw != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {err}") from None
    return key.strip().split("."), value


def apply_override(raw, keys, value):
    node, schema = raw, SCHEMA
    for i, key in enumerate(keys):
        path = ".".join(keys[: i + 1])
        if not isinstance(schema, dict) or key not in schema:
            known = f" (known here: {', '.join(sorted(schema))})" if isinstance(schema, dict) else ""
            raise ConfigError(f"{path}: unknown key{known}")
        schema = schema[key]
        if i == len(keys) - 1:
            if isinstance(schema, dict):
                raise ConfigError(f"{path}: is a section; set one of its keys ({', '.join(schema)})")
            node[key] = value
        else:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]


def load_config(path, overrides=()):
    """Read, override, validate. Raises ConfigError with the key path on any problem."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    with open(path) as f:
        try:
            raw = _yaml_load(f)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    if raw is None:
        # An empty file would silently run a default job: almost certainly the wrong file.
        raise ConfigError(f"{path}: the file is empty; a config sets at least the keys that differ "
                          f"from the defaults (see configs/ for examples)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for text in overrides:
        apply_override(raw, *parse_override(text))
    data = _validate(SCHEMA, raw)
    _resolve_auto(data)
    _check_consistency(data)
    if data["name"] is None:
        data["name"] = os.path.splitext(os.path.basename(path))[0]
    return Config(data)


def dump_config(cfg, path):
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


# Which client (ssdsgd/algorithms) runs a config: decided here, in one place, since the checkpoint
# and the front end need the answer without importing the clients.
STOCK, ROUNDS = "stock", "rounds"


def client_kind(cfg):
    """Our round server (SSD-SGD, compressed SSGD) or MXNet's stock KVStore (the baselines)."""
    return ROUNDS if cfg.algorithm.type == "ssd" or is_sparsifier(cfg.compression.type) else STOCK
