"""Worker-side encoding of one buffer's gradients into a mailbox message.

Every sparsifier goes one way, as GRACE splits it: compensate (the memory's error feedback and momentum
correction, this step's quotas, and with selection: sampled the magnitudes and candidate search the
sparsifier may read), compress (its select_buffer over the buffer's accumulated.Accumulated), then take
the values sent out of the memory and code them.

DenseEncoder: the flattened gradients, what an uncompressed push sends.
SparseEncoder, fusion 'ahead' (SAFusion): every tensor is sparsified on its own with
  k_i = max(1, floor(density * n_i)), so no tensor goes missing, then the (index + offset, value)
  pieces are fused into the buffer's message: [idx_1..idx_m, val_1..val_m].
SparseEncoder, fusion 'behind' (OMGS / SyncEA baseline): the buffer is fused first and one top-k
  with the same total k runs over it, so large tensors can take every slot (min_dense_bytes does
  not apply: there are no tensors any more, only the fused buffer).
The wire format itself (header, index list, digits or bitmap, dtype) is codec.py's.
With compression.fp16_values the message is float16; the values are clipped to the fp16
range and rounded before error feedback, so the residual keeps what the wire format dropped.
With a compression.warmup, make_stages builds one set of encoders per density stage; they share
the error-feedback memory, so switching stage loses nothing.
A dense buffer stays in mx.nd operations (the engine overlaps them with the rest of backward). A
sparse buffer's gradient is encoded with numpy: the quota allocation needs every magnitude on the
host anyway, and per ResNet-20 step the mx.nd version (a sorting topk and a dozen small ops per
tensor) took three times the CPU, on the critical path. With fusion ahead a gradient on the host is
read where MXNet keeps it (host_views, no copy); otherwise it is copied into one host array.
"""
import ctypes
import time

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from ssdsgd.compression import kernels
from ssdsgd.compression.codec import FP16_MAX, encode_message, encode_sparse, sparse_message
from ssdsgd.compression.accumulated import Accumulated
from ssdsgd.compression.compressor import sample_size, sample_threshold, sampled_candidates, step_rng
from ssdsgd.compression.fusion import plan_for_config, tensor_counts, warmup_stages
from ssdsgd.compression.memory import Memory
from ssdsgd.compression.quotas import allocate_by_threshold, quotas_from_candidates
from ssdsgd.compression.registry import is_sparsifier, make_compressor


def flatten(arrays):
    """The arrays, flattened and concatenated in order: one buffer's worth of tensors."""
    return mx.nd.concat(*[a.reshape(-1) for a in arrays], dim=0) if len(arrays) > 1 else arrays[0].reshape(-1)


class DenseEncoder:
    codec = "dense"
    fp16 = False
    memory = None                # no error feedback: everything is sent
    counts = None                # no per-tensor quotas

    def encode(self, grads, step):
        return flatten(grads)

    def message(self, grads, step, rank):
        return encode_message(step, rank, self.encode(grads, step))


class SparseEncoder:
    codec = "sparse"

    def __init__(self, buffer, compressor, memory, whole, behind=False, allocate_every=0, sampled=False, seed=0):
        self.buffer = buffer
        self.compressor = compressor
        self.memory = memory
        self.behind = behind
        self.fp16 = buffer.fp16
        # Tensors below compression.min_dense_bytes are sent whole (every index, every value).
        self.whole = {j for j, w in enumerate(whole) if w}
        self.offsets = buffer.offsets
        self.ends = np.cumsum(buffer.sizes, dtype=np.int64)
        self.counts = list(buffer.counts)       # k_i per tensor; their sum (the message size) is fixed
        self.allocate_every = allocate_every    # compression.allocation: gradient (0: by size, fixed)
        # compression.selection: sampled: top-k searches among sampled candidates (compressor.py), the
        # quotas' and, for a sparsifier that reads the magnitudes, its own (accumulated.py).
        self.sampled, self.seed = sampled, seed
        self.host = self.mag = None             # the buffer's gradient on the host, its magnitudes
        self.room = None                        # the fused search's candidates: (indices, magnitudes)

    def encode(self, grads, step):
        """The payload, as a float32 NDArray (codec.encode_sparse)."""
        idx, val = self._indices_and_values(grads, step)
        bitmap_size = self.buffer.size if self.buffer.wire.bitmap else None
        return mx.nd.array(encode_sparse(idx, val, self.fp16, bitmap_size), dtype=np.float32)

    def message(self, grads, step, rank):
        """encode_message of encode's payload, made on the host (codec.sparse_message)."""
        idx, val = self._indices_and_values(grads, step)
        msg = sparse_message(step, rank, idx, val, self.fp16, self.buffer.size if self.buffer.wire.bitmap else None)
        return mx.nd.array(msg, dtype=msg.dtype)

    def _indices_and_values(self, grads, step):
        """This step's selection, as GRACE splits it for every sparsifier: compensate (error feedback,
        momentum correction, the quotas), compress (the sparsifier's select_buffer), then take the
        values sent from the memory. Buffer indices and their values (what encode_sparse codes)."""
        acc = self._compensate(grads, step)
        picks = self.compressor.select_buffer(acc)
        parts = [self._take(t, acc.counts[j], acc.keys[j], picks.get(j), whole=j not in acc.part)
                 for j, t in enumerate(acc.tensors)]
        idx = np.concatenate([i + off for (i, _), off in zip(parts, acc.offsets)])
        val = np.concatenate([v for _, v in parts])
        return idx, val

    def _compensate(self, grads, step):
        """The buffer's gradients through the memory, this step's quotas, and, with selection: sampled,
        the magnitudes and candidate search the sparsifier may use (accumulated.Accumulated)."""
        b = self.buffer
        if self.mag is None:
            self._allocate_magnitudes()
        rng = step_rng(self.seed, -1 - b.id, step) if self.sampled else None
        wanted = self.sampled and self.compressor.magnitudes     # the sparsifier reads them: written in the pass
        if self.behind:
            flat = self._to_host(grads)           # fusion behind: the whole buffer as one array
            key = -1 - b.id
            acc = self.memory.accumulate(key, flat, self.mag if wanted else None)
            return Accumulated([acc], [b.topk_count], [key], [0], [0], step, rng, self.mag if wanted else None)
        allocate = self.allocate_every and step % self.allocate_every == 0
        pieces = self._host_pieces(grads)
        # The magnitudes are needed for a sampled search: written as the memory accumulates.
        mag = self.mag if self.sampled and (allocate or wanted) else None
        found = self._fused_ahead(pieces, rng) if mag is not None and allocate else None
        if found is not None:
            accs, search = found
        else:
            accs = [self.memory.accumulate(b.params[j], piece,
                                           None if mag is None or j in self.whole else mag[off:off + n])
                    for j, (piece, off, n) in enumerate(zip(pieces, self.offsets, b.sizes))]
            search = self._sampled_quotas(accs, allocate, rng) if mag is not None else {}
        if allocate and not self.sampled:
            self.counts = allocate_by_threshold(accs, self.counts, self.whole)
        part = [j for j in range(len(accs)) if j not in self.whole]
        return Accumulated(accs, self.counts, list(b.params), part, self.offsets, step, rng, mag, **search)

    def _to_host(self, grads):
        """The buffer's gradients copied into one float32 host array, reused every step (a fresh
        array per step costs its page faults: at ResNet-50's size, more than the copy)."""
        b = self.buffer
        if self.host is None:
            self.host = np.empty(b.size, np.float32)
        copy_to_host(grads, self.host, self.offsets, b.sizes)
        return self.host

    def _host_pieces(self, grads):
        """Fusion ahead: each tensor's gradient on the host, MXNet's own memory where it is a float32
        host array (host_views), else a slice of the buffer's host copy."""
        views = host_views(grads)
        if views is None:
            flat = self._to_host(grads)
            return [flat[off:off + n] for off, n in zip(self.offsets, self.buffer.sizes)]
        return views

    def _allocate_magnitudes(self):
        """The buffer's magnitudes array, reused every step."""
        b = self.buffer
        self.mag = np.empty(b.size, np.float32)
        for j in self.whole:         # never a candidate of a top-k search: sent whole anyway
            self.mag[self.offsets[j]:self.offsets[j] + b.sizes[j]] = -1.0

    def _sampled_quotas(self, accs, allocate, rng):
        """compression.selection: sampled, fusion ahead, with self.mag filled: on an allocating step the
        quotas from one sampled candidate search over the buffer (or, where it does not narrow, from the
        accumulated gradients). What the search found, as Accumulated's fields."""
        b, mag = self.buffer, self.mag
        part = [j for j in range(len(accs)) if j not in self.whole]
        if allocate and len(part) > 1:
            found = sampled_candidates(mag, sum(self.counts[j] for j in part), rng)
            if found is not None:
                # found[bounds[j]:bounds[j + 1]] are tensor j's candidates (found is increasing)
                bounds = np.searchsorted(found, np.concatenate([[0], np.cumsum(b.sizes)]))
                return self._quotas(found, mag[found], bounds)
            self.counts = allocate_by_threshold(accs, self.counts, self.whole)
        return {}

    def _quotas(self, found, values, bounds, tops=None):
        """The quotas from the candidates of a buffer-wide search (found, their magnitudes values, tensor
        j's at bounds[j]:bounds[j + 1]); the search, as Accumulated's fields. The fused pass gives tops,
        the position of each tensor's largest magnitude, and leaves self.mag without the magnitudes."""
        self.counts, tau, above, ties = quotas_from_candidates(values, bounds, self.counts, self.whole)
        return dict(found=found, values=values, bounds=bounds, around=None if tau is None else (tau, above, ties),
                    tops=tops, mag_written=tops is None)

    def _fused_ahead(self, pieces, rng):
        """The memory's pass and _sampled_quotas' search of an allocating step, in one pass: the sample's
        magnitudes come first (Memory.peek), so the pass knows the threshold and collects the candidates
        (Memory.accumulate_candidates) instead of writing every magnitude to be read again. (accs, the
        search) as the two give them, or None (rng and memory untouched) where the search would not
        narrow, all entries pass, or there is no residual; candidates overflowing their room or fewer
        than the budget: the magnitudes are written and _sampled_quotas searches again from the same rng
        state."""
        b, memory = self.buffer, self.memory
        part = [j for j in range(len(pieces)) if j not in self.whole]
        budget = sum(self.counts[j] for j in part)
        m = sample_size(b.size, budget)
        if m is None or len(part) < 2 or not memory.error_feedback:
            return None
        state = rng.bit_generator.state
        threshold = sample_threshold(self._peek(pieces, rng.integers(0, b.size, m)), b.size, budget)
        if not -1.0 < threshold:          # the entries sent whole (magnitude -1) pass too, or NaN: all do
            rng.bit_generator.state = state
            return None
        if self.room is None:             # about 1.25 budget expected; the budget is the same every step
            self.room = tuple(np.empty(2 * budget + kernels.CHUNK, t) for t in (np.int64, np.float32))
        idx, val = self.room
        accs, bounds, count, tops = [], [0], 0, {}
        for j, (piece, off) in enumerate(zip(pieces, self.offsets)):
            if j in self.whole:
                accs.append(memory.accumulate(b.params[j], piece))
            else:
                acc, count, tops[j] = memory.accumulate_candidates(b.params[j], piece, threshold, idx, val, count,
                                                                   off)
                accs.append(acc)
            bounds.append(count)
        if count < budget or count > idx.shape[0]:
            for j in part:
                np.abs(accs[j], out=self.mag[self.offsets[j]:self.offsets[j] + b.sizes[j]])
            rng.bit_generator.state = state
            return accs, self._sampled_quotas(accs, True, rng)
        return accs, self._quotas(idx[:count], val[:count], bounds, tops)

    def _peek(self, pieces, at):
        """The buffer's magnitudes at the positions `at`, as the memory's pass will make them
        (Memory.peek), -1 in the tensors sent whole; in increasing order of position (the order does
        not matter to the threshold, an order statistic; in order, the reads walk memory forward)."""
        b = self.buffer
        at = kernels.sort_positions(at)
        ends = np.searchsorted(at, self.ends)
        drawn = np.empty(at.shape[0], np.float32)
        for j, (piece, off) in enumerate(zip(pieces, self.offsets)):
            lo, hi = ends[j - 1] if j else 0, ends[j]
            if j in self.whole:
                drawn[lo:hi] = -1.0
            elif hi > lo:
                self.memory.peek(b.params[j], piece, at[lo:hi], off, drawn[lo:hi])
        return drawn

    def _take(self, acc, k, key, idx, whole=False):
        """The values at idx (for a tensor sent whole, every index) out of the memory, which forgets them."""
        if whole:
            idx = np.arange(acc.shape[0])
        elif idx is None:
            raise ValueError(f"sparsifier {type(self.compressor).__name__}: select_buffer gave no indices for "
                             f"tensor {key}")
        # Every value sent (a small tensor sent whole, a 1-element tensor, a density-1 stage): keep
        # the momentum, see Memory.update.
        whole = whole or k >= acc.shape[0]
        if not self.fp16:
            return idx, self.memory.take(key, acc, idx, whole)
        val = acc[idx]
        sent = np.clip(val, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float32)
        self.memory.update(key, acc, idx, val - sent, whole=whole)
        return idx, sent


def host_views(arrays):
    """Each float32 NDArray of `arrays` as a 1-D numpy array over MXNet's own memory, once its
    pending writes are done, or None if one of them is not a float32 array on the host (copy those:
    copy_to_host). No copy: at ResNet-50's size the copy was a sixth of the encoder's time. The views
    are read-only (the encoder never writes a gradient) and valid until MXNet next writes the
    arrays; the worker encodes within its push, before the next backward is issued."""
    views = []
    for a in arrays:
        if a.dtype != np.float32 or a.context.device_type not in ("cpu", "cpu_pinned", "cpu_shared"):
            return None
        a.wait_to_read()
        ptr = ctypes.c_void_p()
        check_call(_LIB.MXNDArrayGetData(a.handle, ctypes.byref(ptr)))
        view = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(a.size,))
        view.flags.writeable = False
        views.append(view)
    return views


def copy_to_host(arrays, out, offsets, sizes):
    """Each float32 NDArray of `arrays` into out[offset:offset + size]: what NDArray.asnumpy does
    (the same MXNet call, which waits for the array's pending writes), into a host array that is
    reused, one copy per tensor and no flat NDArray in between."""
    if out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"host buffer of {out.dtype}: a contiguous float32 array is needed")
    base = out.ctypes.data
    for a, off, n in zip(arrays, offsets, sizes):
        if a.dtype != np.float32 or a.size != n or off + n > out.size:
            raise ValueError(f"gradient of {a.size} {np.dtype(a.dtype)} values for a slot of {n} float32")
        check_call(_LIB.MXNDArraySyncCopyToCPU(a.handle, ctypes.c_void_p(base + 4 * off), ctypes.c_size_t(n)))


def make_encoders(shapes, num_servers, comp, rank, *, momentum=0.0, cost=None, seed=0, counts=None):
    """Buffer plan plus one encoder per buffer, for the `compression` config section (steady-state
    density; make_stages adds the warm-up stages).

    cost: {'alpha', 'beta', 'backward'} measured at job start (needed for buffers: cost_model).
    counts: tensor_counts(shapes, comp), if the caller has them.
    """
    counts = counts or tensor_counts(shapes, comp)
    buffers = plan_for_config(shapes, num_servers, comp, cost, counts)
    whole = counts.whole
    if not is_sparsifier(comp.type):
        return buffers, [DenseEncoder() for _ in buffers]
    memory = Memory(comp.error_feedback, momentum if comp.momentum_correction else 0.0,
                    masking=comp.momentum_masking, rescale=comp.rescale_held)
    compressor = make_compressor(comp.type, seed)
    return buffers, _sparse_encoders(buffers, compressor, memory, whole, comp)


def _sparse_encoders(buffers, compressor, memory, whole, comp):
    every = comp.allocate_every if comp.allocation == "gradient" else 0
    return [SparseEncoder(b, compressor, memory, [whole[i] for i in b.params], behind=comp.fusion == "behind",
                          allocate_every=every, sampled=comp.selection == "sampled", seed=compressor.seed)
            for b in buffers]


def make_stages(shapes, num_servers, comp, rank, *, momentum=0.0, cost=None, seed=0):
    """(buffers, encoders) per density stage: one per compression.warmup entry (an epoch each),
    then the steady state. The steady state decides the buffers (the cost model plans for it);
    the warm-up stages reuse them with their own counts, mailbox keys and encoders, sharing the
    compressor and the error-feedback memory."""
    counts = tensor_counts(shapes, comp)
    buffers, encoders = make_encoders(shapes, num_servers, comp, rank, momentum=momentum, cost=cost,
                                      seed=seed, counts=counts)
    if not comp.warmup:
        return [(buffers, encoders)]
    stage_counts = [tensor_counts(shapes, comp, density).counts for density in comp.warmup]
    whole = counts.whole                                     # min_dense_bytes: the same in every stage
    memory, compressor = encoders[0].memory, encoders[0].compressor
    stages = [(bufs, _sparse_encoders(bufs, compressor, memory, whole, comp))
              for bufs in warmup_stages(buffers, stage_counts)]
    return stages + [(buffers, encoders)]


def time_encoding(buffers, encoders, shapes, repeats=3):
    """Median seconds to encode one step's gradients (random data, throwaway memory state)."""
    grads = [mx.nd.random.normal(shape=s) for s in shapes]
    memories = list({id(e.memory): e.memory for e in encoders if e.memory is not None}.values())
    times = []
    for r in range(repeats):
        saved = [m.state_dict() for m in memories]
        t0 = time.perf_counter()
        outs = [e.encode([grads[i] for i in b.params], -1 - r) for b, e in zip(buffers, encoders)]
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
        del outs
        for m, s in zip(memories, saved):
            m.load_state_dict(s)
    return float(np.median(times))
