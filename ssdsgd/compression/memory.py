"""Error feedback (residual memory) and DGC-style momentum correction, per tensor.

Error feedback: what was not sent is added to the next gradient, so nothing is lost, only delayed:
    acc = residual + g;  send acc[idx];  residual = acc with acc[idx] = 0
(plus, with fp16 values, what rounding and clipping lost at idx).
Momentum correction (DGC): the momentum is accumulated on the worker before sparsification,
    u = mu*u + g;  acc = residual + u;  after sending, the residual is zeroed at idx
(the servers then apply the pushes without momentum, see rounds.BufferState), so delayed coordinates
keep their momentum. DGC's momentum factor masking also zeroes u at idx (masking=True, the default):
a coordinate sent every step then moves by lr*g, without momentum, where SSGD moves it by about
lr*g/(1 - mu). Without masking, what the servers apply over a run is exactly the momentum SGD updates,
each coordinate's delayed until it is sent.
Rescaling (rescale=True, compression.rescale_held): the servers apply a push at the learning rate of
the round that carries it, so a value held back for many steps would be applied at a later step's rate;
under a decaying schedule its gradient would count less than SSGD counts it. So before each step's
accumulate both u and the residual are multiplied by lr_prev / lr (set_carry): the held values stay
in weight units, each gradient is applied at its own step's rate, and without masking what the
servers apply is exactly SSGD's (MXNet's) momentum updates, each value delayed until it is sent.
The state is float32 numpy arrays on the host, where the encoders select (see compressor.py); the
arithmetic runs in compiled passes (kernels.py), bit for bit the numpy operations it is written as above.
"""
import numpy as np

from ssdsgd.compression import kernels

NONE_F = np.empty(0, np.float32)      # an absent array, for the kernels' fixed signatures
NONE_I = np.empty(0, np.int64)


class Memory:
    def __init__(self, error_feedback=True, momentum=0.0, masking=True, rescale=False):
        self.error_feedback = error_feedback
        self.momentum = momentum
        self.masking = masking            # momentum correction: zero u where sent (DGC)
        self.rescale = rescale            # keep the held values in weight units (set_carry)
        self.carry = 1.0                  # this step's factor on the held values: lr_prev / lr
        self.residual = {}
        self.velocity = {}
        kernels.warm()                    # compiled (or loaded from numba's cache) before any step

    def set_carry(self, carry):
        """This step's factor on the held values, schedule.held_carry: lr_prev / lr (used with rescale
        only). Call it once per step, before the step's accumulates."""
        self.carry = carry if self.rescale else 1.0

    def accumulate(self, key, g, magnitude=None):
        """The vector to sparsify for this step (g: a 1-D float32 array, left unchanged). With error
        feedback it is the tensor's residual itself, updated in place: call update() with it before
        the next accumulate of the same key. magnitude: an array of g's size that receives the
        result's absolute values, computed while each chunk is still in the cache."""
        return self._accumulate(key, g, magnitude)[0]

    def accumulate_candidates(self, key, g, threshold, idx, val, count, offset):
        """accumulate, and in the same pass the candidates of a sampled search: every position i
        whose result is not below threshold in magnitude (a NaN included) is appended, as offset + i
        and the magnitude, to idx and val from position count, in increasing order. Returns the result,
        the new count (beyond the arrays' size the candidates are counted, not written) and the first
        position of the result's largest magnitude (a NaN's if any: np.argmax of its magnitudes)."""
        if not self.error_feedback:
            raise ValueError("accumulate_candidates collects from the residual: it needs error feedback")
        return self._accumulate(key, g, None, (threshold, idx, val, count, offset))

    def _accumulate(self, key, g, magnitude=None, candidates=None):
        u = r = None
        if self.momentum:
            u = self.velocity.get(key)
            if u is None:                 # the first step: u = g, and nothing below adds to it
                u = self.velocity[key] = g.copy()
                g = None
        if self.error_feedback:
            r = self.residual.get(key)
            if r is None:                 # the first step: nothing held back yet
                r = self.residual[key] = np.zeros(g.shape[0] if g is not None else u.shape[0], np.float32)
        # In place, chunk by chunk in one compiled pass (kernels.accumulate): no new array of the
        # tensor's size per step (at ResNet-50's size its page faults cost more than the arithmetic).
        carry = np.float32(self.carry)
        mu = np.float32(self.momentum) * carry
        out = r if r is not None else u if u is not None else g
        threshold, idx, val, count, offset = candidates or (np.float32(0), NONE_I, NONE_F, 0, 0)
        count, top = kernels.accumulate(out.shape[0], NONE_F if u is None else u, NONE_F if g is None else g,
                                        NONE_F if r is None else r, mu, carry, u is not None and g is not None,
                                        u is not None, r is not None, bool(carry != 1),
                                        NONE_F if magnitude is None else magnitude, np.float32(threshold),
                                        candidates is not None, idx, val, count, offset)
        return out, count, top

    def peek(self, key, g, at, offset, out):
        """out = the magnitudes accumulate(key, g) would give at the positions at - offset (an int64
        array), the state left as it is: a sample of them, drawn before the pass that makes them all.
        The same float32 operations as the pass (kernels.peek), so the same values bit for bit."""
        u = self.velocity.get(key) if self.momentum else None
        r = self.residual.get(key) if self.error_feedback else None
        carry = np.float32(self.carry)
        kernels.peek(at, offset, NONE_F if u is None else u, g, NONE_F if r is None else r,
                     np.float32(self.momentum) * carry, carry, u is not None, u is not None, self.error_feedback,
                     r is not None, bool(carry != 1), out)

    def take(self, key, acc, idx, whole=False):
        """acc[idx], then update(key, acc, idx, whole=whole): in one pass over idx (kernels.take) where
        acc is the tensor's residual (the values sent, and their positions forgotten)."""
        idx = np.asarray(idx, np.int64)
        if not self.error_feedback or self.residual.get(key) is not acc:
            val = acc[idx]
            self.update(key, acc, idx, None, whole)
            return val
        clear = bool(self.momentum and self.masking and not whole)
        val = np.empty(idx.shape[0], np.float32)
        kernels.take(acc, self.velocity[key] if clear else NONE_F, idx, clear, val)
        return val

    def update(self, key, acc, idx, lost=None, whole=False):
        """Forget what was sent: zero the sent positions of the residual (and of the momentum).

        lost: per sent position, what the wire format dropped of acc[idx] (fp16 rounding and
        clipping); it stays in the residual, so reduced precision is compensated like sparsity.
        whole: every value of the tensor was sent. Its momentum is kept: masking it would
        zero it every step and leave the tensor with no momentum at all (the servers apply pushes
        without momentum under momentum correction), where DGC sends such tensors with ordinary
        momentum SGD."""
        if not (self.error_feedback or self.momentum):
            return
        if self.error_feedback:
            residual = self.residual.get(key)
            if residual is not acc:          # an acc that accumulate did not make (tests, tools)
                self.residual[key] = residual = acc.copy()
            residual[idx] = 0.0 if lost is None else lost
        if self.momentum and self.masking and not whole:
            self.velocity[key][idx] = 0.0

    def state_dict(self):
        """The per-tensor state as numpy arrays (copies) named residual<key> and velocity<key> (the
        names the worker checkpoints have always used)."""
        arrays = {f"residual{k}": v.copy() for k, v in self.residual.items()}
        arrays.update({f"velocity{k}": v.copy() for k, v in self.velocity.items()})
        return arrays

    def load_state_dict(self, arrays):
        """Replace the state with the residual<key>/velocity<key> entries of `arrays` (other names are
        ignored, so a whole checkpoint file can be passed)."""
        state = {"residual": {}, "velocity": {}}
        for name, arr in arrays.items():
            for kind, found in state.items():
                if name.startswith(kind) and name[len(kind):].lstrip("-").isdigit():
                    found[int(name[len(kind):])] = np.array(arr, np.float32).reshape(-1)
        self.residual, self.velocity = state["residual"], state["velocity"]

    def residual_norm(self):
        if not self.residual:
            return 0.0
        return float(np.sqrt(sum(np.dot(r, r) for r in self.residual.values())))
