"""The tests: tests/unit/ run in this process (fast: `pytest tests/unit`); tests/jobs/ start processes --
multi-process jobs on loopback and on the virtual cluster (testbed/), the launcher, the tools as commands --
each under a timeout and checking that nothing is left behind. tests/support/jobs.py runs their jobs.

The order of the files: `make test` hands them, in this order, to the xdist workers (--dist loadfile
--no-loadscope-reorder), each taking the next file when it is almost out of tests. The slowest files go first,
so that what starts last is short (xdist's own order, most tests first, left the files of one or two long job
tests for the end, where a worker with one of them queued kept running while the others had nothing left).
Then the other files, fewest tests first: a file of few tests is mostly real jobs, and the many quick unit
tests fill the end.
"""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))

# By wall time in `make test --durations` (slowest first); a file missing here only starts later.
SLOWEST_FIRST = ["jobs/test_cluster.py", "jobs/test_shipped_configs.py", "jobs/test_reliability.py",
                 "jobs/test_devices.py", "jobs/test_auto_density.py", "jobs/test_jobs.py", "jobs/test_chaos.py",
                 "jobs/test_folders.py",
                 "jobs/test_data.py", "jobs/test_downlink.py", "jobs/test_stock_compat.py", "jobs/test_bench_step.py",
                 "jobs/test_reproduce.py", "jobs/test_launcher_units.py", "jobs/test_membership.py",
                 "jobs/test_launcher.py", "jobs/test_liveness.py", "jobs/test_stalls.py", "jobs/test_manifest.py",
                 "jobs/test_bitmap_coding.py", "jobs/test_horovod_accuracy.py", "jobs/test_stock.py",
                 "jobs/test_selection.py", "jobs/test_scripts.py", "jobs/test_compression.py",
                 "jobs/test_bench_tools.py"]


def _file(item):
    return os.path.relpath(str(item.path), TESTS)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    counts = {}
    for item in items:
        counts[_file(item)] = counts.get(_file(item), 0) + 1
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: (rank.get(_file(item), len(rank)), counts[_file(item)], _file(item)))
