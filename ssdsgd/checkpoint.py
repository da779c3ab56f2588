"""Checkpoints: everything a run needs to continue exactly where it stopped.

Layout: <checkpoint.dir>/epoch-<E>/ (E = epochs completed) holding
  server-buffer<b>.npz   round-based runs: each buffer's global weights, momentum, version, pending rounds
  server-stock<r>.npz    stock-KVStore runs: server r's optimizer state per key and update counters
  worker<r>.npz          each worker: local weights, BatchNorm statistics, GLU snapshots, local
                         optimizer counters, error-feedback residuals, in-flight pull buffers, versions
  manifest.json          written last: config fingerprint, epoch, step, sha256 of every file
Every file is written to a temporary name and renamed, and a folder without a manifest is not a
checkpoint, so a crash while saving never leaves something that looks complete. On resume the
fingerprint and every hash are checked; any mismatch stops the job with a message saying which.

The cut is consistent because saving happens at an epoch boundary, where every worker has run the
same number of steps: workers wait for their pushes to be acknowledged, meet at a barrier, rank 0
asks the servers to save (a signed command; servers only write data), each worker saves its own
state, a second barrier, then rank 0 writes the manifest.
"""
import hashlib
import json
import os

import numpy as np

from ssdsgd.metrics import write_json_atomic

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    pass


def fingerprint(cfg):
    """Hash of the config parts that must match for a resume to continue the same run."""
    d = cfg.to_dict()
    relevant = {
        "seed": d["seed"], "model": d["model"], "algorithm": d["algorithm"], "compression": d["compression"],
        "data": {k: d["data"][k] for k in ("dataset", "shape", "num_classes", "synthetic_samples", "augment")},
        "train": {k: v for k, v in d["train"].items() if k not in ("max_steps", "eval_every_epochs")},
        "cluster": {"workers": d["cluster"]["workers"], "servers": d["cluster"]["servers"]},
    }
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def epoch_dir(root, epochs_done):
    return os.path.join(root, f"epoch-{epochs_done:04d}")


def save_npz(path, arrays, meta=None):
    """Atomic: write to a temporary file, then rename over the final name."""
    arrays = dict(arrays)
    if meta is not None:
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)           # a full disk must not stay full of half-written files
        raise


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def load_npz(path):
    """(arrays dict, meta dict or None); a corrupt file raises CheckpointError naming it."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None
    meta = arrays.pop("__meta__", None)
    return arrays, (json.loads(meta.tobytes().decode()) if meta is not None else None)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory, cfg, epochs_done, step):
    files = sorted(f for f in os.listdir(directory) if f.endswith(".npz") and ".tmp" not in f)
    manifest = {"format": FORMAT, "fingerprint": fingerprint(cfg), "name": cfg.name,
                "epochs_done": epochs_done, "step": step,
                "files": {f: _sha256(os.path.join(directory, f)) for f in files}}
    write_json_atomic(os.path.join(directory, MANIFEST), manifest)
    return manifest


def latest(root):
    """The newest complete checkpoint folder under root, or None."""
    if not root or not os.path.isdir(root):
        return None
    done = [d for d in sorted(os.listdir(root))
            if d.startswith("epoch-") and os.path.exists(os.path.join(root, d, MANIFEST))]
    return os.path.join(root, done[-1]) if done else None


def verify(directory, cfg, num_workers):
    """Load and check a checkpoint's manifest against the config and the files; return it."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: {err}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    if manifest.get("fingerprint") != fingerprint(cfg):
        raise CheckpointError(
            f"{directory} was written by a different configuration (model, data, algorithm, compression, "
            f"training hyper-parameters or cluster size differ); refusing to resume from it")
    for r in range(num_workers):
        if f"worker{r}.npz" not in manifest["files"]:
            raise CheckpointError(f"{directory} has no state for worker {r}")
    for name, digest in manifest["files"].items():
        file = os.path.join(directory, name)
        if not os.path.exists(file):
            raise CheckpointError(f"checkpoint file {file} is missing")
        if _sha256(file) != digest:
            raise CheckpointError(f"checkpoint file {file} is corrupt (sha256 differs from the manifest)")
    return manifest


def resume_point(cfg):
    """The checkpoint to resume from for --resume: verified, or CheckpointError saying why not."""
    root = cfg.checkpoint.dir
    if not root:
        raise CheckpointError("--resume needs checkpoint.dir (the folder the run saved its checkpoints in)")
    directory = latest(root)
    if directory is None:
        raise CheckpointError(f"--resume: no complete checkpoint in {root}")
    return directory, verify(directory, cfg, cfg.cluster.workers)
