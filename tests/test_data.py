"""Tests for ssdsgd.data on small generated datasets (nothing is downloaded)."""
import os
import pickle
import shutil

import mxnet as mx
import numpy as np
import pytest

from ssdsgd import data

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465]).reshape(1, 3, 1, 1)
CIFAR_STD = np.array([0.2023, 0.1994, 0.2010]).reshape(1, 3, 1, 1)
IMAGENET_MEAN = np.array([123.68, 116.779, 103.939])
IMAGENET_STD = np.array([58.393, 57.12, 57.375])
SHARD = dict(rank=0, num_workers=1, seed=0)


def collect(batches):
    """Concatenate an iterator of (data, label) NDArrays into numpy arrays."""
    pairs = [(d.asnumpy(), l.asnumpy()) for d, l in batches]
    return np.concatenate([d for d, _ in pairs]), np.concatenate([l for _, l in pairs])


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
        assert all(d.shape == (10, 3, 32, 32) and l.shape == (10,) for d, l in batches)
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
        for d, l in batches:
            assert d.shape == (4, 3, 32, 32) and l.shape == (4,)
            assert d.dtype == np.float32 and l.dtype == np.float32
        x, labels[rank] = collect(batches)
        assert np.isfinite(x).all() and np.abs(x).max() < 3  # normalized 0..255 pixels
    # Every label is one that was written, and each worker sees its own 12 records.
    all_labels = np.concatenate([labels[0], labels[1]])
    assert sorted(all_labels.astype(int)) == list(range(24))


def test_imagenet_train_is_deterministic_per_seed_and_epoch(imagenet_root):
    first = collect(build_imagenet(imagenet_root, seed=5).train.epoch(1))
    again = collect(build_imagenet(imagenet_root, seed=5).train.epoch(1))
    other_epoch = collect(build_imagenet(imagenet_root, seed=5).train.epoch(2))
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert not np.array_equal(first[0], other_epoch[0])


def test_imagenet_epoch_yields_steps_even_if_part_runs_out(imagenet_root):
    bundle = build_imagenet(imagenet_root)
    bundle.train.steps_per_epoch = 7  # more than the 3 batches the part holds
    batches = list(bundle.train.epoch(0))
    assert len(batches) == 7
    assert all(d.shape == (4, 3, 32, 32) for d, _ in batches)


def test_imagenet_val_center_crop_and_normalization(imagenet_root):
    bundle = build_imagenet(imagenet_root)
    batches = list(bundle.test.batches(3))
    assert [d.shape[0] for d, _ in batches] == [3, 3, 2]
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


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(data.DataError, match="digits, cifar10, imagenet, synthetic"):
        data.build_data("mnist", batch_size=8, **SHARD)
