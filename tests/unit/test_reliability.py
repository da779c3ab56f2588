"""Faults, checkpoints and bad input on real jobs: clean failure, exact resume, refused commands."""



def test_nonfinite_message_names_a_few_parameters_and_counts_the_rest():
    # A diverging ResNet is non-finite in all of its ~60 parameters at once: one line, not a page.
    from ssdsgd.worker.loop import nonfinite_summary
    names = ["loss"] + [f"p{i}" for i in range(60)]
    assert nonfinite_summary(names) == "loss, p0, p1 and 58 more parameters (all named in this rank's metrics log)"
    assert nonfinite_summary(["a", "b", "c"]) == "a, b, c"
    assert nonfinite_summary([]) == "sum of squared gradients overflowed"


def test_restart_backoff_doubles_while_no_checkpoint_is_newer_and_is_capped():
    from ssdsgd.launch.run import MAX_BACKOFF, backoff_seconds
    assert [backoff_seconds(1.0, stuck) for stuck in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_seconds(1.0, 30) == MAX_BACKOFF == 60.0
    assert backoff_seconds(0.0, 5) == 0.0                      # 0: restart at once
