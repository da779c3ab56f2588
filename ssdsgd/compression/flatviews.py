"""A fixed list of NDArrays seen as one flat vector, copied in and out with one operator each way.

Every step a worker moves a fused buffer's tensors (its parameters, their gradients, its local
optimizer's state) to and from flat vectors. Done per tensor, that is a slice, a reshape and a copy
each, and for ResNet-20's 65 tensors the Python cost of those calls was most of the worker's
refresh (a reshape alone takes about 50 us). Here every view is made once:
  FlatViews(arrays)    flat views of the arrays (a reshaped NDArray shares its array's memory, so
                       writing the view writes the array);
  FlatBuffer           a flat vector of the same total size with views of its pieces, cut like the
                       arrays (FlatViews.buffer);
  copy_from, copy_to   one operator copies every piece between the buffer and the arrays. The
                       operator is amp_multicast, which casts each input into its output as the widest
                       dtype among the inputs: for float32 arrays, a copy of each, in one call.
Limits: float32 arrays only (amp_multicast would widen float16 to float32, which its float16
outputs refuse), and a buffer must not share memory with the arrays (MXNet treats an output that
shares an input's memory as in place and skips that copy). Views stay valid while the arrays are
the same objects; `matches` tells whether they still are, so that an array replaced elsewhere is
never written through a stale view.
"""
from typing import NamedTuple

import mxnet as mx
import numpy as np


class FlatBuffer(NamedTuple):
    array: object                 # the flat NDArray
    pieces: list                  # views of its consecutive pieces, one per array of a FlatViews


class FlatViews:
    def __init__(self, arrays):
        self.arrays = list(arrays)
        if not self.arrays:
            raise ValueError("FlatViews of no arrays")
        dtypes = {np.dtype(a.dtype) for a in self.arrays}
        if dtypes != {np.dtype(np.float32)}:
            raise ValueError(f"FlatViews of {', '.join(sorted(map(str, dtypes)))} arrays: float32 only")
        self.dtype = np.dtype(np.float32)
        self.views = [a.reshape(-1) for a in self.arrays]
        self.sizes = [v.shape[0] for v in self.views]
        self.size = int(sum(self.sizes))

    def matches(self, arrays):
        """Are these the very arrays (same objects, same order) the views were made of?"""
        return len(arrays) == len(self.arrays) and all(a is b for a, b in zip(arrays, self.arrays))

    def buffer(self, flat=None):
        """A FlatBuffer over the flat NDArray `flat` (self.size elements; default: new zeros)."""
        if flat is None:
            flat = mx.nd.zeros(self.size, dtype=self.dtype)
        if flat.shape != (self.size,) or np.dtype(flat.dtype) != self.dtype:
            raise ValueError(f"flat vector of shape {flat.shape} and dtype {np.dtype(flat.dtype)} for arrays "
                             f"of {self.size} elements of {self.dtype}")
        starts = np.cumsum([0] + self.sizes[:-1])
        return FlatBuffer(flat, [flat[int(s):int(s) + n] for s, n in zip(starts, self.sizes)])

    def copy_from(self, buf):
        """The arrays <- the FlatBuffer's pieces."""
        self._check(buf)
        mx.nd.amp_multicast(*buf.pieces, num_outputs=len(self.views), out=self.views)

    def copy_to(self, buf):
        """The FlatBuffer's pieces <- the arrays."""
        self._check(buf)
        mx.nd.amp_multicast(*self.views, num_outputs=len(self.views), out=buf.pieces)

    def _check(self, buf):
        if buf.array.shape != (self.size,) or len(buf.pieces) != len(self.views):
            raise ValueError(f"a flat buffer of {buf.array.shape[0]} elements in {len(buf.pieces)} pieces for "
                             f"{len(self.views)} arrays of {self.size} elements")
