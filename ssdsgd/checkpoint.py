"""Checkpoints: everything a run needs to continue exactly where it stopped.

Layout: <checkpoint.dir>/epoch-<E>/ (E = epochs completed, or the epoch a train.max_steps stop fell in) holding
  server-buffer<b>.npz   round-based runs: each buffer's global weights, momentum, version, pending rounds
  server-stock<r>.npz    stock-KVStore runs: server r's optimizer state per key and update counters
  worker<r>.npz          each worker: local weights, BatchNorm statistics, GLU snapshots, local
                         optimizer counters, error-feedback residuals, in-flight pull buffers, versions
  manifest.json          written last: config fingerprint (and the config parts it hashes), epoch,
                         step, the plan the servers' layout follows, sha256 of every file
Every file is written to a temporary name and renamed, and a folder without a manifest is not a
checkpoint, so a crash while saving never leaves something that looks complete. On resume the
manifest is validated field by field (types, ranges, every file the plan needs), the fingerprint
and every hash are checked; any problem stops the job before it starts, with a message saying which.

Manifest format 2:
  {"format": 2, "fingerprint": sha256 hex, "config": {the hashed config parts}, "name": str,
   "run_dir": the run folder, absolute (optional: a resume goes on writing there),
   "run_id": the run folder's id (optional; ssdsgd.run_id): a resume writes into run_dir only if
             that folder holds this run (folders.resume_run_folder),
   "epochs_done": int >= 1 (the folder's E), "step": int, epochs_done <= step,
   "plan": {"kind": "rounds", "servers": S, "buffer_sizes": [int > 0, ...],
            "cost_model": {"alpha", "beta", "backward"} or null}    round-based runs
         | {"kind": "stock", "servers": S},                          stock-KVStore runs
   "files": {file name: sha256 hex}}
A rounds plan needs worker0..W-1.npz and server-buffer0..B-1.npz (B = len(buffer_sizes)); a stock
plan needs worker0..W-1.npz and server-stock0..S-1.npz; no other file may be listed.

The cut is consistent because saving happens at an epoch boundary, where every worker has run the
same number of steps: workers wait for their pushes to be acknowledged, meet at a barrier, rank 0
asks the servers to save (a signed command; servers only write data), each worker saves its own
state, a second barrier, then rank 0 writes the manifest.
"""
import hashlib
import json
import os
import re
import zipfile

import numpy as np

from ssdsgd.compression.fusion import describe_sizes, plan_for_config
from ssdsgd.config import apply_override, resumed_density, runner_of
from ssdsgd.idle import idle_keys
from ssdsgd.errors import CheckpointError
from ssdsgd.fingerprint import (  # noqa: F401  (read through checkpoint by the run folders and tests)
    RESUME_MAY_CHANGE, RESUME_MUST_MATCH, differences, differing, fingerprint, fingerprint_parts, hash_parts)
from ssdsgd.metrics import write_atomic, write_json_atomic
from ssdsgd.registry import ROUNDS, STOCK
from ssdsgd.run_id import run_id

MANIFEST = "manifest.json"
FORMAT = 2
WORKER, SERVER_BUFFER, SERVER_STOCK = "worker", "server-buffer", "server-stock"   # <name><n>.npz
FILE_NAME = re.compile(rf"({WORKER}|{SERVER_BUFFER}|{SERVER_STOCK})(\d+)\.npz")
SHA256 = re.compile(r"[0-9a-f]{64}")


def worker_file(rank):
    return f"{WORKER}{rank}.npz"


def server_buffer_file(b):
    return f"{SERVER_BUFFER}{b}.npz"


def server_stock_file(rank):
    return f"{SERVER_STOCK}{rank}.npz"


def round_based(cfg):
    """Runs through our round server (SSD-SGD, compressed SSGD) rather than the stock KVStore."""
    return runner_of(cfg).plan == ROUNDS


def epoch_dir(root, epochs_done):
    return os.path.join(root, f"epoch-{epochs_done:04d}")


def save_npz(path, arrays, meta=None):
    """Atomic: write to a temporary file, then rename over the final name (metrics.write_atomic)."""
    arrays = dict(arrays)
    if meta is not None:
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    write_atomic(path, lambda tmp: np.savez(tmp, **arrays), suffix=".npz")     # WriteError on a full disk


def load_npz(path):
    """(arrays dict, meta dict or None); a corrupt file raises CheckpointError naming it."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None
    meta = arrays.pop("__meta__", None)
    return arrays, (json.loads(meta.tobytes().decode()) if meta is not None else None)


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory, cfg, epochs_done, step, plan, run_dir):
    """plan: {"kind": "rounds", "buffer_sizes", "cost_model"} or {"kind": "stock"}; servers is added.
    run_dir: the run folder (absolute), where a resume of this run goes on writing; its run id goes with it."""
    files = sorted(f for f in os.listdir(directory) if FILE_NAME.fullmatch(f))
    manifest = {"format": FORMAT, "fingerprint": fingerprint(cfg), "config": fingerprint_parts(cfg),
                "name": cfg.name, "run_dir": os.path.abspath(run_dir),
                "run_id": run_id(run_dir), "epochs_done": epochs_done, "step": step,
                "plan": dict(plan, servers=cfg.cluster.servers),
                "files": {f: file_sha256(os.path.join(directory, f)) for f in files}}
    problem = manifest_problem(manifest, cfg, epochs_done)
    if problem:
        raise CheckpointError(f"{directory}: refusing to write a manifest that could not be resumed: {problem}")
    write_json_atomic(os.path.join(directory, MANIFEST), manifest)
    return manifest


def latest(root):
    """The newest complete checkpoint folder under root, or None."""
    if not root or not os.path.isdir(root):
        return None
    done = [d for d in sorted(os.listdir(root))
            if d.startswith("epoch-") and os.path.exists(os.path.join(root, d, MANIFEST))]
    return os.path.join(root, done[-1]) if done else None


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def manifest_problem(m, cfg, folder_epoch=None):
    """What is wrong with a manifest for resuming this config, field by field; None if nothing."""
    if not isinstance(m, dict):
        return f"the manifest is not a JSON object (got {type(m).__name__})"
    fmt = m.get("format")
    if not _is_int(fmt) or fmt != FORMAT:
        return f"unknown checkpoint format {fmt!r} (this version reads {FORMAT})"
    required = {"fingerprint": str, "epochs_done": int, "step": int, "files": dict, "plan": dict, "config": dict}
    for key, kind in required.items():
        if key not in m:
            return f"the manifest has no {key!r}"
        value = m[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{key}: expected {'an object' if kind is dict else kind.__name__}, got {value!r}"
    if not SHA256.fullmatch(m["fingerprint"]):
        return f"fingerprint: not a sha256 hex digest: {m['fingerprint']!r}"
    for key in ("name", "run_dir", "run_id"):
        if m.get(key) is not None and not isinstance(m[key], str):
            return f"{key}: expected str, got {m[key]!r}"
    epochs, step = m["epochs_done"], m["step"]
    if epochs < 1:
        return f"epochs_done: {epochs} (a checkpoint is taken after at least one epoch)"
    if epochs > cfg.train.epochs:
        return f"epochs_done: {epochs} is more than train.epochs ({cfg.train.epochs})"
    if folder_epoch is not None and epochs != folder_epoch:
        return f"epochs_done: {epochs}, but the folder is that of epoch {folder_epoch}"
    if step < epochs:
        return f"step: {step} is less than epochs_done ({epochs}); every epoch runs at least one step"
    workers = cfg.cluster.workers
    for name, digest in m["files"].items():
        match = FILE_NAME.fullmatch(name) if isinstance(name, str) else None
        if not match:
            return (f"files: {name!r} is not a checkpoint file name (worker<r>.npz, server-buffer<b>.npz, "
                    f"server-stock<r>.npz)")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            return f"files: {name}: not a sha256 hex digest: {digest!r}"
    problem = _plan_problem(m["plan"], cfg)
    if problem:
        return f"plan: {problem}"
    return _files_problem(m["files"], m["plan"], workers)


def _files_problem(files, plan, workers):
    """The manifest's files against those the plan needs: worker<r>.npz of every worker, and the servers'."""
    needed = {worker_file(r) for r in range(workers)} | set(PLAN_FORMS[plan["kind"]][1](plan))
    extra = sorted(set(files) - needed)
    if extra:
        return f"files: lists {', '.join(extra)}, which this plan does not have"
    missing = sorted(needed - set(files), key=lambda n: (len(n), n))
    if missing:
        return f"files: {', '.join(missing)} missing (the plan needs them)"
    return None


def _stock_keys_problem(keys):
    """A stock plan's parameter keys (the servers saved their optimizer state by key): distinct
    non-negative ints below MXNet's 2^20 key range, one per parameter."""
    if not (isinstance(keys, list) and keys and len(set(keys)) == len(keys)
            and all(_is_int(k) and 0 <= k < (1 << 20) for k in keys)):
        return f"keys: expected a list of distinct parameter keys in [0, 2^20), got {keys!r}"
    return None


def _plan_problem(plan, cfg):
    kind = runner_of(cfg).plan
    if plan.get("kind") != kind:
        return f"kind {plan.get('kind')!r}, but this config runs {kind!r}"
    servers = plan.get("servers")
    if not _is_int(servers) or servers != cfg.cluster.servers:
        return (f"written for {servers!r} servers, but cluster.servers is {cfg.cluster.servers}: a checkpoint "
                f"resumes only on the server layout it was taken with")
    return PLAN_FORMS[kind][0](plan, cfg)


def _rounds_plan_problem(plan, cfg):
    """A rounds plan's buffers (compression.fusion's plan) and the costs it was planned from."""
    sizes = plan.get("buffer_sizes")
    if not isinstance(sizes, list) or not sizes or not all(_is_int(n) and n > 0 for n in sizes):
        return f"buffer_sizes: expected a non-empty list of positive integers, got {sizes!r}"
    cost = plan.get("cost_model")
    if cfg.compression.buffers == "cost_model":
        if not (isinstance(cost, dict) and all(_is_number(cost.get(k)) and cost[k] >= 0
                                               for k in ("alpha", "beta", "backward"))):
            return (f"cost_model: expected the measured costs {{alpha, beta, backward}} (compression.buffers: "
                    f"cost_model plans from them), got {cost!r}")
    return None


# How a plan of each form (registry.PLANS: an algorithm's entry declares its own) is checked: (what is
# wrong with its fields, given the config; the server files it needs).
PLAN_FORMS = {
    ROUNDS: (_rounds_plan_problem, lambda plan: [server_buffer_file(b) for b in range(len(plan["buffer_sizes"]))]),
    STOCK: (lambda plan, cfg: _stock_keys_problem(plan.get("keys")),
            lambda plan: [server_stock_file(r) for r in range(plan["servers"])]),
}


def verify(directory, cfg):
    """Load and check a checkpoint's manifest against the config and the files; return it."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except RecursionError:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: nested too deep") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: {err}") from None
    match = re.fullmatch(r"epoch-(\d+)", os.path.basename(os.path.normpath(directory)))
    cfg = resumed_density(cfg, manifest)
    problem = manifest_problem(manifest, cfg, int(match.group(1)) if match else None)
    saved = manifest.get("config") if isinstance(manifest, dict) else None
    # Keys the config leaves idle (algorithm.delay under SSGD) may differ: they change no step. A key that
    # differs is named before the plan's checks, which it fails (cluster.workers 3: worker2.npz missing).
    now = fingerprint_parts(cfg)
    if isinstance(saved, dict) and isinstance(manifest.get("fingerprint"), str) \
            and manifest["fingerprint"] != hash_parts(now) and not _only_idle_keys_differ(manifest, now, cfg):
        diff = differences(saved, now)
        if diff or not problem:
            which = ": " + "; ".join(diff) if diff else ""
            raise CheckpointError(
                f"{directory} was written by a different configuration (model, data, algorithm, compression, "
                f"training hyper-parameters or cluster size differ{which}); refusing to resume from it")
    if problem:
        raise CheckpointError(f"checkpoint manifest {path}: {problem}")
    for name, digest in manifest["files"].items():
        file = os.path.join(directory, name)
        if not os.path.exists(file):
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file_sha256(file) != digest:
            raise CheckpointError(f"checkpoint file {file} is corrupt (sha256 differs from the manifest)")
    return manifest


def check_against_run(manifest, directory, steps_per_epoch, worker_meta):
    """What only a worker knows (the data's steps per epoch, its own saved step): CheckpointError if
    the manifest disagrees."""
    epochs, step = manifest["epochs_done"], manifest["step"]
    if not (epochs - 1) * steps_per_epoch < step <= epochs * steps_per_epoch:
        raise CheckpointError(f"{directory}: step {step} is not within epoch {epochs} of this run "
                              f"({steps_per_epoch} steps per epoch)")
    saved = (worker_meta or {}).get("step")
    if saved is not None and saved != step:
        raise CheckpointError(f"{directory}: the manifest says step {step}, this worker's file step {saved}")


def _npz_shapes(path):
    """{array name: shape} of an .npz file, from the array headers only (nothing large is read)."""
    shapes = {}
    try:
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                with z.open(name) as f:
                    major, _ = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                    shapes[name[:-4] if name.endswith(".npy") else name] = read(f)[0]
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None
    return shapes


def served_plan_problem(cfg, directory, manifest):
    """Re-make the plan of a round-based checkpoint from the parameter shapes of worker0.npz and the
    costs it recorded, as the resumed workers will, and check it against the manifest's plan and the
    shapes of the server buffer files; what is wrong, or None. No mxnet, no large reads."""
    if not round_based(cfg):
        return None
    worker0 = os.path.join(directory, "worker0.npz")
    shapes = _npz_shapes(worker0)
    params = [shapes[f"param{i}"] for i in range(len(shapes)) if f"param{i}" in shapes]
    if not params:
        return f"{worker0} holds no parameters"
    _, meta = load_npz_meta(worker0)
    cost = (meta or {}).get("cost_model")
    problem = costs_problem(cfg, cost, worker0)
    if problem:
        return problem
    try:
        sizes = [b.size for b in plan_for_config(params, cfg.cluster.servers, cfg.compression, cost)]
    except (TypeError, ValueError) as err:
        return f"the plan cannot be made again from the checkpoint: {err}"
    problem = plan_problem((manifest.get("plan") or {}).get("buffer_sizes"), sizes)
    if problem:
        return problem
    listed = sorted(f for f in manifest["files"] if f.startswith(SERVER_BUFFER))
    want = [server_buffer_file(b) for b in range(len(sizes))]
    if sorted(want) != listed:
        return (f"the plan has {len(sizes)} buffers, but the checkpoint has server files "
                f"{', '.join(listed) or 'none'}")
    for b, n in enumerate(sizes):
        path = os.path.join(directory, server_buffer_file(b))
        got = _npz_shapes(path).get("weights")
        if got != (n,):
            return f"{path} holds weights of shape {got}, but buffer {b} of the plan has {n} elements"
    return None


def costs_problem(cfg, cost, source):
    """compression.buffers: cost_model plans from the costs measured at job start; a checkpoint whose
    `source` (a worker file) did not record them cannot have its plan made again."""
    if cfg.compression.buffers == "cost_model" and not cost:
        return (f"compression.buffers is cost_model but {source} has no recorded costs, so the buffer plan "
                f"the servers saved cannot be made again")
    return None


def plan_problem(saved_sizes, sizes):
    """The buffer plan the manifest records against the one made again from the same shapes and costs
    (by the front end from worker0.npz, by every resumed worker from its parameters)."""
    if saved_sizes is not None and saved_sizes != sizes:
        return (f"the manifest's buffer plan ({describe_sizes(saved_sizes)}) is not the plan this config makes "
                f"from the checkpoint's shapes and costs ({describe_sizes(sizes)}); its server files cannot be "
                f"served")
    return None


def load_npz_meta(path):
    """(None, meta dict or None) of an .npz written by save_npz, reading only its meta array."""
    try:
        with np.load(path, allow_pickle=False) as f:
            meta = f["__meta__"] if "__meta__" in f.files else None
    except Exception as err:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {err}") from None
    return None, (json.loads(meta.tobytes().decode()) if meta is not None else None)


def _only_idle_keys_differ(manifest, now, cfg):
    """Whether the checkpoint's config differs from cfg (whose fingerprint parts are `now`) only in keys idle
    in both: idle now, and still idle with the checkpoint's values put back (a milestone moved past the last
    epoch is idle now, not before). The saved parts count only if they are the ones the checkpoint's
    fingerprint hashed."""
    saved = manifest.get("config")
    if not isinstance(saved, dict) or hash_parts(saved) != manifest["fingerprint"]:
        return False
    diff = differing(saved, now)
    if not diff or any(key not in cfg.idle for key, _, _ in diff):
        return False
    before = cfg.to_dict()
    for key, value, _ in diff:
        apply_override(before, key.split("."), value)
    idle_before = idle_keys(before, before)
    return all(key in idle_before for key, _, _ in diff)


def resume_point(cfg):
    """The checkpoint to resume from for --resume: verified, or CheckpointError saying why not."""
    root = cfg.checkpoint.dir
    if not root:
        raise CheckpointError("--resume needs checkpoint.dir (the folder the run saved its checkpoints in)")
    directory = latest(root)
    if directory is None:
        raise CheckpointError(f"--resume: no complete checkpoint in {root}")
    manifest = verify(directory, cfg)
    for rank in range(cfg.cluster.workers):          # each worker's own record of the step (meta only)
        path = os.path.join(directory, worker_file(rank))
        saved = (load_npz_meta(path)[1] or {}).get("step")
        if saved != manifest["step"]:
            raise CheckpointError(f"{os.path.join(directory, MANIFEST)}: step {manifest['step']}, but "
                                  f"{worker_file(rank)} says step {saved}; resume refused")
    problem = served_plan_problem(resumed_density(cfg, manifest), directory, manifest)
    if problem:
        raise CheckpointError(f"{directory}: {problem}; resume refused")
    return directory, manifest
