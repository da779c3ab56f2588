"""What every data reader shares: DataError, the DataBundle a reader returns, the in-memory training
shard and test set (with the train/validation split), the steps per epoch, the seeds and the checks.

Every worker must run the same number of steps per epoch (the parameter server waits for all of them
at each step), so `steps_per_epoch` is derived from the whole training set and is identical on all
ranks. Batch order and augmentation depend only on (seed, epoch, rank), so a run can be repeated
exactly. MXNet is imported only to hand out batches: the front end counts a training set without it.
"""
from dataclasses import dataclass

import numpy as np

from ssdsgd.config import VALIDATION_SOURCES
from ssdsgd.errors import JobError


class DataError(JobError):
    """Bad or missing data; message says what to put where."""


@dataclass
class DataBundle:
    train: object  # ShardedTrainSet or recordio.RecordTrainSet: this worker's shard of the training set
    test: object   # TestSet or recordio.RecordTestSet: the full test set, or the validation split
    num_classes: int
    image_shape: tuple  # (C, H, W)
    eval_set: str = "test"  # what `test` holds: "test" or "validation"
    notes: tuple = ()       # what the user should know of how the data was cut (rank 0 prints them)
    source: str = ""        # where it was read from, and in which form where a data set has several


VALIDATION_SEED = 20240607  # fixed: every run and seed validates on the same images


def split_train(x, y, train_per_class=None, validation=0, validation_from="subset", train_offset=0):
    """(train x, train y, validation x or None, validation y or None).

    train_per_class: keep the first n images of each class (in file order), e.g. a fixed
    class-balanced subset; train_offset skips the first n of each class before that, so that
    offsets 0, n, 2n, ... give disjoint subsets of the same size. validation: a fraction in (0, 1)
    or a count of images, drawn with a fixed seed, so the split never depends on the run's seed.
    validation_from "subset" carves them out of the kept training images; "rest" draws them from
    the training images train_per_class leaves out, so the training subset (and the schedule)
    stays exactly that of the test runs, and the held-out set can be far larger than a slice of the subset."""
    if validation_from not in VALIDATION_SOURCES:
        raise DataError(f"data.validation_from: one of {', '.join(VALIDATION_SOURCES)}, got {validation_from!r}")
    if validation_from == "rest" and not train_per_class:
        raise DataError("data.validation_from: 'rest' draws from the training images that data.train_per_class "
                        "leaves out; set data.train_per_class too")
    kept = np.arange(len(y))
    if train_per_class or train_offset:
        end = train_offset + train_per_class if train_per_class else None
        per_class = [np.flatnonzero(y == c) for c in np.unique(y)]
        short = min(len(ix) for ix in per_class)
        if train_offset >= short:
            raise DataError(f"data.train_offset: {train_offset} skips every training image of a class that has "
                            f"{short}; it must be below {short}")
        kept = np.sort(np.concatenate([ix[train_offset:end] for ix in per_class]))
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


def short_classes_note(y, train_per_class=None, train_offset=0, **_):
    """A line naming the classes that hold fewer than data.train_per_class images after data.train_offset
    (they keep all they have, so the subset is not class-balanced), or None."""
    if not train_per_class:
        return None
    classes, counts = np.unique(y, return_counts=True)
    left = counts - train_offset
    short = [f"{int(c)}: {int(n)}" for c, n in zip(classes, left) if n < train_per_class]
    if not short:
        return None
    return (f"data.train_per_class: {train_per_class} asked, but {len(short)} of {len(classes)} classes have fewer"
            + (f" after data.train_offset {train_offset}" if train_offset else "")
            + f" and keep all they have ({', '.join(short[:5])}{', ...' if len(short) > 5 else ''})")


def in_memory_bundle(x_train, y_train, x_test, y_test, shard, split, image_shape, train_transform=None,
                     test_transform=None):
    """Training shard plus the test set, or the validation split carved from the training set."""
    note = short_classes_note(y_train, **split)
    x_train, y_train, x_val, y_val = split_train(x_train, y_train, **split)
    eval_set = "test"
    if x_val is not None:
        x_test, y_test, eval_set = x_val, y_val, "validation"
    return DataBundle(train=ShardedTrainSet(x_train, y_train, transform=train_transform, **shard),
                      test=TestSet(x_test, y_test, transform=test_transform),
                      num_classes=10, image_shape=image_shape, eval_set=eval_set,
                      notes=(note,) if note else ())


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
        self.steps_per_epoch = steps_per_epoch(self.num_samples, batch_size, num_workers)

    def epoch(self, epoch):
        """Yield exactly `steps_per_epoch` (data, label) NDArray batches for `epoch`."""
        # All workers draw the same permutation, so the strided shards are disjoint.
        perm = np.random.RandomState(self._seed + epoch).permutation(self.num_samples)
        shard = perm[self._rank::self._num_workers][:self.steps_per_epoch * self._batch_size]
        rng = np.random.RandomState(augment_seed(self._seed, epoch, self._rank))
        for start in range(0, len(shard), self._batch_size):
            idx = shard[start:start + self._batch_size]
            images = self._images[idx]
            if self._transform is not None:
                images = self._transform(images, rng)
            yield to_nd(images, self._labels[idx])


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
            yield to_nd(images, self._labels[start:start + batch_size])


def steps_per_epoch(num_train, batch_size, num_workers):
    steps = num_train // (num_workers * batch_size)
    if steps == 0:
        raise DataError(f"the training set has {num_train} samples, fewer than one global batch "
                        f"(num_workers {num_workers} x batch_size {batch_size}); lower the batch "
                        f"size or the number of workers, or use more data")
    return steps


def augment_seed(seed, epoch, rank):
    # An explicit formula rather than hash(): hash() of str is salted per process.
    return (seed * 1000003 + epoch * 1009 + rank) % 2 ** 32


def to_nd(images, labels):
    import mxnet as mx   # not at import: the front end counts the in-memory data sets without MXNet
    return mx.nd.array(images, dtype=np.float32), mx.nd.array(labels, dtype=np.float32)


def check_shape(shape):
    shape = tuple(shape)
    if len(shape) != 3 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape):
        raise DataError(f"data.shape must be three positive integers (C, H, W), got {shape}")
    return tuple(int(d) for d in shape)


def check_ten_classes(dataset, num_classes):
    if num_classes not in (None, 10):
        raise DataError(f"{dataset} has 10 classes; data.num_classes is {num_classes}")


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

