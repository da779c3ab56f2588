"""`make demo`: the embedded digits demo, SSGD, SSD-SGD and SSD-SGD + top-k 1% side by side.

Each job runs 1 scheduler + 1 server + 2 workers on loopback; the table compares their summary.json.
"""
import os
import subprocess
import sys

from results_io import run_folder

from ssdsgd.metrics import comparison_table, read_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ["configs/demo_digits_ssgd.yaml", "configs/demo_digits_ssd.yaml", "configs/demo_digits_ssd_topk.yaml"]


def main():
    summaries = []
    for config in CONFIGS:
        print(f"=== {config}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "ssdsgd", "--config", config] + sys.argv[1:], cwd=ROOT)
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
