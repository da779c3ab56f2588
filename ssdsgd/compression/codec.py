"""Wire format of one mailbox payload (after the [round, rank] header), decoded on the server.

dense:  the buffer's gradient, `size` float32 values.
sparse: `k` indices then `k` values, all carried as float32. The indices are offsets inside the
        buffer; buffers are capped at 2**24 elements so every index is an exact float32 integer,
        which lets the whole message be one float32 NDArray built by asynchronous mx.nd ops.
        4 bytes per index and 4 per value, as an int32+fp32 wire format would take.
"""
import numpy as np

MAX_BUFFER_ELEMENTS = 1 << 24


def payload_length(codec, size, k=None):
    return size if codec == "dense" else 2 * k


def make_decoder(codec, size, k=None):
    if codec == "dense":
        def decode(payload):
            if payload.shape != (size,):
                raise ValueError(f"dense payload has {payload.shape[0]} values, expected {size}")
            return payload
        return decode
    if codec == "sparse":
        def decode(payload):
            if payload.shape != (2 * k,):
                raise ValueError(f"sparse payload has {payload.shape[0]} values, expected {2 * k}")
            idx = payload[:k].astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= size):
                raise ValueError("sparse payload index out of range")
            dense = np.zeros(size, np.float32)
            np.add.at(dense, idx, payload[k:])     # add.at: repeated indices (random-k) add up
            return dense
        return decode
    raise ValueError(f"unknown codec {codec!r}")
