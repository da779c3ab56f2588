"""MNIST and Fashion-MNIST from the four standard IDX files (LeCun's format), read directly.

Debian's `dataset-fashion-mnist` package installs them in /usr/share/datasets/fashion-mnist; MXNet's
own FashionMNIST class rejects those copies (its sha1 check fails on the re-compressed files) and
then tries to download, so we parse the format ourselves. An IDX file is: two zero bytes, a type
byte (0x08 = uint8), the number of dimensions, one big-endian uint32 per dimension, then the data.
Files may be gzip-compressed (`.gz`) or plain.
"""
import gzip
import math
import os
import struct
import zlib

import numpy as np

from ssdsgd.errors import JobError

# The standard names; `.gz` is looked for first.
FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
NATIVE_SIZE = 28
# Mean and standard deviation of the training pixels (0..1), per dataset.
STATS = {"mnist": (0.1307, 0.3081), "fashion_mnist": (0.2860, 0.3530)}
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


class IdxError(JobError):
    """A missing, truncated or malformed IDX file; the message names the file."""


def find_files(root, dataset):
    """Paths of the four files in `root`, or IdxError listing what is missing and where."""
    if root is None:
        where = "data.root is not set"
    elif os.path.exists(root) and not os.path.isdir(root):
        where = f"data.root {root!r} is a file, not a folder"
    elif not os.path.isdir(root):
        where = f"folder {root!r} does not exist"
    else:
        paths, missing = {}, []
        for key, name in FILES.items():
            found = [os.path.join(root, n) for n in (name + ".gz", name)
                     if os.path.isfile(os.path.join(root, n))]
            if found:
                paths[key] = found[0]
            else:
                missing.append(name + "[.gz]")
        if not missing:
            return paths
        where = f"{root!r} lacks {', '.join(missing)}"
    hint = (f" Debian's package dataset-fashion-mnist installs them in {DEBIAN_FASHION_MNIST}."
            if dataset == "fashion_mnist" else "")
    raise IdxError(f"{dataset}: {where}. Nothing is downloaded; put the four standard IDX files "
                   f"({', '.join(n + '.gz' for n in FILES.values())}) in data.root.{hint}")


def read_idx(path, ndim):
    """The uint8 array stored in an IDX file with `ndim` dimensions."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:   # gzip raises these for corrupt or cut-off streams
        raise IdxError(f"{path}: cannot read: {err}") from err
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IdxError(f"{path}: not an IDX file (it must start with two zero bytes)")
    if raw[2] != 0x08:
        raise IdxError(f"{path}: element type 0x{raw[2]:02x}, expected 0x08 (unsigned byte)")
    if raw[3] != ndim:
        raise IdxError(f"{path}: {raw[3]} dimensions, expected {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{path}: truncated header ({len(raw)} bytes)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + math.prod(shape)     # Python ints: numpy's int64 product wraps on huge headers
    if len(raw) != expected:
        raise IdxError(f"{path}: {len(raw)} bytes, but its header {shape} needs {expected} "
                       f"({'truncated' if len(raw) < expected else 'trailing bytes'})")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


def load(root, dataset):
    """((train images, train labels), (test images, test labels)): (N, 28, 28) uint8, (N,) int64."""
    paths = find_files(root, dataset)
    out = []
    for part in ("train", "test"):
        images = read_idx(paths[f"{part}_images"], 3)
        labels = read_idx(paths[f"{part}_labels"], 1)
        if images.shape[1:] != (NATIVE_SIZE, NATIVE_SIZE):
            raise IdxError(f"{paths[part + '_images']}: images are {images.shape[1:]}, expected 28x28")
        if len(images) != len(labels):
            raise IdxError(f"{paths[part + '_images']} holds {len(images)} images but "
                           f"{paths[part + '_labels']} {len(labels)} labels")
        if labels.size and labels.max() > 9:
            raise IdxError(f"{paths[part + '_labels']}: labels must be in 0..9, found {labels.max()}")
        out.append((images, labels.astype(np.int64)))
    return tuple(out)


def fit_to_shape(images, shape):
    """(N, 28, 28) uint8 -> (N, C, H, W) uint8: centred zero padding when H, W >= 28 (28 -> 32 is
    the usual way to feed CIFAR models), bilinear resizing otherwise; the gray channel repeated C times."""
    channels, height, width = shape
    if channels not in (1, 3):
        raise IdxError(f"data.shape: MNIST-style images have 1 channel (repeated to 3 if asked); "
                       f"got {channels} channels")
    x = images[:, None]
    if height >= NATIVE_SIZE and width >= NATIVE_SIZE:
        top, left = (height - NATIVE_SIZE) // 2, (width - NATIVE_SIZE) // 2
        x = np.pad(x, ((0, 0), (0, 0), (top, height - NATIVE_SIZE - top), (left, width - NATIVE_SIZE - left)))
    else:
        import mxnet as mx   # not at import: the front end reads IDX files without MXNet (resizing needs it)
        resized = mx.nd.contrib.BilinearResize2D(mx.nd.array(x, dtype=np.float32), height=height, width=width)
        x = np.clip(np.rint(resized.asnumpy()), 0, 255).astype(np.uint8)
    return np.repeat(x, channels, axis=1) if channels > 1 else x
