"""bench/bench_selection.py: the table's figures and a tiny real run writing its results folder."""

from bench import bench_selection


def test_table_prints_the_clock_asked_for():
    row = {"model": "m", "values": 1234567, "buffers": 2, "selection": "sampled",
           "pass_cpu_ms": 10.0, "warm_cpu_ms": 4.0, "encode_cpu_ms": 25.0, "read_cpu_ms": 3.0,
           "memory_cpu_ms": 12.0, "select_cpu_ms": 10.0, "ratio_cpu": 2.5, "ratio_warm_cpu": 6.25,
           "ratio_select_cpu": 1.0,
           "pass_wall_ms": 20.0, "warm_wall_ms": 8.0, "encode_wall_ms": 90.0, "read_wall_ms": 6.0,
           "memory_wall_ms": 40.0, "select_wall_ms": 44.0, "ratio_wall": 4.5, "ratio_warm_wall": 11.25,
           "ratio_select_wall": 2.2}
    assert bench_selection.table([row]).splitlines()[-1] == \
        "| m | 1,234,567 | 2 | sampled | 10.0 | 4.0 | 25.0 | 3.0 | 12.0 | 10.0 | 2.50 | 6.25 | 1.00 |"
    assert bench_selection.table([row], "wall").splitlines()[-1] == \
        "| m | 1,234,567 | 2 | sampled | 20.0 | 8.0 | 90.0 | 6.0 | 40.0 | 44.0 | 4.50 | 11.25 | 2.20 |"
