"""Fused numba kernels of the worker's per-step hot path: error feedback, momentum correction and the
candidate search of `compression.selection: sampled`, in one pass over each tensor.

Each kernel does, element by element, exactly the float32 operations the numpy formulation does, in the
same order (u * mu, then + g; r * carry, then + the momentum or gradient; the magnitude |r|), so its
results are the numpy formulation's bit for bit: numba compiles without fastmath, so LLVM neither fuses
a multiply and an add nor reorders them. The numpy formulation is kept in tests/unit/test_kernels.py, as the
oracle the kernels are compared with.

The pass runs chunk by chunk (CHUNK elements, within the L1 cache). Collecting a sampled search's
candidates (the entries whose magnitude is not below a threshold), one loop per chunk updates the
momentum and the residual, flags the candidates and keeps the chunk's largest magnitude; the flags are
then read eight at a time as one 64-bit word packed into a byte of a bit mask, whose set bits are
visited by their trailing zeros: the cost grows with the candidates (about 1.25 k), not the elements.
Otherwise the chunk's momentum, residual and magnitude loops run one after the other, each reading what
the previous one wrote while it is still in the cache.

The search's other steps are here too: the sample's magnitudes before the pass (peek, with its
positions sorted first, sort_positions), the quotas' threshold and a tensor's k-th largest (kth_smallest,
count_around), each tensor's top-k among its candidates (top_among), and the values sent, gathered and
forgotten in one pass over their indices (take).

Compiled on first use with cache=True (numba keeps the machine code in __pycache__ next to this file, so
later processes load it); `warm` compiles or loads every variant the encoders call, and Memory calls it
when it is made (with the encoders, at worker start-up), so that no compilation lands in a training step.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ssdsgd.lean_mxnet import hidden

CHUNK = 2048                          # elements per chunk (8 KiB of float32: each step's reads stay in L1)
_PACK = np.uint64(0x0102040810204080)  # 8 flag bytes (0 or 1) of a word times this: bit i of the top byte is byte i
# The key of a magnitude: its float32 bits as an int32, which order non-negative floats as their values
# do; every NaN gets _NAN_KEY, above +inf's 0x7F800000, so that a maximum of keys is np.argmax's choice.
_NAN_KEY = 0x7F800001
_NONE_F = np.empty(0, np.float32)


@intrinsic
def _trailing_zeros(typingctx, x):
    """The count of trailing zero bits of an integer (LLVM's cttz)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))
    return x(x), codegen


@intrinsic
def _bits(typingctx, x):
    """The bits of a float32 as an int32 (a bit cast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(x), codegen


@njit(cache=True, nogil=True)
def _momentum(u, g, mu):
    """u = u * mu + g (two roundings, as np.multiply then np.add)."""
    for i in range(u.shape[0]):
        u[i] = u[i] * mu + g[i]


@njit(cache=True, nogil=True)
def _add(r, a, carry, scale):
    """r = r * carry + a, or r = r + a without scale."""
    for i in range(r.shape[0]):
        r[i] = (r[i] * carry if scale else r[i]) + a[i]


@njit(cache=True, nogil=True)
def _momentum_flags(u, g, r, mu, carry, scale, t, flags):
    """_momentum(u, g, mu), then _add(r, u, carry, scale), and flags[i] = not |r[i]| < t, in one loop.
    Returns the largest magnitude key of r (see _NAN_KEY)."""
    top = np.int32(0)
    for i in range(r.shape[0]):
        x = u[i] * mu + g[i]
        u[i] = x
        y = (r[i] * carry if scale else r[i]) + x
        r[i] = y
        m = abs(y)
        flags[i] = not (m < t)
        top = max(top, min(_bits(m), np.int32(_NAN_KEY)))
    return top


@njit(cache=True, nogil=True)
def _add_flags(r, a, carry, scale, t, flags):
    """_add(r, a, carry, scale) and flags[i] = not |r[i]| < t, in one loop. Returns the largest
    magnitude key of r."""
    top = np.int32(0)
    for i in range(r.shape[0]):
        y = (r[i] * carry if scale else r[i]) + a[i]
        r[i] = y
        m = abs(y)
        flags[i] = not (m < t)
        top = max(top, min(_bits(m), np.int32(_NAN_KEY)))
    return top


@njit(cache=True, nogil=True)
def _collect(x, lo, n, flags, idx, val, count, offset):
    """Append (offset + lo + i, |x[lo + i]|) for every flagged i < n to idx, val from position count,
    in increasing i: the flags read eight at a time as a 64-bit word packed into a byte, the set
    bits of 64 visited by their trailing zeros. Returns the new count (beyond idx's size: counted,
    not written)."""
    for i in range(n, flags.shape[0]):
        flags[i] = False
    words = flags.view(np.uint64)
    cap = idx.shape[0]
    for b in range(flags.shape[0] // 64):
        bits = np.uint64(0)
        for w in range(8):
            bits |= ((words[8 * b + w] * _PACK) >> np.uint64(56)) << np.uint64(8 * w)
        while bits:
            i = lo + 64 * b + np.int64(_trailing_zeros(bits))
            if count < cap:
                idx[count] = offset + i
                val[count] = abs(x[i])
            count += 1
            bits &= bits - np.uint64(1)
    return count


@njit(cache=True, nogil=True)
def _first(x, lo, hi, key):
    """The first i in [lo, hi) whose magnitude key is key."""
    for i in range(lo, hi):
        if min(_bits(abs(x[i])), np.int32(_NAN_KEY)) == key:
            return i
    return -1


@njit(cache=True, nogil=True)
def _magnitudes(x, mag):
    """mag = |x|."""
    for i in range(x.shape[0]):
        mag[i] = abs(x[i])


@njit(cache=True, nogil=True)
def accumulate(n, u, g, r, mu, carry, update_u, from_u, residual, scale, mag, t, collect, idx, val, count,
               offset):
    """Memory.accumulate's arithmetic over n elements, chunk by chunk, in place:
      update_u: u = u * mu + g (momentum correction);
      residual: r = r * carry + a (r + a without scale), a the momentum u (from_u) or the gradient g;
    then of the result x (r with residual, else u or g): |x| into mag (unless mag is empty) and, with
    collect (residual only), the candidates, the positions whose magnitude is not below t (a NaN
    included), into idx, val (see _collect). Returns the candidate count and, with collect, the
    first position of x's largest magnitude (a NaN's, if any: np.argmax of |x|), else -1."""
    flags = np.empty(CHUNK, np.bool_)
    best, where = -1, 0                   # the largest key so far, and the chunk where it first came
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        if collect:
            if update_u:
                top = _momentum_flags(u[lo:hi], g[lo:hi], r[lo:hi], mu, carry, scale, t, flags)
            elif from_u:
                top = _add_flags(r[lo:hi], u[lo:hi], carry, scale, t, flags)
            else:
                top = _add_flags(r[lo:hi], g[lo:hi], carry, scale, t, flags)
            count = _collect(r, lo, hi - lo, flags, idx, val, count, offset)
            if top > best:
                best, where = top, lo
            continue
        if update_u:
            _momentum(u[lo:hi], g[lo:hi], mu)
        if residual:
            if from_u:
                _add(r[lo:hi], u[lo:hi], carry, scale)
            else:
                _add(r[lo:hi], g[lo:hi], carry, scale)
            if mag.shape[0]:
                _magnitudes(r[lo:hi], mag[lo:hi])
        elif mag.shape[0]:
            if from_u:
                _magnitudes(u[lo:hi], mag[lo:hi])
            else:
                _magnitudes(g[lo:hi], mag[lo:hi])
    return count, _first(r, where, min(where + CHUNK, n), best) if best >= 0 else -1


@njit(cache=True, nogil=True)
def sort_positions(at):
    """The non-negative int64 array at, sorted: a radix sort of 12-bit digits, least significant first,
    O(len(at)) per digit (two for a buffer's positions, below 2**24)."""
    out, spare = at.copy(), np.empty_like(at)
    top = at.max() if at.shape[0] else 0
    shift = 0
    while top >> shift:
        ends = np.zeros(4097, np.int64)
        for x in out:
            ends[((x >> shift) & 4095) + 1] += 1
        for d in range(4096):
            ends[d + 1] += ends[d]
        for x in out:
            d = (x >> shift) & 4095
            spare[ends[d]] = x
            ends[d] += 1
        out, spare = spare, out
        shift += 12
    return out


@njit(cache=True, nogil=True)
def peek(at, offset, u, g, r, mu, carry, update_u, from_u, residual, held, scale, out):
    """out[s] = the magnitude accumulate would give at position at[s] - offset, nothing else written
    (the same operations, see accumulate; held: r holds the residual, else the residual is still 0)."""
    zero = np.float32(0)
    for s in range(at.shape[0]):
        i = at[s] - offset
        if update_u:
            x = u[i] * mu + g[i]
        elif from_u:
            x = u[i]
        else:
            x = g[i]
        if residual:
            h = r[i] if held else zero
            x = (h * carry if scale else h) + x
        out[s] = abs(x)


@njit(cache=True, nogil=True)
def kth_smallest(values, k):
    """np.partition(values, k)[k] for values that are magnitudes (no sign bit set; NaN last), by the
    values' keys (see _NAN_KEY): a histogram of their top 16 bits (the exponent and 8 bits of the
    mantissa) finds the bucket that holds the k-th, a partition of that bucket's keys finds it.
    (False, 0) where a value has its sign bit set."""
    hist = np.zeros((1 << 16) + 1, np.int32)
    for x in values:
        key = _bits(x)
        if key < 0:
            return False, np.float32(0)
        hist[(min(key, np.int32(_NAN_KEY)) >> 15) + 1] += 1
    below = 0
    bucket = 0
    while below + hist[bucket + 1] <= k:
        below += hist[bucket + 1]
        bucket += 1
    keys = np.empty(hist[bucket + 1], np.int32)
    n = 0
    for x in values:
        key = min(_bits(x), np.int32(_NAN_KEY))
        if key >> 15 == bucket:
            keys[n] = key
            n += 1
    key = np.partition(keys, k - below)[k - below]
    return True, np.float32(np.nan) if key == _NAN_KEY else values[_position(values, key)]


@njit(cache=True, nogil=True)
def _position(values, key):
    """The first position of values whose key is key."""
    for i in range(values.shape[0]):
        if min(_bits(values[i]), np.int32(_NAN_KEY)) == key:
            return i
    return -1


@njit(cache=True, nogil=True)
def count_around(values, bounds, tau):
    """Per tensor j, of values[bounds[j]:bounds[j + 1]]: how many are above tau, how many equal to it."""
    above = np.zeros(bounds.shape[0] - 1, np.int64)
    ties = np.zeros(bounds.shape[0] - 1, np.int64)
    for j in range(bounds.shape[0] - 1):
        for x in values[bounds[j]:bounds[j + 1]]:
            above[j] += x > tau
            ties[j] += x == tau
    return above, ties


@njit(cache=True, nogil=True)
def top_among(found, values, bounds, counts, fits, kths, out):
    """For every tensor j with fits[j]: the counts[j] largest of values[bounds[j]:bounds[j + 1]] as
    compressor.top_magnitudes takes them, every one above kths[j] (a NaN above every number), then the
    first ones equal to it (kths[j] NaN: the first counts[j] NaN), written as their entries of found, in
    increasing order, to out after those of the fitting tensors before it (quotas.kth_largest gives
    the kths). Returns the number written."""
    pos = 0
    for j in range(counts.shape[0]):
        if not fits[j]:
            continue
        v, k, kth = values[bounds[j]:bounds[j + 1]], counts[j], kths[j]
        nan = kth != kth
        room = k
        if not nan:
            for x in v:
                room -= x > kth or x != x
        for i in range(v.shape[0]):
            x = v[i]
            if nan:
                take = x != x and room > 0
                room -= take
            elif x > kth or x != x:
                take = True
            else:
                take = x == kth and room > 0
                room -= take
            if take:
                out[pos] = found[bounds[j] + i]
                pos += 1
    return pos


@njit(cache=True, nogil=True)
def take(acc, u, idx, clear_u, out):
    """out = acc[idx]; acc[idx] = 0; with clear_u u[idx] = 0: a sent selection's values, and the
    memory's forgetting of them, in one pass over idx."""
    for s in range(idx.shape[0]):
        i = idx[s]
        out[s] = acc[i]
        acc[i] = 0
        if clear_u:
            u[i] = 0


_warmed = []


def warm():
    """Compile (or load from numba's cache) every kernel as Memory and the encoders call them, once
    per process: the gradient read-only (a view of MXNet's memory) or writable (a host copy)."""
    if _warmed:
        return
    # numba's first compile or cache load imports scipy.linalg to look for a BLAS, which no kernel calls.
    with hidden(["scipy.linalg"]):
        _compile_all()
    _warmed.append(True)


def _compile_all():
    n = CHUNK + 3
    f, i8 = np.zeros(n, np.float32), np.arange(8, dtype=np.int64)
    for readonly in (False, True):
        g = np.zeros(n, np.float32)
        g.flags.writeable = not readonly
        accumulate(n, f, g, f, np.float32(0.5), np.float32(1.0), True, True, True, False, _NONE_F,
                   np.float32(1.0), True, np.empty(8, np.int64), np.empty(8, np.float32), 0, 0)
        peek(i8, 0, f, g, f, np.float32(0.5), np.float32(1.0), True, True, True, True, False, f[:8])
    sort_positions(i8[::-1].copy())
    bounds = np.array([0, 8], np.int64)
    kth_smallest(f[:8], 3)
    count_around(f[:8], bounds, np.float32(0))
    top_among(i8, f[:8], bounds, np.array([3], np.int64), np.array([True]), np.zeros(1), np.empty(3, np.int64))
    take(f, f, i8, True, np.empty(8, np.float32))
