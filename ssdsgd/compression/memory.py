"""Error feedback (residual memory) and DGC-style momentum correction, per tensor.

Error feedback: what was not sent is added to the next gradient, so nothing is lost, only delayed:
    acc = residual + g;  send acc[idx];  residual = acc with acc[idx] = 0
(plus, with fp16 values, what rounding and clipping lost at idx).
Momentum correction (DGC): the momentum is accumulated on the worker before sparsification,
    u = mu*u + g;  acc = residual + u;  after sending, u and residual are zeroed at idx
(the servers then run plain SGD, see RoundClient), so delayed coordinates keep their momentum.
"""
import mxnet as mx


class Memory:
    def __init__(self, error_feedback=True, momentum=0.0):
        self.error_feedback = error_feedback
        self.momentum = momentum
        self.residual = {}
        self.velocity = {}

    def accumulate(self, key, g):
        """The vector to sparsify for this step."""
        if self.momentum:
            u = self.velocity.get(key)
            u = g.copy() if u is None else self.momentum * u + g
            self.velocity[key] = u
            g = u
        if self.error_feedback and key in self.residual:
            return self.residual[key] + g
        return g

    def update(self, key, acc, idx, lost=None, whole=False):
        """Forget what was sent: zero the sent positions of the residual (and of the momentum).

        lost: per sent position, what the wire format dropped of acc[idx] (fp16 rounding and
        clipping); it stays in the residual, so reduced precision is compensated like sparsity.
        whole: every value of the tensor was sent. Its momentum is kept: masking it would
        zero it every step and leave the tensor with no momentum at all (the servers run plain SGD
        under momentum correction), where DGC sends such tensors with ordinary momentum SGD."""
        if not (self.error_feedback or self.momentum):
            return
        where = idx.reshape(1, -1)
        keep = 1 - mx.nd.scatter_nd(mx.nd.ones(idx.shape[0]), where, shape=acc.shape)
        if self.error_feedback:
            residual = acc * keep
            if lost is not None:
                residual = residual + mx.nd.scatter_nd(lost, where, shape=acc.shape)
            self.residual[key] = residual
        if self.momentum and not whole:
            self.velocity[key] = self.velocity[key] * keep

    def state_dict(self):
        """The per-tensor state as numpy arrays named residual<key> and velocity<key> (the names the
        worker checkpoints have always used). Synchronises."""
        arrays = {f"residual{k}": v.asnumpy() for k, v in self.residual.items()}
        arrays.update({f"velocity{k}": v.asnumpy() for k, v in self.velocity.items()})
        return arrays

    def load_state_dict(self, arrays):
        """Replace the state with the residual<key>/velocity<key> entries of `arrays` (other names
        are ignored, so a whole checkpoint file can be passed)."""
        state = {"residual": {}, "velocity": {}}
        for name, arr in arrays.items():
            for kind, found in state.items():
                if name.startswith(kind) and name[len(kind):].lstrip("-").isdigit():
                    found[int(name[len(kind):])] = mx.nd.array(arr)
        self.residual, self.velocity = state["residual"], state["velocity"]

    def residual_norm(self):
        if not self.residual:
            return 0.0
        return float(sum((r * r).sum() for r in self.residual.values()).sqrt().asscalar())
