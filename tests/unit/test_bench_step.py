"""bench/bench_step.py: the table's medians and ratios, a tiny real run, and the --shape error."""
import argparse


from bench import bench_step


def test_table_reports_median_per_mode_and_ratio_to_imperative():
    rows = []
    # Skewed samples, so that a mean (0.9, 1.6, 0.8, 0.6) would not pass for the median.
    for copies, imperative, hybridized in [(1, [0.5, 1.6, 0.6], [1.0, 2.8, 1.2]), (2, [0.8, 0.8], [0.4, 0.6])]:
        rows += [{"mode": "imperative", "copies": copies, "seconds": s} for s in imperative]
        rows += [{"mode": "hybridized", "copies": copies, "seconds": s} for s in hybridized]
    args = argparse.Namespace(model="m", batch=4, shape="3,8,8", steps=3, warmup=1, copies=[1, 2], task="train")
    lines = bench_step.table(rows, args).splitlines()
    assert "| 1 | imperative | 0.600 | 1.00x |" in lines
    assert "| 1 | hybridized | 1.200 | 2.00x |" in lines
    # Two copies: median of [0.4, 0.6] is 0.5 against 0.8.
    assert "| 2 | hybridized | 0.500 | 0.62x |" in lines
