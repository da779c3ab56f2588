"""Watching a run: rank 0's progress lines carry the percentage, the elapsed time and an ETA, and its
scalars are in TensorBoard event files that read back to the metrics.jsonl values."""
import csv
import glob
import os
import re
import struct

import pytest
from support.jobs import run_job


def read_scalars(folder):
    """{tag: [(step, value)]} from the TensorBoard event files in folder (TFRecord framing: length,
    its CRC, the serialized Event, its CRC), parsed with tensorboardX's own Event message."""
    from tensorboardX.proto.event_pb2 import Event
    scalars = {}
    for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


@pytest.mark.timeout(120)
def test_progress_eta_and_tensorboard_scalars(tmp_path):
    job = run_job(tmp_path, "configs/demo_digits_ssgd.yaml", "train.epochs=2", "log.every_steps=11")
    assert job.rc == 0, job.output[-3000:]
    lines = re.findall(r"step (\d+)/44 .* (\d+)% (\d+:\d\d:\d\d) elapsed, ETA (\d+:\d\d:\d\d)( \+ evaluations)?",
                       job.output)
    assert [(int(s), int(p)) for s, p, _, _, _ in lines] == [(11, 25), (22, 50), (33, 75), (44, 100)]
    # Before the first epoch's end its evaluation time is unknown, and the ETA says so; then it is in.
    assert [later for *_, later in lines] == [" + evaluations", " + evaluations", "", ""]
    scalars = read_scalars(os.path.join(job.run_dir, "tensorboard"))
    records = job.metrics()
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    accs = [(r["step"], r["test_acc"]) for r in records if "test_acc" in r]
    assert [s for s, _ in scalars["train/loss"]] == [s for s, _ in losses] == [11, 22, 33, 44]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)
    assert [s for s, _ in scalars["eval/test_acc"]] == [s for s, _ in accs] == [22, 44]
    assert [v for _, v in scalars["eval/test_acc"]] == pytest.approx([v for _, v in accs], rel=1e-6)
    assert {"speed/images_per_sec", "traffic/push_bytes_per_step", "train/lr"} <= set(scalars)
    with open(os.path.join(job.run_dir, "metrics.csv")) as f:          # the same lines as CSV
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]] == losses
    assert [(int(r["step"]), float(r["test_acc"])) for r in rows if r["test_acc"]] == accs
