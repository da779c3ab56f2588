"""Which run a run folder holds: a random run id, written into the folder (RUN_ID_FILE) when it is made,
with the checkpoint.dir its checkpoints go to. Each checkpoint manifest records the id beside run_dir, so a
resume can tell the run's own folder from one named by a copied or edited manifest (folders.resume_run_folder).
"""
import json
import os
import uuid

from ssdsgd.metrics import write_json_atomic

RUN_ID_FILE = "run-id.json"        # {"run_id": 32 hex digits, "checkpoint_dir": absolute path or null}


def write_run_identity(run_dir, checkpoint_dir):
    """Give a new run folder its run id and the checkpoint.dir of its run (WriteError if it cannot)."""
    write_json_atomic(os.path.join(run_dir, RUN_ID_FILE),
                      {"run_id": uuid.uuid4().hex,
                       "checkpoint_dir": os.path.realpath(checkpoint_dir) if checkpoint_dir else None})


def run_identity(run_dir):
    """The run folder's RUN_ID_FILE as a dict, or None (a folder made before run ids, or not a run's)."""
    try:
        with open(os.path.join(run_dir, RUN_ID_FILE)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("run_id"), str) else None


def run_id(run_dir):
    """The run folder's id, or None."""
    return (run_identity(run_dir) or {}).get("run_id")
