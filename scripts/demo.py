"""`make demo`: the embedded digits demo, SSGD, SSD-SGD and SSD-SGD + top-k 1% side by side.

Each job runs 1 scheduler + 1 server + 2 workers on loopback; the table compares their summary.json.
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import run_folder
from ssdsgd.metrics import comparison_table, read_summary

CONFIGS = ["configs/demo_digits_ssgd.yaml", "configs/demo_digits_ssd.yaml", "configs/demo_digits_ssd_topk.yaml"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Other arguments (for example "
                                     "--set train.epochs=2) are passed to every job's ssdsgd-run.")
    _, passed = parser.parse_known_args()
    summaries = []
    for config in CONFIGS:
        print(f"=== {config}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "ssdsgd", "--config", config, *passed], cwd=ROOT)
        if rc != 0:
            print(f"demo: {config} failed with exit code {rc}", file=sys.stderr)
            return rc
        name = os.path.splitext(os.path.basename(config))[0]
        summaries.append(read_summary(run_folder("", os.path.join(ROOT, "runs"), name)))
    print()
    print(comparison_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
