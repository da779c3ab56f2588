"""Training and test data for ssdsgd workers: `build_data` picks the reader of a data set and returns
this worker's shard of the training set plus the full test set (a DataBundle).

The readers: small_sets.py (digits, MNIST and Fashion-MNIST from IDX files, synthetic), cifar.py
(CIFAR-10 in its batch-file, archive and RecordIO forms), recordio.py (ImageNet-style RecordIO);
what they share (the in-memory sets, the split, DataError) is in datasets.py.

Nothing is ever downloaded: cifar10 and imagenet must already be on local disk, and a
missing or damaged file raises `DataError` saying what to put where.
"""
from ssdsgd.config import DATASETS, ROOTED_DATASETS
from ssdsgd.config import IN_MEMORY_DATASETS as IN_MEMORY
from ssdsgd.worker import small_sets
from ssdsgd.worker.datasets import (  # noqa: F401 (the API)
    VALIDATION_SEED, DataBundle, DataError, short_classes_note, split_train)
from ssdsgd.worker.datasets import steps_per_epoch


def build_data(dataset, *, batch_size, rank, num_workers, seed, root=None, shape=None,
               num_classes=None, synthetic_samples=1024, augment=True,
               preprocess_threads=2, train_per_class=None, validation=0,
               validation_from="subset", data_format="auto", train_offset=0) -> DataBundle:
    """Load `dataset` and return this worker's training shard and the full test set.

    `root` is the data folder (cifar10, imagenet, mnist, fashion_mnist), `shape` the (C, H, W)
    image shape (default per dataset), `num_classes` is used by imagenet and synthetic and must
    be 10 (or None) for the others.
    In-memory datasets (digits, cifar10, mnist, fashion_mnist) can be cut down and split:
    `train_per_class` keeps the first n training images of each class (after the first
    `train_offset`, which picks another subset of the same size); `validation` (a fraction
    below 1, or a count) then moves a fixed, seed-independent random part of those into a
    validation set, which replaces the test set as `DataBundle.test` (`eval_set` says which);
    `validation_from="rest"` draws it from the images `train_per_class` leaves out instead.
    `data_format` (cifar10 only) picks the form of the copy in `root` (config.CIFAR_FORMATS).
    """
    if not 0 <= rank < num_workers or batch_size < 1:
        raise ValueError(f"need batch_size >= 1 and 0 <= rank < num_workers, got "
                         f"batch_size={batch_size}, rank={rank}, num_workers={num_workers}")
    shard = dict(batch_size=batch_size, rank=rank, num_workers=num_workers, seed=seed)
    split = dict(train_per_class=train_per_class, validation=validation, validation_from=validation_from,
                 train_offset=train_offset)
    cut = [f"data.{key}" for key, value in split.items() if value and key != "validation_from"]
    if dataset not in IN_MEMORY and cut:
        raise DataError(f"{' and '.join(cut)}: work on the in-memory datasets ({', '.join(IN_MEMORY)}), "
                        f"not on {dataset}")
    if dataset == "digits":
        return small_sets.build_digits(shape, num_classes, shard, split)
    if dataset in ("mnist", "fashion_mnist"):
        return small_sets.build_idx(dataset, root, shape, num_classes, augment, shard, split)
    if dataset == "synthetic":
        return small_sets.build_synthetic(shape, num_classes, synthetic_samples, shard)
    # Imported when asked for: they import MXNet, which the front end need not pay for to count digits.
    if dataset == "cifar10":
        from ssdsgd.worker.cifar import build_cifar10
        return build_cifar10(root, shape, num_classes, augment, shard, split, data_format)
    if dataset == "imagenet":
        from ssdsgd.worker.recordio import build_imagenet
        return build_imagenet(root, shape, num_classes, augment, preprocess_threads, shard)
    raise DataError(f"unknown dataset {dataset!r}; valid names: {', '.join(DATASETS)}")


def data_from_config(cfg, rank, num_workers):
    """build_data with the config's data section: what a worker trains on (and what the front end
    reads once before any process starts, to refuse bad data with one line)."""
    d = cfg.data
    return build_data(d.dataset, batch_size=cfg.train.batch_size, rank=rank, num_workers=num_workers,
                      seed=cfg.seed, root=d.root, shape=tuple(d.shape) if d.shape else None,
                      num_classes=d.num_classes, synthetic_samples=d.synthetic_samples,
                      augment=d.augment, preprocess_threads=d.preprocess_threads, data_format=d.format,
                      **split_settings(d))


def split_settings(d):
    """The data section's keys that cut and split an in-memory training set (datasets.split_train's)."""
    return dict(train_per_class=d.train_per_class, validation=d.validation, validation_from=d.validation_from,
                train_offset=d.train_offset)


def check_data(cfg):
    """Raise the DataError every worker would meet, once, before any process starts (the front end's
    preflight). A data set on disk is read as rank 0 will read it; digits and synthetic are counted with
    their checks, not read (their sizes follow from the settings; drawing synthetic images would take up to
    gigabytes), so that a batch larger than the data set is refused too."""
    d, workers = cfg.data, cfg.cluster.workers
    if d.dataset in ROOTED_DATASETS:
        data_from_config(cfg, 0, workers)
        return
    shape = tuple(d.shape) if d.shape else None
    if d.dataset == "digits":
        images = small_sets.count_digits(shape, d.num_classes, split_settings(d))
    else:
        images = small_sets.count_synthetic(shape, d.synthetic_samples)
    steps_per_epoch(images, cfg.train.batch_size, workers)
