"""What checkpoint.dir holds: its epoch-<E> folders, complete (with a manifest) or left by a save that never
completed, the cleanup of the latter, and the pruning of old checkpoints (checkpoint.keep). No MXNet at
import: the front end uses this module.
"""
import json
import os
import re
import shutil

from ssdsgd.checkpoint import MANIFEST


def checkpoint_folders(root):
    """Names of the epoch-* folders under root (complete or not), sorted."""
    if not root or not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("epoch-") and os.path.isdir(os.path.join(root, d)))


def remove_leftovers(root, log=print):
    """Temporary files of interrupted saves, and epoch folders without a manifest (saves that never
    completed; never used for a resume), under checkpoint.dir. Only while holding its lock."""
    removed = []
    for d in checkpoint_folders(root):
        folder = os.path.join(root, d)
        if _is_leftover(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(d + "/")
            continue
        for name in os.listdir(folder):
            if ".tmp" in name:
                os.remove(os.path.join(folder, name))
                removed.append(f"{d}/{name}")
    if removed:
        log(f"checkpoint.dir {root}: removed what interrupted saves left: {', '.join(removed)}")
    return removed


def _is_leftover(checkpoint_folder):
    """An epoch folder without a manifest: a save that never completed."""
    return not os.path.exists(os.path.join(checkpoint_folder, MANIFEST))


def prune_checkpoints(root, keep, steps_per_epoch):
    """Delete the epoch-<E> folders under root below the `keep` newest complete checkpoints (keep 0:
    none) and below the newest one of whole epochs (a max_steps stop's partial one is replaced when
    its resume ends that epoch; the whole one stays if that save fails). Returns those deleted."""
    if not keep or not root or not os.path.isdir(root):
        return []
    epochs = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := re.fullmatch(r"epoch-(\d+)", d)))
    manifests = [(e, os.path.join(root, d, MANIFEST)) for e, d in epochs]
    complete = [(e, path) for e, path in manifests if os.path.exists(path)]
    if len(complete) <= keep:
        return []
    whole = [e for e, path in complete if _load_json(path).get("step") == e * steps_per_epoch]
    oldest_kept = min([complete[-keep][0]] + whole[-1:])
    removed = [os.path.join(root, d) for e, d in epochs if e < oldest_kept]
    for folder in removed:
        shutil.rmtree(folder)
    return removed


def _load_json(path):
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}
