"""Finding a job's processes on this machine by what their command line holds, and their ps-lite role
(for the tests and scripts/chaos.py, which end or stop only processes of the job they started)."""
import os


def role_of(pid):
    """DMLC_ROLE and DMLC_TASK_ID from a process's environment, or (None, None)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None, None
    role = env.get(b"DMLC_ROLE")
    task = env.get(b"DMLC_TASK_ID")
    return (role.decode() if role else None), (int(task) if task else None)


def processes_with(marker):
    """PIDs of live processes whose command line contains `marker` (a unique path of the job's)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(pid))
    return found
