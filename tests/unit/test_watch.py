"""Watching a run: rank 0's progress lines carry the percentage, the elapsed time and an ETA, and its
scalars are in TensorBoard event files that read back to the metrics.jsonl values."""



def test_eta_adds_the_epoch_ends_left_at_their_mean_time_once_one_is_known():
    from ssdsgd.worker.loop import eta_seconds
    assert eta_seconds(10.0, 10, 30, 0.0, 0, 3) == (30.0, False)        # 1 s a step; evaluation time unknown
    assert eta_seconds(10.0, 10, 30, 4.0, 2, 3) == (36.0, True)         # + 3 ends at 2 s each
    assert eta_seconds(10.0, 10, 0, 4.0, 2, 0) == (0.0, True)
    assert eta_seconds(0.0, 0, 30, 0.0, 0, 3) == (0.0, False)
