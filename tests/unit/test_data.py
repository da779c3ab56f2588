"""Tests for ssdsgd.worker.data on small generated datasets (nothing is downloaded)."""
import gzip
import io
import os
import pickle
import re
import shutil
import struct

import mxnet as mx
import numpy as np
import pytest
from support.jobs import ROOT

from ssdsgd.worker import data, idx

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465]).reshape(1, 3, 1, 1)
CIFAR_STD = np.array([0.2023, 0.1994, 0.2010]).reshape(1, 3, 1, 1)
IMAGENET_MEAN = np.array([123.68, 116.779, 103.939])
IMAGENET_STD = np.array([58.393, 57.12, 57.375])
SHARD = dict(rank=0, num_workers=1, seed=0)


def collect(batches):
    """Concatenate an iterator of (data, label) NDArrays into numpy arrays."""
    pairs = [(d.asnumpy(), y.asnumpy()) for d, y in batches]
    return np.concatenate([d for d, _ in pairs]), np.concatenate([y for _, y in pairs])


# ---------------------------------------------------------------- cifar10

def make_cifar_arrays():
    """5 train batches of 20 records and a test batch of 10, all images distinct."""
    rng = np.random.RandomState(123)
    batches = []
    for n in [20] * 5 + [10]:
        images = rng.randint(0, 256, size=(n, 3, 32, 32)).astype(np.uint8)
        labels = rng.randint(0, 10, size=n).astype(np.uint8)
        batches.append((images, labels))
    return batches


def write_cifar(folder, fmt, batches):
    """Write `batches` in the official binary ("bin") or python ("py") format."""
    os.makedirs(folder, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name, (images, labels) in zip(names, batches):
        if fmt == "bin":
            records = np.concatenate([labels[:, None], images.reshape(len(images), -1)], axis=1)
            records.astype(np.uint8).tofile(os.path.join(folder, name + ".bin"))
        else:
            with open(os.path.join(folder, name), "wb") as f:
                pickle.dump({b"data": images.reshape(len(images), -1),
                             b"labels": [int(v) for v in labels]}, f, protocol=2)


@pytest.fixture(scope="module")
def cifar_arrays():
    return make_cifar_arrays()


def denormalize_cifar(x):
    return np.round((x * CIFAR_STD + CIFAR_MEAN) * 255).astype(np.int64)


def match_rows(found, written):
    """Index into `written` of each image in `found` (exact match required)."""
    flat = written.reshape(len(written), -1).astype(np.int64)
    index = []
    for image in found.reshape(len(found), -1):
        hits = np.flatnonzero((flat == image).all(axis=1))
        assert len(hits) == 1
        index.append(hits[0])
    return np.array(index)


@pytest.mark.parametrize("fmt,subfolder", [("bin", ""), ("py", ""),
                                           ("bin", "cifar-10-batches-bin"),
                                           ("py", "cifar-10-batches-py")])
def test_cifar_loads_exact_pixels_labels_and_normalization(tmp_path, cifar_arrays, fmt,
                                                           subfolder):
    write_cifar(str(tmp_path / subfolder), fmt, cifar_arrays)
    raw_test_images, raw_test_labels = cifar_arrays[5]
    if fmt == "bin":
        # Decode the file again with plain numpy, independently of the writer's arrays.
        raw = np.fromfile(str(tmp_path / subfolder / "test_batch.bin"), np.uint8).reshape(-1, 3073)
        raw_test_images, raw_test_labels = raw[:, 1:].reshape(-1, 3, 32, 32), raw[:, 0]

    bundle = data.build_data("cifar10", batch_size=10, root=str(tmp_path), augment=False, **SHARD)
    assert (bundle.num_classes, bundle.image_shape) == (10, (3, 32, 32))
    assert (bundle.train.num_samples, bundle.test.num_samples) == (100, 10)

    test_x, test_y = collect(bundle.test.batches(4))
    assert test_x.shape == (10, 3, 32, 32) and test_x.dtype == np.float32
    expected = (raw_test_images / 255.0 - CIFAR_MEAN) / CIFAR_STD
    np.testing.assert_allclose(test_x, expected, atol=1e-5)
    np.testing.assert_array_equal(test_y, raw_test_labels)

    # One worker with 10 x 10 batches sees every training image once, in some order.
    assert bundle.train.steps_per_epoch == 10
    train_x, train_y = collect(bundle.train.epoch(0))
    written_x = np.concatenate([images for images, _ in cifar_arrays[:5]])
    written_y = np.concatenate([labels for _, labels in cifar_arrays[:5]])
    index = match_rows(denormalize_cifar(train_x), written_x)
    assert sorted(index) == list(range(100))
    np.testing.assert_array_equal(train_y, written_y[index])
    np.testing.assert_allclose(train_x, (written_x[index] / 255.0 - CIFAR_MEAN) / CIFAR_STD,
                               atol=1e-5)


def test_cifar_shards_disjoint_deterministic_and_per_epoch(tmp_path, cifar_arrays):
    write_cifar(str(tmp_path), "bin", cifar_arrays)
    written_x = np.concatenate([images for images, _ in cifar_arrays[:5]])

    def shard_indices(rank, epoch, seed=7):
        bundle = data.build_data("cifar10", batch_size=10, rank=rank, num_workers=2, seed=seed,
                                 root=str(tmp_path), augment=False)
        assert bundle.train.steps_per_epoch == 5  # 100 // (2 * 10)
        batches = list(bundle.train.epoch(epoch))
        assert len(batches) == 5
        assert all(d.shape == (10, 3, 32, 32) and y.shape == (10,) for d, y in batches)
        return match_rows(denormalize_cifar(collect(batches)[0]), written_x)

    rank0, rank1 = shard_indices(0, 0), shard_indices(1, 0)
    assert len(rank0) == len(rank1) == 50
    assert set(rank0).isdisjoint(rank1)
    assert sorted(np.concatenate([rank0, rank1])) == list(range(100))
    # The documented scheme: one permutation per epoch from RandomState(seed + epoch).
    perm = np.random.RandomState(7 + 0).permutation(100)
    np.testing.assert_array_equal(rank0, perm[0::2])
    np.testing.assert_array_equal(rank1, perm[1::2])

    np.testing.assert_array_equal(shard_indices(0, 0), rank0)  # a second build: same order
    assert not np.array_equal(shard_indices(0, 1), rank0)
    assert not np.array_equal(shard_indices(0, 0, seed=8), rank0)


def test_cifar_augmentation_is_padded_crop_and_flip(tmp_path, cifar_arrays):
    write_cifar(str(tmp_path), "py", cifar_arrays)

    def first_epoch(augment):
        bundle = data.build_data("cifar10", batch_size=10, rank=1, num_workers=2, seed=3,
                                 root=str(tmp_path), augment=augment)
        return collect(bundle.train.epoch(2))[0]

    plain, augmented = first_epoch(False), first_epoch(True)
    np.testing.assert_array_equal(first_epoch(True), augmented)  # deterministic
    plain_pixels = denormalize_cifar(plain)
    # Zero padding happens before normalization, so padded pixels decode to 0.
    padded = np.pad(plain_pixels, ((0, 0), (0, 0), (4, 4), (4, 4)))
    transforms = []
    for i, image in enumerate(denormalize_cifar(augmented)):
        found = [(dy, dx, flip) for dy in range(9) for dx in range(9) for flip in (False, True)
                 if np.array_equal(image, padded[i, :, dy:dy + 32, dx:dx + 32][:, :, ::-1]
                                   if flip else padded[i, :, dy:dy + 32, dx:dx + 32])]
        assert len(found) == 1
        transforms.append(found[0])
    assert len(set(transforms)) > 10  # crops and flips actually vary
    assert any(flip for _, _, flip in transforms) and not all(flip for _, _, flip in transforms)


def test_cifar_truncated_binary_names_file(tmp_path, cifar_arrays):
    write_cifar(str(tmp_path), "bin", cifar_arrays)
    path = tmp_path / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(data.DataError, match="data_batch_3.bin"):
        data.build_data("cifar10", batch_size=10, root=str(tmp_path), **SHARD)


def test_cifar_corrupt_pickle_names_file(tmp_path, cifar_arrays):
    write_cifar(str(tmp_path), "py", cifar_arrays)
    path = tmp_path / "data_batch_2"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(data.DataError, match="data_batch_2"):
        data.build_data("cifar10", batch_size=10, root=str(tmp_path), **SHARD)


def test_cifar_label_out_of_range_names_file(tmp_path, cifar_arrays):
    batches = [(images, labels.copy()) for images, labels in cifar_arrays]
    batches[5][1][0] = 10
    write_cifar(str(tmp_path), "bin", batches)
    with pytest.raises(data.DataError, match=r"test_batch\.bin.*0\.\.9"):
        data.build_data("cifar10", batch_size=10, root=str(tmp_path), **SHARD)


def test_cifar_missing_folder_or_files(tmp_path):
    missing = str(tmp_path / "no_such_folder")
    with pytest.raises(data.DataError, match="no_such_folder") as err:
        data.build_data("cifar10", batch_size=10, root=missing, **SHARD)
    message = str(err.value)
    for name in ["data_batch_1.bin", "data_batch_5.bin", "test_batch.bin", "data_batch_5",
                 "cifar-10-batches-bin", "cifar-10-batches-py", "Nothing is downloaded"]:
        assert name in message
    with pytest.raises(data.DataError, match="no complete CIFAR-10"):
        data.build_data("cifar10", batch_size=10, root=str(tmp_path), **SHARD)
    with pytest.raises(data.DataError, match="data.root is not set"):
        data.build_data("cifar10", batch_size=10, **SHARD)


def test_cifar_incomplete_copy_names_the_missing_file(tmp_path, cifar_arrays):
    write_cifar(str(tmp_path), "python", cifar_arrays)
    os.remove(str(tmp_path / "data_batch_3"))
    with pytest.raises(data.DataError) as err:
        data.build_data("cifar10", batch_size=10, root=str(tmp_path), **SHARD)
    assert f"(the python copy there lacks {tmp_path / 'data_batch_3'})" in str(err.value)


# ---------------------------------------------------------------- imagenet (RecordIO)

VAL_COLOURS = [(30 * i, 255 - 25 * i, 100 + 10 * i) for i in range(8)]  # RGB


def write_recordio(prefix, images, labels):
    record = mx.recordio.MXIndexedRecordIO(prefix + ".idx", prefix + ".rec", "w")
    for i, (image, label) in enumerate(zip(images, labels)):
        header = mx.recordio.IRHeader(0, float(label), i, 0)
        # pack_img encodes with OpenCV, which expects BGR channel order.
        record.write_idx(i, mx.recordio.pack_img(header, image[:, :, ::-1], quality=95,
                                                 img_fmt=".jpg"))
    record.close()


@pytest.fixture(scope="module")
def imagenet_root(tmp_path_factory):
    """24 random train images labelled 0..23 and 8 constant-colour val images, 40x48."""
    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.RandomState(0)
    train = rng.randint(0, 256, size=(24, 40, 48, 3)).astype(np.uint8)
    write_recordio(str(root / "train"), train, range(24))
    val = np.array([np.full((40, 48, 3), colour, np.uint8) for colour in VAL_COLOURS])
    write_recordio(str(root / "val"), val, [3 * i for i in range(8)])
    return root


def build_imagenet(root, rank=0, seed=0):
    return data.build_data("imagenet", batch_size=4, rank=rank, num_workers=2, seed=seed,
                           root=str(root), shape=(3, 32, 32), num_classes=24)


def test_imagenet_train_shards(imagenet_root):
    labels = {}
    for rank in (0, 1):
        bundle = build_imagenet(imagenet_root, rank=rank)
        assert (bundle.num_classes, bundle.image_shape) == (24, (3, 32, 32))
        assert bundle.train.num_samples == 24 and bundle.test.num_samples == 8
        assert bundle.train.steps_per_epoch == 3  # 24 // (2 * 4)
        batches = list(bundle.train.epoch(0))
        assert len(batches) == 3
        for d, y in batches:
            assert d.shape == (4, 3, 32, 32) and y.shape == (4,)
            assert d.dtype == np.float32 and y.dtype == np.float32
            # cpu(0), not the iterator's cpu_pinned(0): a hybridized network refuses the latter.
            assert d.context == y.context == mx.cpu()
        x, labels[rank] = collect(batches)
        assert np.isfinite(x).all() and np.abs(x).max() < 3  # normalized 0..255 pixels
    # Every label is one that was written, and each worker sees its own 12 records.
    all_labels = np.concatenate([labels[0], labels[1]])
    assert sorted(all_labels.astype(int)) == list(range(24))


def test_imagenet_train_is_deterministic_per_seed_and_epoch(imagenet_root):
    first = collect(build_imagenet(imagenet_root, seed=5).train.epoch(1))
    again = collect(build_imagenet(imagenet_root, seed=5).train.epoch(1))
    other_epoch = collect(build_imagenet(imagenet_root, seed=5).train.epoch(2))
    other_seed = collect(build_imagenet(imagenet_root, seed=9).train.epoch(1))
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other_epoch[0])
    assert not np.array_equal(first[1], other_seed[1])      # the order of the records follows the seed


def test_imagenet_epoch_yields_steps_even_if_part_runs_out(imagenet_root):
    bundle = build_imagenet(imagenet_root)
    bundle.train.steps_per_epoch = 7  # more than the 3 batches the part holds
    batches = list(bundle.train.epoch(0))
    assert len(batches) == 7
    assert all(d.shape == (4, 3, 32, 32) for d, _ in batches)


def test_imagenet_val_shares_cover_each_record_once(imagenet_root):
    """train.eval_workers: all: worker r of 2 evaluates batches r, r + 2, ... of the 8 records."""
    test = build_imagenet(imagenet_root).test
    shares = [list(test.batches(3, part, 2)) for part in (0, 1)]
    assert [[d.shape[0] for d, _ in sh] for sh in shares] == [[3, 2], [3]]
    x0, y0 = collect(shares[0])
    x1, y1 = collect(shares[1])
    x, y = collect(list(test.batches(3)))
    np.testing.assert_array_equal(np.concatenate([y0[:3], y1, y0[3:]]), y)
    np.testing.assert_array_equal(np.concatenate([x0[:3], x1, x0[3:]]), x)


def test_in_memory_test_shares_cover_each_image_once():
    """Part p of 3 holds batches p, p + 3, ... of the 360 digits test images in batches of 50 (8
    batches, the last of 10): taken in turn, the parts give back the whole set in order."""
    test = data.build_data("digits", batch_size=32, rank=0, num_workers=2, seed=0).test
    shares = [list(test.batches(50, part, 3)) for part in range(3)]
    assert [len(sh) for sh in shares] == [3, 3, 2]
    in_turn = [sh[i] for i in range(3) for sh in shares if i < len(sh)]
    x, y = collect(in_turn)
    want_x, want_y = collect(list(test.batches(50)))
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)


def test_imagenet_val_center_crop_and_normalization(imagenet_root):
    bundle = build_imagenet(imagenet_root)
    batches = list(bundle.test.batches(3))
    assert [d.shape[0] for d, _ in batches] == [3, 3, 2]
    assert all(d.context == y.context == mx.cpu() for d, y in batches)
    x, y = collect(batches)
    np.testing.assert_array_equal(y, [3 * i for i in range(8)])
    expected = (np.array(VAL_COLOURS) - IMAGENET_MEAN) / IMAGENET_STD  # (8, 3)
    np.testing.assert_allclose(x.mean(axis=(2, 3)), expected, atol=2 / 58)
    np.testing.assert_allclose(x.std(axis=(2, 3)), 0, atol=2 / 58)  # constant after crop


@pytest.mark.parametrize("cut", ["few_bytes", "half"])
def test_imagenet_truncated_rec_names_file(imagenet_root, tmp_path, cut):
    for name in ["train.rec", "train.idx", "val.rec", "val.idx"]:
        shutil.copy(str(imagenet_root / name), str(tmp_path / name))
    path = tmp_path / "val.rec"
    content = path.read_bytes()
    path.write_bytes(content[:-100] if cut == "few_bytes" else content[:len(content) // 2])
    with pytest.raises(data.DataError, match=r"val\.rec is truncated"):
        build_imagenet(tmp_path)


def test_imagenet_missing_files_explain_im2rec(imagenet_root, tmp_path):
    shutil.copy(str(imagenet_root / "train.rec"), str(tmp_path / "train.rec"))
    with pytest.raises(data.DataError) as err:
        build_imagenet(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "train.idx") in message and str(tmp_path / "val.rec") in message
    missing_list = message.split("Nothing is downloaded")[0]
    assert str(tmp_path / "train.rec") not in missing_list  # only the missing files are listed
    assert "python -m mxnet.tools.im2rec" in message and "Nothing is downloaded" in message
    assert "\n" not in message                              # one line, like every bad-data message


def write_recordio_with_bad_image(prefix, n, bad_at, payload):
    """n random 32x32 JPEG records (labels 0..3), record bad_at holding `payload` instead of an image."""
    rng = np.random.RandomState(0)
    record = mx.recordio.MXIndexedRecordIO(prefix + ".idx", prefix + ".rec", "w")
    for i in range(n):
        header = mx.recordio.IRHeader(0, float(i % 4), i, 0)
        image = rng.randint(0, 256, size=(32, 32, 3)).astype(np.uint8)
        record.write_idx(i, mx.recordio.pack(header, payload) if i == bad_at
                         else mx.recordio.pack_img(header, image, quality=95, img_fmt=".jpg"))
    record.close()


@pytest.mark.parametrize("bad", ["train", "val"])
def test_imagenet_image_that_does_not_decode_names_the_file(imagenet_root, tmp_path, bad):
    """The check before the start reads records' heads, not their images: a worker meeting one that does not
    decode says so in one DataError line naming the file (not MXNet's traceback). The validation record is
    empty: one with bytes that decode to nothing kills the process in validation's resize (SIGFPE in
    MXNet), which no Python code can turn into a message."""
    for name in ("train", "val"):
        for ext in (".rec", ".idx"):
            shutil.copy(str(imagenet_root / (name + ext)), str(tmp_path / (name + ext)))
    write_recordio_with_bad_image(str(tmp_path / bad), 24 if bad == "train" else 8, 5,
                                  b"\xff\xd8\xff garbage" if bad == "train" else b"")
    bundle = build_imagenet(tmp_path)
    with pytest.raises(data.DataError) as err:
        if bad == "train":
            list(bundle.train.epoch(0))
        else:
            list(bundle.test.batches(4))
    message = str(err.value)
    assert message.startswith(f"{tmp_path / bad}.rec: cannot decode an image ("), message
    assert "a record holds no valid JPEG or PNG (OpenCV: (-215:Assertion failed)" in message
    assert ("rank 0's part, epoch 0" if bad == "train" else "evaluation") in message
    assert "\n" not in message and "/opencv-3" not in message


# ---------------------------------------------------------------- digits

def test_digits_split_shapes_and_range():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bundle = data.build_data("digits", batch_size=32, **SHARD)
    assert (bundle.num_classes, bundle.image_shape) == (10, (1, 8, 8))
    assert (bundle.train.num_samples, bundle.test.num_samples) == (1437, 360)
    assert bundle.train.steps_per_epoch == 1437 // 32
    train_x, train_y = collect(bundle.train.epoch(0))
    assert train_x.shape == (44 * 32, 1, 8, 8)
    assert train_x.min() == 0 and train_x.max() == 1
    test_x, test_y = collect(bundle.test.batches(100))
    digits = load_digits()
    _, x_test, _, y_test = train_test_split(digits.data, digits.target, test_size=0.2,
                                            random_state=0, stratify=digits.target)
    np.testing.assert_array_equal(test_y, y_test)
    np.testing.assert_allclose(test_x.reshape(360, 64), x_test / 16, atol=1e-7)


def test_digits_are_read_and_split_as_scikit_learn_does_without_importing_it():
    from sklearn.datasets import load_digits

    from scripts.digits_split import sklearn_split
    from ssdsgd.worker import small_sets
    digits = load_digits()
    pixels, labels = small_sets._read_digits()
    np.testing.assert_array_equal(pixels, digits.data)
    np.testing.assert_array_equal(labels, digits.target)
    for shipped, sklearn_rows in zip(small_sets._digits_split(), sklearn_split()):   # rewrite: scripts/digits_split.py
        np.testing.assert_array_equal(shipped, sklearn_rows)


def test_digits_upscaled_equals_kron_of_original():
    small = data.build_data("digits", batch_size=50, **SHARD)
    big = data.build_data("digits", batch_size=50, shape=(3, 32, 32), **SHARD)
    assert big.image_shape == (3, 32, 32)
    for (x8, y8), (x32, y32) in zip(small.train.epoch(3), big.train.epoch(3)):
        expected = np.kron(x8.asnumpy(), np.ones((1, 1, 4, 4)))
        np.testing.assert_array_equal(x32.asnumpy(), np.repeat(expected, 3, axis=1))
        np.testing.assert_array_equal(y32.asnumpy(), y8.asnumpy())


@pytest.mark.parametrize("shape", [(1, 10, 10), (2, 16, 16), (1, 16, 8)])
def test_digits_bad_shape(shape):
    with pytest.raises(data.DataError, match="data.shape"):
        data.build_data("digits", batch_size=8, shape=shape, **SHARD)


# ---------------------------------------------------------------- synthetic and errors

def test_synthetic_shapes_and_determinism():
    def build(seed, rank):
        return data.build_data("synthetic", batch_size=8, rank=rank, num_workers=2, seed=seed,
                               shape=(3, 16, 16), num_classes=5, synthetic_samples=64)

    bundle = build(1, 0)
    assert (bundle.num_classes, bundle.image_shape) == (5, (3, 16, 16))
    assert (bundle.train.num_samples, bundle.test.num_samples) == (64, 16)
    assert bundle.train.steps_per_epoch == 4
    x, y = collect(bundle.train.epoch(0))
    assert x.shape == (32, 3, 16, 16) and y.shape == (32,)
    assert set(np.unique(y)) <= set(range(5))
    again = collect(build(1, 0).train.epoch(0))
    np.testing.assert_array_equal(x, again[0])
    np.testing.assert_array_equal(y, again[1])
    other_rank = collect(build(1, 1).train.epoch(0))[0]
    assert not np.isin(x[:, 0, 0, 0], other_rank[:, 0, 0, 0]).any()  # disjoint shards
    assert not np.array_equal(x, collect(build(2, 0).train.epoch(0))[0])
    test_x, _ = collect(bundle.test.batches(5))
    assert test_x.shape == (16, 3, 16, 16)
    np.testing.assert_array_equal(test_x, collect(build(1, 1).test.batches(16))[0])


def test_synthetic_test_set_at_least_one_batch():
    bundle = data.build_data("synthetic", batch_size=32, synthetic_samples=64, **SHARD)
    assert bundle.test.num_samples == 32


def test_zero_steps_per_epoch():
    with pytest.raises(data.DataError, match="fewer than one global batch"):
        data.build_data("digits", batch_size=800, rank=0, num_workers=2, seed=0)


def test_digits_images_per_class_are_the_splits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from ssdsgd.worker.small_sets import DIGITS_TRAIN_PER_CLASS
    digits = load_digits()
    _, _, y_train, _ = train_test_split(digits.data, digits.target, test_size=0.2, random_state=0,
                                        stratify=digits.target)
    assert tuple(np.bincount(y_train)) == DIGITS_TRAIN_PER_CLASS


DIGITS_SPLITS = [{}, {"train_per_class": 20}, {"train_per_class": 20, "validation": 0.5},
                 {"train_per_class": 30, "validation": 100, "validation_from": "rest"}, {"validation": 37}]


@pytest.mark.parametrize("split", DIGITS_SPLITS)
def test_digits_counted_without_reading_as_read(split):
    """The front end counts digits (small_sets.count_digits) as build_data then reads them."""
    from ssdsgd.worker.small_sets import count_digits
    bundle = data.build_data("digits", batch_size=8, **SHARD, **split)
    full = dict({"train_per_class": None, "validation": 0, "validation_from": "subset"}, **split)
    assert count_digits(None, None, full) == bundle.train.num_samples


@pytest.mark.parametrize("dataset,sets,message", [
    ("digits", ["data.shape=[2,8,8]"], "digits supports data.shape"),
    ("digits", ["data.shape=[3,16,8]"], "digits supports data.shape"),
    ("digits", ["data.num_classes=5"], "digits has 10 classes"),
    ("digits", ["data.train_per_class=20", "data.validation=0.5", "train.batch_size=60"],
     "the training set has 100 samples, fewer than one global batch (num_workers 2 x batch_size 60)"),
    ("digits", ["data.validation=1437"], "gives 1437 of 1437 training images; it must leave at least one on each side"),
    ("synthetic", ["data.synthetic_samples=64", "train.batch_size=40"], "the training set has 64 samples"),
])
def test_check_data_refuses_what_the_workers_would(dataset, sets, message):
    """check_data (the front end's) raises for digits and synthetic what build_data raises in each worker."""
    from ssdsgd.config import load_config
    cfg = load_config(os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml"),
                      [f"data.dataset={dataset}", "model.name=mlp"] + sets)
    with pytest.raises(data.DataError, match=re.escape(message)):
        data.check_data(cfg)
    with pytest.raises(data.DataError, match=re.escape(message)):
        data.data_from_config(cfg, 0, cfg.cluster.workers)


def test_unknown_dataset_lists_valid_names():
    # (mnist was the unknown name here before it became a dataset.)
    with pytest.raises(data.DataError, match="digits, cifar10, mnist, fashion_mnist, imagenet, synthetic"):
        data.build_data("svhn", batch_size=8, **SHARD)


# ---------------------------------------------------------------- mnist, fashion_mnist (IDX files)

IDX_NAMES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
# The published per-dataset pixel statistics (0..1 scale).
IDX_STATS = {"mnist": (0.1307, 0.3081), "fashion_mnist": (0.2860, 0.3530)}
# 60 training images: class 0 has 10, class 9 only 2, the others 6 each (an uneven split, so that
# train_per_class=3 keeps 3 of most classes but both images of class 9).
IDX_TRAIN_COUNTS = [10, 6, 6, 6, 6, 6, 6, 6, 6, 2]


def idx_bytes(array, type_byte=0x08):
    """The IDX encoding of a uint8 array: 0, 0, type, ndim, big-endian uint32 dims, data."""
    array = np.asarray(array, np.uint8)
    header = bytes([0, 0, type_byte, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_raw(folder, key, raw, gz=True):
    """Write one of the four files (raw IDX bytes), gzip-compressed or plain; return its path."""
    path = os.path.join(str(folder), IDX_NAMES[key] + (".gz" if gz else ""))
    with open(path, "wb") as f:
        f.write(gzip.compress(raw) if gz else raw)
    return path


def write_idx_set(folder, arrays, gz=True):
    os.makedirs(str(folder), exist_ok=True)
    return {key: write_raw(folder, key, idx_bytes(arrays[key]), gz) for key in IDX_NAMES}


@pytest.fixture(scope="module")
def idx_arrays():
    rng = np.random.RandomState(2024)
    train_labels = rng.permutation(np.repeat(np.arange(10), IDX_TRAIN_COUNTS)).astype(np.uint8)
    return {"train_images": rng.randint(0, 256, size=(60, 28, 28)).astype(np.uint8),
            "train_labels": train_labels,
            "test_images": rng.randint(0, 256, size=(20, 28, 28)).astype(np.uint8),
            "test_labels": rng.randint(0, 10, size=20).astype(np.uint8)}


@pytest.fixture
def idx_root(tmp_path, idx_arrays):
    write_idx_set(tmp_path, idx_arrays)
    return tmp_path


def denormalize_idx(x, dataset):
    mean, std = IDX_STATS[dataset]
    return np.round((x.astype(np.float64) * std + mean) * 255).astype(np.int64)


def build_idx(dataset, root, **kwargs):
    args = dict(batch_size=10, rank=0, num_workers=1, seed=0, augment=False)
    args.update(kwargs)
    return data.build_data(dataset, root=str(root), **args)


def first_per_class(labels, n):
    """Indices kept by train_per_class=n, computed by walking the file in order."""
    seen = np.zeros(10, int)
    keep = []
    for i, label in enumerate(labels):
        if seen[label] < n:
            keep.append(i)
            seen[label] += 1
    return np.array(keep)


def test_idx_stats_are_the_published_values():
    assert idx.STATS == IDX_STATS


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
@pytest.mark.parametrize("dataset", ["mnist", "fashion_mnist"])
def test_idx_loads_exact_pixels_labels_and_normalization(tmp_path, idx_arrays, gz, dataset):
    paths = write_idx_set(tmp_path, idx_arrays, gz=gz)
    # Decode the written test files again with plain numpy, independently of idx.py.
    raw = {}
    for key in ("test_images", "test_labels"):
        with (gzip.open if gz else open)(paths[key], "rb") as f:
            content = f.read()
        ndim = content[3]
        shape = struct.unpack(f">{ndim}I", content[4:4 + 4 * ndim])
        raw[key] = np.frombuffer(content[4 + 4 * ndim:], np.uint8).reshape(shape)
    assert raw["test_images"].shape == (20, 28, 28)

    bundle = build_idx(dataset, tmp_path)
    assert (bundle.num_classes, bundle.image_shape, bundle.eval_set) == (10, (1, 28, 28), "test")
    assert (bundle.train.num_samples, bundle.test.num_samples) == (60, 20)

    test_x, test_y = collect(bundle.test.batches(7))
    assert test_x.shape == (20, 1, 28, 28) and test_x.dtype == np.float32
    mean, std = IDX_STATS[dataset]
    np.testing.assert_allclose(test_x[:, 0], (raw["test_images"] / 255.0 - mean) / std, atol=1e-5)
    np.testing.assert_array_equal(denormalize_idx(test_x[:, 0], dataset), raw["test_images"])
    np.testing.assert_array_equal(test_y, raw["test_labels"])

    # One worker with 6 x 10 batches sees every training image once, with its label.
    assert bundle.train.steps_per_epoch == 6
    train_x, train_y = collect(bundle.train.epoch(0))
    index = match_rows(denormalize_idx(train_x, dataset), idx_arrays["train_images"])
    assert sorted(index) == list(range(60))
    np.testing.assert_array_equal(train_y, idx_arrays["train_labels"][index])
    np.testing.assert_allclose(train_x[:, 0], (idx_arrays["train_images"][index] / 255.0 - mean) / std,
                               atol=1e-5)


def test_idx_prefers_gz_and_mixes_gz_and_plain(tmp_path, idx_arrays):
    write_idx_set(tmp_path, idx_arrays, gz=True)
    # A damaged plain copy next to a good .gz is ignored: the .gz is read first.
    (tmp_path / IDX_NAMES["train_images"]).write_bytes(b"garbage")
    # And a set may mix compressed and plain files.
    os.remove(str(tmp_path / (IDX_NAMES["test_labels"] + ".gz")))
    write_raw(tmp_path, "test_labels", idx_bytes(idx_arrays["test_labels"]), gz=False)
    bundle = build_idx("mnist", tmp_path)
    np.testing.assert_array_equal(collect(bundle.test.batches(20))[1], idx_arrays["test_labels"])
    train_x, _ = collect(bundle.train.epoch(0))
    assert sorted(match_rows(denormalize_idx(train_x, "mnist"), idx_arrays["train_images"])) == \
        list(range(60))


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 31, 30), (3, 28, 28)])
def test_idx_padding_centred_with_zeros_and_channels_repeated(idx_root, idx_arrays, shape):
    channels, height, width = shape
    bundle = build_idx("fashion_mnist", idx_root, shape=shape)
    assert bundle.image_shape == shape
    test_x, _ = collect(bundle.test.batches(8))
    assert test_x.shape == (20,) + shape
    top, left = (height - 28) // 2, (width - 28) // 2
    expected = np.pad(idx_arrays["test_images"],
                      ((0, 0), (top, height - 28 - top), (left, width - 28 - left)))
    pixels = denormalize_idx(test_x, "fashion_mnist")
    for c in range(channels):
        np.testing.assert_array_equal(pixels[:, c], expected)
    np.testing.assert_array_equal(test_x, np.repeat(test_x[:, :1], channels, axis=1))
    if shape == (3, 32, 32):
        # The padding is 0 before normalisation: two rows/columns of -mean/std on every side.
        border = -IDX_STATS["fashion_mnist"][0] / IDX_STATS["fashion_mnist"][1]
        for edge in (test_x[:, :, :2], test_x[:, :, -2:], test_x[:, :, :, :2], test_x[:, :, :, -2:]):
            np.testing.assert_allclose(edge, border, atol=1e-6)
    train_x, _ = collect(bundle.train.epoch(0))
    assert train_x.shape == (60,) + shape


@pytest.mark.parametrize("shape", [(1, 14, 14), (3, 20, 36), (1, 16, 28)])
def test_idx_resize_gives_requested_shape(tmp_path, idx_arrays, shape):
    # Constant images (each its own grey level) must stay exactly constant after resizing, and a
    # left-to-right ramp must stay non-decreasing along the width.
    levels = np.arange(20, dtype=np.uint8) * 12
    test_images = np.repeat(levels, 28 * 28).reshape(20, 28, 28)
    test_images[-1] = np.tile(np.arange(0, 252, 9, dtype=np.uint8), (28, 1))   # ramp 0..243
    arrays = dict(idx_arrays, test_images=test_images)
    write_idx_set(tmp_path, arrays)
    bundle = build_idx("mnist", tmp_path, shape=shape)
    assert bundle.image_shape == shape
    test_x, _ = collect(bundle.test.batches(20))
    assert test_x.shape == (20,) + shape
    pixels = denormalize_idx(test_x, "mnist")
    np.testing.assert_array_equal(pixels[:-1], np.broadcast_to(levels[:-1, None, None, None],
                                                               (19,) + shape))
    ramp = pixels[-1]
    assert ramp.min() >= 0 and ramp.max() <= 243
    assert (np.diff(ramp, axis=2) >= 0).all() and ramp[:, :, -1].min() > ramp[:, :, 0].max()
    np.testing.assert_array_equal(test_x, np.repeat(test_x[:, :1], shape[0], axis=1))
    assert collect(bundle.train.epoch(0))[0].shape == (60,) + shape


def test_idx_bad_shape_and_classes(idx_root):
    with pytest.raises(data.DataError, match="channel"):
        build_idx("mnist", idx_root, shape=(2, 28, 28))
    with pytest.raises(data.DataError, match="data.shape"):
        build_idx("mnist", idx_root, shape=(1, 28))
    with pytest.raises(data.DataError, match="10 classes"):
        build_idx("mnist", idx_root, num_classes=5)


def test_idx_train_per_class_keeps_first_n_of_each_class_in_file_order(idx_root, idx_arrays):
    labels = idx_arrays["train_labels"]
    keep = first_per_class(labels, 3)
    assert len(keep) == 9 * 3 + 2      # class 9 has only two images: both kept
    bundle = build_idx("mnist", idx_root, train_per_class=3, batch_size=29)
    assert bundle.train.num_samples == 29 and bundle.eval_set == "test"
    assert bundle.test.num_samples == 20     # the test set is untouched
    assert bundle.notes == ("data.train_per_class: 3 asked, but 1 of 10 classes have fewer and keep all they "
                            "have (9: 2)",)
    assert build_idx("mnist", idx_root, train_per_class=2, batch_size=20).notes == ()
    assert data.short_classes_note(labels, train_per_class=5, train_offset=3) == (
        "data.train_per_class: 5 asked, but 9 of 10 classes have fewer after data.train_offset 3 and keep all "
        "they have (1: 3, 2: 3, 3: 3, 4: 3, 5: 3, ...)")
    train_x, train_y = collect(bundle.train.epoch(0))
    index = match_rows(denormalize_idx(train_x, "mnist"), idx_arrays["train_images"])
    np.testing.assert_array_equal(np.sort(index), keep)
    np.testing.assert_array_equal(train_y, labels[index])
    assert np.bincount(train_y.astype(int), minlength=10).tolist() == [3] * 9 + [2]

    # split_train directly: the kept images in file order.
    x, y, vx, vy = data.split_train(idx_arrays["train_images"], labels, train_per_class=3)
    assert vx is None and vy is None
    np.testing.assert_array_equal(x, idx_arrays["train_images"][keep])
    np.testing.assert_array_equal(y, labels[keep])
    x, y, _, _ = data.split_train(idx_arrays["train_images"], labels, train_per_class=100)
    np.testing.assert_array_equal(y, labels)      # more than any class has: everything


def test_train_offset_picks_the_next_n_of_each_class(idx_root, idx_arrays):
    """Offsets 0 and n give disjoint subsets of n per class; 'rest' validation avoids both the subset and
    nothing else; an offset past a class's images is an error naming the key."""
    images, labels = idx_arrays["train_images"], idx_arrays["train_labels"]
    x0, y0, _, _ = data.split_train(images, labels, train_per_class=1)
    x1, y1, _, _ = data.split_train(images, labels, train_per_class=1, train_offset=1)
    second = np.sort([np.flatnonzero(labels == c)[1] for c in range(10)])
    np.testing.assert_array_equal(x1, images[second])
    np.testing.assert_array_equal(y1, labels[second])
    assert not set(match_rows(x0, images)) & set(match_rows(x1, images))
    _, _, vx, _ = data.split_train(images, labels, train_per_class=1, train_offset=1, validation=5,
                                   validation_from="rest")
    assert not set(match_rows(vx, images)) & set(second)
    bundle = build_idx("mnist", idx_root, train_per_class=1, train_offset=1, batch_size=10)
    assert bundle.train.num_samples == 10
    with pytest.raises(data.DataError, match=r"data.train_offset: 2 skips every training image of a class that has 2"):
        data.split_train(images, labels, train_per_class=1, train_offset=2)


@pytest.mark.parametrize("validation,n_val", [(0.25, 7), (5, 5), (5.0, 5), (1, 1)])
def test_split_train_validation_sizes_disjoint_and_fixed(idx_arrays, validation, n_val):
    images, labels = idx_arrays["train_images"], idx_arrays["train_labels"]
    keep = first_per_class(labels, 3)        # 29 images; 0.25 * 29 = 7.25 -> 7
    x, y, vx, vy = data.split_train(images, labels, train_per_class=3, validation=validation)
    assert (len(x), len(vx)) == (29 - n_val, n_val) and (len(y), len(vy)) == (29 - n_val, n_val)
    train_rows = match_rows(x, images)
    val_rows = match_rows(vx, images)
    assert set(train_rows).isdisjoint(val_rows)
    np.testing.assert_array_equal(np.sort(np.concatenate([train_rows, val_rows])), keep)
    np.testing.assert_array_equal(y, labels[train_rows])
    np.testing.assert_array_equal(vy, labels[val_rows])
    # The documented draw: a permutation of the kept images from RandomState(VALIDATION_SEED).
    perm = np.random.RandomState(data.VALIDATION_SEED).permutation(29)
    np.testing.assert_array_equal(val_rows, np.sort(keep[perm[:n_val]]))
    # Independent of any global random state.
    np.random.seed(99)
    again = data.split_train(images, labels, train_per_class=3, validation=validation)
    np.testing.assert_array_equal(again[2], vx)


def test_idx_validation_replaces_test_set_same_for_all_seeds_and_ranks(idx_root, idx_arrays):
    images = idx_arrays["train_images"]
    keep = first_per_class(idx_arrays["train_labels"], 3)
    val_sets, shards = [], []
    for seed, rank in [(0, 0), (0, 1), (7, 0), (7, 1)]:
        # 29 kept, 5 validation, 24 train = 2 workers x 3 steps x 4: nothing is cut off.
        bundle = build_idx("mnist", idx_root, train_per_class=3, validation=5, batch_size=4,
                           rank=rank, num_workers=2, seed=seed)
        assert bundle.eval_set == "validation"
        assert (bundle.train.num_samples, bundle.test.num_samples) == (24, 5)
        assert bundle.train.steps_per_epoch == 3
        val_x, val_y = collect(bundle.test.batches(3))
        val_rows = match_rows(denormalize_idx(val_x, "mnist"), images)
        np.testing.assert_array_equal(val_y, idx_arrays["train_labels"][val_rows])
        # Not the IDX test set: every validation image is a training image, none a test image.
        test_flat = idx_arrays["test_images"].reshape(20, -1).astype(np.int64)
        for image in denormalize_idx(val_x, "mnist").reshape(5, -1):
            assert not (test_flat == image).all(axis=1).any()
        val_sets.append(val_rows)
        shards.append(match_rows(denormalize_idx(collect(bundle.train.epoch(0))[0], "mnist"), images))
    for other in val_sets[1:]:
        np.testing.assert_array_equal(other, val_sets[0])
    for seed_shards in (shards[:2], shards[2:]):
        rank0, rank1 = seed_shards
        assert set(rank0).isdisjoint(rank1) and set(rank0).isdisjoint(val_sets[0])
        np.testing.assert_array_equal(np.sort(np.concatenate([rank0, rank1, val_sets[0]])), keep)
    assert not np.array_equal(shards[0], shards[2])     # the run seed still shuffles the train part


@pytest.mark.parametrize("validation,message", [
    (29, "gives 29 of 29"), (40, "gives 40 of 29"), (0.01, "gives 0 of 29"), (0.999, "gives 29 of 29"),
    (2.5, "whole number"), (-3, "at least one on each side")])   # config forbids < 0 anyway
def test_validation_that_leaves_a_side_empty_is_an_error(idx_root, validation, message):
    with pytest.raises(data.DataError, match="data.validation") as err:
        build_idx("mnist", idx_root, train_per_class=3, validation=validation)
    assert message in str(err.value)


@pytest.mark.parametrize("validation,n_val", [(0.5, 16), (7, 7), (31, 31)])
def test_validation_from_rest_draws_from_the_images_the_subset_leaves_out(idx_root, idx_arrays, validation,
                                                                           n_val):
    images, labels = idx_arrays["train_images"], idx_arrays["train_labels"]
    keep = first_per_class(labels, 3)                      # 29 of the 60 training images
    rest = np.setdiff1d(np.arange(len(labels)), keep)     # the 31 left out; 0.5 * 31 = 15.5 -> 16
    x, y, vx, vy = data.split_train(images, labels, train_per_class=3, validation=validation,
                                    validation_from="rest")
    np.testing.assert_array_equal(x, images[keep])         # the training subset stays whole
    np.testing.assert_array_equal(y, labels[keep])
    val_rows = match_rows(vx, images)
    perm = np.random.RandomState(data.VALIDATION_SEED).permutation(31)
    np.testing.assert_array_equal(val_rows, np.sort(rest[perm[:n_val]]))
    np.testing.assert_array_equal(vy, labels[val_rows])
    # The whole pipeline: same training shard sizes as without validation, the held-out images evaluated.
    bundle = build_idx("mnist", idx_root, train_per_class=3, validation=validation, validation_from="rest",
                       batch_size=29)
    assert bundle.eval_set == "validation"
    assert (bundle.train.num_samples, bundle.test.num_samples) == (29, n_val)


@pytest.mark.parametrize("kwargs,message", [
    (dict(train_per_class=3, validation=32), "gives 32 of the 31 training images that data.train_per_class"),
    (dict(train_per_class=3, validation=0.01), "gives 0 of the 31"),
    (dict(validation=5), "set data.train_per_class too"),
    (dict(train_per_class=3, validation=5, validation_from="test"), "one of subset, rest, got 'test'")])
def test_validation_from_rest_errors(idx_root, kwargs, message):
    kwargs.setdefault("validation_from", "rest")
    with pytest.raises(data.DataError, match="data.validation") as err:
        build_idx("mnist", idx_root, **kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("key,value", [("train_per_class", 3), ("validation", 0.2), ("train_offset", 3)])
def test_split_only_on_in_memory_datasets(key, value):
    with pytest.raises(data.DataError, match=rf"^data\.{key}: work on the in-memory datasets .*not on synthetic"):
        data.build_data("synthetic", batch_size=8, synthetic_samples=64, **SHARD, **{key: value})


def test_digits_validation_split():
    bundle = data.build_data("digits", batch_size=32, validation=0.1, **SHARD)
    assert bundle.eval_set == "validation"
    # 1437 training images: round(143.7) = 144 validate, 1293 train; the 360 test images are unused.
    assert (bundle.train.num_samples, bundle.test.num_samples) == (1293, 144)


def test_idx_shards_of_an_epoch_are_disjoint(idx_root, idx_arrays):
    images = idx_arrays["train_images"]
    for epoch in (0, 3):
        shards = []
        for rank in range(3):
            bundle = build_idx("fashion_mnist", idx_root, batch_size=5, rank=rank, num_workers=3, seed=11)
            assert bundle.train.steps_per_epoch == 4       # 60 // (3 * 5)
            x, y = collect(bundle.train.epoch(epoch))
            rows = match_rows(denormalize_idx(x, "fashion_mnist"), images)
            np.testing.assert_array_equal(y, idx_arrays["train_labels"][rows])
            shards.append(rows)
        for a in range(3):
            assert len(shards[a]) == 20
            for b in range(a + 1, 3):
                assert set(shards[a]).isdisjoint(shards[b])
        assert sorted(np.concatenate(shards)) == list(range(60))
        if epoch == 0:
            first = shards
    assert not np.array_equal(first[0], shards[0])


@pytest.mark.parametrize("dataset", ["mnist", "fashion_mnist"])
def test_idx_augmentation_is_padded_crop_flipping_only_clothes(idx_root, dataset):
    def epoch(augment, shape=None):
        bundle = build_idx(dataset, idx_root, batch_size=10, rank=1, num_workers=2, seed=3,
                           augment=augment, shape=shape)
        return collect(bundle.train.epoch(2))[0], collect(bundle.test.batches(20))[0]

    (plain, plain_test), (augmented, augmented_test) = epoch(False), epoch(True)
    assert augmented.shape == plain.shape == (30, 1, 28, 28)
    np.testing.assert_array_equal(epoch(True)[0], augmented)      # deterministic
    np.testing.assert_array_equal(augmented_test, plain_test)     # the test set is never augmented
    # Zero padding (2 pixels) happens before normalisation, so padded pixels decode to 0.
    padded = np.pad(denormalize_idx(plain, dataset), ((0, 0), (0, 0), (2, 2), (2, 2)))
    transforms = []
    for i, image in enumerate(denormalize_idx(augmented, dataset)):
        found = [(dy, dx, flip) for dy in range(5) for dx in range(5) for flip in (False, True)
                 if np.array_equal(image, padded[i, :, dy:dy + 28, dx:dx + 28][:, :, ::-1]
                                   if flip else padded[i, :, dy:dy + 28, dx:dx + 28])]
        assert len(found) == 1
        transforms.append(found[0])
    assert len({(dy, dx) for dy, dx, _ in transforms}) > 8       # the crops vary
    flips = [flip for _, _, flip in transforms]
    if dataset == "mnist":
        assert not any(flips)                                    # a mirrored 2 is no 2
    else:
        assert any(flips) and not all(flips)
    # With padding to 32x32 and 3 channels the crop works on the padded image, channels stay equal.
    big = epoch(True, shape=(3, 32, 32))[0]
    assert big.shape == (30, 3, 32, 32)
    np.testing.assert_array_equal(big, np.repeat(big[:, :1], 3, axis=1))


# ---- errors: each names the file (or folder) and says what is wrong

def build_error(dataset, root):
    with pytest.raises(data.DataError) as err:
        data.build_data(dataset, batch_size=10, root=None if root is None else str(root), **SHARD)
    return str(err.value)


@pytest.mark.parametrize("dataset", ["mnist", "fashion_mnist"])
def test_idx_missing_folder_or_unset_root(tmp_path, dataset):
    missing = tmp_path / "no_such_folder"
    message = build_error(dataset, missing)
    assert message.startswith(dataset) and str(missing) in message and "does not exist" in message
    assert "Nothing is downloaded" in message
    for name in IDX_NAMES.values():
        assert name + ".gz" in message
    if dataset == "fashion_mnist":
        assert "dataset-fashion-mnist" in message and "/usr/share/datasets/fashion-mnist" in message
    else:
        assert "dataset-fashion-mnist" not in message
    assert "data.root is not set" in build_error(dataset, None)


def test_idx_root_is_a_file(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(b"x")
    message = build_error("mnist", path)
    assert str(path) in message and "is a file" in message


@pytest.mark.parametrize("key", sorted(IDX_NAMES))
def test_idx_one_missing_file_is_named(idx_root, key):
    os.remove(str(idx_root / (IDX_NAMES[key] + ".gz")))
    message = build_error("fashion_mnist", idx_root)
    lacks = message.split("Nothing is downloaded")[0]
    assert str(idx_root) in lacks and IDX_NAMES[key] in lacks
    assert [name for name in IDX_NAMES.values() if name in lacks] == [IDX_NAMES[key]]


def header(type_byte, ndim, *dims):
    return bytes([0, 0, type_byte, ndim]) + struct.pack(f">{len(dims)}I", *dims)


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
@pytest.mark.parametrize("case", ["truncated", "truncated_header", "short", "magic", "type", "ndim",
                                  "trailing", "not_28x28"])
def test_idx_malformed_file_named(tmp_path, idx_arrays, gz, case):
    write_idx_set(tmp_path, idx_arrays, gz=gz)
    key, expected = {
        "truncated": ("train_images", "truncated"),
        "truncated_header": ("test_images", "truncated header"),
        "short": ("train_labels", "not an IDX file"),
        "magic": ("test_labels", "not an IDX file"),
        "type": ("train_images", "element type 0x0d"),
        "ndim": ("train_labels", "2 dimensions, expected 1"),
        "trailing": ("test_images", "trailing bytes"),
        "not_28x28": ("test_images", "expected 28x28"),
    }[case]
    good = idx_bytes(idx_arrays[key])
    raw = {
        "truncated": good[:-5],
        "truncated_header": good[:10],                       # 4 + 3 * 4 = 16 header bytes needed
        "short": b"\0\0",
        "magic": b"\x08\x03" + good[2:],
        "type": bytes([0, 0, 0x0D]) + good[3:],               # float32
        "ndim": header(0x08, 2, 30, 2) + good[8:],            # 60 labels as 30 x 2
        "trailing": good + b"\0\0\0",
        "not_28x28": idx_bytes(idx_arrays["test_images"][:, :27]),   # 27 x 28 images
    }[case]
    path = write_raw(tmp_path, key, raw, gz=gz)
    message = build_error("mnist", tmp_path)
    assert message.startswith(path) and expected in message


def test_idx_truncated_message_gives_sizes(tmp_path, idx_arrays):
    write_idx_set(tmp_path, idx_arrays)
    path = write_raw(tmp_path, "train_images", idx_bytes(idx_arrays["train_images"])[:-5])
    message = build_error("mnist", tmp_path)
    need = 16 + 60 * 28 * 28
    assert f"{need - 5} bytes" in message and f"needs {need}" in message and "(60, 28, 28)" in message
    assert message.startswith(path)


@pytest.mark.parametrize("part", ["train", "test"])
def test_idx_image_label_count_mismatch(tmp_path, idx_arrays, part):
    write_idx_set(tmp_path, idx_arrays)
    labels = idx_arrays[f"{part}_labels"][:-1]
    write_raw(tmp_path, f"{part}_labels", idx_bytes(labels))
    message = build_error("fashion_mnist", tmp_path)
    n = len(idx_arrays[f"{part}_images"])
    assert f"{IDX_NAMES[part + '_images']}.gz holds {n} images" in message
    assert f"{IDX_NAMES[part + '_labels']}.gz {n - 1} labels" in message


@pytest.mark.parametrize("part,value", [("train", 10), ("test", 255)])
def test_idx_label_out_of_range(tmp_path, idx_arrays, part, value):
    write_idx_set(tmp_path, idx_arrays)
    labels = idx_arrays[f"{part}_labels"].copy()
    labels[3] = value
    path = write_raw(tmp_path, f"{part}_labels", idx_bytes(labels))
    message = build_error("mnist", tmp_path)
    assert message.startswith(path) and "0..9" in message and f"found {value}" in message


@pytest.mark.parametrize("damage", ["not_gzip", "cut_stream", "bad_crc", "bad_deflate"])
def test_idx_corrupt_gzip_named(tmp_path, idx_arrays, damage):
    write_idx_set(tmp_path, idx_arrays)
    path = str(tmp_path / (IDX_NAMES["test_images"] + ".gz"))
    content = gzip.compress(idx_bytes(idx_arrays["test_images"]))
    if damage == "not_gzip":
        content = idx_bytes(idx_arrays["test_images"])          # plain bytes under a .gz name
    elif damage == "cut_stream":
        content = content[:len(content) // 2]
    elif damage == "bad_deflate":
        # A damaged stored-block header right after the 10-byte gzip header: zlib rejects the stream
        # itself (zlib.error, not the OSError of a bad checksum).
        content = content[:12] + bytes(b ^ 0xFF for b in content[12:20]) + content[20:]
    else:
        content = content[:-8] + bytes(b ^ 0xFF for b in content[-8:-4]) + content[-4:]
    with open(path, "wb") as f:
        f.write(content)
    message = build_error("mnist", tmp_path)
    assert message.startswith(path + ": cannot read")


# ---------------------------------------------------------------- cifar10: the archives and RecordIO

def write_cifar_archive(root, fmt, batches):
    """The official cifar-10-binary.tar.gz or cifar-10-python.tar.gz layout (the batch files under
    cifar-10-batches-bin/ or cifar-10-batches-py/), written in `root`; returns its path."""
    import tarfile
    subfolder, archive = {"bin": ("cifar-10-batches-bin", "cifar-10-binary.tar.gz"),
                          "py": ("cifar-10-batches-py", "cifar-10-python.tar.gz")}[fmt]
    staging = os.path.join(str(root), "staging")
    write_cifar(os.path.join(staging, subfolder), fmt, batches)
    path = os.path.join(str(root), archive)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(os.path.join(staging, subfolder), arcname=subfolder)
    shutil.rmtree(staging)
    return path


def write_cifar_recordio(root, batches, labels=None, size=32):
    """train.rec/.idx (the five training batches) and test.rec/.idx as im2rec writes them, each
    image a lossless PNG; `labels` replaces the labels written (a list per file)."""
    os.makedirs(str(root), exist_ok=True)
    parts = [(np.concatenate([b[0] for b in batches[:5]]), np.concatenate([b[1] for b in batches[:5]])),
             batches[5]]
    for i, (prefix, (images, written)) in enumerate(zip(("train", "test"), parts)):
        record = mx.recordio.MXIndexedRecordIO(os.path.join(str(root), prefix + ".idx"),
                                               os.path.join(str(root), prefix + ".rec"), "w")
        for j, image in enumerate(images):
            label = written[j] if labels is None else labels[i][j]
            pixels = image.transpose(1, 2, 0)[:, :, ::-1]              # CHW RGB -> OpenCV's HWC BGR
            if size != 32:
                pixels = pixels[:size, :size]
            header = mx.recordio.IRHeader(0, float(label), j, 0)
            record.write_idx(j, mx.recordio.pack_img(header, np.ascontiguousarray(pixels), img_fmt=".png"))
        record.close()


def build_cifar(root, data_format="auto", augment=False):
    return data.build_data("cifar10", batch_size=10, root=str(root), augment=augment,
                           data_format=data_format, **SHARD)


def cifar_arrays_of(bundle):
    """Every training image and label in file order (one worker, no augmentation), and the test set."""
    train_x, train_y = collect(bundle.train.epoch(0))
    perm = np.random.RandomState(0).permutation(bundle.train.num_samples)   # SHARD's seed 0, epoch 0
    order = np.argsort(perm)
    return denormalize_cifar(train_x)[order], train_y[order], *collect(bundle.test.batches(4))


@pytest.mark.parametrize("form", ["bin_archive", "py_archive", "recordio"])
def test_cifar_archives_and_recordio_give_the_written_images(tmp_path, cifar_arrays, form):
    if form == "recordio":
        write_cifar_recordio(tmp_path, cifar_arrays)
    else:
        write_cifar_archive(tmp_path, form.split("_")[0], cifar_arrays)
    bundle = build_cifar(tmp_path)
    assert (bundle.train.num_samples, bundle.test.num_samples) == (100, 10)
    train_x, train_y, test_x, test_y = cifar_arrays_of(bundle)
    np.testing.assert_array_equal(train_x, np.concatenate([b[0] for b in cifar_arrays[:5]]))
    np.testing.assert_array_equal(train_y, np.concatenate([b[1] for b in cifar_arrays[:5]]))
    images, labels = cifar_arrays[5]
    np.testing.assert_allclose(test_x, (images / 255.0 - CIFAR_MEAN) / CIFAR_STD, atol=1e-5)
    np.testing.assert_array_equal(test_y, labels)


def test_cifar_recordio_trains_with_the_batch_files_augmentation(tmp_path, cifar_arrays):
    """The same images from RecordIO and from binary batches give the same augmented epoch:
    one pipeline (pad-4 crop, flip, CIFAR normalisation) for every form."""
    write_cifar_recordio(tmp_path / "rec", cifar_arrays)
    write_cifar(str(tmp_path / "bin"), "bin", cifar_arrays)
    from_rec = collect(build_cifar(tmp_path / "rec", augment=True).train.epoch(1))
    from_bin = collect(build_cifar(tmp_path / "bin", augment=True).train.epoch(1))
    np.testing.assert_array_equal(from_rec[0], from_bin[0])
    np.testing.assert_array_equal(from_rec[1], from_bin[1])
    assert not np.array_equal(from_rec[0], collect(build_cifar(tmp_path / "bin").train.epoch(1))[0])


def test_cifar_format_picks_one_form_and_auto_takes_the_first(tmp_path, cifar_arrays):
    changed = [(images, (labels + 1) % 10) for images, labels in cifar_arrays]    # tell the copies apart
    write_cifar(str(tmp_path), "bin", cifar_arrays)
    write_cifar_recordio(tmp_path, changed)
    _, auto_y, _, _ = cifar_arrays_of(build_cifar(tmp_path))
    _, rec_y, _, _ = cifar_arrays_of(build_cifar(tmp_path, "recordio"))
    written = np.concatenate([b[1] for b in cifar_arrays[:5]])
    np.testing.assert_array_equal(auto_y, written)                      # binary batches come first
    np.testing.assert_array_equal(rec_y, (written + 1) % 10)
    with pytest.raises(data.DataError, match=r"no complete CIFAR-10 copy in format python") as err:
        build_cifar(tmp_path, "python")
    message = str(err.value)
    assert "python: data_batch_1, " in message and "recordio" not in message and "\n" not in message


def test_cifar_missing_message_lists_every_form(tmp_path):
    message = build_error("cifar10", tmp_path)
    for text in ("binary: data_batch_1.bin", "(or in cifar-10-batches-bin/)", "python: data_batch_1,",
                 "cifar-10-binary.tar.gz or cifar-10-python.tar.gz", "train.rec and test.rec made by im2rec"):
        assert text in message
    assert "\n" not in message


@pytest.mark.parametrize("damage", ["cut", "not_gzip"])
def test_cifar_damaged_archive_names_it(tmp_path, cifar_arrays, damage):
    path = write_cifar_archive(tmp_path, "bin", cifar_arrays)
    content = open(path, "rb").read()
    open(path, "wb").write(content[:len(content) // 2] if damage == "cut" else b"not a gzip stream" * 10)
    message = build_error("cifar10", tmp_path)
    assert message.startswith(f"{path}: not a readable .tar.gz archive"), message


def test_cifar_archive_member_errors_name_the_member(tmp_path, cifar_arrays):
    batches = [(images, labels.copy()) for images, labels in cifar_arrays]
    batches[2][1][4] = 12
    path = write_cifar_archive(tmp_path, "py", batches)
    message = build_error("cifar10", tmp_path)
    assert message.startswith(f"{path}:cifar-10-batches-py/data_batch_3: labels must be in 0..9"), message


def test_cifar_archive_without_a_batch_names_it(tmp_path, cifar_arrays):
    import tarfile
    path = write_cifar_archive(tmp_path, "bin", cifar_arrays)
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    with tarfile.open(path, "w:gz") as tar:
        for member, content in members:
            if not member.name.endswith("test_batch.bin"):
                tar.addfile(member, None if content is None else io.BytesIO(content))
    message = build_error("cifar10", tmp_path)
    assert message == (f"{path}: the archive has no file cifar-10-batches-bin/test_batch.bin "
                       f"(is it the official cifar-10-binary.tar.gz?)")


@pytest.mark.parametrize("case", ["label", "size", "truncated", "garbage"])
def test_cifar_recordio_errors_name_file_and_record(tmp_path, cifar_arrays, case):
    labels = None
    if case == "label":
        labels = [np.concatenate([b[1] for b in cifar_arrays[:5]]), cifar_arrays[5][1].copy()]
        labels[1][7] = 10
    write_cifar_recordio(tmp_path, cifar_arrays, labels=labels, size=28 if case == "size" else 32)
    path = str(tmp_path / ("train.rec" if case in ("size", "truncated", "garbage") else "test.rec"))
    content = open(path, "rb").read()
    if case == "truncated":
        open(path, "wb").write(content[:-50])
    elif case == "garbage":                                        # record 1's magic word zeroed
        offset = int(open(path[:-4] + ".idx").read().splitlines()[1].split("\t")[1])
        open(path, "wb").write(content[:offset] + b"\0" * 4 + content[offset + 4:])
    message = build_error("cifar10", tmp_path)
    expected = {"label": f"{path}: record 7 (id 7, byte ", "size": f"{path}: record 0 (id 0, byte 0): a 28x28 image",
                "truncated": f"{path} is truncated: record 99 at byte ",
                "garbage": f"{path} is corrupt or not RecordIO: no record starts at byte "}[case]
    if case == "garbage":
        assert message.endswith("(record 1)")
    assert message.startswith(expected), message
    if case == "label":
        assert message.endswith("label 10, CIFAR-10 labels are 0..9")


# ---------------------------------------------------------------- RecordIO labels, IDX header overflow

def test_imagenet_label_beyond_num_classes_names_file_and_record(imagenet_root, tmp_path):
    rng = np.random.RandomState(1)
    images = rng.randint(0, 256, size=(12, 40, 48, 3)).astype(np.uint8)
    write_recordio(str(tmp_path / "train"), images, [i % 10 for i in range(11)] + [10])
    for name in ("val.rec", "val.idx"):
        shutil.copy(str(imagenet_root / name), str(tmp_path / name))
    with pytest.raises(data.DataError) as err:
        data.build_data("imagenet", batch_size=4, root=str(tmp_path), shape=(3, 32, 32), num_classes=10, **SHARD)
    assert str(err.value).startswith(f"{tmp_path / 'train.rec'}: record 11 (byte ")
    assert str(err.value).endswith("has label 10, outside 0..9 (data.num_classes 10)")
    # The val set's labels go to 21: 24 classes hold them all.
    assert data.build_data("imagenet", batch_size=4, root=str(imagenet_root), shape=(3, 32, 32),
                           num_classes=24, **SHARD).test.num_samples == 8


def test_idx_header_whose_size_overflows_names_the_file(tmp_path, idx_arrays):
    """2^31 x 2^31 x 4 bytes wraps to 0 in numpy's int64 product: the 16-byte file looked whole."""
    write_idx_set(tmp_path, idx_arrays)
    path = write_raw(tmp_path, "train_images", header(0x08, 3, 2 ** 31, 2 ** 31, 4))
    message = build_error("mnist", tmp_path)
    assert message.startswith(f"{path}: 16 bytes, but its header (2147483648, 2147483648, 4) needs "
                              f"{16 + 2 ** 64} (truncated)"), message


def test_record_reading_without_mxnet_matches_mxnets_own(tmp_path):
    """The index and the image-record headers as mxnet.recordio reads them, by recordio.py's own readers
    (the front end checks and reads RecordIO files without importing MXNet)."""
    from ssdsgd.worker.recordio import read_index, records, unpack_image
    prefix = str(tmp_path / "r")
    writer = mx.recordio.MXIndexedRecordIO(prefix + ".idx", prefix + ".rec", "w")
    headers = [mx.recordio.IRHeader(0, 3.0, 7, 0), mx.recordio.IRHeader(2, [4.0, 5.0], 8, 1)]
    for i, header in enumerate(headers):
        writer.write_idx(10 + i, mx.recordio.pack(header, b"image bytes %d" % i))
    writer.close()
    reader = mx.recordio.MXIndexedRecordIO(prefix + ".idx", prefix + ".rec", "r")
    assert read_index(prefix + ".idx") == reader.idx
    reader.close()
    with open(prefix + ".rec", "rb") as f:
        raw = f.read()
    for _, payload in records(prefix + ".rec", raw):
        ours, theirs = unpack_image(payload), mx.recordio.unpack(payload)
        (header, image), (mx_header, mx_image) = ours, theirs
        assert image == mx_image and (header.flag, header.id, header.id2) == (mx_header.flag, mx_header.id,
                                                                                mx_header.id2)
        np.testing.assert_array_equal(header.label, mx_header.label)
