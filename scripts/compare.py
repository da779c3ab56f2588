"""Print the side-by-side table of finished runs.

Each RUN is a run folder (log.dir/<name>/<YYYYmmdd-HHMMSS>, holding summary.json) or the folder of a
name's runs (log.dir/<name>), which stands for its latest run.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import resolve_run_dir
from ssdsgd.metrics import SUMMARY_FILE, comparison_table, read_summary


def finished_summary(path):
    """The summary.json dict of the run `path` names; ValueError with one line when there is none."""
    run = resolve_run_dir(path)
    shown = path if os.path.samefile(run, path) else f"{path} (latest run {run})"
    if not os.path.exists(os.path.join(run, SUMMARY_FILE)):
        raise ValueError(f"{shown} has no {SUMMARY_FILE}: the run did not finish, or is still running")
    try:
        summary = read_summary(run)
    except (OSError, ValueError) as err:
        raise ValueError(f"{shown}: cannot read {SUMMARY_FILE}: {getattr(err, 'strerror', None) or err}") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{shown}: {SUMMARY_FILE} is not a JSON object")
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/compare.py", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run folder, or log.dir/<name> for its latest run")
    args = ap.parse_args(argv)
    try:
        summaries = [finished_summary(path) for path in args.runs]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(comparison_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
