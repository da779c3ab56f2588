"""fp16 wire format (compression.fp16_values) and the density warm-up (compression.warmup): codec
against an independent numpy decoder, error feedback that keeps what fp16 rounding and clipping lost,
the per-stage plans, the server applying rounds from every stage, and a real 2-worker job whose
push bytes match the per-stage message sizes exactly."""

import pytest
from support.jobs import processes_with, run_job


TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"


# ------------------------------------------------------------------------------------ codec


# ------------------------------------------------------------------------------ fp16 encoder


# ------------------------------------------------------------------------------ warm-up stages


# ------------------------------------------------------------------------------------ config


# ---------------------------------------------------------------------------- real 2-worker job

@pytest.mark.timeout(200)
def test_job_with_fp16_values_and_density_warmup_pushes_the_planned_bytes(tmp_path):
    """Epoch 0 at density 25%, epoch 1 at 1%, fp16 values: every push goes through the real
    KVStore, and the bytes of the arrays the workers pushed (their size times their dtype's) are
    exactly the per-stage fp16 message sizes."""
    job = run_job(tmp_path, TOPK_CONFIG, "train.epochs=2", "compression.warmup=[0.25]",
                  "compression.fp16_values=true", "compression.buffers=one", name="fp16_warmup",
                  timeout=150)
    assert job.rc == 0, job.output
    assert processes_with(job.marker) == []
    s = job.summary()
    assert s["steps"] == 44 and s["num_workers"] == 2
    client = s["client"]
    (n_total,) = client["buffer_sizes"]
    from jobs.test_compression import _digits_param_sizes
    sizes = _digits_param_sizes()
    assert n_total == sum(sizes)
    k_warm = sum(max(1, int(0.25 * n)) for n in sizes)
    k_final = sum(max(1, int(0.01 * n)) for n in sizes)
    assert client["warmup_density_sent"] == [pytest.approx(k_warm / n_total)]
    assert client["density_sent"] == pytest.approx(k_final / n_total)
    per_step = {k: 2 * (3 + 3 * k) for k in (k_warm, k_final)}     # fp16: 2 bytes a slot
    for part in s["workers"]:
        assert part["push_bytes"] == 22 * per_step[k_warm] + 22 * per_step[k_final]
    assert per_step[k_final] < 0.016 * 4 * n_total                 # 6 bytes per value, not 8
    assert s["final_test_acc"] > 0.25        # learning (chance is 0.1; the fp32 run gets 0.33 in 2 epochs)
