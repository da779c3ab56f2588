"""Names of the environment variables the processes of a job pass to each other (one home each).

Set by the launcher (ssdsgd/launch/launcher.py) for every role, unless said otherwise. No imports: read by
the front end, the launcher, and every role before mxnet is imported. (Two files spell names
from here themselves, since they may import nothing of ssdsgd: remote.py, shipped as source to ssh
hosts, and pyhooks/sitecustomize.py, run in processes that never import ssdsgd; a test checks them.)
"""
# ours
SECRET_ENV = "SSDSGD_JOB_SECRET"             # the per-job key that signs worker -> server commands
HEARTBEAT_ENV = "SSDSGD_HEARTBEAT_FILE"      # a worker touches this file every step
LIVENESS_ENV = "SSDSGD_LIVENESS_FILE"        # servers/scheduler: pyhooks/sitecustomize.py touches it every second
WRAPPER_ENV = "SSDSGD_REMOTE_WRAPPER"        # set for remote.py only, so the wrapper does not touch the role's file
JOB_DIR_ENV = "SSDSGD_JOB_DIR"               # ssh roles: remote.py ends the role once this folder is gone
ROLE_NAME_ENV = "SSDSGD_ROLE_NAME"           # 'worker 1', 'server 0', ... for messages
HOST_INTERFACE_ENV = "SSDSGD_HOST_INTERFACE"  # ssh launcher: the host file's interface= (ssdsgd.launch.remote)
LOCKED_ENV = "SSDSGD_FOLDERS_LOCKED"         # set by ssdsgd.launch.run: the front end holds the folder locks
RUN_DIR_ENV = "SSDSGD_RUN_DIR"               # set by ssdsgd.launch.run: the run folder every worker writes to
COMMAND_ENV = "SSDSGD_COMMAND"               # set by ssdsgd.launch.run: the command the user ran (JSON list)
# lines a role prints for the launcher (ssdsgd/launch/launcher.py reads them and does not show them)
MARK = '@ssdsgd '      # a line `@ssdsgd <key> <value>...` is for the launcher; remote.py spells it too
RANK_MARK = 'rank'     # `MARK + 'rank N'`: printed once a role knows its KVStore rank


def rank_line(rank):
    """The line that tells the launcher this process's KVStore rank (it labels the output with it)."""
    return f"{MARK}{RANK_MARK} {rank}"


# tests only (ssdsgd/faults.py)
FAULT_ENV = "SSDSGD_TEST_FAULT"
COST_SCALE_ENV = "SSDSGD_TEST_COST_SCALE"
PICKLE_MARKER_ENV = "SSDSGD_TEST_PICKLE_MARKER"
# ps-lite's (DMLC_*) and MXNet's, as far as we read or set them ourselves
ROLE_ENV = "DMLC_ROLE"
TASK_ID_ENV = "DMLC_TASK_ID"
NUM_SERVER_ENV = "DMLC_NUM_SERVER"
NUM_WORKER_ENV = "DMLC_NUM_WORKER"
SCHEDULER_HOST_ENV = "DMLC_PS_ROOT_URI"
BIGARRAY_BOUND_ENV = "MXNET_KVSTORE_BIGARRAY_BOUND"
