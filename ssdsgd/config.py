"""Experiment configuration: one YAML file per run, validated against SCHEMA (ssdsgd.schema).

Every key a run can use is declared in the schema with its type, default and allowed range, so a typo
or a wrong value stops the job before any process starts (ConfigError names the key path; the CLIs
exit 2). `--set a.b=value` overrides use the same validation; values are parsed as YAML scalars/lists.
Here: reading the YAML, the overrides, the keys whose default depends on others, and the checks of
keys against each other.
"""
import copy
import os

import yaml

from ssdsgd.compression.registry import NATIVE_2BIT, is_sparsifier
from ssdsgd.config_compression import (  # noqa: F401  (read through config)
    auto_densities, check_compression, check_compression_type, density_note, density_warmup, resumed_density,
    with_density)
from ssdsgd.idle import idle_keys
from ssdsgd.registry import ALGORITHMS, PluginError, import_plugins, runner
from ssdsgd.schema import (  # noqa: F401  (the names the rest of the package reads through config)
    CIFAR_FORMATS, DATASETS, IN_MEMORY_DATASETS, MIN_SERVER_TIMEOUT, ROOTED_DATASETS, SCHEMA,
    RING_DOWNLINKS, SYNTHETIC_SHAPE, VALIDATION_SOURCES, ConfigError, Field, ListField, StrListField, defaults,
    key_name, shown)
from ssdsgd.config_yaml import MAX_BYTES, load_yaml
from ssdsgd.metrics import human_bytes, write_atomic
from ssdsgd.paths import file_problem

MAX_SYNTHETIC_BYTES = 16 << 30     # a synthetic data set (train and test images), drawn in every worker's memory
NAME_MAX = 255                     # bytes in a folder name (Linux file systems)


class Config:
    """Read-only attribute view of a validated config dict: cfg.train.lr."""

    def __init__(self, data, idle=None):
        object.__setattr__(self, "_data", data)
        # The keys the rest of the config leaves without effect (idle.idle_keys), dotted, and a
        # line for each one given a value of its own (rank 0 and --dry-run print them, so that nothing is
        # ignored silently). A resume may change an idle key: it changes nothing.
        idle = idle or {}
        object.__setattr__(self, "idle", frozenset(idle))
        object.__setattr__(self, "ignored", tuple(line for line in idle.values() if line))

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

    def replaced(self, data):
        """A Config of `data` (a changed to_dict()) with this one's idle keys and notes."""
        new = Config(data)
        object.__setattr__(new, "idle", self.idle)
        object.__setattr__(new, "ignored", self.ignored)
        return new


def _validate(schema, user, path=""):
    if not isinstance(user, dict):
        raise ConfigError(f"{path or '<top level>'}: expected a mapping, got {shown(user)}")
    out = defaults(schema)
    for key, value in user.items():
        full = f"{path}.{key_name(key)}" if path else key_name(key)
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise ConfigError(f"{full}: unknown key (known here: {known})")
        spec = schema[key]
        out[key] = _validate(spec, value, full) if isinstance(spec, dict) else spec.check(full, value)
    return out


def _resolve_auto(c):
    """The keys whose default depends on other keys (null or auto in SCHEMA) made concrete, so that the
    run folder's config.yaml, the checkpoint fingerprint and the code all see what runs. (A warm-up of
    null, one epoch, is resolved where the epoch's length is known: ssd_warmup_steps.)"""
    alg, comp = c["algorithm"], c["compression"]
    sparsifier = is_sparsifier(comp["type"])
    if alg["max_staleness"] is None:
        alg["max_staleness"] = alg["delay"]
    if "lr_cap" in ALGORITHMS[alg["type"]].uses:        # an algorithm with a delay stage
        _resolve_delay_stage_rate(alg, c["train"])
    if alg["local"]["lr_scale"] is None:
        alg["local"]["lr_scale"] = 4.0 if alg["local"]["optimizer"] == "glu" else float(c["cluster"]["workers"])
    # Under density: auto the warm-up's default follows the density chosen (with_density).
    if comp["warmup"] is None and comp["density"] != "auto":
        comp["warmup"] = density_warmup(comp["density"], c["train"]) if sparsifier else []
    if comp["momentum_correction"] is None:
        comp["momentum_correction"] = sparsifier
    if comp["allocation"] == "auto":
        comp["allocation"] = "gradient" if sparsifier and comp["fusion"] == "ahead" else "size"
    if comp["downlink"] == "auto":
        comp["downlink"] = "sparse" if sparsifier else "dense"
    if comp["selection"] == "auto":
        comp["selection"] = "sampled" if sparsifier else "exact"


def _resolve_delay_stage_rate(alg, train):
    """The steps-delay stage's learning rate and momentum. A stale gradient is stable only at a smaller
    step than SSGD's (docs/design.md, "The delay stage's rate"), so above algorithm.lr_cap the stage
    takes smaller steps with more momentum: the same lr / (1 - momentum), the rate at which gradients
    move the weights in the long run."""
    if alg["lr"] is None:
        alg["lr"] = train["lr"] if alg["lr_cap"] is None else min(train["lr"], alg["lr_cap"])
    if alg["lr"] > train["lr"]:
        raise ConfigError(f"algorithm.lr: the steps-delay stage's rate {shown(alg['lr'])} is above train.lr "
                          f"({shown(train['lr'])}); it may only be lower")
    if alg["momentum"] is None:
        same = alg["lr"] == train["lr"]        # (exactly train.momentum then, not 1 - (1 - it))
        alg["momentum"] = train["momentum"] if same else 1.0 - (1.0 - train["momentum"]) * alg["lr"] / train["lr"]


def ssd_warmup_steps(algorithm, steps_per_epoch):
    """SSD-SGD's synchronous warm-up in steps: algorithm.warmup_iters, or one epoch when it is null."""
    return steps_per_epoch if algorithm.warmup_iters is None else algorithm.warmup_iters


def _check_local_cluster(cl):
    """cluster.hostfile and cluster.interface only mean something to the ssh launcher; with the local one
    (the default) every role would run on this machine without a word, as if the hosts were used."""
    keys = [f"cluster.{k}" for k in ("hostfile", "interface") if cl[k]]
    if cl["launcher"] == "local" and keys:
        raise ConfigError(f"{' and '.join(keys)}: set, but cluster.launcher is local, which runs every role on this "
                          f"machine: set cluster.launcher: ssh, or remove {' and '.join(keys)} (--set "
                          f"{' '.join(k + '=null' for k in keys)})")


def _check_devices(c):
    devices, cl = c["train"]["devices"], c["cluster"]
    if devices > c["train"]["batch_size"]:
        raise ConfigError(f"train.devices: {devices} replicas share a worker's batch of train.batch_size "
                          f"{c['train']['batch_size']} images: every replica needs at least one")
    if cl["gpus"] is not None and cl["device"] != "gpu":
        raise ConfigError("cluster.gpus: set, but cluster.device is cpu: set cluster.device: gpu, or remove "
                          "cluster.gpus")


def _check_unused(c):
    """Settings that would do nothing with the rest of the config: refused rather than ignored (only
    those whose non-default value shows they were set)."""
    ck, sched = c["checkpoint"], c["train"]["lr_schedule"]
    if ck["every_epochs"] and not ck["dir"]:
        raise ConfigError(f"checkpoint.every_epochs: {ck['every_epochs']}, but checkpoint.dir is not set, so no "
                          f"checkpoint would be written: set checkpoint.dir, or checkpoint.every_epochs: 0")
    if sched["milestones"] and sched["type"] != "step":
        raise ConfigError(f"train.lr_schedule.milestones: only the step schedule uses them, and "
                          f"train.lr_schedule.type is {sched['type']}: set type: step, or remove the milestones")


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
    check_compression_type(alg["type"], comp["type"], sparsifier)
    check_compression(c, sparsifier)
    _check_unused(c)
    cl = c["cluster"]
    _check_devices(c)
    if cl["launcher"] == "ssh" and not cl["hostfile"]:
        raise ConfigError("cluster.hostfile: required when cluster.launcher is ssh")
    _check_local_cluster(cl)
    if cl["server_timeout"] and cl["server_timeout"] < MIN_SERVER_TIMEOUT:
        raise ConfigError(f"cluster.server_timeout: at least {MIN_SERVER_TIMEOUT:g} s (the liveness file is touched "
                          f"every second; a shorter timeout fails live jobs); 0 or null turns it off; got "
                          f"{cl['server_timeout']:g}")
    if cl["server_timeout"] and cl["stall_timeout"] and cl["server_timeout"] >= cl["stall_timeout"]:
        raise ConfigError(f"cluster.server_timeout: must be shorter than cluster.stall_timeout, so a stopped or "
                          f"unreachable server is named before a worker is blamed for the stall it causes; got "
                          f"server_timeout {cl['server_timeout']:g} s, stall_timeout {cl['stall_timeout']:g} s")
    d = c["data"]
    for key in ("train_per_class", "train_offset", "validation"):
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
    _check_synthetic_size(c)
    if c["data"]["dataset"] in ROOTED_DATASETS and not c["data"]["root"]:
        raise ConfigError(f"data.root: required for dataset {c['data']['dataset']} "
                          "(the local folder holding the dataset files; nothing is downloaded)")


def _check_synthetic_size(c):
    """A synthetic data set is drawn in every worker's memory: its size, bounded before a worker tries."""
    d, batch = c["data"], c["train"]["batch_size"]
    if d["dataset"] != "synthetic":
        return
    shape = d["shape"] or SYNTHETIC_SHAPE
    images = d["synthetic_samples"] + max(d["synthetic_samples"] // 4, batch)      # small_sets.build_synthetic
    size = images * shape[0] * shape[1] * shape[2] * 4
    if size > MAX_SYNTHETIC_BYTES:
        raise ConfigError(f"data.synthetic_samples: {d['synthetic_samples']} images of {'x'.join(map(str, shape))} "
                          f"(data.shape) and their test set are {human_bytes(size)} of float32 in each worker's "
                          f"memory; at most {human_bytes(MAX_SYNTHETIC_BYTES)}")


def parse_override(text):
    """'a.b=value' -> (['a', 'b'], parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {shown(text)}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    try:
        value = load_yaml(raw, keys) if raw != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"{key_name(key)}: cannot parse value {shown(raw)}: {_one_line(err)}") from None
    return keys, value


def _one_line(err):
    """A YAML error's message on one line (PyYAML's spans several, quoting the text around the fault)."""
    return " ".join(str(err).split())[:300]


def apply_override(raw, keys, value):
    node, schema = raw, SCHEMA
    for i, key in enumerate(keys):
        path = ".".join(keys[: i + 1])
        if not isinstance(schema, dict) or key not in schema:
            known = f" (known here: {', '.join(sorted(schema))})" if isinstance(schema, dict) else ""
            raise ConfigError(f"{key_name(path)}: unknown key{known}")
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
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"--config: {problem}")
    try:
        with open(path) as f:
            text = f.read(MAX_BYTES + 1)        # a larger file is refused, not read whole
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config: cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(err)}") from None
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
    _import_plugins(raw)
    data = _validate(SCHEMA, raw)
    given = copy.deepcopy(data)
    _resolve_auto(data)
    _check_consistency(data)
    idle = idle_keys(given, data)
    if data["name"] is None:
        data["name"] = os.path.splitext(os.path.basename(path))[0]
    _check_run_name(data["name"])
    return Config(data, idle)


def _import_plugins(raw):
    """The config's plug-in modules, imported before any key is checked: they register the algorithm and
    compression names the rest of the config may use (ssdsgd.registry)."""
    plugins = SCHEMA["plugins"].check("plugins", raw.get("plugins", []))
    try:
        import_plugins(plugins)
    except PluginError as err:
        raise ConfigError(f"plugins: {err}") from None


def _check_run_name(name):
    """The run's folder is log.dir/<name>/<stamp>: a name must stay one folder inside log.dir, one a folder
    listing shows on one line."""
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ConfigError(f"name: {shown(name)} is not a folder name (runs go to log.dir/<name>/; "
                          f"no '/', not '.' or '..')")
    if not name.isprintable():
        raise ConfigError(f"name: {shown(name)} holds a control character (a newline, a tab, ...), which would "
                          f"be in the run folder's name")
    if len(name.encode()) > NAME_MAX:
        raise ConfigError(f"name: at most {NAME_MAX} bytes, the longest folder name; got {len(name.encode())} "
                          f"({shown(name)})")


def dump_config(cfg, path):
    """Write cfg as YAML to path, whole or not at all (WriteError naming path on a full disk)."""

    def write(tmp):
        with open(tmp, "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    write_atomic(path, write)


def algorithm_of(cfg):
    """The registered Algorithm of cfg.algorithm.type (ssdsgd.registry)."""
    return ALGORITHMS[cfg.algorithm.type]


def runner_of(cfg):
    """The registered Algorithm whose client and checkpoint plan run cfg (registry.runner)."""
    return runner(cfg.algorithm.type, cfg.compression.type)
