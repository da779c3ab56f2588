"""Tests for the sparsifying gradient compressor on the push path (ssdsgd.compression): codec,
selection, error feedback, SAFusion ('ahead') vs fuse-then-sparsify ('behind'), the buffer plan and
its cost model, the server-side decode+sum, and a real 2-worker top-k job. Every check is against an
independent numpy reference written here."""
import os

import numpy as np
import pytest
from support.jobs import ROOT, processes_with, run_job

from ssdsgd.config import load_config

TOPK_CONFIG = "configs/demo_digits_ssd_topk.yaml"


# ------------------------------------------------------------------------------------------ 1. codec


# ------------------------------------------------------------------------------------------ 2. top-k


# ---------------------------------------------------------------------------- 3. DGC and random-k


# ------------------------------------------------------------------------------ 4. error feedback


# ------------------------------------------------------------------ 5. every tensor sends (ahead)


# ---------------------------------------------------------------------------- 6. min_dense_bytes


# ------------------------------------------------------------------- 7. identical plans on workers


# ------------------------------------------------------------------------------- 8. cost model


# ------------------------------------------------------------------ 9. server decode + sum


# --------------------------------------------------------------------------- 10. real 2-worker job

def _digits_param_sizes():
    from ssdsgd.worker.models import build_net
    cfg = load_config(os.path.join(ROOT, TOPK_CONFIG))
    _, params = build_net(cfg, 10, (1, 8, 8))
    return [int(np.prod(p.shape)) for p in params]


@pytest.mark.timeout(240)
def test_topk_job_pushes_about_density_of_dense_bytes(tmp_path):
    density = 0.01
    sizes = _digits_param_sizes()
    n_total = sum(sizes)
    k_total = sum(max(1, int(density * n)) for n in sizes)
    n_small = sum(1 for n in sizes if int(density * n) < 1)   # sent at the max(1, .) minimum

    results = {}
    for fusion in ("ahead", "behind"):
        job = run_job(tmp_path, TOPK_CONFIG, "train.epochs=1", f"compression.fusion={fusion}",
                      name=f"topk_{fusion}", timeout=110)
        assert job.rc == 0, job.output
        assert processes_with(job.marker) == []
        s = job.summary()
        assert s["compression"] == "topk" and s["num_workers"] == 2 and s["steps"] == 22
        client = s["client"]
        assert sum(client["buffer_sizes"]) == n_total
        assert set(client["cost_model"]) == {"alpha", "beta", "backward"}
        n_buffers = client["buffers"]
        assert n_buffers == len(client["buffer_sizes"]) >= 1
        dense_bytes = 4 * n_total
        push = s["bytes_per_step"]["push"]
        # [round, rank] header per buffer, then k indices + k values per buffer, 4 bytes each
        overhead = 4 * 2 * n_buffers + 8 * n_small
        assert push <= 2 * density * dense_bytes + overhead
        assert push == 4 * (2 * n_buffers + 2 * k_total)
        assert push < 0.03 * dense_bytes
        assert client["density_sent"] == pytest.approx(k_total / n_total)
        assert client["density_sent"] == pytest.approx(density, abs=1e-3)
        for part in s["workers"]:
            assert part["push_bytes"] == push * 22
        results[fusion] = (push, n_buffers)
    # Same payload either way; only the cost-model buffer count (measured per run) can differ.
    (pa, ba), (pb, bb) = results["ahead"], results["behind"]
    assert pa - 8 * ba == pb - 8 * bb
    if ba == bb:
        assert pa == pb


# ------------------------------------------------------------------- 11. DGC momentum correction


# ------------------------------------------------------- 12. allocation by the accumulated gradient


# ------------------------------------------------------------------ 10. quantised link costs

