"""compression.selection: sampled (issue 36, item 6): the sampled top-k search finds the exact top-k
set, falls back where its estimate fails, is deterministic given the seed, gives the encoders the
same messages and memory as exact selection, and a job runs with it."""

import numpy as np
import pytest

from support.jobs import processes_with, run_job

TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"


@pytest.mark.parametrize("selection", ["exact", "sampled"])
def test_a_short_job_with_each_selection(tmp_path, selection):
    """A few steps of the demo's top-k job, each selection: same push size, the loss logged finite."""
    # density 0.2 over one buffer: the buffer-wide search of the gradient allocation samples
    job = run_job(tmp_path, TOPK_CONFIG, "train.max_steps=6", "log.every_steps=3", "compression.density=0.2",
                  "compression.buffers=one", "compression.allocation=gradient",
                  f"compression.selection={selection}", name=f"sel_{selection}", timeout=150)
    assert job.rc == 0, job.output
    assert processes_with(job.marker) == []
    s = job.summary()
    assert s["steps"] == 6 and s["compression"] == "topk"
    losses = [r["loss"] for r in job.metrics() if "loss" in r]
    assert losses and all(np.isfinite(losses))
