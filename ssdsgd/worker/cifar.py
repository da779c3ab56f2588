"""CIFAR-10 in each form a user may have: the binary or python batch files (in data.root or the folder
the official archive unpacks to), the official .tar.gz archives themselves, or im2rec RecordIO files
of the 32x32 images. Whatever the form, the images are read whole into memory as uint8 and
augmented per batch with gluoncv's CIFAR-10 recipe (crop of the 4-pixel padded image, flip, normalise).
"""
import dataclasses
import os
import pickle
import tarfile
import zlib

import numpy as np

from ssdsgd.worker.datasets import DataError, check_ten_classes, in_memory_bundle, random_crop_flip
from ssdsgd.worker.recordio import record_label, records, unpack_image

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


def build_cifar10(root, shape, num_classes, augment, shard, split, fmt):
    check_ten_classes("cifar10", num_classes)
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
    bundle = in_memory_bundle(x_train, y_train, x_test, y_test, shard, split, (3, 32, 32), transform, _cifar_normalize)
    return dataclasses.replace(bundle, source=f"{form} form in {path}")


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
    partial = []                         # (files found, form, the files missing) of incomplete copies
    if root is not None and os.path.isdir(root):
        for form, path, files in _cifar_candidates(root):
            if fmt not in ("auto", form):
                continue
            missing = [f for f in files if not os.path.isfile(f)]
            if not missing:
                return form, path
            if len(missing) < len(files):
                partial.append((len(files) - len(missing), form, missing))
    kind = "CIFAR-10 copy" if fmt == "auto" else f"CIFAR-10 copy in format {fmt} (data.format)"
    where = "data.root is not set" if root is None else (
        f"folder {root!r} does not exist" if not os.path.isdir(root) else f"no complete {kind} found in {root!r}")
    if partial:                          # name what the most complete copy lacks
        _, form, missing = max(partial, key=lambda p: p[0])
        where += f" (the {form} copy there lacks {', '.join(missing)})"
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
    import cv2  # MXNet's dependency for RecordIO images, slow to import: only this form of CIFAR-10 needs it
    with open(path, "rb") as f:
        raw = f.read()
    images, labels = [], []
    for number, (offset, body) in enumerate(records(path, raw)):
        header, encoded = unpack_image(body)
        label = record_label(header)
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


def _cifar_normalize(images):
    return (images.astype(np.float32) / 255 - _CIFAR_MEAN) / _CIFAR_STD


def _cifar_eval_transform(images, rng):  # train transform signature, without augmentation
    return _cifar_normalize(images)


def _cifar_train_transform(images, rng):
    """Random 32x32 crop of the 4-pixel zero-padded image, random horizontal flip, normalize."""
    return _cifar_normalize(random_crop_flip(images, rng, pad=4))

