"""Worker-side encoding of one buffer's gradients into a mailbox payload (asynchronous mx.nd ops).

DenseEncoder: the flattened gradients, what an uncompressed push sends.
SparseEncoder, fusion 'ahead' (SAFusion): every tensor is sparsified on its own with
  k_i = max(1, floor(density * n_i)), so no tensor goes missing, then the (index + offset, value)
  pieces are fused into the buffer's message: [idx_1..idx_m, val_1..val_m].
SparseEncoder, fusion 'behind' (OMGS / SyncEA baseline): the buffer is fused first and one top-k
  with the same total k runs over it, so large tensors can take every slot (min_dense_bytes does
  not apply: there are no tensors any more, only the fused buffer).
All of it stays in mx.nd operations: the engine overlaps them with the rest of backward.
"""
import time

import mxnet as mx
import numpy as np

from ssdsgd.compression.compressor import make_compressor
from ssdsgd.compression.fusion import make_plan, plan_cost_model
from ssdsgd.compression.memory import Memory


class DenseEncoder:
    codec = "dense"

    def encode(self, grads, step):
        if len(grads) == 1:
            return grads[0].reshape(-1)
        return mx.nd.concat(*[g.reshape(-1) for g in grads], dim=0)


class SparseEncoder:
    codec = "sparse"

    def __init__(self, buffer, compressor, memory, whole, behind=False):
        self.buffer = buffer
        self.compressor = compressor
        self.memory = memory
        self.behind = behind
        # Tensors below compression.min_dense_bytes are sent whole (every index, every value).
        self.whole_idx = {j: mx.nd.arange(n, dtype="float32") for j, (n, w) in
                          enumerate(zip(buffer.sizes, whole)) if w}
        self.offsets = buffer.offsets

    def encode(self, grads, step):
        b = self.buffer
        if self.behind:
            flat = mx.nd.concat(*[g.reshape(-1) for g in grads], dim=0) if len(grads) > 1 else grads[0].reshape(-1)
            idx, val = self._sparsify(flat, b.k, key=-1 - b.id, step=step)
            return mx.nd.concat(idx, val, dim=0)
        idx_parts, val_parts = [], []
        for j, g in enumerate(grads):
            x = g.reshape(-1)
            if j in self.whole_idx:
                idx, val = self.whole_idx[j], x
            else:
                idx, val = self._sparsify(x, b.counts[j], key=b.params[j], step=step)
            idx_parts.append(idx + self.offsets[j] if self.offsets[j] else idx)
            val_parts.append(val)
        return mx.nd.concat(*(idx_parts + val_parts), dim=0)

    def _sparsify(self, x, k, key, step):
        acc = self.memory.accumulate(key, x)
        idx = self.compressor.select(acc, k, key, step)
        val = mx.nd.take(acc, idx)
        self.memory.update(key, acc, idx)
        return idx, val


def tensor_counts(shapes, comp):
    """Values each tensor sends: k_i = max(1, floor(density * n_i)), or all of a small tensor."""
    sizes = [int(np.prod(s)) for s in shapes]
    whole = [4 * n < comp.min_dense_bytes for n in sizes]
    counts = [n if w else max(1, int(comp.density * n)) for n, w in zip(sizes, whole)]
    return sizes, counts, whole


def make_encoders(shapes, num_servers, comp, rank, *, momentum=0.0, cost=None, seed=0):
    """Buffer plan plus one encoder per buffer, for the `compression` config section.

    cost: {'alpha', 'beta', 'backward'} measured at job start (needed for buffers: cost_model).
    """
    sizes, counts, whole = tensor_counts(shapes, comp)
    sparse = comp.type not in ("none", "2bit")
    if not sparse:
        counts = sizes
    codec = "sparse" if sparse else "dense"
    if comp.buffers == "cost_model":
        if cost is None:
            raise ValueError("compression.buffers: cost_model needs the startup probe's measurements")
        groups = plan_cost_model(sizes, counts, sparse, **cost)
        buffers = make_plan(shapes, num_servers, groups=groups, counts=counts, codec=codec)
    else:
        buffers = make_plan(shapes, num_servers, mode=comp.buffers, buffer_bytes=comp.buffer_bytes,
                            counts=counts, codec=codec)
    if not sparse:
        return buffers, [DenseEncoder() for _ in buffers]
    memory = Memory(comp.error_feedback, momentum if comp.momentum_correction else 0.0)
    compressor = make_compressor(comp.type, seed)
    encoders = [SparseEncoder(b, compressor, memory, [whole[i] for i in b.params],
                              behind=comp.fusion == "behind") for b in buffers]
    return buffers, encoders


def time_encoding(buffers, encoders, shapes, repeats=3):
    """Median seconds to encode one step's gradients (random data, throwaway memory state)."""
    grads = [mx.nd.random.normal(shape=s) for s in shapes]
    times = []
    for r in range(repeats):
        saved = [(e.memory.residual.copy(), e.memory.velocity.copy()) if hasattr(e, "memory") else None
                 for e in encoders]
        t0 = time.perf_counter()
        outs = [e.encode([grads[i] for i in b.params], -1 - r) for b, e in zip(buffers, encoders)]
        mx.nd.waitall()
        times.append(time.perf_counter() - t0)
        del outs
        for e, s in zip(encoders, saved):
            if s is not None:
                e.memory.residual, e.memory.velocity = s
    return float(np.median(times))
