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
each coordinate's delayed until it is sent. Masking can also be kept to values that waited: with
min_wait = w > 0, u is zeroed only where the value sent had been held back for at least w steps in a
row just before (so, with w = 1, not where it was also sent at the previous step). Masking exists to
stop a delayed value's stale momentum; a value sent every step has none, and keeps SSGD's momentum.
(A step here is one push of the tensor. The counts are checkpointed; a resume with another min_wait
is refused, as the compression section is part of the checkpoint's config fingerprint.)
Local gradient clipping (DGC): with a clip threshold, each tensor's gradient is first scaled to an
L2 norm of at most `clip` (per tensor, as DGC's reference code clips), before the momentum and the
residual: a burst in one worker's gradient then cannot fill the residual for many steps. Only the
pushed gradient is clipped; SSD-SGD's local update between refreshes uses the worker's own gradient.
Learning-rate weighting (lr_of given): the residual and the momentum hold lr-weighted gradients in
the units of the current step's learning rate, as EF-SGD's error feedback and MXNet's momentum do:
at each new step both are multiplied by lr(previous step) / lr(this step). The servers multiply what
they get by this step's lr, so a value held back for many steps is applied at the learning rate of
the step that computed it, as SSGD would, not at the (smaller, late in a decaying schedule) rate of
the step that finally sends it.
The state is float32 numpy arrays on the host, where the encoders select (see compressor.py).
"""
import numpy as np

MEMORY_CHUNK = 1 << 18          # elements per chunk of accumulate's passes (1 MiB: within L2)


class Memory:
    def __init__(self, error_feedback=True, momentum=0.0, clip=None, masking=True, lr_of=None, min_wait=0):
        self.error_feedback = error_feedback
        self.momentum = momentum
        self.masking = masking            # momentum correction: zero u where sent (DGC)
        self.min_wait = min_wait          # ... only where the value had waited this many steps (0: all)
        self.clip = clip                  # L2 bound per tensor on g as passed in (None: no clipping)
        self.lr_of = lr_of                # step -> the lr the servers apply to it (None: unweighted)
        self.step = None                  # the step of the last accumulate (lr weighting)
        self.residual = {}
        self.velocity = {}
        self.wait = {}                    # min_wait > 0: steps each value has been held back in a row

    def accumulate(self, key, g, step=None, magnitude=None):
        """The vector to sparsify for this step (g: a 1-D float32 array, left unchanged). With error
        feedback it is the tensor's residual itself, updated in place: call update() with it before
        the next accumulate of the same key. magnitude: an array of g's size that receives the
        result's absolute values, computed while each chunk is still in the cache."""
        if self.lr_of is not None and step != self.step:
            self._rescale(self.step, step)
            self.step = step
        if self.clip is not None:
            g = clip_l2(g, self.clip)
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
        mu = np.float32(self.momentum)
        for lo in range(0, out.shape[0], MEMORY_CHUNK):
            part = slice(lo, lo + MEMORY_CHUNK)
            if u is not None and g is not None:
                np.multiply(u[part], mu, out=u[part])
                np.add(u[part], g[part], out=u[part])
            if r is not None:
                np.add(r[part], add[part], out=r[part])
            if magnitude is not None:
                np.abs(out[part], out=magnitude[part])
        return out

    def _rescale(self, old, new):
        """Carry the state from lr(old) units to lr(new) units (nothing to do for a first step, or
        when either rate is 0: a round at lr 0 applies nothing, whatever it is sent)."""
        if old is None or new is None:
            return
        before, now = self.lr_of(old), self.lr_of(new)
        if before <= 0 or now <= 0 or before == now:
            return
        factor = np.float32(before / now)
        for state in (self.residual, self.velocity):
            for arr in state.values():
                arr *= factor

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
        if self.momentum and self.masking:
            if not whole:
                self._mask(key, idx)
            elif key in self.wait:        # every value was sent: none has waited
                self.wait[key][:] = 0

    def _mask(self, key, idx):
        if not self.min_wait:
            self.velocity[key][idx] = 0.0
            return
        wait = self.wait.get(key)
        if wait is None:                  # the first step: nothing has been held back yet
            wait = self.wait[key] = np.zeros(self.velocity[key].shape, np.int32)
        waited = idx[wait[idx] >= self.min_wait]
        self.velocity[key][waited] = 0.0
        wait += 1
        wait[idx] = 0

    def state_dict(self):
        """The per-tensor state as numpy arrays (copies) named residual<key> and velocity<key> (the
        names the worker checkpoints have always used), and wait<key> with min_wait."""
        arrays = {f"residual{k}": v.copy() for k, v in self.residual.items()}
        arrays.update({f"velocity{k}": v.copy() for k, v in self.velocity.items()})
        arrays.update({f"wait{k}": v.copy() for k, v in self.wait.items()})
        if self.step is not None:
            arrays["memory_step"] = np.array([self.step], np.int64)
        return arrays

    def load_state_dict(self, arrays):
        """Replace the state with the residual<key>/velocity<key>/wait<key> entries of `arrays` (other
        names are ignored, so a whole checkpoint file can be passed)."""
        dtypes = {"residual": np.float32, "velocity": np.float32, "wait": np.int32}
        state = {kind: {} for kind in dtypes}
        for name, arr in arrays.items():
            for kind, found in state.items():
                if name.startswith(kind) and name[len(kind):].lstrip("-").isdigit():
                    found[int(name[len(kind):])] = np.array(arr, dtypes[kind]).reshape(-1)
        self.residual, self.velocity, self.wait = state["residual"], state["velocity"], state["wait"]
        self.step = int(np.asarray(arrays["memory_step"])[0]) if "memory_step" in arrays else None

    def residual_norm(self):
        if not self.residual:
            return 0.0
        return float(np.sqrt(sum(np.dot(r, r) for r in self.residual.values())))


def clip_l2(g, bound):
    """g scaled down to an L2 norm of `bound` if it is longer (a new array then; g itself otherwise)."""
    norm = float(np.sqrt(np.dot(g, g)))
    if norm <= bound:
        return g
    return g * np.float32(bound / norm)
