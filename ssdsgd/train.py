"""`python -m ssdsgd.train --config FILE [--set k=v ...]`: the command every role runs under the launcher.

The scheduler and servers enter our server loop (ssdsgd.ps.server); workers train (ssdsgd.worker.loop).
A worker that raises exits hard with status 1: a normal exit would wait forever in ps-lite's finalize
barrier for the other workers, hanging the job instead of failing it. A JobError (a problem with the
job's input: a data file, a checkpoint, a folder) is printed as its one-line message; anything else
with its traceback. Every role stops at start (exit 2, one line) when the job secret is missing or the
launcher's -n/-s differ from cluster.workers/cluster.servers.
"""
import os
import sys
import traceback

from ssdsgd.cli import config_from_args, parse_args
from ssdsgd.env import NUM_SERVER_ENV, NUM_WORKER_ENV, ROLE_ENV, ROLE_NAME_ENV, SECRET_ENV
from ssdsgd.errors import JobError
from ssdsgd.folders import make_private
from ssdsgd.lean_mxnet import import_mxnet
from ssdsgd.ps.scheduler import run_scheduler


def check_job_size(cfg, workers, servers):
    """Raise a JobError when the job the launcher started (`workers`, `servers`: its -n and -s; None when
    not known) is not the one cluster.workers and cluster.servers describe: the run folder would record the
    config's numbers while the job trains with the launcher's."""
    wrong = [(key, want, got, flag) for key, want, got, flag in
             (("workers", cfg.cluster.workers, workers, "-n"), ("servers", cfg.cluster.servers, servers, "-s"))
             if got is not None and got != want]
    if not wrong:
        return
    said = " and ".join(f"cluster.{key} is {want}" for key, want, _, _ in wrong)
    default = "; -s defaults to -n" if servers == workers else ""       # an -s of its own is not the default
    started = " and ".join(f"{got} {key if got != 1 else key[:-1]} ({flag} {got}{default if flag == '-s' else ''})"
                           for key, _, got, flag in wrong)
    sets = " ".join(f"cluster.{key}={got}" for key, _, got, _ in wrong)
    flags = " ".join(f"{flag} {want}" for _, want, _, flag in wrong)
    raise JobError(f"{said}, but the launcher started {started}: add --set {sets} to the command, or launch "
                   f"with {flags}")


def _launched_size():
    """(workers, servers) the launcher started, from ps-lite's variables; None for one not set or not a number."""
    def number(name):
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else None
    return number(NUM_WORKER_ENV), number(NUM_SERVER_ENV)


def main(argv=None):
    args = parse_args(argv, prog="python -m ssdsgd.train", description=__doc__.splitlines()[0])
    cfg = config_from_args(args)
    if cfg is None:
        return 2
    make_private()              # run folder, checkpoints, metrics: 0700 folders, 0600 files
    role = os.environ.get(ROLE_ENV)
    if role and not os.environ.get(SECRET_ENV):
        # Every role stops here, so a foreign launcher's job ends instead of hanging in ps-lite.
        print(f"ssdsgd.train ({role}): SSDSGD_JOB_SECRET is not set. Our launcher sets it; under another\n"
              "launcher export the same random value to every process, e.g.\n"
              "  export SSDSGD_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')",
              file=sys.stderr)
        return 2
    try:
        if role:
            check_job_size(cfg, *_launched_size())
    except JobError as err:
        # Every role stops before it starts ps-lite or writes anything, so a foreign launcher's job ends too.
        print(f"{os.environ.get(ROLE_NAME_ENV, role)}: error: {err}", file=sys.stderr)
        return 2
    if role == "scheduler":
        run_scheduler()
        return 0
    if role == "server":
        # Imported by its role alone: the scheduler starts without the server's and the worker's imports.
        from ssdsgd.ps.server import run_server
        run_server()
        return 0
    if role != "worker":
        print("ssdsgd.train runs under the launcher (DMLC_ROLE is not set). Use\n"
              f"  python -m ssdsgd --config {args.config}\n"
              "or python launch/launch.py -n WORKERS -s SERVERS python -m ssdsgd.train --config ...",
              file=sys.stderr)
        return 2
    try:
        # Imports MXNet, which a server or the scheduler must not import with its own DMLC_ROLE (run_server).
        import_mxnet()
        from ssdsgd.worker.loop import run_worker
        run_worker(cfg, resume=args.resume, overwrite=args.overwrite)
    except BaseException as err:
        name = os.environ.get(ROLE_NAME_ENV, "worker")
        if isinstance(err, JobError):
            print(f"{name}: error: {err}", file=sys.stderr)
        else:
            print(f"{name} failed:", file=sys.stderr)
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
