"""Wire format of one mailbox message, [header, payload], and its decoding on the server (numpy).

Every message is a single NDArray, built on the worker by asynchronous mx.nd ops and pushed to a
mailbox key whose size is fixed at kv.init:

fp32 wire (default), float32 message:
  header  [round, rank]
  dense   the buffer's gradient, `size` values.
  sparse  `k` indices then `k` values. The indices are offsets inside the buffer; buffers are capped
          at 2**24 elements so every index is an exact float32 integer. 8 bytes per sent value, as
          an int32 + fp32 format would take.
fp16 wire (compression.fp16_values), float16 message, sparse only:
  header  [round // 2048, round % 2048, rank]
  sparse  `k` high index digits, `k` low index digits (index = high * 2048 + low), `k` values.
          fp16 holds every integer below 2048 exactly, so two digits carry an index exactly; buffers
          are capped at 2**22 elements. 6 bytes per sent value. Values beyond the fp16 range are
          clipped on the worker and what clipping and rounding lost stays in its error-feedback
          residual (encoders.py).
"""
import numpy as np

DIGIT = 2048                           # fp16 represents every integer in [0, 2048] exactly
MAX_BUFFER_ELEMENTS = 1 << 24          # float32 represents every integer below 2**24 exactly
MAX_BUFFER_ELEMENTS_FP16 = DIGIT * DIGIT
MAX_ROUND_FP16 = DIGIT * DIGIT - 1
FP16_MAX = 65504.0


def max_buffer_elements(fp16=False):
    return MAX_BUFFER_ELEMENTS_FP16 if fp16 else MAX_BUFFER_ELEMENTS


def header_length(fp16=False):
    return 3 if fp16 else 2


def payload_length(codec, size, k=None, fp16=False):
    if codec == "dense":
        return size
    return (3 if fp16 else 2) * k


def message_length(codec, size, k=None, fp16=False):
    return header_length(fp16) + payload_length(codec, size, k, fp16)


def message_bytes(codec, size, k=None, fp16=False):
    return (2 if fp16 else 4) * message_length(codec, size, k, fp16)


def make_decoder(codec, size, k=None, fp16=False):
    """payload (1-D numpy) -> the dense float32 gradient contribution of one worker."""
    if codec == "dense":
        if fp16:
            raise ValueError("the fp16 wire format carries sparse payloads only")

        def decode(payload):
            if payload.shape != (size,):
                raise ValueError(f"dense payload has {payload.shape[0]} values, expected {size}")
            return payload
        return decode
    if codec == "sparse":
        parts = 3 if fp16 else 2

        def decode(payload):
            if payload.shape != (parts * k,):
                raise ValueError(f"sparse payload has {payload.shape[0]} values, expected {parts * k}")
            if fp16:
                idx = payload[:k].astype(np.int64) * DIGIT + payload[k:2 * k].astype(np.int64)
            else:
                idx = payload[:k].astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= size):
                raise ValueError("sparse payload index out of range")
            dense = np.zeros(size, np.float32)
            # add.at: repeated indices (random-k) add up
            np.add.at(dense, idx, payload[(parts - 1) * k:].astype(np.float32))
            return dense
        return decode
    raise ValueError(f"unknown codec {codec!r}")


class MailboxFormat:
    """One mailbox key's message layout: parse() gives (round, rank, dense gradient contribution)."""

    def __init__(self, codec, size, k=None, fp16=False):
        self.fp16 = fp16
        self.dtype = np.float16 if fp16 else np.float32
        self.header = header_length(fp16)
        self.length = message_length(codec, size, k, fp16)
        self.decode = make_decoder(codec, size, k, fp16)

    def parse(self, message):
        # The fp16 wire crosses the network as float16; MXNet's server may widen a float16 push to
        # float32 before its updater sees it (exact, every fp16 value is a float32 value), so both
        # dtypes are accepted for it. A float16 message on an fp32 mailbox is a plan mismatch.
        if message.dtype not in ((np.float16, np.float32) if self.fp16 else (np.float32,)):
            raise ValueError(f"mailbox message is {message.dtype}, the plan says {np.dtype(self.dtype)}")
        if message.ndim != 1 or message.shape[0] < self.header:
            raise ValueError(f"mailbox message of shape {message.shape} has no header")
        if self.fp16:
            rnd = int(message[0]) * DIGIT + int(message[1])
        else:
            rnd = int(message[0])
        rank = int(message[self.header - 1])
        return rnd, rank, self.decode(message[self.header:])
