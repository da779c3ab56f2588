"""Print the side-by-side table of finished runs: python scripts/compare.py RUN_DIR [RUN_DIR ...]"""
import json
import os
import sys

from ssdsgd.metrics import SUMMARY_FILE, comparison_table


def main(run_dirs):
    summaries = []
    for d in run_dirs:
        path = os.path.join(d, SUMMARY_FILE)
        if not os.path.exists(path):
            print(f"error: {path} does not exist (the run did not finish)", file=sys.stderr)
            return 1
        with open(path) as f:
            summaries.append(json.load(f))
    print(comparison_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) if len(sys.argv) > 1 else (print(__doc__, file=sys.stderr) or 2))
