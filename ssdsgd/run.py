"""`python -m ssdsgd.run --config FILE [--set k=v ...]`: one command for a whole job.

Reads the `cluster` section and starts scheduler, servers and workers through the launcher, each
running `python -m ssdsgd.train` with the same config and overrides.
"""
import os
import sys

from ssdsgd.config import ConfigError, load_config
from ssdsgd.train import parse_args


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from ssdsgd.launcher import run_job
    cl = cfg.cluster
    command = [sys.executable, "-m", "ssdsgd.train", "--config", os.path.abspath(args.config)]
    for text in args.set:
        command += ["--set", text]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return run_job(command, cl.workers, cl.servers, launcher=cl.launcher, hostfile=cl.hostfile,
                   env=env, timeout=cl.timeout, interface=cl.interface, stall_timeout=cl.stall_timeout)


if __name__ == "__main__":
    sys.exit(main())
