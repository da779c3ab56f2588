"""The compressed downlink's slot payload: a round's (index, value) pairs at about 2 bytes a pair.

Under `compression.downlink: compressed` a round may carry two pushes' bytes. As float32 (index,
value) pairs that is two pushes' values; packed, the same bytes carry about three times the values
(why it matters: docs/design.md, "Compressed downlink"):

- each value as one byte, a float with 4 significant bits: sign, a 4-bit exponent below the round's
  largest (16 octaves) and 3 mantissa bits. What rounding changes, and any value more than 16 octaves
  below the largest, stays in the servers' error feedback (take_round, for BufferState.squeezed);
- each index as the gap to the previous one, in 7-bit groups with the high bit set on all but the
  last group (LEB128): one byte for a gap below 128, which at a few percent density is nearly all.

Payload bytes: the values' byte count n is the slot's count; then n value bytes, then n gaps. They
travel three to a float32 word (a 24-bit integer, exact in float32) after one word holding the round's
largest binary exponent plus EXPONENT_BIAS. Encoding a value that is already rounded gives it back bit
for bit, so the servers apply exactly what every replica decodes.
"""
import numpy as np

from ssdsgd.compression.compressor import top_magnitudes

EXPONENT_BIAS = 1024                  # keeps the exponent word non-negative (float32 exponents > -150)
OCTAVES = 16                          # 4 exponent bits
MANTISSA_STEPS = 16                   # |m| in [0.5, 1) rounded to a multiple of 1/16: 4 significant bits
BYTES_PER_WORD = 3


def payload_bytes(words):
    """Bytes a payload of `words` float32 words holds (the first word is the exponent)."""
    return BYTES_PER_WORD * (words - 1)


def round_values(values):
    """(rounded float32 values, mask of those representable): each value to 4 significant bits; a
    value more than OCTAVES octaves below the largest magnitude, or zero, is not representable."""
    m, e = np.frexp(np.asarray(values, np.float32))
    q = np.rint(np.abs(m) * MANTISSA_STEPS)           # 8 .. 16 (0 for a zero)
    carry = q == MANTISSA_STEPS
    q[carry] = MANTISSA_STEPS // 2
    rounded = np.ldexp(np.copysign(q, m) / MANTISSA_STEPS, e + carry).astype(np.float32)
    # The exponents of what is sent: a float32 subnormal may round further, or to zero.
    _, e = np.frexp(rounded)
    keep = rounded != 0
    if keep.any():
        keep &= e > e[keep].max() - OCTAVES
    return np.where(keep, rounded, np.float32(0)), keep


def varint_lengths(gaps):
    """Bytes each non-negative gap takes in 7-bit groups."""
    gaps = np.asarray(gaps, np.int64)
    return 1 + (gaps >= 1 << 7) + (gaps >= 1 << 14) + (gaps >= 1 << 21) + (gaps >= 1 << 28)


def gaps_of(idx):
    """Sorted distinct indices -> the gaps encoded: the first index, then each index's distance to the
    previous one less 1."""
    idx = np.asarray(idx, np.int64)
    return np.diff(idx, prepend=-1) - 1


def encoded_bytes(idx):
    """Payload bytes (after the exponent word) of a round with these sorted distinct indices."""
    return idx.size + int(varint_lengths(gaps_of(idx)).sum())


def fit(idx, magnitudes, budget):
    """Positions (ascending) of the largest-magnitude part of sorted indices `idx` whose encoding
    fits `budget` bytes: drops the smallest magnitudes, the first of equal ones (one-byte values are
    often equal), until it does. Each dropped pair frees at least its value byte (merging two gaps
    never takes more bytes than the two did), so dropping the excess converges in a few passes."""
    idx, magnitudes = np.asarray(idx, np.int64), np.asarray(magnitudes)
    kept = np.arange(idx.size)
    while True:
        excess = encoded_bytes(idx[kept]) - budget
        if excess <= 0:
            return kept
        if excess >= kept.size:
            return kept[:0]
        # the `excess` smallest, ties by position (a stable sort's first), in O(n): all below the
        # excess-th smallest value, then the first of those equal to it
        v = magnitudes[kept]
        t = np.partition(v, excess - 1)[excess - 1]
        drop = v < t
        drop[np.flatnonzero(v == t)[:excess - int(drop.sum())]] = True
        kept = kept[~drop]


def take_round(acc, cap, words, seed, out=None, magnitude=None):
    """What a compressed round carries of `acc` (the round's sum plus the servers' residual), taken
    out of it: (float32 array of acc's size holding the carried values, their indices ascending). The
    largest magnitudes, at most `cap`, rounded by round_values and cut by fit to a payload of `words`
    words; acc keeps the rest, rounding errors included. The sampled search finds the same top-cap
    set as a partition, in one masked pass; seeded by the caller (the round), nothing to checkpoint.
    out (zeros) and magnitude: float32 arrays of acc's size to use instead of fresh ones."""
    magnitude = np.abs(acc, out=magnitude)
    idx = top_magnitudes(magnitude, cap, rng=np.random.default_rng(seed))     # increasing
    values, representable = round_values(acc[idx])
    idx, values = idx[representable], values[representable]
    kept = fit(idx, np.abs(values), payload_bytes(words))
    idx, values = idx[kept], values[kept]
    out = np.zeros(acc.size, np.float32) if out is None else out
    out[idx] = values
    acc[idx] -= values
    return out, idx


def encode(idx, values, words):
    """float32 payload of `words` words for sorted distinct indices and values already rounded by
    round_values (all representable); None if it does not fit."""
    idx = np.asarray(idx, np.int64)
    values = np.asarray(values, np.float32)
    out = np.zeros(words, np.float32)
    if idx.size == 0:
        return out
    m, e = np.frexp(values)
    top = int(e.max())
    steps = np.abs(m) * MANTISSA_STEPS
    q = steps.astype(np.int64)
    offset = top - e
    if np.any(steps != q) or offset.max() >= OCTAVES or q.min() < MANTISSA_STEPS // 2:
        raise ValueError("ring payload: a value is not rounded to the packed format")
    value_bytes = (m < 0) * 128 + offset * 8 + (q - MANTISSA_STEPS // 2)
    gaps = gaps_of(idx)
    lengths = varint_lengths(gaps)
    stream = np.zeros(idx.size + int(lengths.sum()), np.int64)
    stream[:idx.size] = value_bytes
    starts = idx.size + np.cumsum(lengths) - lengths
    for j in range(int(lengths.max())):
        has = lengths > j
        stream[starts[has] + j] = ((gaps[has] >> (7 * j)) & 127) | np.where(lengths[has] > j + 1, 128, 0)
    if stream.size > payload_bytes(words):
        return None
    out[0] = top + EXPONENT_BIAS
    padded = np.zeros(BYTES_PER_WORD * -(-stream.size // BYTES_PER_WORD), np.int64)
    padded[:stream.size] = stream
    triples = padded.reshape(-1, BYTES_PER_WORD)
    out[1:1 + triples.shape[0]] = (triples[:, 0] << 16) | (triples[:, 1] << 8) | triples[:, 2]
    return out


def decode(payload, count, size):
    """(int64 indices, float32 values) of a payload holding `count` pairs of a buffer of `size`
    elements; ValueError where the payload cannot hold them."""
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    words = np.asarray(payload[1:], np.float64).astype(np.int64)
    stream = np.stack([(words >> 16) & 255, (words >> 8) & 255, words & 255], axis=1).ravel()
    top = int(payload[0]) - EXPONENT_BIAS
    value_bytes = stream[:count]
    ends = np.flatnonzero(stream[count:] < 128)[:count]
    if ends.size < count:
        raise ValueError(f"ring payload holds fewer than {count} index gaps")
    groups = stream[count:count + ends[-1] + 1]
    gid = np.concatenate(([0], np.cumsum(groups < 128)[:-1]))
    first = np.concatenate(([0], ends[:-1] + 1))
    shift = 7 * (np.arange(groups.size) - first[gid])
    gaps = np.bincount(gid, weights=(groups & 127) << shift, minlength=count).astype(np.int64)
    idx = np.cumsum(gaps + 1) - 1
    if idx[-1] >= size:
        raise ValueError(f"ring payload index {idx[-1]} outside a buffer of {size}")
    sign = np.where(value_bytes >= 128, -1.0, 1.0)
    offset = (value_bytes >> 3) & 15
    q = (value_bytes & 7) + MANTISSA_STEPS // 2
    values = np.ldexp(sign * q / MANTISSA_STEPS, top - offset).astype(np.float32)
    return idx, values
