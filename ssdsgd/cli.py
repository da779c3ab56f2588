"""The command line a job's commands share: the front end (`ssdsgd-run`, ssdsgd/launch/run.py) and every
role's `python -m ssdsgd.train` (ssdsgd/train.py) take --config, --set, --resume and --overwrite, and load
the config they name the same way. Each command gives its own name and description, and may add options.
"""
import argparse
import sys

from ssdsgd.config import ConfigError, load_config


def parse_args(argv, prog, description, extra=None):
    """The options every command of a job takes; extra(parser) adds the command's own."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", required=True, help="experiment YAML file")
    ap.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY.PATH=VALUE",
                    help="override config keys (repeatable, several after one --set), e.g. "
                         "--set train.epochs=3 train.lr=0.05")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest complete checkpoint in checkpoint.dir")
    ap.add_argument("--overwrite", action="store_true",
                    help="start afresh even though checkpoint.dir holds checkpoints: delete them first")
    if extra:
        extra(ap)
    return ap.parse_args(argv)


def config_from_args(args):
    """The validated config, or None after printing the error (the caller exits with 2)."""
    try:
        return load_config(args.config, args.set)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return None
