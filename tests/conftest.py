"""The order of the test files: `make test` hands them, in this order, to 2 xdist workers (--dist loadfile
--no-loadscope-reorder), each taking the next file when it is almost out of tests.

The slowest files go first, so that what starts last is short. (xdist's own order, most tests first, left
the files of one or two long job tests, test_reproduce and test_chaos, for the end, where a worker with
one of them queued kept running while the other had nothing left.) Then the other files, fewest tests
first: a file of few tests is mostly real jobs, and the many quick unit tests fill the end.
"""

# By wall time in `make test --durations` (slowest first); a file missing here only starts later.
SLOWEST_FIRST = ["test_shipped_configs.py", "test_reliability.py", "test_cluster.py", "test_chaos.py",
                 "test_devices.py",
                 "test_data_jobs.py", "test_stock_compat.py", "test_downlink.py", "test_manifest.py",
                 "test_reproduce.py", "test_membership.py", "test_compression.py", "test_bitmap_coding.py",
                 "test_bench_step.py", "test_jobs.py", "test_wire_and_warmup.py", "test_bench_tools.py",
                 "test_selection.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    counts = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), counts[item.path.name], item.path.name))
