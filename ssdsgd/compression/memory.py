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
The state is float32 numpy arrays on the host, where the encoders select (see compressor.py).
"""
import numpy as np


MEMORY_CHUNK = 1 << 18          # elements per chunk of accumulate's passes (1 MiB: within L2)


class Memory:
    def __init__(self, error_feedback=True, momentum=0.0, masking=True, rescale=False):
        self.error_feedback = error_feedback
        self.momentum = momentum
        self.masking = masking            # momentum correction: zero u where sent (DGC)
        self.rescale = rescale            # keep the held values in weight units (set_carry)
        self.carry = 1.0                  # this step's factor on the held values: lr_prev / lr
        self.residual = {}
        self.velocity = {}

    def set_carry(self, carry):
        """This step's factor on the held values, schedule.held_carry: lr_prev / lr (used with rescale
        only). Call it once per step, before the step's accumulates."""
        self.carry = carry if self.rescale else 1.0

    def accumulate(self, key, g, magnitude=None):
        """The vector to sparsify for this step (g: a 1-D float32 array, left unchanged). With error
        feedback it is the tensor's residual itself, updated in place: call update() with it before
        the next accumulate of the same key. magnitude: an array of g's size that receives the
        result's absolute values, computed while each chunk is still in the cache."""
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
        add = u if u is not None else g   # what the residual gets: the momentum, or the gradient
        out = r if r is not None else add
        # In place, chunk by chunk: no new array of the tensor's size per step (at ResNet-50's size its
        # page faults cost more than the arithmetic), and each chunk's several passes hit the cache.
        carry = np.float32(self.carry)
        mu = np.float32(self.momentum) * carry
        for lo in range(0, out.shape[0], MEMORY_CHUNK):
            part = slice(lo, lo + MEMORY_CHUNK)
            if u is not None and g is not None:
                np.multiply(u[part], mu, out=u[part])
                np.add(u[part], g[part], out=u[part])
            if r is not None:
                if carry != 1:
                    np.multiply(r[part], carry, out=r[part])
                np.add(r[part], add[part], out=r[part])
            if magnitude is not None:
                np.abs(out[part], out=magnitude[part])
        return out

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
