"""`python -m ssdsgd.run --config FILE [--set k=v ...]`: one command for a whole job.

Reads the `cluster` section and starts scheduler, servers and workers through the launcher, each
running `python -m ssdsgd.train` with the same config and overrides.
"""
import os
import sys

from ssdsgd.config import ConfigError, load_config
from ssdsgd.train import parse_args


def preflight(cfg, resume):
    """Problems that can be found before any process starts; None if there are none."""
    from ssdsgd.checkpoint import CheckpointError, resume_point
    if cfg.model.name not in ("linear", "mlp", "small_cnn"):
        from gluoncv.model_zoo import get_model_list
        if cfg.model.name not in get_model_list():
            return (f"model.name: unknown model {cfg.model.name!r} (use linear, mlp, small_cnn or a "
                    f"gluoncv model zoo name such as cifar_resnet20_v1 or resnet50_v1)")
    root = cfg.data.root
    if cfg.data.dataset in ("cifar10", "imagenet") and not os.path.isdir(root):
        return (f"data.root: folder {root} does not exist (put the {cfg.data.dataset} files there; "
                f"nothing is downloaded)")
    if cfg.cluster.launcher == "ssh" and not os.path.isfile(cfg.cluster.hostfile):
        return f"cluster.hostfile: file {cfg.cluster.hostfile} does not exist"
    if resume:
        try:
            resume_point(cfg)
        except CheckpointError as err:
            return str(err)
    return None


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    problem = preflight(cfg, args.resume)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from ssdsgd.launcher import run_job
    cl = cfg.cluster
    command = [sys.executable, "-m", "ssdsgd.train", "--config", os.path.abspath(args.config)]
    for text in args.set:
        command += ["--set", text]
    if args.resume:
        command.append("--resume")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return run_job(command, cl.workers, cl.servers, launcher=cl.launcher, hostfile=cl.hostfile,
                   env=env, timeout=cl.timeout, interface=cl.interface, stall_timeout=cl.stall_timeout,
                   port=cl.port)


if __name__ == "__main__":
    sys.exit(main())
