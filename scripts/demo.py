"""`make demo`: the embedded digits demo, SSGD, SSD-SGD and SSD-SGD + top-k 1% side by side.

Each job runs 1 scheduler + 1 server + 2 workers on loopback; the table compares the summary.json of the
run folders these jobs print, never an older run's.
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: scripts.*, bench.* and ssdsgd from this checkout
from scripts.results_io import dies_with_script, printed_run_folder, survive_closed_stdout
from ssdsgd.metrics import SUMMARY_FILE, comparison_table, read_summary

CONFIGS = ["configs/demo_digits_ssgd.yaml", "configs/demo_digits_ssd.yaml", "configs/demo_digits_ssd_topk.yaml"]


class JobFailed(Exception):
    """A job that left no result of its own: the one-line reason, and the exit code for the demo."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


def run_shown(cmd):
    """Run a job in this checkout, its output shown as it comes and kept: (exit code, output)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, preexec_fn=dies_with_script())
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def job_summary(config, passed):
    """The summary.json of the run folder this job printed. Not log.dir/<name>/latest: the user's
    arguments (log.dir, name) may put the run elsewhere, and latest may be an earlier run's."""
    rc, output = run_shown([sys.executable, "-m", "ssdsgd", "--config", config, *passed])
    if rc != 0:
        raise JobFailed(f"{config} failed with exit code {rc}", rc if rc > 0 else 1)
    folder = printed_run_folder(output)
    if folder is None:
        raise JobFailed(f"{config} ended without training a run (it printed no run folder)")
    try:
        return read_summary(folder)
    except (OSError, ValueError) as err:
        raise JobFailed(f"{config}: cannot read {os.path.join(folder, SUMMARY_FILE)}: "
                        f"{getattr(err, 'strerror', None) or err}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Other arguments (for example "
                                     "--set train.epochs=2) are passed to every job's ssdsgd-run.")
    _, passed = parser.parse_known_args(argv)
    survive_closed_stdout()
    summaries = []
    for config in CONFIGS:
        print(f"=== {config}", flush=True)
        try:
            summaries.append(job_summary(config, passed))
        except JobFailed as err:
            print(f"demo: {err}", file=sys.stderr)
            return err.code
    print()
    print(comparison_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
