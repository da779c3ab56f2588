"""The static-graph twin that evaluates an imperative model (models.inference_graph, models.build_eval_net):
its outputs against a numpy forward of the network's current weights and statistics, however those
change, and a real job whose reported accuracy is recomputed here from its saved weights."""
import os

import pytest
from support.jobs import processes_with, run_job



@pytest.mark.timeout(240)
def test_imperative_job_reports_the_accuracy_of_its_saved_weights(tmp_path):
    """A real SSD-SGD job with model.hybridize: false evaluates through the graph. Its final accuracy
    (rank 0: the global weights with rank 0's statistics, which final.params holds) must be that of
    final.params run through the imperative network here, on the same test set."""
    from ssdsgd.config import load_config
    from ssdsgd.worker.data import build_data
    from ssdsgd.worker.evaluate import count_correct
    from ssdsgd.worker.models import build_net
    job = run_job(tmp_path, "configs/demo_digits_ssd.yaml", "train.epochs=2", "model.hybridize=false",
                  name="imperative")
    assert job.rc == 0, job.output
    assert processes_with(job.marker) == []
    cfg = load_config(os.path.join(job.run_dir, "config.yaml"))
    data = build_data("digits", batch_size=cfg.train.batch_size, rank=0, num_workers=2, seed=cfg.seed)
    net, _ = build_net(cfg, data.num_classes, data.image_shape)
    assert not cfg.model.hybridize and not net._active
    net.load_parameters(job.summary()["checkpoint"])
    correct, images = count_correct(net, data.test, cfg.train.batch_size)
    assert images == 360
    assert job.summary()["final_test_acc"] == correct / images
