"""Wire format of one mailbox message, [header, payload]: its encoding on the worker (see
encode_sparse, encode_message) and its decoding on the server (numpy): WireFormat, one frozen description
of a mailbox's messages. Nothing else knows it.

Every message is a single NDArray pushed to a mailbox key whose size is fixed at kv.init (a dense
payload stays in mx.nd ops; a sparse payload is built on the host, see encoders.py):

fp32 wire (default), float32 message:
  header  [round, rank]
  dense   the buffer's gradient, `size` values.
  sparse  `k` indices then `k` values. The indices are offsets inside the buffer; buffers are capped
          at 2**24 elements so every index is an exact float32 integer. 8 bytes per sent value, as
          an int32 + fp32 format would take.
  sparse, bitmap index coding (compression.index_coding: auto, when it is the smaller form: `k`
          above 1/24 of the buffer, about 4.2% density): ceil(size / 24) bitmap words, then the `k`
          values in increasing index order. Word w holds bits 24w .. 24w + 23 of the buffer's
          selection mask as an integer below 2**24 (exact in float32), most significant bit first.
          4 bytes per sent value plus size / 6 bytes per message, whatever k is. Needs distinct
          indices (every registered sparsifier selects without repeats).
fp16 wire (compression.fp16_values), float16 message, sparse only:
  header  [round // 2048, round % 2048, rank]
  sparse  `k` high index digits, `k` low index digits (index = high * 2048 + low), `k` values.
          fp16 holds every integer below 2048 exactly, so two digits carry an index exactly; buffers
          are capped at 2**22 elements. 6 bytes per sent value. Values beyond the fp16 range are
          clipped on the worker and what clipping and rounding lost stays in its error-feedback
          residual (encoders.py).

On the server a dense payload decodes to the float32 array itself and a sparse payload to a
`SparseGrad` (the distinct indices and their float32 sums), which `SparseGrad.add_to` scatter-adds
into the round's accumulator: decoding and adding one message cost O(k), not O(buffer size) (a
bitmap message O(size / 24 + k), and it is chosen only where size / 24 < k).

mxnet is imported inside the encoding functions only: the server imports this module before it may
import mxnet (see ssdsgd.ps.server.run_server).
"""
import threading
from dataclasses import asdict, dataclass, fields
from typing import Optional

import numpy as np

BITMAP_BITS = 24                       # bits of the selection mask per float32 word (exact below 2**24)
DIGIT = 2048                           # fp16 represents every integer in [0, 2048] exactly
MAX_BUFFER_ELEMENTS = 1 << 24          # float32 represents every integer below 2**24 exactly
MAX_BUFFER_ELEMENTS_FP16 = DIGIT * DIGIT
MAX_ROUND_FP16 = DIGIT * DIGIT - 1
FP16_MAX = 65504.0


def max_buffer_elements(fp16=False):
    return MAX_BUFFER_ELEMENTS_FP16 if fp16 else MAX_BUFFER_ELEMENTS


def wire_dtype(fp16=False):
    """The dtype of a message on the wire (and of its mailbox key)."""
    return "float16" if fp16 else "float32"


def header_length(fp16=False):
    return 3 if fp16 else 2


def _sparse_parts(fp16):
    """Numbers on the wire per sent value: index (two digits on the fp16 wire) and value."""
    return 3 if fp16 else 2


def bitmap_words(size):
    """float32 words of a selection mask over `size` elements."""
    return -(-size // BITMAP_BITS)


def use_bitmap(size, k, index_coding="auto", fp16=False):
    """Does a sparse message of k of `size` values carry its indices as a bitmap? Under
    compression.index_coding: auto when the bitmap is smaller than the k-index list (fp32 wire
    only: the fp16 wire keeps its index digits); `list`: never."""
    if index_coding not in ("auto", "list"):
        raise ValueError(f"unknown index coding {index_coding!r}")
    return index_coding == "auto" and not fp16 and bitmap_words(size) < k


def pack_bitmap(idx, size):
    """The selection mask of the distinct indices `idx` (< size) as float32 words of 24 bits."""
    bits = np.zeros(bitmap_words(size) * BITMAP_BITS, np.uint8)
    bits[idx] = 1
    octets = np.packbits(bits).reshape(-1, 3).astype(np.uint32)
    return ((octets[:, 0] << 16) | (octets[:, 1] << 8) | octets[:, 2]).astype(np.float32)


def unpack_bitmap(words, size):
    """The indices (int64, increasing) a pack_bitmap mask over `size` elements marks. ValueError
    for a mask that pack_bitmap cannot have made (a word that is not an integer in [0, 2**24), a
    bit at or beyond `size`)."""
    words = np.asarray(words)
    if words.shape != (bitmap_words(size),):
        raise ValueError(f"bitmap of {words.shape[0]} words, expected {bitmap_words(size)} for {size} elements")
    # Range first, so that no NaN or inf reaches the integer cast.
    if not (np.isfinite(words) & (words >= 0) & (words < 1 << BITMAP_BITS)).all() or (words % 1).any():
        raise ValueError("bitmap word is not an integer in [0, 2**24)")
    ints = words.astype(np.int64)
    octets = np.stack([ints >> 16, (ints >> 8) & 255, ints & 255], axis=1).astype(np.uint8)
    idx = np.flatnonzero(np.unpackbits(octets.ravel()))
    if idx.size and idx[-1] >= size:
        raise ValueError(f"bitmap marks index {idx[-1]}, beyond the buffer's {size} elements")
    return idx


def bitmap_indices(words, size, count):
    """unpack_bitmap, and the mask must mark exactly `count` indices (the values that follow it)."""
    idx = unpack_bitmap(words, size)
    if idx.size != count:
        raise ValueError(f"bitmap marks {idx.size} indices for {count} values")
    return idx


def header_values(step, rank, fp16=False):
    """[round, rank], or for the fp16 wire [round // 2048, round % 2048, rank]."""
    if fp16:
        if not 0 <= step <= MAX_ROUND_FP16:
            raise ValueError(f"round {step} does not fit the fp16 wire header (at most {MAX_ROUND_FP16})")
        return [step // DIGIT, step % DIGIT, rank]
    return [step, rank]


def encode_header(step, rank, fp16=False):
    """The header as an NDArray (header_values)."""
    import mxnet as mx
    return mx.nd.array(header_values(step, rank, fp16))


def encode_sparse(idx, val, fp16=False, bitmap_size=None):
    """A sparse payload (numpy, float32): [idx, val], or for the fp16 wire [idx high, idx low, val],
    or with bitmap_size (the buffer's size) [bitmap words, val in increasing index order]."""
    idx = np.asarray(idx, np.int64)
    val = np.asarray(val, np.float32)
    if bitmap_size is not None and fp16:
        raise ValueError("bitmap index coding is for the fp32 wire only")
    if bitmap_size is not None:
        order = np.argsort(idx, kind="stable")
        idx, val = idx[order], val[order]
        if idx.size > 1 and (idx[1:] == idx[:-1]).any():
            raise ValueError("bitmap index coding needs distinct indices, and the selection repeats one; "
                             "set compression.index_coding: list")
        return np.concatenate([pack_bitmap(idx, bitmap_size), val])
    if fp16:
        high = idx // DIGIT
        return np.concatenate([high.astype(np.float32), (idx - high * DIGIT).astype(np.float32), val])
    return np.concatenate([idx.astype(np.float32), val])


def encode_message(step, rank, payload, fp16=False):
    """The message a worker pushes: header and payload, float16 on the fp16 wire."""
    import mxnet as mx
    msg = mx.nd.concat(encode_header(step, rank, fp16), payload, dim=0)
    return msg.astype(wire_dtype(fp16)) if fp16 else msg


def sparse_message(step, rank, idx, val, fp16=False, bitmap_size=None):
    """encode_message of the encode_sparse payload, made on the host: one numpy array of the wire's
    dtype (every number in it is exact in float16 on that wire), so that MXNet gets the message in one
    copy (its header array and concatenation took 1.5 ms a message, the copy 0.1)."""
    payload = encode_sparse(idx, val, fp16, bitmap_size)
    msg = np.concatenate([np.asarray(header_values(step, rank, fp16), np.float32), payload])
    return msg.astype(np.float16) if fp16 else msg


class _RepeatFinder:
    """Tells in O(k) whether an index array repeats an index: writes each index's position into a
    scratch array at that index and reads it back (with a repeat the later position wins). One
    int32 per element of the largest buffer decoded so far, shared by every decoder of the process
    (under a lock); np.empty, so only the pages of indices ever sent are touched."""

    def __init__(self):
        self.lock = threading.Lock()
        self.scratch = np.empty(0, np.int32)

    def __call__(self, idx, size):
        if idx.size < 2 or (idx[1:] > idx[:-1]).all():
            return False              # increasing (a top-k selection's): no repeat, and no scatter
        positions = np.arange(idx.size, dtype=np.int32)
        with self.lock:
            if self.scratch.size < size:
                self.scratch = np.empty(size, np.int32)
            self.scratch[idx] = positions
            return bool((self.scratch[idx] != positions).any())


has_repeats = _RepeatFinder()


class SparseGrad:
    """One worker's sparse contribution to a buffer of `size` elements: `idx` (int64, distinct, in
    range) and `vals` (float32, the sum of the values sent at each index). Never densified by
    the server; `to_dense()` is for tests and tools."""
    __slots__ = ("size", "idx", "vals")

    def __init__(self, size, idx, vals):
        self.size = size
        self.idx = idx
        self.vals = vals

    def add_to(self, acc):
        """acc += this contribution, in place, in O(k). Bit for bit what adding its dense form
        (np.zeros + np.add.at) would give: the indices are distinct, so every touched element
        gets exactly one float32 addition and every other element is left as it is (adding the
        dense form's 0.0 there would only turn a -0.0 into +0.0; a round's accumulator never holds
        -0.0: it starts at +0.0 and a float32 sum is -0.0 only when both terms are)."""
        acc[self.idx] += self.vals

    def to_dense(self):
        dense = np.zeros(self.size, np.float32)
        self.add_to(dense)
        return dense


@dataclass(frozen=True)
class WireFormat:
    """One mailbox key's message layout, the one description the worker's plan, the encoders, the cost
    model and the server's decoding all read: `codec` dense or sparse, over a buffer of `size`
    elements, `topk_count` values per sparse message (None for dense), `fp16` the fp16 wire, `bitmap`
    the bitmap index coding. parse() gives (round, rank, gradient contribution), the contribution a
    float32 array (dense codec) or a SparseGrad (sparse codec)."""
    codec: str
    size: int
    topk_count: Optional[int] = None
    fp16: bool = False
    bitmap: bool = False

    def __post_init__(self):
        if self.codec not in ("dense", "sparse"):
            raise ValueError(f"unknown codec {self.codec!r}")
        if self.bitmap and (self.codec != "sparse" or self.fp16):
            raise ValueError("bitmap index coding is for sparse payloads on the fp32 wire only")
        if self.codec == "dense" and self.fp16:
            raise ValueError("the fp16 wire format carries sparse payloads only")
        if self.codec == "sparse" and self.topk_count is None:
            raise ValueError("a sparse wire format needs its topk_count")

    @classmethod
    def planned(cls, size, topk_count=None, fp16=False, index_coding="list"):
        """The format of a buffer's messages: dense when topk_count is None, else sparse, with the bitmap
        index coding where use_bitmap says it is the smaller form under `index_coding`."""
        if topk_count is None:
            return cls("dense", size)
        return cls("sparse", size, topk_count, fp16, use_bitmap(size, topk_count, index_coding, fp16))

    @classmethod
    def from_dict(cls, d):
        """The inverse of to_dict (a plan's mailbox entry; other entries, e.g. its key, are left out)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def to_dict(self):
        return asdict(self)

    @property
    def dtype(self):
        """The dtype of a message on the wire (and of its mailbox key)."""
        return wire_dtype(self.fp16)

    @property
    def header_length(self):
        return header_length(self.fp16)

    @property
    def payload_length(self):
        if self.codec == "dense":
            return self.size
        if self.bitmap:
            return bitmap_words(self.size) + self.topk_count
        return _sparse_parts(self.fp16) * self.topk_count

    @property
    def length(self):
        return self.header_length + self.payload_length

    @property
    def bytes(self):
        return np.dtype(self.dtype).itemsize * self.length

    def decode(self, payload):
        """payload (1-D numpy) -> one worker's float32 gradient contribution: the dense array itself
        for the dense codec, a SparseGrad for the sparse one."""
        if payload.shape != (self.payload_length,):
            what = "dense" if self.codec == "dense" else "sparse bitmap" if self.bitmap else "sparse"
            raise ValueError(f"{what} payload has {payload.shape[0]} values, expected {self.payload_length}")
        if self.codec == "dense":
            return payload
        k, size = self.topk_count, self.size
        if self.bitmap:
            words = bitmap_words(size)
            idx = bitmap_indices(payload[:words], size, k)
            return SparseGrad(size, idx, payload[words:].astype(np.float32, copy=False))
        if self.fp16:
            idx = payload[:k].astype(np.int64) * DIGIT + payload[k:2 * k].astype(np.int64)
        else:
            idx = payload[:k].astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise ValueError("sparse payload index out of range")
        vals = payload[(_sparse_parts(self.fp16) - 1) * k:].astype(np.float32, copy=False)
        if has_repeats(idx, size):
            # Repeated indices (a selection with replacement, a hand-made message) add up: sum
            # them first, from 0.0 in message order, as np.add.at into a zero dense array does.
            idx, where = np.unique(idx, return_inverse=True)
            sums = np.zeros(idx.size, np.float32)
            np.add.at(sums, where, vals)
            vals = sums
        return SparseGrad(size, idx, vals)

    def parse(self, message):
        # The fp16 wire crosses the network as float16; MXNet's server may widen a float16 push to
        # float32 before its updater sees it (exact, every fp16 value is a float32 value), so both
        # dtypes are accepted for it. A float16 message on an fp32 mailbox is a plan mismatch.
        if message.dtype not in ((np.float16, np.float32) if self.fp16 else (np.float32,)):
            raise ValueError(f"mailbox message is {message.dtype}, the plan says {np.dtype(self.dtype)}")
        header = self.header_length
        if message.ndim != 1 or message.shape[0] < header:
            raise ValueError(f"mailbox message of shape {message.shape} has no header")
        if self.fp16:
            rnd = int(message[0]) * DIGIT + int(message[1])
        else:
            rnd = int(message[0])
        rank = int(message[header - 1])
        return rnd, rank, self.decode(message[header:])
