"""The small data sets read (or drawn) whole in one call: scikit-learn's digits, MNIST and Fashion-MNIST
(from the IDX files, idx.py) and synthetic Gaussian images.
"""
import os

import numpy as np

from ssdsgd.lean_mxnet import package_folder
from ssdsgd.schema import SYNTHETIC_SHAPE

from ssdsgd.worker import idx
from ssdsgd.worker.datasets import (
    DataBundle,
    DataError,
    ShardedTrainSet,
    TestSet,
    check_shape,
    check_ten_classes,
    in_memory_bundle,
    random_crop_flip,
    split_train,
)

# Images per class (0..9) of the digits training split (build_digits: 80 % of scikit-learn's 1797, stratified,
# random_state 0), from which the front end counts a digits training set without reading it;
# tests/unit/test_data.py checks them against the split itself.
DIGITS_TRAIN_PER_CLASS = (142, 146, 142, 146, 145, 145, 145, 143, 139, 144)


DIGITS_SPLIT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits_split.txt")


def build_digits(shape, num_classes, shard, split):
    check_ten_classes("digits", num_classes)
    shape, scale = _digits_shape(shape)
    channels = shape[0]
    pixels, labels = _read_digits()
    train_rows, test_rows = _digits_split()

    def to_images(flat):
        # Pixels are 0..16; upscale each pixel to an m x m block and repeat it per channel.
        images = (flat / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
        images = np.kron(images, np.ones((1, 1, scale, scale), np.float32))
        return np.repeat(images, channels, axis=1)

    return in_memory_bundle(to_images(pixels[train_rows]), labels[train_rows], to_images(pixels[test_rows]),
                            labels[test_rows], shard, split, shape)


def _read_digits():
    """(pixels (1797, 64) float64, labels) of scikit-learn's digits, read from the file its load_digits reads,
    without importing scikit-learn (its cost: docs/design.md, "The code, folder by folder")."""
    folder = package_folder("sklearn")
    path = os.path.join(folder, "datasets", "data", "digits.csv.gz") if folder else ""
    if not os.path.isfile(path):
        raise DataError(f"digits: scikit-learn's digits.csv.gz not found ({path or 'scikit-learn not installed'})")
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def _digits_split():
    """(train rows, test rows) of digits: scikit-learn's stratified 80/20 split, random_state 0, as
    scripts/digits_split.py wrote it (tests/unit/test_data.py checks it against scikit-learn)."""
    rows = {}
    with open(DIGITS_SPLIT_FILE) as f:
        for line in f:
            if not line.startswith("#"):
                name, *values = line.split()
                rows[name] = np.array(values, dtype=np.int64)
    return rows["train"], rows["test"]


def _digits_shape(shape):
    """The (C, H, W) of a digits data.shape (default (1, 8, 8)), checked, and its upscale factor H / 8."""
    shape = check_shape(shape or (1, 8, 8))
    channels, height, width = shape
    scale = height // 8
    if channels not in (1, 3) or height != width or height != 8 * scale:
        raise DataError(f"digits supports data.shape (C, 8*m, 8*m) with C in {{1, 3}}, "
                        f"e.g. (1, 8, 8) or (3, 32, 32); got {shape}")
    return shape, scale


def count_digits(shape, num_classes, split):
    """The number of training images build_digits gives, without reading digits, and its DataErrors (split_train
    on labels alone: how many images a split keeps depends only on the images per class)."""
    check_ten_classes("digits", num_classes)
    _digits_shape(shape)
    labels = np.repeat(np.arange(10), DIGITS_TRAIN_PER_CLASS)
    return len(split_train(labels, labels, **split)[1])


def build_idx(dataset, root, shape, num_classes, augment, shard, split):
    check_ten_classes(dataset, num_classes)
    shape = check_shape(shape or (1, idx.NATIVE_SIZE, idx.NATIVE_SIZE))
    try:
        (x_train, y_train), (x_test, y_test) = idx.load(root, dataset)
        x_train, x_test = idx.fit_to_shape(x_train, shape), idx.fit_to_shape(x_test, shape)
    except idx.IdxError as err:
        raise DataError(str(err)) from None
    mean, std = idx.STATS[dataset]

    def normalize(images):
        return (images.astype(np.float32) / 255 - mean) / std

    def train_transform(images, rng):
        # Crop with 2 pixels of padding (1/14 of the side, as pad 4 is for CIFAR); flip clothes,
        # not digits (a mirrored 2 is no 2).
        if augment:
            images = random_crop_flip(images, rng, pad=2, flip=dataset == "fashion_mnist")
        return normalize(images)

    return in_memory_bundle(x_train, y_train, x_test, y_test, shard, split, shape, train_transform, normalize)


def build_synthetic(shape, num_classes, num_samples, shard):
    shape = _synthetic_shape(shape)
    num_classes = num_classes or 10
    num_test = max(num_samples // 4, shard["batch_size"])
    rng = np.random.RandomState(shard["seed"])

    def draw(n):
        # One sample at a time: a single float64 draw of the whole set would need twice
        # the final float32 memory (GBs at ImageNet size).
        images = np.empty((n,) + shape, np.float32)
        for i in range(n):
            images[i] = rng.standard_normal(shape)
        return images, rng.randint(0, num_classes, size=n)

    x_train, y_train = draw(num_samples)
    x_test, y_test = draw(num_test)
    return DataBundle(train=ShardedTrainSet(x_train, y_train, **shard),
                      test=TestSet(x_test, y_test),
                      num_classes=num_classes, image_shape=shape)


def _synthetic_shape(shape):
    return check_shape(shape or SYNTHETIC_SHAPE)


def count_synthetic(shape, num_samples):
    """The number of training images build_synthetic draws, without drawing them, and its DataErrors."""
    _synthetic_shape(shape)
    return num_samples
