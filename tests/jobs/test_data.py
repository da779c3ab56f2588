"""Real 2-worker jobs on the data forms users have, generated small: ImageNet-style RecordIO (hybridized
and not), CIFAR-10 as im2rec RecordIO and as the two official .tar.gz archives (ResNet-50 on 224x224 RecordIO:
test_shipped_configs); and bad data refused by the front end before any process starts."""
import os

import numpy as np
import pytest
from support.jobs import processes_with, run_job
from unit.test_data import (
    header,
    idx_bytes,
    make_cifar_arrays,
    write_cifar,
    write_cifar_archive,
    write_cifar_recordio,
    write_raw,
    write_recordio,
    write_recordio_with_bad_image,
)

SSGD = "configs/cifar10_resnet20_ssgd.yaml"
SSD_TOPK = "configs/cifar10_resnet20_ssd_topk.yaml"
FAST = ["cluster.stall_timeout=120", "cluster.timeout=200", "log.every_steps=1"]


def write_imagenet(root, size, num_train, num_val, classes=10, bad_label_at=None):
    """train.rec/.idx and val.rec/.idx of random size x size JPEGs, labels cycling through the classes."""
    os.makedirs(str(root), exist_ok=True)
    rng = np.random.RandomState(0)
    for prefix, n in (("train", num_train), ("val", num_val)):
        labels = [i % classes for i in range(n)]
        if prefix == "train" and bad_label_at is not None:
            labels[bad_label_at] = classes
        images = rng.randint(0, 256, size=(n, size, size, 3)).astype(np.uint8)
        write_recordio(os.path.join(str(root), prefix), images, labels)
    return str(root)


def check_finished(job):
    assert job.rc == 0, job.output[-3000:]
    summary = job.summary()
    assert 0 <= summary["final_test_acc"] <= 1
    assert processes_with(job.marker) == []
    return summary


def train_checkpoint_resume(tmp_path, config, *sets, steps_per_epoch):
    """Job A trains the first of two epochs, evaluates and checkpoints; job B resumes it (--resume),
    trains the second and evaluates. Both must finish, report a test accuracy and leave no process."""
    ck = os.path.join(str(tmp_path), "ck")
    sets = FAST + list(sets) + ["train.epochs=2", "checkpoint.every_epochs=1", f"checkpoint.dir={ck}"]
    a = run_job(tmp_path, config, *sets, f"train.max_steps={steps_per_epoch}", name="A")
    summary = check_finished(a)
    assert summary["steps"] == steps_per_epoch and summary["epochs"] == 1
    b = run_job(tmp_path, config, *sets, name="B", args=["--resume"])
    summary = check_finished(b)
    assert f"resuming from {ck}" in b.output and f"1 epochs, {steps_per_epoch} steps done" in b.output
    assert summary["steps"] == 2 * steps_per_epoch
    return a, b


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hybridize", [True, False], ids=["hybridized", "imperative"])
def test_imagenet_recordio_trains_evaluates_and_resumes(tmp_path, hybridize):
    """The issue's reproduction, smaller: 64 + 20 images of 32x32 in 10 classes; it crashed at the
    first step (batches on cpu_pinned(0)) hybridized, and at the evaluation when not."""
    root = write_imagenet(tmp_path / "data", 32, 64, 20)
    sets = ["data.dataset=imagenet", f"data.root={root}", "data.shape=[3,32,32]", "data.num_classes=10",
            "train.batch_size=8", f"model.hybridize={hybridize}", "data.preprocess_threads=1"]
    if hybridize:                   # checkpoint and resume once; the imperative net trains and evaluates
        train_checkpoint_resume(tmp_path, SSGD, *sets, steps_per_epoch=4)
    else:
        job = run_job(tmp_path, SSGD, *FAST, *sets, "train.epochs=1", f"checkpoint.dir={tmp_path / 'ck'}")
        assert check_finished(job)["steps"] == 4


@pytest.mark.timeout(200)
@pytest.mark.parametrize("form", ["recordio", "bin_archive", "py_archive"])
def test_cifar10_forms_train_evaluate_and_resume(tmp_path, form):
    """100 training and 10 test images (20 per batch file) in each form, auto-detected, with the
    SSD-SGD top-k config."""
    root = tmp_path / "data"
    if form == "recordio":
        write_cifar_recordio(root, make_cifar_arrays())
    else:
        os.makedirs(str(root))
        write_cifar_archive(root, form.split("_")[0], make_cifar_arrays())
    if form == "recordio":          # checkpoint and resume once; the archives train and evaluate one epoch
        job, _ = train_checkpoint_resume(tmp_path, SSD_TOPK, f"data.root={root}", "train.batch_size=8",
                                         steps_per_epoch=6)         # 100 // (2 x 8)
    else:
        job = run_job(tmp_path, SSD_TOPK, *FAST, f"data.root={root}", "train.batch_size=8", "train.epochs=1",
                      f"checkpoint.dir={tmp_path / 'ck'}")
        assert check_finished(job)["steps"] == 6
    # The run says which form data.format auto found, and how many images it read.
    where = root / "cifar-10-python.tar.gz" if form == "py_archive" else root / "cifar-10-binary.tar.gz"
    source = f"recordio form in {root}" if form == "recordio" else f"archive form in {where}"
    assert f"data: cifar10 ({source}): 100 training images, 10 test images" in job.output, job.output[:3000]
    # The archive is read as it is, never unpacked next to it.
    expected = {"recordio": {"train.rec", "train.idx", "test.rec", "test.idx"},
                "bin_archive": {"cifar-10-binary.tar.gz"}, "py_archive": {"cifar-10-python.tar.gz"}}[form]
    assert set(os.listdir(str(root))) == expected


# ---------------------------------------------------------------- bad data: one message, exit 2, no process

def empty(tmp_path):
    os.makedirs(str(tmp_path / "data"))
    return str(tmp_path / "data")


def too_small(tmp_path):      # 100 training images, fewer than one global batch of 2 x 64
    write_cifar(str(tmp_path / "data"), "bin", make_cifar_arrays())
    return str(tmp_path / "data")


def idx_overflow(tmp_path):
    root = str(tmp_path / "data")
    os.makedirs(root)
    for key, array in (("train_labels", np.zeros(60)), ("test_images", np.zeros((10, 28, 28))),
                       ("test_labels", np.zeros(10))):
        write_raw(root, key, idx_bytes(array))
    write_raw(root, "train_images", header(0x08, 3, 2 ** 31, 2 ** 31, 4))
    return root


def no_train_idx(tmp_path):
    root = write_imagenet(tmp_path / "data", 32, 16, 4)
    os.remove(os.path.join(root, "train.idx"))
    return root


BAD_DATA = [
    # (dataset, data folder maker, extra sets, the start of the one error line)
    ("mnist", empty, [], "error: mnist: '{root}' lacks train-images-idx3-ubyte[.gz]"),
    ("fashion_mnist", empty, [], "error: fashion_mnist: '{root}' lacks train-images-idx3-ubyte[.gz]"),
    ("cifar10", empty, [], "error: cifar10: no complete CIFAR-10 copy found in '{root}'"),
    ("imagenet", empty, [], "error: imagenet: missing {root}/train.rec"),
    ("imagenet", no_train_idx, [], "error: imagenet: missing {root}/train.idx. Nothing is downloaded"),
    ("cifar10", too_small, ["train.batch_size=64"], "error: the training set has 100 samples, fewer than one "
                                                    "global batch (num_workers 2 x batch_size 64)"),
    ("mnist", idx_overflow, [], "error: {root}/train-images-idx3-ubyte.gz: 16 bytes, but its header "
                                "(2147483648, 2147483648, 4) needs"),
    ("imagenet", lambda tmp_path: write_imagenet(tmp_path / "data", 32, 16, 4, bad_label_at=5),
     ["data.num_classes=10", "data.shape=[3,32,32]"],
     "error: {root}/train.rec: record 5 (byte "),
]


IDS = ["mnist-empty", "fashion_mnist-empty", "cifar10-empty", "imagenet-empty", "imagenet-no-train-idx",
       "batch-larger-than-data", "idx-header-overflow", "recordio-label-beyond-classes"]
DIGITS = "configs/demo_digits_ssgd.yaml"


def check_one_message(output, dataset, make, first_line, root):
    assert output.startswith(first_line.format(root=root)), output[-3000:]
    assert output.count("\n") == 1, output
    assert "Traceback" not in output and "[worker" not in output


@pytest.mark.parametrize("dataset,make,sets,first_line", BAD_DATA, ids=IDS)
def test_bad_data_is_refused_by_the_front_end(tmp_path, capsys, dataset, make, sets, first_line):
    """ssdsgd.launch.run's main in this process (a job would spend seconds importing MXNet): exit 2 and one
    message before it takes the run folder or starts a process."""
    from ssdsgd.launch.run import main
    root = make(tmp_path)
    argv = ["--config", DIGITS, "--set", f"log.dir={tmp_path}/runs", "--set", f"data.dataset={dataset}",
            "--set", f"data.root={root}", "--set", "model.name=mlp"]
    assert main(argv + [arg for s in sets for arg in ("--set", s)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    check_one_message(err, dataset, make, first_line, root)
    assert not os.path.exists(str(tmp_path / "runs"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dataset,make,sets,first_line", [BAD_DATA[0], BAD_DATA[-1]], ids=[IDS[0], IDS[-1]])
def test_bad_data_job_exits_2_with_one_message_and_no_process(tmp_path, dataset, make, sets, first_line):
    """As a job: an empty data.root used to end in three tracebacks around the message (two workers
    and the launcher's copy), a RecordIO label beyond the classes in none (the loss clipped it)."""
    root = make(tmp_path)
    job = run_job(tmp_path, DIGITS, f"data.dataset={dataset}", f"data.root={root}", "model.name=mlp", *sets,
                  name="bad")
    assert job.rc == 2, job.output[-3000:]
    check_one_message(job.output, dataset, make, first_line, root)
    assert not os.path.exists(os.path.join(job.run_dir, "summary.json"))
    assert processes_with(job.marker) == []


# digits and synthetic are counted by the front end, not read: a batch larger than the data set used to
# print its message three times (each worker's line and the launcher's copy) and leave an empty run folder.
TOO_LARGE_BATCH = [
    ("digits", ["train.batch_size=800"],
     "error: the training set has 1437 samples, fewer than one global batch (num_workers 2 x batch_size 800)"),
    ("synthetic", ["data.synthetic_samples=64", "train.batch_size=40"],
     "error: the training set has 64 samples, fewer than one global batch (num_workers 2 x batch_size 40)"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dataset,sets,line", TOO_LARGE_BATCH, ids=["digits", "synthetic"])
def test_a_batch_larger_than_digits_or_synthetic_is_one_message_and_no_process(tmp_path, dataset, sets, line):
    job = run_job(tmp_path, DIGITS, f"data.dataset={dataset}", "model.name=mlp", *sets, name="bad")
    assert job.rc == 2, job.output[-3000:]
    check_one_message(job.output, dataset, None, line, None)
    assert not os.path.exists(str(tmp_path / "runs")), job.output           # no run folder made
    assert processes_with(job.marker) == []


@pytest.mark.timeout(120)
def test_an_image_that_does_not_decode_ends_the_job_with_one_line_naming_the_file(tmp_path):
    """The shipped ImageNet config on a set whose training record 5 is not an image: the check before the
    start reads records' heads, not their images, so a worker meets it; it used to print MXNet's ~20-line
    traceback ending in OpenCV's assertion. Now: that worker's one line naming the file, exit 1, no process."""
    root = write_imagenet(tmp_path / "data", 32, 16, 4, classes=4)
    write_recordio_with_bad_image(os.path.join(root, "train"), 16, 5, b"\xff\xd8\xff garbage")
    job = run_job(tmp_path, "configs/imagenet_resnet50_ssd_topk.yaml", *FAST, f"data.root={root}",
                  "cluster.launcher=local", "cluster.hostfile=null", "cluster.interface=null", "cluster.workers=2",
                  "cluster.servers=1", "model.name=cifar_resnet20_v1", "data.num_classes=4", "data.shape=[3,32,32]",
                  "train.batch_size=4", "train.epochs=1", "data.preprocess_threads=1",
                  f"checkpoint.dir={tmp_path / 'ck'}", name="corrupt")
    assert job.rc == 1, job.output[-3000:]
    assert "Traceback" not in job.output and "MXNetError" not in job.output, job.output[-3000:]
    said = [line for line in job.output.splitlines() if ": error: " in line and line.startswith("[worker")]
    assert said, job.output[-3000:]
    for line in said:           # each worker that met it (both may)
        assert f"error: {root}/train.rec: cannot decode an image (rank " in line, line
        assert "a record holds no valid JPEG or PNG" in line, line
    assert not os.path.exists(os.path.join(job.run_dir, "summary.json"))
    assert processes_with(job.marker) == []
