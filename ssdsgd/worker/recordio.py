"""RecordIO (MXNet's .rec files, made by im2rec): ImageNet-style training and validation sets decoded by
ImageRecordIter, the check of a .rec/.idx pair and its labels before any worker trains on it, and a
reader of the records themselves (for CIFAR-10 packed as RecordIO).
"""
import collections
import contextlib
import os
import re
import struct

import numpy as np

# MXNet only where a set is read (import_mxnet() there): the front end checks the files (build_imagenet,
# _check_recordio) and reads CIFAR-10's RecordIO form without it (seconds of CPU in every job's launcher).
from ssdsgd.lean_mxnet import import_mxnet
from ssdsgd.worker.datasets import DataBundle, DataError, augment_seed, check_shape, steps_per_epoch

# The standard ResNet ImageNet normalization, on 0..255 RGB pixels.
_IMAGENET_NORM = dict(mean_r=123.68, mean_g=116.779, mean_b=103.939,
                      std_r=58.393, std_g=57.12, std_b=57.375)
_IMAGENET_FILES = ["train.rec", "train.idx", "val.rec", "val.idx"]


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
        self.steps_per_epoch = steps_per_epoch(num_samples, batch_size, num_workers)

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
        where = f"rank {self._rank}'s part, epoch {epoch}"
        with _reading(self._rec, where):          # it decodes its first batches at once
            records = import_mxnet().io.ImageRecordIter(
                path_imgrec=self._rec, path_imgidx=self._idx, data_shape=self._shape,
                batch_size=self._batch_size, shuffle=True, seed=self._seed + epoch,
                seed_aug=augment_seed(self._seed, epoch, self._rank),
                part_index=self._rank, num_parts=self._num_workers,
                preprocess_threads=self._preprocess_threads, **augmentation, **_IMAGENET_NORM)
        for step in range(self.steps_per_epoch):
            with _reading(self._rec, f"{where}, batch {step + 1} of {self.steps_per_epoch}"):
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
        with _reading(self._rec, "evaluation"):
            records = iter(import_mxnet().io.ImageRecordIter(
                path_imgrec=self._rec, data_shape=self._shape, batch_size=batch_size,
                resize=_eval_resize(self._shape), round_batch=False,
                preprocess_threads=self._preprocess_threads, **_IMAGENET_NORM))
        # The last batch is filled up with junk and its `pad` is not reliable with
        # round_batch=False, so cut it by counting against the number of records.
        remaining, i = self.num_samples, 0
        while remaining > 0:
            with _reading(self._rec, f"evaluation, batch {i + 1}"):
                batch = next(records, None)
            if batch is None:
                break
            n = min(batch_size, remaining)
            if i % parts == part:
                data, label = _on_cpu(batch)
                yield data[:n], label[:n]
            remaining -= n
            i += 1


@contextlib.contextmanager
def _reading(rec, where):
    """MXNet's errors while ImageRecordIter reads rec (a record whose image does not decode) as one
    DataError line naming the file, where the reader was, and MXNet's reason; the records' heads and
    labels are checked before the start (_check_recordio), their images are not (1.3 M decodes).
    MXNet decodes a few batches ahead, so the image may be in a batch after the one named."""
    try:
        yield
    except import_mxnet().base.MXNetError as err:
        raise DataError(f"{rec}: {decode_problem(err, where)}") from None


def decode_problem(err, where):
    """MXNet's last line, in words where it is OpenCV's assertion about an image that decoded to nothing."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1].removeprefix("MXNetError: ") if lines else "MXNet gave no reason"
    last = re.sub(r"^OpenCV\([^)]*\) \S+: error: ", "OpenCV: ", last)     # not OpenCV's own source path
    if "!ssize.empty()" in last or "!buf.empty()" in last:
        return f"cannot decode an image ({where}): a record holds no valid JPEG or PNG ({last})"
    return f"cannot read it ({where}): {last}"


def _on_cpu(batch):
    """(data, label) of an ImageRecordIter batch on cpu(0). The iterator hands out cpu_pinned(0)
    arrays (also with ctx='cpu'), and a hybridized network refuses inputs off its parameters'
    context; one copy per batch is small next to the forward pass."""
    mx = import_mxnet()
    return batch.data[0].as_in_context(mx.cpu()), batch.label[0].as_in_context(mx.cpu())


def _eval_resize(shape):
    # Resize the shorter side to 256/224 of the crop (256 for 224), then center crop.
    return int(round(256 * max(shape[1:]) / 224))


def build_imagenet(root, shape, num_classes, augment, preprocess_threads, shard):
    shape = check_shape(shape or (3, 224, 224))
    if shape[0] != 3:
        raise DataError(f"imagenet images are RGB: data.shape must be (3, H, W), got {shape}")
    shown = root or "<data.root>"
    paths = {name: os.path.join(shown, name) for name in _IMAGENET_FILES}
    missing = [path for path in paths.values() if root is None or not os.path.isfile(path)]
    if missing:
        # im2rec writes <prefix>.lst/.rec/.idx, so prefixes inside the data folder put the
        # files where they belong.
        # One line, like every bad-data message (docs/design.md: What you see when something goes wrong).
        train, val = os.path.join(shown, "train"), os.path.join(shown, "val")
        raise DataError(
            f"imagenet: missing {', '.join(missing)}. Nothing is downloaded; put the im2rec "
            f"RecordIO files {', '.join(_IMAGENET_FILES)} in {shown!r} (each .idx is written with its .rec). "
            f"Make them from folders with one sub-folder of JPEGs per class (val/ arranged like train/) "
            f"with MXNet's im2rec: 'python -m mxnet.tools.im2rec --list --recursive {train} /path/to/train', "
            f"then 'python -m mxnet.tools.im2rec --resize 256 --quality 95 --num-thread 8 {train} /path/to/train', "
            f"and the same two commands with {val} /path/to/val")
    num_classes = num_classes or 1000
    num_train = _check_recordio(paths["train.rec"], paths["train.idx"], num_classes)
    num_val = _check_recordio(paths["val.rec"], paths["val.idx"], num_classes)
    return DataBundle(
        train=RecordTrainSet(paths["train.rec"], paths["train.idx"], num_train, shape=shape,
                             augment=augment, preprocess_threads=preprocess_threads, **shard),
        test=RecordTestSet(paths["val.rec"], num_val, shape=shape,
                           preprocess_threads=preprocess_threads),
        num_classes=num_classes, image_shape=shape, source=f"RecordIO in {root}")


def _check_recordio(rec, idx, num_classes):
    """Validate a .rec/.idx pair and every record's label; return the number of records.

    ImageRecordIter would otherwise fail (or abort) deep inside a worker mid-epoch, and a label
    beyond the classes would train silently wrong (the loss clips it to the last class). Reads
    the 36 bytes at each offset the .idx lists (the record head and its image header), not the
    images: 1.3 M records on ImageNet.
    """
    offsets = read_index(idx)
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


def read_index(idx):
    """{key: byte offset} of an im2rec .idx file (lines of 'key<TAB>offset'), as MXIndexedRecordIO reads it."""
    offsets = {}
    with open(idx) as f:
        for line in f:
            try:
                key, offset = line.strip().split("\t")[:2]
                offsets[int(key)] = int(offset)
            except ValueError as err:
                raise DataError(f"{idx} is not an im2rec index (lines of 'key<TAB>offset'): {err}") from None
    return offsets


ImageHeader = collections.namedtuple("ImageHeader", "flag label id id2")   # mxnet.recordio.IRHeader's fields


def unpack_image(payload):
    """(header, image bytes) of an image record's payload, as mxnet.recordio.unpack splits it: flag > 0
    means the label is that many float32 values after the header."""
    header = ImageHeader(*_IR_HEADER.unpack_from(payload))
    rest = payload[_IR_HEADER.size:]
    if header.flag > 0:
        header = header._replace(label=np.frombuffer(rest, np.float32, header.flag))
        rest = rest[header.flag * 4:]
    return header, rest


def records(path, raw):
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


def record_label(header):
    """The class label of an unpacked IRHeader (im2rec --pack-label stores a list: its first)."""
    return float(header.label if header.flag == 0 else header.label[0])
