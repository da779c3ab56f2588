"""Training and test data for ssdsgd workers.

`build_data` returns this worker's shard of the training set plus the full test set.
Every worker must run the same number of steps per epoch (the parameter server waits
for all of them at each step), so `steps_per_epoch` is derived from the whole training
set and is identical on all ranks. Batch order and augmentation depend only on
(seed, epoch, rank), so a run can be repeated exactly.

Nothing is ever downloaded: cifar10 and imagenet must already be on local disk, and a
missing or damaged file raises `DataError` saying what to put where.
"""
import os
import pickle
import struct
import tarfile
import zlib
from dataclasses import dataclass

import mxnet as mx
import numpy as np

from ssdsgd.config import DATASETS, VALIDATION_SOURCES
from ssdsgd.config import IN_MEMORY_DATASETS as IN_MEMORY
from ssdsgd.errors import JobError
from ssdsgd.worker import idx

# gluoncv's CIFAR-10 recipe (scripts/classification/cifar/train_cifar10.py).
_CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
_CIFAR_STD = np.array([0.2023, 0.1994, 0.2010], np.float32).reshape(1, 3, 1, 1)
_CIFAR_RECORD = 1 + 3 * 32 * 32  # binary version: 1 label byte + CHW uint8 pixels
_CIFAR_BIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
_CIFAR_PY_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
# data.format: (official archive, the folder it unpacks to, the batch files in it).
_CIFAR_FORMS = {"binary": ("cifar-10-binary.tar.gz", "cifar-10-batches-bin", _CIFAR_BIN_FILES),
                "python": ("cifar-10-python.tar.gz", "cifar-10-batches-py", _CIFAR_PY_FILES)}
_CIFAR_REC_FILES = ("train.rec", "test.rec")     # im2rec output (the .idx beside them is not needed)

# The standard ResNet ImageNet normalization, on 0..255 RGB pixels.
_IMAGENET_NORM = dict(mean_r=123.68, mean_g=116.779, mean_b=103.939,
                      std_r=58.393, std_g=57.12, std_b=57.375)
_IMAGENET_FILES = ["train.rec", "train.idx", "val.rec", "val.idx"]


class DataError(JobError):
    """Bad or missing data; message says what to put where."""


@dataclass
class DataBundle:
    train: "ShardedTrainSet | RecordTrainSet"  # this worker's shard of the training set
    test: "TestSet | RecordTestSet"  # the full test set, or the validation split (evaluated on rank 0)
    num_classes: int
    image_shape: tuple  # (C, H, W)
    eval_set: str = "test"  # what `test` holds: "test" or "validation"


VALIDATION_SEED = 20240607  # fixed: every run and seed validates on the same images


def split_train(x, y, train_per_class=None, validation=0, validation_from="subset"):
    """(train x, train y, validation x or None, validation y or None).

    train_per_class: keep the first n images of each class (in file order), e.g. a fixed
    class-balanced subset. validation: a fraction in (0, 1) or a count of images, drawn with a
    fixed seed, so the split never depends on the run's seed. validation_from "subset" carves them
    out of the kept training images; "rest" draws them from the training images that
    train_per_class leaves out, so the training subset (and the schedule) stays exactly that of
    the test runs, and the held-out set can be far larger than a slice of the subset."""
    if validation_from not in VALIDATION_SOURCES:
        raise DataError(f"data.validation_from: one of {', '.join(VALIDATION_SOURCES)}, got {validation_from!r}")
    if validation_from == "rest" and not train_per_class:
        raise DataError("data.validation_from: 'rest' draws from the training images that data.train_per_class "
                        "leaves out; set data.train_per_class too")
    kept = np.arange(len(y))
    if train_per_class:
        kept = np.sort(np.concatenate([np.flatnonzero(y == c)[:train_per_class] for c in np.unique(y)]))
    if not validation:
        return x[kept], y[kept], None, None
    pool = kept if validation_from == "subset" else np.setdiff1d(np.arange(len(y)), kept)
    n_val = int(round(validation * len(pool))) if validation < 1 else int(validation)
    if validation >= 1 and validation != n_val:
        raise DataError(f"data.validation: a count must be a whole number, got {validation}")
    if validation_from == "subset" and not 0 < n_val < len(pool):
        raise DataError(f"data.validation: {validation} gives {n_val} of {len(pool)} training images; "
                        f"it must leave at least one on each side")
    if validation_from == "rest" and not 0 < n_val <= len(pool):
        raise DataError(f"data.validation: {validation} gives {n_val} of the {len(pool)} training images that "
                        f"data.train_per_class leaves out (data.validation_from: rest); it must be 1 to {len(pool)}")
    val = np.sort(np.random.RandomState(VALIDATION_SEED).permutation(pool)[:n_val])
    train = kept if validation_from == "rest" else np.setdiff1d(kept, val)
    return x[train], y[train], x[val], y[val]


def _bundle(x_train, y_train, x_test, y_test, shard, split, image_shape, train_transform=None,
            test_transform=None):
    """Training shard plus the test set, or the validation split carved from the training set."""
    x_train, y_train, x_val, y_val = split_train(x_train, y_train, **split)
    eval_set = "test"
    if x_val is not None:
        x_test, y_test, eval_set = x_val, y_val, "validation"
    return DataBundle(train=ShardedTrainSet(x_train, y_train, transform=train_transform, **shard),
                      test=TestSet(x_test, y_test, transform=test_transform),
                      num_classes=10, image_shape=image_shape, eval_set=eval_set)


def build_data(dataset, *, batch_size, rank, num_workers, seed, root=None, shape=None,
               num_classes=None, synthetic_samples=1024, augment=True,
               preprocess_threads=2, train_per_class=None, validation=0,
               validation_from="subset", data_format="auto") -> DataBundle:
    """Load `dataset` and return this worker's training shard and the full test set.

    `root` is the data folder (cifar10, imagenet, mnist, fashion_mnist), `shape` the (C, H, W)
    image shape (default per dataset), `num_classes` is used by imagenet and synthetic and must
    be 10 (or None) for the others.
    In-memory datasets (digits, cifar10, mnist, fashion_mnist) can be cut down and split:
    `train_per_class` keeps the first n training images of each class; `validation` (a fraction
    below 1, or a count) then moves a fixed, seed-independent random part of those into a
    validation set, which replaces the test set as `DataBundle.test` (`eval_set` says which);
    `validation_from="rest"` draws it from the images `train_per_class` leaves out instead.
    `data_format` (cifar10 only) picks the form of the copy in `root` (config.CIFAR_FORMATS).
    """
    if not 0 <= rank < num_workers or batch_size < 1:
        raise ValueError(f"need batch_size >= 1 and 0 <= rank < num_workers, got "
                         f"batch_size={batch_size}, rank={rank}, num_workers={num_workers}")
    shard = dict(batch_size=batch_size, rank=rank, num_workers=num_workers, seed=seed)
    split = dict(train_per_class=train_per_class, validation=validation, validation_from=validation_from)
    if dataset not in IN_MEMORY and (train_per_class or validation):
        raise DataError(f"data.train_per_class and data.validation work on the in-memory datasets "
                        f"({', '.join(IN_MEMORY)}), not on {dataset}")
    if dataset == "digits":
        return _build_digits(shape, num_classes, shard, split)
    if dataset == "cifar10":
        return _build_cifar10(root, shape, num_classes, augment, shard, split, data_format)
    if dataset in ("mnist", "fashion_mnist"):
        return _build_idx(dataset, root, shape, num_classes, augment, shard, split)
    if dataset == "imagenet":
        return _build_imagenet(root, shape, num_classes, augment, preprocess_threads, shard)
    if dataset == "synthetic":
        return _build_synthetic(shape, num_classes, synthetic_samples, shard)
    raise DataError(f"unknown dataset {dataset!r}; valid names: {', '.join(DATASETS)}")


def data_from_config(cfg, rank, num_workers):
    """build_data with the config's data section: what a worker trains on (and what the front end
    reads once before any process starts, to refuse bad data with one line)."""
    d = cfg.data
    return build_data(d.dataset, batch_size=cfg.train.batch_size, rank=rank, num_workers=num_workers,
                      seed=cfg.seed, root=d.root, shape=tuple(d.shape) if d.shape else None,
                      num_classes=d.num_classes, synthetic_samples=d.synthetic_samples,
                      augment=d.augment, preprocess_threads=d.preprocess_threads,
                      train_per_class=d.train_per_class, validation=d.validation,
                      validation_from=d.validation_from, data_format=d.format)


# ---------------------------------------------------------------- in-memory datasets

class ShardedTrainSet:
    """An in-memory training set, iterated as this worker's shard of each epoch.

    `transform(images, rng)` turns a batch of stored images into float32 network input;
    None means the images are stored ready to use.
    """

    def __init__(self, images, labels, *, batch_size, rank, num_workers, seed,
                 transform=None):
        self._images = images
        self._labels = labels.astype(np.float32)
        self._batch_size = batch_size
        self._rank = rank
        self._num_workers = num_workers
        self._seed = seed
        self._transform = transform
        self.num_samples = len(labels)
        self.steps_per_epoch = _steps_per_epoch(self.num_samples, batch_size, num_workers)

    def epoch(self, epoch):
        """Yield exactly `steps_per_epoch` (data, label) NDArray batches for `epoch`."""
        # All workers draw the same permutation, so the strided shards are disjoint.
        perm = np.random.RandomState(self._seed + epoch).permutation(self.num_samples)
        shard = perm[self._rank::self._num_workers][:self.steps_per_epoch * self._batch_size]
        rng = np.random.RandomState(_augment_seed(self._seed, epoch, self._rank))
        for start in range(0, len(shard), self._batch_size):
            idx = shard[start:start + self._batch_size]
            images = self._images[idx]
            if self._transform is not None:
                images = self._transform(images, rng)
            yield _to_nd(images, self._labels[idx])


class TestSet:
    """An in-memory test set; `transform(images)` as in ShardedTrainSet, without randomness."""

    __test__ = False  # the name starts with "Test": keep pytest from collecting it

    def __init__(self, images, labels, transform=None):
        self._images = images
        self._labels = labels.astype(np.float32)
        self._transform = transform
        self.num_samples = len(labels)

    def batches(self, batch_size, part=0, parts=1):
        """Yield (data, label) NDArrays over the whole set once (parts > 1: batches part, part +
        parts, ... only); the last batch may be smaller."""
        for start in range(part * batch_size, self.num_samples, parts * batch_size):
            images = self._images[start:start + batch_size]
            if self._transform is not None:
                images = self._transform(images)
            yield _to_nd(images, self._labels[start:start + batch_size])


def _steps_per_epoch(num_train, batch_size, num_workers):
    steps = num_train // (num_workers * batch_size)
    if steps == 0:
        raise DataError(f"the training set has {num_train} samples, fewer than one global batch "
                        f"(num_workers {num_workers} x batch_size {batch_size}); lower the batch "
                        f"size or the number of workers, or use more data")
    return steps


def _augment_seed(seed, epoch, rank):
    # An explicit formula rather than hash(): hash() of str is salted per process.
    return (seed * 1000003 + epoch * 1009 + rank) % 2 ** 32


def _to_nd(images, labels):
    return mx.nd.array(images, dtype=np.float32), mx.nd.array(labels, dtype=np.float32)


def _check_shape(shape):
    shape = tuple(shape)
    if len(shape) != 3 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape):
        raise DataError(f"data.shape must be three positive integers (C, H, W), got {shape}")
    return tuple(int(d) for d in shape)


def _check_ten_classes(dataset, num_classes):
    if num_classes not in (None, 10):
        raise DataError(f"{dataset} has 10 classes; data.num_classes is {num_classes}")


# ---------------------------------------------------------------- digits

def _build_digits(shape, num_classes, shard, split):
    # Imported here: scikit-learn is only needed for this small test dataset.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    _check_ten_classes("digits", num_classes)
    shape = _check_shape(shape or (1, 8, 8))
    channels, height, width = shape
    scale = height // 8
    if channels not in (1, 3) or height != width or height != 8 * scale:
        raise DataError(f"digits supports data.shape (C, 8*m, 8*m) with C in {{1, 3}}, "
                        f"e.g. (1, 8, 8) or (3, 32, 32); got {shape}")
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.2, random_state=0, stratify=digits.target)

    def to_images(flat):
        # Pixels are 0..16; upscale each pixel to an m x m block and repeat it per channel.
        images = (flat / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
        images = np.kron(images, np.ones((1, 1, scale, scale), np.float32))
        return np.repeat(images, channels, axis=1)

    return _bundle(to_images(x_train), y_train, to_images(x_test), y_test, shard, split, shape)


# ---------------------------------------------------------------- cifar10

def _build_cifar10(root, shape, num_classes, augment, shard, split, fmt):
    _check_ten_classes("cifar10", num_classes)
    if shape is not None and tuple(shape) != (3, 32, 32):
        raise DataError(f"cifar10 images are (3, 32, 32); data.shape is {tuple(shape)}")
    form, path = _find_cifar10(root, fmt)
    if form == "recordio":
        (x_train, y_train), (x_test, y_test) = [_read_cifar_recordio(os.path.join(path, name))
                                                for name in _CIFAR_REC_FILES]
    else:
        files = _cifar_archive_files(path) if form == "archive" else _cifar_folder_files(path, form)
        parts = [_parse_cifar(name, raw, binary) for name, raw, binary in files]
        # Images stay uint8 (150 MB for the full train set) and are converted per batch.
        x_train = np.concatenate([images for images, _ in parts[:5]])
        y_train = np.concatenate([labels for _, labels in parts[:5]])
        x_test, y_test = parts[5]
    transform = _cifar_train_transform if augment else _cifar_eval_transform
    return _bundle(x_train, y_train, x_test, y_test, shard, split, (3, 32, 32), transform, _cifar_normalize)


def _cifar_candidates(root):
    """Every form of CIFAR-10 data.root can hold, in the order data.format auto looks for them:
    (format, the path its reader takes, the files that must exist)."""
    def inside(folder, names):
        return [os.path.join(folder, name) for name in names]
    candidates = []
    for form, (archive, subfolder, names) in _CIFAR_FORMS.items():
        for folder in (root, os.path.join(root, subfolder)):
            candidates.append((form, folder, inside(folder, names)))
    for archive, _, _ in _CIFAR_FORMS.values():
        candidates.append(("archive", os.path.join(root, archive), [os.path.join(root, archive)]))
    candidates.append(("recordio", root, inside(root, _CIFAR_REC_FILES)))
    return candidates


def _find_cifar10(root, fmt):
    """(format, path) of the first complete CIFAR-10 copy of format `fmt` (auto: any) in `root`."""
    if root is not None and os.path.isdir(root):
        for form, path, files in _cifar_candidates(root):
            if fmt in ("auto", form) and all(os.path.isfile(f) for f in files):
                return form, path
    kind = "CIFAR-10 copy" if fmt == "auto" else f"CIFAR-10 copy in format {fmt} (data.format)"
    where = "data.root is not set" if root is None else (
        f"folder {root!r} does not exist" if not os.path.isdir(root) else f"no complete {kind} found in {root!r}")
    layouts = {form: f"{form}: {', '.join(names)} (or in {subfolder}/)"
               for form, (_, subfolder, names) in _CIFAR_FORMS.items()}
    layouts["archive"] = f"archive: {' or '.join(a for a, _, _ in _CIFAR_FORMS.values())} as downloaded"
    layouts["recordio"] = f"recordio: {' and '.join(_CIFAR_REC_FILES)} made by im2rec"
    shown = [layouts[fmt]] if fmt != "auto" else list(layouts.values())
    raise DataError(f"cifar10: {where}. Nothing is downloaded; put one of these in data.root: " + "; ".join(shown))


def _cifar_folder_files(folder, form):
    """[(path, bytes, is_binary)] of the six batch files in `folder`."""
    names = _CIFAR_FORMS[form][2]
    out = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            out.append((os.path.join(folder, name), f.read(), form == "binary"))
    return out


def _cifar_archive_files(path):
    """[(name, bytes, is_binary)] of the six batch files inside an official .tar.gz archive."""
    form, subfolder, names = next((form, sub, names) for form, (archive, sub, names) in _CIFAR_FORMS.items()
                                  if os.path.basename(path) == archive)
    out = []
    try:
        with tarfile.open(path, "r:gz") as archive:
            for name in names:
                member = f"{subfolder}/{name}"
                try:
                    f = archive.extractfile(member)
                except KeyError:
                    f = None
                if f is None:
                    raise DataError(f"{path}: the archive has no file {member} (is it the official "
                                    f"{os.path.basename(path)}?)")
                out.append((f"{path}:{member}", f.read(), form == "binary"))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:   # a cut or damaged download
        raise DataError(f"{path}: not a readable .tar.gz archive: {err}") from None
    return out


def _parse_cifar(name, raw, binary):
    """(N, 3, 32, 32) uint8 images and N labels from one batch file's bytes; errors name `name`."""
    if binary:
        if len(raw) == 0 or len(raw) % _CIFAR_RECORD:
            raise DataError(f"{name} is truncated or corrupt: {len(raw)} bytes is not a positive "
                            f"multiple of the {_CIFAR_RECORD}-byte CIFAR-10 record")
        records = np.frombuffer(raw, np.uint8).reshape(-1, _CIFAR_RECORD)
        return _check_cifar(name, records[:, 1:], records[:, 0])
    try:
        # The official python version is a pickle of bytes-keyed dicts (written by
        # Python 2), hence encoding="bytes". It comes from the user's own data folder.
        batch = pickle.loads(raw, encoding="bytes")
        images = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"])
    except Exception as err:  # any unpickling failure means the same thing: a bad file
        raise DataError(f"{name} is not a readable CIFAR-10 python batch "
                        f"(a pickled dict with b'data' and b'labels'): {err!r}") from None
    if images.dtype != np.uint8:
        raise DataError(f"{name}: b'data' must be uint8, got {images.dtype}")
    return _check_cifar(name, images, labels)


def _check_cifar(path, flat_images, labels):
    """Validate (N, 3072) pixels and N labels in 0..9; return (N, 3, 32, 32) images, labels."""
    if flat_images.ndim != 2 or flat_images.shape[1] != 3 * 32 * 32 \
            or labels.shape != (len(flat_images),):
        raise DataError(f"{path}: expected data of shape (N, 3072) and N labels, got "
                        f"{flat_images.shape} and {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels must be in 0..9, found {labels.min()}..{labels.max()}")
    return flat_images.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _read_cifar_recordio(path):
    """(N, 3, 32, 32) uint8 RGB images and N labels of an im2rec .rec file of 32x32 images, read
    whole into memory (180 MB of pixels for CIFAR-10), so that training uses the same crop, flip and
    normalisation as the batch files."""
    import cv2  # MXNet's own dependency for packing and decoding RecordIO images
    with open(path, "rb") as f:
        raw = f.read()
    images, labels = [], []
    for number, (offset, body) in enumerate(_records(path, raw)):
        header, encoded = mx.recordio.unpack(body)
        label = _record_label(header)
        where = f"{path}: record {number} (id {header.id}, byte {offset})"
        if not (label == int(label) and 0 <= label <= 9):
            raise DataError(f"{where}: label {label:g}, CIFAR-10 labels are 0..9")
        image = cv2.imdecode(np.frombuffer(encoded, np.uint8), cv2.IMREAD_COLOR)
        if image is None or image.shape != (32, 32, 3):
            got = "not a decodable image" if image is None else f"a {image.shape[1]}x{image.shape[0]} image"
            raise DataError(f"{where}: {got}; CIFAR-10 images are 32x32 (im2rec without --resize)")
        images.append(image[:, :, ::-1].transpose(2, 0, 1))      # OpenCV's BGR rows -> RGB planes
        labels.append(int(label))
    if not images:
        raise DataError(f"{path} holds no records")
    return np.stack(images), np.array(labels, np.int64)


def _record_label(header):
    """The class label of an unpacked IRHeader (im2rec --pack-label stores a list: its first)."""
    return float(header.label if header.flag == 0 else header.label[0])


def _cifar_normalize(images):
    return (images.astype(np.float32) / 255 - _CIFAR_MEAN) / _CIFAR_STD


def _cifar_eval_transform(images, rng):  # train transform signature, without augmentation
    return _cifar_normalize(images)


def _cifar_train_transform(images, rng):
    """Random 32x32 crop of the 4-pixel zero-padded image, random horizontal flip, normalize."""
    return _cifar_normalize(random_crop_flip(images, rng, pad=4))


def random_crop_flip(images, rng, pad, flip=True):
    """Random crop of the `pad`-pixel zero-padded (N, C, H, W) images back to (H, W), and a random
    horizontal flip (unless flip=False): gluoncv's RandomCrop(size, pad) + RandomFlipLeftRight, on
    stored pixels (padding with 0 before normalizing, as gluoncv does)."""
    height, width = images.shape[2:]
    padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    offsets = rng.randint(0, 2 * pad + 1, size=(len(images), 2))
    flips = (rng.rand(len(images)) < 0.5) & flip
    out = np.empty_like(images)
    for i, ((dy, dx), flip) in enumerate(zip(offsets, flips)):
        crop = padded[i, :, dy:dy + height, dx:dx + width]
        out[i] = crop[:, :, ::-1] if flip else crop
    return out


# ---------------------------------------------------------------- mnist, fashion_mnist (IDX files)

def _build_idx(dataset, root, shape, num_classes, augment, shard, split):
    _check_ten_classes(dataset, num_classes)
    shape = _check_shape(shape or (1, idx.NATIVE_SIZE, idx.NATIVE_SIZE))
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

    return _bundle(x_train, y_train, x_test, y_test, shard, split, shape, train_transform, normalize)


# ---------------------------------------------------------------- imagenet (RecordIO)

class RecordTrainSet:
    """This worker's part of an im2rec RecordIO training set, decoded by ImageRecordIter."""

    def __init__(self, rec, idx, num_samples, *, shape, batch_size, rank, num_workers, seed,
                 augment, preprocess_threads):
        self._rec, self._idx = rec, idx
        self._shape = shape
        self._batch_size = batch_size
        self._rank = rank
        self._num_workers = num_workers
        self._seed = seed
        self._augment = augment
        self._preprocess_threads = preprocess_threads
        self.num_samples = num_samples
        self.steps_per_epoch = _steps_per_epoch(num_samples, batch_size, num_workers)

    def epoch(self, epoch):
        """Yield exactly `steps_per_epoch` (data, label) NDArray batches for `epoch`."""
        # A fresh iterator per epoch: its shuffle and augmentation seeds then depend on
        # (seed, epoch, rank) only, not on how many epochs this process ran before.
        if self._augment:
            augmentation = dict(random_resized_crop=True, min_random_area=0.08,
                                max_random_area=1, min_aspect_ratio=3 / 4,
                                max_aspect_ratio=4 / 3, rand_mirror=True)
        else:
            augmentation = dict(resize=_eval_resize(self._shape))
        records = mx.io.ImageRecordIter(
            path_imgrec=self._rec, path_imgidx=self._idx, data_shape=self._shape,
            batch_size=self._batch_size, shuffle=True, seed=self._seed + epoch,
            seed_aug=_augment_seed(self._seed, epoch, self._rank),
            part_index=self._rank, num_parts=self._num_workers,
            preprocess_threads=self._preprocess_threads, **augmentation, **_IMAGENET_NORM)
        for _ in range(self.steps_per_epoch):
            try:
                batch = records.next()
            except StopIteration:
                # Parts may differ by a record; restart a short part so that every worker
                # yields the same number of batches.
                records.reset()
                batch = records.next()
            yield _on_cpu(batch)


class RecordTestSet:
    """An im2rec RecordIO validation set: resize, center crop, normalize."""

    def __init__(self, rec, num_samples, *, shape, preprocess_threads):
        self._rec = rec
        self._shape = shape
        self._preprocess_threads = preprocess_threads
        self.num_samples = num_samples

    def batches(self, batch_size, part=0, parts=1):
        """Yield (data, label) NDArrays over the whole set once; the last batch may be smaller.
        parts > 1: batches part, part + parts, ... only. Every record is still decoded (the record
        file's own partitioning splits by bytes, so the shares' sizes would not be known)."""
        records = mx.io.ImageRecordIter(
            path_imgrec=self._rec, data_shape=self._shape, batch_size=batch_size,
            resize=_eval_resize(self._shape), round_batch=False,
            preprocess_threads=self._preprocess_threads, **_IMAGENET_NORM)
        # The last batch is filled up with junk and its `pad` is not reliable with
        # round_batch=False, so cut it by counting against the number of records.
        remaining = self.num_samples
        for i, batch in enumerate(records):
            if remaining <= 0:
                break
            n = min(batch_size, remaining)
            if i % parts == part:
                data, label = _on_cpu(batch)
                yield data[:n], label[:n]
            remaining -= n


def _on_cpu(batch):
    """(data, label) of an ImageRecordIter batch on cpu(0). The iterator hands out cpu_pinned(0)
    arrays (also with ctx='cpu'), and a hybridized network refuses inputs off its parameters'
    context; one copy per batch is small next to the forward pass."""
    return batch.data[0].as_in_context(mx.cpu()), batch.label[0].as_in_context(mx.cpu())


def _eval_resize(shape):
    # Resize the shorter side to 256/224 of the crop (256 for 224), then center crop.
    return int(round(256 * max(shape[1:]) / 224))


def _build_imagenet(root, shape, num_classes, augment, preprocess_threads, shard):
    shape = _check_shape(shape or (3, 224, 224))
    if shape[0] != 3:
        raise DataError(f"imagenet images are RGB: data.shape must be (3, H, W), got {shape}")
    shown = root or "<data.root>"
    paths = {name: os.path.join(shown, name) for name in _IMAGENET_FILES}
    missing = [path for path in paths.values() if root is None or not os.path.isfile(path)]
    if missing:
        # im2rec writes <prefix>.lst/.rec/.idx, so prefixes inside the data folder put the
        # files where they belong.
        train, val = os.path.join(shown, "train"), os.path.join(shown, "val")
        raise DataError(
            f"imagenet: missing {', '.join(missing)}. Nothing is downloaded; put the im2rec "
            f"RecordIO files {', '.join(_IMAGENET_FILES)} in {shown!r}. Make them from "
            f"folders with one sub-folder of JPEGs per class (val/ arranged like train/) "
            f"with MXNet's im2rec (also tools/im2rec.py in the MXNet sources):\n"
            f"  python -m mxnet.tools.im2rec --list --recursive {train} /path/to/train\n"
            f"  python -m mxnet.tools.im2rec --resize 256 --quality 95 --num-thread 8 "
            f"{train} /path/to/train\n"
            f"and the same two commands with {val} /path/to/val.")
    num_classes = num_classes or 1000
    num_train = _check_recordio(paths["train.rec"], paths["train.idx"], num_classes)
    num_val = _check_recordio(paths["val.rec"], paths["val.idx"], num_classes)
    return DataBundle(
        train=RecordTrainSet(paths["train.rec"], paths["train.idx"], num_train, shape=shape,
                             augment=augment, preprocess_threads=preprocess_threads, **shard),
        test=RecordTestSet(paths["val.rec"], num_val, shape=shape,
                           preprocess_threads=preprocess_threads),
        num_classes=num_classes, image_shape=shape)


def _check_recordio(rec, idx, num_classes):
    """Validate a .rec/.idx pair and every record's label; return the number of records.

    ImageRecordIter would otherwise fail (or abort) deep inside a worker mid-epoch, and a label
    beyond the classes would train silently wrong (the loss clips it to the last class). Reads
    the 36 bytes at each offset the .idx lists (the record head and its image header), not the
    images: 1.3 M records on ImageNet.
    """
    try:
        reader = mx.recordio.MXIndexedRecordIO(idx, rec, "r")
    except (ValueError, IndexError) as err:
        raise DataError(f"{idx} is not an im2rec index (lines of 'key<TAB>offset'): {err}") from None
    offsets = reader.idx
    reader.close()
    if not offsets:
        raise DataError(f"{idx} lists no records")
    size = os.path.getsize(rec)
    with open(rec, "rb") as f:
        for key, offset in sorted(offsets.items(), key=lambda item: item[1]):
            if offset >= size:
                raise DataError(f"{rec} is truncated or does not belong to {idx}: {idx} points "
                                f"at byte {offset} (record {key}) but {rec} has {size} bytes")
            f.seek(offset)
            head = f.read(_RECORD_HEAD.size + _IR_HEADER.size + 4)
            _record_part(rec, head, offset, size, f"record {key}")
            flag, label = _IR_HEADER.unpack_from(head, _RECORD_HEAD.size)[:2]
            if flag > 0 and len(head) == _RECORD_HEAD.size + _IR_HEADER.size + 4:
                label = struct.unpack_from("<f", head, _RECORD_HEAD.size + _IR_HEADER.size)[0]
            if not (label == int(label) and 0 <= label < num_classes):
                raise DataError(f"{rec}: record {key} (byte {offset}) has label {label:g}, outside "
                                f"0..{num_classes - 1} (data.num_classes {num_classes})")
    return len(offsets)


# dmlc RecordIO, the format of MXNet's .rec files: each part of a record is the magic word, a word
# (continuation flag << 29 | length), then the payload padded to 4 bytes. A payload holding the
# magic word is split there into parts (flags 1, 2.., 3), which a reader joins with the magic word.
_RECORD_MAGIC = 0xCED7230A
_RECORD_HEAD = struct.Struct("<II")
_IR_HEADER = struct.Struct("<IfQQ")      # MXNet's image record header: flag, label, id, id2


def _record_part(path, head, offset, size, what):
    """(payload length, continuation flag) of the record part at `offset` of `path` (`size`
    bytes), from its first bytes `head`; DataError if it is not there whole."""
    if len(head) < _RECORD_HEAD.size:
        raise DataError(f"{path} is truncated: {what} at byte {offset} is cut off")
    magic, word = _RECORD_HEAD.unpack_from(head)
    if magic != _RECORD_MAGIC:
        raise DataError(f"{path} is corrupt or not RecordIO: no record starts at byte {offset} ({what})")
    length = word & ((1 << 29) - 1)
    if offset + _RECORD_HEAD.size + length > size:
        raise DataError(f"{path} is truncated: {what} at byte {offset} needs "
                        f"{_RECORD_HEAD.size + length} bytes, the file ends at byte {size}")
    return length, word >> 29


def _records(path, raw):
    """(offset, payload) of every record in the bytes `raw` of RecordIO file `path`."""
    pos, number = 0, 0
    while pos < len(raw):
        start, parts = pos, []
        while True:
            length, flag = _record_part(path, raw[pos:pos + _RECORD_HEAD.size], pos, len(raw),
                                        f"record {number}")
            parts.append(raw[pos + _RECORD_HEAD.size:pos + _RECORD_HEAD.size + length])
            pos += _RECORD_HEAD.size + (length + 3) // 4 * 4
            if flag in (0, 3):
                break
        yield start, struct.pack("<I", _RECORD_MAGIC).join(parts)
        number += 1


# ---------------------------------------------------------------- synthetic

def _build_synthetic(shape, num_classes, num_samples, shard):
    shape = _check_shape(shape or (3, 32, 32))
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
