"""The checkpoint's config fingerprint: which config keys a resume may change and which must match the
checkpoint, and the hash of the latter (written into every manifest, checked on resume)."""
import hashlib
import json

from ssdsgd.schema import shown

# Every config key is one of these two (tests/unit/test_fingerprint.py walks SCHEMA): the keys a
# resume may change, because they change neither the data a step sees nor the arithmetic of a step
# (where the job runs, how long it may take, what is logged, when it stops and how it is evaluated),
# and everything else, which must match the checkpoint. A new key is refused by that test until it is
# put in one of them. Sections are named by their keys' dotted paths.
RESUME_MAY_CHANGE = (
    "name",
    "cluster.launcher", "cluster.hostfile", "cluster.interface", "cluster.timeout", "cluster.stall_timeout",
    "cluster.server_timeout", "cluster.ssh_user", "cluster.ssh_identity", "cluster.ssh_config",
    "cluster.ssh_options", "cluster.port", "cluster.max_restarts", "cluster.restart_backoff",
    "cluster.host_wait",
    "cluster.device", "cluster.gpus",
    "data.root", "data.preprocess_threads",
    "train.max_steps", "train.eval_every_epochs", "train.eval_workers",
    "checkpoint.dir", "checkpoint.every_epochs", "checkpoint.keep",
    "log.dir", "log.every_steps", "log.tensorboard",
)
RESUME_MUST_MATCH = (
    "seed", "plugins", "cluster.workers", "cluster.servers",
    "data.dataset", "data.format", "data.shape", "data.num_classes", "data.synthetic_samples", "data.augment",
    "data.train_per_class", "data.train_offset", "data.validation", "data.validation_from",
    "model", "train.epochs", "train.batch_size", "train.devices", "train.lr", "train.momentum", "train.wd",
    "train.lr_schedule",
    "train.eval_bn_batches", "train.nonfinite",
    "algorithm", "compression",
)


def _pick(d, dotted):
    for part in dotted.split("."):
        d = d[part]
    return d


def fingerprint_parts(cfg):
    """The config parts that must match for a resume to continue the same run (RESUME_MUST_MATCH),
    as a nested dict."""
    d, parts = cfg.to_dict(), {}
    for dotted in RESUME_MUST_MATCH:
        *outer, last = dotted.split(".")
        node = parts
        for key in outer:
            node = node.setdefault(key, {})
        node[last] = _pick(d, dotted)
    return parts


def fingerprint(cfg):
    """Hash of fingerprint_parts(cfg)."""
    return hash_parts(fingerprint_parts(cfg))


def hash_parts(parts):
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def differing(saved, now, prefix=""):
    """[(dotted key, saved value, value now)] where two nested dicts differ."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differing(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def differences(saved, now):
    """'key (saved in the checkpoint, value now)' for each dotted key whose values differ."""
    return [f"{key} ({shown(a)} in the checkpoint, {shown(b)} now)" for key, a, b in differing(saved, now)]
